"""The built-in engine: a thread pool issuing os.preadv / os.pwritev, O_DIRECT where the
filesystem supports it. Threads block in the syscalls with the GIL released, so
``threads`` requests are in flight at once."""

from __future__ import annotations

import errno
import itertools
import logging
import mmap
import os
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable

import numpy as np

from ..files import create_fresh, open_own
from ..units import PAGE

__all__ = ["PosixEngine", "PosixFile", "PriorityPool", "dio_memory_alignment", "probe_direct_io"]

log = logging.getLogger(__name__)


class PosixFile:
    def __init__(self, path: str, *, direct: bool) -> None:
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
        if direct:
            flags |= os.O_DIRECT
        self.path = path
        self.direct = direct
        self.fd = open_own(path, flags)

    def pread_into(self, buf: np.ndarray, offset: int) -> int:
        mv = memoryview(buf).cast("B")
        done = 0
        while done < len(mv):
            n = os.preadv(self.fd, [mv[done:]], offset + done)
            if n == 0:  # past the end of the file: the tail was never written
                mv[done:] = b"\0" * (len(mv) - done)
                break
            done += n
        return done

    def pwrite_from(self, buf: np.ndarray, offset: int) -> int:
        mv = memoryview(buf).cast("B")
        done = 0
        while done < len(mv):
            n = os.pwritev(self.fd, [mv[done:]], offset + done)
            if n <= 0:
                raise OSError(errno.EIO, f"short write to {self.path}")
            done += n
        return done

    def fileno(self) -> int:
        return self.fd

    def sync(self) -> None:
        os.fdatasync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class PriorityPool:
    """Worker threads serving a priority queue: demand I/O (priority 0) overtakes
    prefetch I/O (priority 1) that was queued earlier; FIFO within a priority."""

    def __init__(self, threads: int, name: str) -> None:
        self._q: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = itertools.count()
        self._workers = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(threads)]
        for w in self._workers:
            w.start()

    def submit(self, fn: Callable[..., Any], *args: Any, priority: int = 0) -> Future:
        fut: Future = Future()
        self._q.put((priority, next(self._seq), fut, fn, args))
        return fut

    def queued(self) -> int:
        """Requests waiting for a worker (not counting those being served)."""
        return self._q.qsize()

    def _run(self) -> None:
        while True:
            _, _, fut, fn, args = self._q.get()
            if fut is None:  # sentinel: stop
                return
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # the error belongs to the request, not the worker
                fut.set_exception(e)

    def shutdown(self) -> None:
        # sentinels sort after every queued request, so queued I/O drains first
        for _ in self._workers:
            self._q.put((1 << 30, next(self._seq), None, None, None))
        for w in self._workers:
            w.join()


class PooledEngine:
    """What both engines share: a ``PriorityPool`` of ``threads`` workers running the
    blocking I/O functions ``submit`` hands them."""

    name = "?"

    def __init__(self, threads: int, reason: str, thread_name: str) -> None:
        self.threads = threads
        self.reason = reason
        self.gds = False
        self.device_reason = f"{self.name} engine: host buffers only"
        self._pool = PriorityPool(threads, thread_name)
        self._closed = threading.Event()

    def submit(self, fn: Callable[..., Any], *args: Any, priority: int = 0) -> Future:
        return self._pool.submit(fn, *args, priority=priority)

    def queued(self) -> int:
        return self._pool.queued()

    def close(self) -> None:
        if not self._closed.is_set():
            self._closed.set()
            # drain in-flight and queued I/O before the files are closed under it
            self._pool.shutdown()
            log.info("%s engine stopped", self.name)


class PosixEngine(PooledEngine):
    """Thread-pool engine; ``submit`` runs a blocking I/O function on a worker."""

    name = "posix"

    def __init__(self, threads: int, reason: str) -> None:
        super().__init__(threads, reason, "tierstore-io")

    def open(self, path: str, *, direct: bool) -> PosixFile:
        return PosixFile(path, direct=direct)


_STATX_DIOALIGN = 0x2000
_AT_SYMLINK_NOFOLLOW = 0x100
_AT_FDCWD = -100
_STATX_DIO_MEM_ALIGN = 152
"""Offset of ``stx_dio_mem_align`` in ``struct statx`` (Linux 6.1+)."""


def dio_memory_alignment(path: str) -> int:
    """The alignment O_DIRECT needs of a buffer's address for the file at ``path``, as the
    kernel reports it (``statx`` with ``STATX_DIOALIGN``: the device's DMA alignment, 4 B
    on most NVMe drives, 512 B on virtio disks); ``PAGE`` where it does not say (older
    kernels, a C library without ``statx``), which every device accepts."""
    import ctypes

    try:
        statx = ctypes.CDLL(None, use_errno=True).statx
    except (OSError, AttributeError):
        return PAGE
    buf = ctypes.create_string_buffer(256)
    if statx(_AT_FDCWD, os.fsencode(path), _AT_SYMLINK_NOFOLLOW, _STATX_DIOALIGN, buf) != 0:
        return PAGE
    mask = int.from_bytes(buf.raw[0:4], "little")
    align = int.from_bytes(buf.raw[_STATX_DIO_MEM_ALIGN:_STATX_DIO_MEM_ALIGN + 4], "little")
    if not mask & _STATX_DIOALIGN or align <= 0 or align > PAGE or align & (align - 1):
        return PAGE
    return align


def probe_direct_io(directory: str) -> tuple[bool, str]:
    """Can files in ``directory`` be opened and written with O_DIRECT? (ok, reason)."""
    path = os.path.join(directory, f".odirect-probe-{os.getpid()}-{threading.get_ident()}")
    buf = mmap.mmap(-1, PAGE)  # page-aligned by construction
    try:
        fd = create_fresh(path, os.O_RDWR | os.O_DIRECT)
    except OSError as e:
        return False, f"O_DIRECT open failed in {directory}: {os.strerror(e.errno)}; using buffered I/O"
    try:
        os.pwritev(fd, [buf], 0)
        os.preadv(fd, [buf], 0)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT) and _reads_direct(os.path.join(directory, "data.bin"), buf):
            # a full filesystem says nothing of O_DIRECT: the tier's own file, read, does
            return True, f"O_DIRECT supported in {directory} (read of its data file: the filesystem is full)"
        return False, f"O_DIRECT I/O failed in {directory}: {os.strerror(e.errno)}; using buffered I/O"
    finally:
        os.close(fd)
        os.unlink(path)
        buf.close()
    return True, f"O_DIRECT supported in {directory}"


def _reads_direct(path: str, buf: mmap.mmap) -> bool:
    """Whether the first page of the existing file ``path`` reads with O_DIRECT."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return os.preadv(fd, [buf], 0) == len(buf)
    except OSError:
        return False
    finally:
        os.close(fd)
