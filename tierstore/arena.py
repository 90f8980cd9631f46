"""Host tier memory: a shared ``memfd`` arena, pre-faulted, mappable by other processes.

The arena knows nothing about objects; the store allocates blocks in it with an
``ExtentAllocator`` and the daemon passes ``fd`` to clients over the socket.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os

import numpy as np

from .errors import CapacityExceeded, InvalidArgument
from .units import PAGE, align_up, format_size

__all__ = ["Arena", "map_arena_fd"]

log = logging.getLogger(__name__)


class Arena:
    """One memfd of ``size`` bytes mapped MAP_SHARED and pre-faulted.

    Pre-faulting matters: a first-touch page fault costs far more than the copy
    into the page, so the pages are allocated (fallocate) and mapped in
    (MAP_POPULATE) here, once, instead of on the first put.
    """

    def __init__(self, size: int, *, name: str = "tierstore-host", fd: int | None = None) -> None:
        self.adopted = fd is not None
        if fd is not None:  # an arena handed back (systemd's fd store): its pages and bytes are kept
            self.fd = fd
            self.size = os.fstat(fd).st_size
        else:
            self.size = align_up(size, PAGE)
            ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            if self.size > ram:
                raise InvalidArgument(f"host_bytes is {format_size(self.size)} but this machine has "
                                      f"{format_size(ram)} of memory; lower host_bytes")
            self.fd = os.memfd_create(name, os.MFD_CLOEXEC | getattr(os, "MFD_ALLOW_SEALING", 0))
        try:
            if self.adopted:
                pass
            elif self.size:
                # fallocate makes the shmem pages exist now, so a later touch cannot SIGBUS
                try:
                    os.posix_fallocate(self.fd, 0, self.size)
                except OSError as e:
                    raise CapacityExceeded(f"cannot allocate the {format_size(self.size)} host arena: "
                                           f"{e.strerror}; lower host_bytes (or free memory)") from None
            else:
                os.ftruncate(self.fd, 0)
            self.sealed = _seal(self.fd)
            self.mm = _map(self.fd, self.size)
        except BaseException:
            os.close(self.fd)
            raise
        self.array = np.frombuffer(self.mm, dtype=np.uint8) if self.size else np.empty(0, np.uint8)
        log.info("host arena: %d bytes in memfd %d, %s, %s", self.size, self.fd,
                 "adopted with its contents" if self.adopted else "pre-faulted",
                 "sealed against shrinking and growing" if self.sealed else "NOT sealed (a client could truncate it)")

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        """A uint8 view of ``[offset, offset + nbytes)`` (no copy)."""
        return self.array[offset:offset + nbytes]

    def close(self) -> None:
        self.array = np.empty(0, np.uint8)
        try:
            self.mm.close()
        except BufferError:
            # views handed out (checked-out tensors) still reference the mapping; the
            # memory is released when the last of them is garbage-collected
            log.debug("host arena still referenced by live views; unmapped when they are collected")
        except ValueError:
            pass
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


ARENA_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
"""Every client is handed the arena's fd: with these seals none can change its size (a
truncated arena would turn the daemon's next touch of a block into SIGBUS), nor add a seal
of its own (F_SEAL_FUTURE_WRITE would stop new clients from mapping it writable). Writes
stay possible — clients fill their blocks — and so does punching a hole (FALLOC_FL_PUNCH_HOLE,
refused only under F_SEAL_WRITE): that zeroes the bytes and the pages come back, zeroed, on the
next touch, which is no more than a client could do by writing zeros."""


def _seal(fd: int) -> bool:
    """Seal ``fd`` against size changes and further seals; whether it is (an arena handed
    back by systemd may be sealed already, or come from a memfd created without sealing)."""
    try:
        have = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        if have & ARENA_SEALS == ARENA_SEALS:
            return True
        if have & fcntl.F_SEAL_SEAL:
            log.warning("host arena memfd is sealed without F_SEAL_SHRINK/F_SEAL_GROW (seals %#x): a client "
                        "could truncate it; restart the daemon without the handed-back arena", have)
            return False
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, ARENA_SEALS)
        return True
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EPERM):
            raise
        log.warning("host arena memfd cannot be sealed (%s): a client could truncate it", e.strerror)
        return False


def _map(fd: int, size: int) -> mmap.mmap:
    if size == 0:
        return mmap.mmap(-1, PAGE)
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def map_arena_fd(fd: int, size: int, *, read_only: bool = False) -> tuple[mmap.mmap, np.ndarray]:
    """Map an arena fd received from the daemon; returns the mapping and a uint8 view
    (``read_only``: a ``PROT_READ`` mapping, whose view is not writeable)."""
    if read_only and size:
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    else:
        mm = _map(fd, size)
    return mm, (np.frombuffer(mm, dtype=np.uint8) if size else np.empty(0, np.uint8))
