"""Host tier memory: a shared ``memfd`` arena, pre-faulted, mappable by other processes.

The arena knows nothing about objects; the store allocates blocks in it with an
``ExtentAllocator`` and the daemon passes ``fd`` to clients over the socket.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .errors import CapacityExceeded, InvalidArgument
from .units import PAGE, align_up, format_size

__all__ = ["Arena", "map_arena_fd"]

log = logging.getLogger(__name__)


class Arena:
    """One memfd of ``size`` bytes mapped MAP_SHARED, its pages populated.

    Populating matters: a first-touch page fault costs far more than the copy into
    the page (measured 20x on a 2-core VM), so every page is allocated and mapped in
    here, once, instead of on the first put. ``populate=False`` leaves that to a later
    ``populate()`` call; ``populate="background"`` starts it on a thread at once, and
    ``populate()`` waits for it (the daemon replays its journal meanwhile, and waits only
    once it is already serving): touching a page before then is correct, only slower.
    """

    def __init__(self, size: int, *, name: str = "tierstore-host", fd: int | None = None,
                 populate: bool | str = True, huge_pages: str = "auto") -> None:
        self.adopted = fd is not None
        self.huge_pages = huge_pages
        if fd is not None:  # an arena handed back (systemd's fd store): its pages and bytes are kept
            self.fd = fd
            self.size = os.fstat(fd).st_size
            wanted = align_up(size, PAGE)
            if wanted != self.size:
                log.warning("host_bytes is %s, but the host arena handed back by the service manager holds %s: it "
                            "keeps its size (and its objects) until the daemon is stopped and started again "
                            "(systemctl stop tierstore; systemctl start tierstore), not restarted",
                            format_size(wanted), format_size(self.size))
        else:
            self.size = align_up(size, _hugetlb_page() if huge_pages == "hugetlb" else PAGE)
            ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            if self.size > ram:
                raise InvalidArgument(f"host_bytes is {format_size(self.size)} but this machine has "
                                      f"{format_size(ram)} of memory; lower host_bytes")
            flags = os.MFD_CLOEXEC | getattr(os, "MFD_ALLOW_SEALING", 0)
            self.fd = os.memfd_create(name, flags | (os.MFD_HUGETLB if huge_pages == "hugetlb" else 0))
        try:
            if not self.adopted:
                os.ftruncate(self.fd, self.size)
            self.sealed = _seal(self.fd)
            try:
                self.mm = _map(self.fd, self.size)
            except OSError as e:
                if huge_pages != "hugetlb" or e.errno != errno.ENOMEM:
                    raise
                raise CapacityExceeded(
                    f"host_huge_pages = 'hugetlb' needs {self.size // _hugetlb_page()} reserved huge pages of "
                    f"{format_size(_hugetlb_page())} for the {format_size(self.size)} host arena, and the kernel "
                    "has not that many free (vm.nr_hugepages); reserve them, or use host_huge_pages = 'auto'"
                ) from None
            if huge_pages == "auto" and self.size:
                _advise_huge(self.mm)  # before the pages exist: they are allocated huge where the kernel allows
        except BaseException:
            os.close(self.fd)
            raise
        self.array = np.frombuffer(self.mm, dtype=np.uint8) if self.size else np.empty(0, np.uint8)
        self._huge: tuple[int, str] | None = None
        self.advises_huge = huge_pages == "auto"
        """Whoever maps the arena asks for transparent huge pages (``map_arena_fd(huge=)``):
        the kernel gives a page of shared memory the size the first mapping to touch it
        asks for, and a client may touch pages before the daemon has populated them."""
        self._collapsed: list[int] | None = [] if huge_pages == "auto" and not _shmem_thp_at_fault() else None
        """Where the kernel gives shared memory no huge pages when it faults them in, the
        populating threads make them afterwards (``_collapse``): the bytes each made."""
        self.populated = False
        self.populate_how = "not yet"
        self._populating: threading.Thread | None = None
        self._populate_stop = threading.Event()
        self._populated_in: tuple[float, str] | BaseException | None = None
        if populate == "background":
            self._populate_in_background()
        elif populate:
            self.populate()

    def _populate_in_background(self, threads: int | None = None) -> None:
        t0 = time.perf_counter()

        def run() -> None:
            try:
                # a core is left to what runs meanwhile (the daemon's journal replay, which
                # decides when clients are served): populating two cores' worth on a 2-core
                # machine held a million objects' replay back by half
                how = _populate(self.fd, self.mm, self.size,
                                threads or max(1, min(8, (os.cpu_count() or 1) - 1)), self._populate_stop,
                                collapse=self._collapsed)
                self._populated_in = (time.perf_counter() - t0, how)
            except BaseException as e:  # (raised by the populate() that waits for it)
                self._populated_in = e

        if self.size:
            self._populating = threading.Thread(target=run, name="tierstore-populate", daemon=True)
            self._populating.start()

    def populate(self, threads: int | None = None) -> float:
        """Allocate and map every page now; returns the seconds it took.

        ``MADV_POPULATE_WRITE`` (Linux 5.14) on ranges spread over a few threads: it
        allocates the memfd's pages and fills this mapping's page tables, without
        writing (an adopted arena keeps its bytes). Where the kernel lacks it,
        ``posix_fallocate`` makes the pages exist (a later touch cannot SIGBUS) and
        the first touch of each still faults. Raises ``CapacityExceeded`` when the
        memory is not there.
        """
        t0 = time.perf_counter()
        if self._populating is not None:  # started in the background: its time counts from its start
            self._populating.join()
            self._populating, out = None, self._populated_in
            if isinstance(out, BaseException):
                raise out
            seconds, self.populate_how = out
        else:
            if self.size and not self.populated:
                self.populate_how = _populate(self.fd, self.mm, self.size, threads or min(8, os.cpu_count() or 1),
                                              collapse=self._collapsed)
            seconds = time.perf_counter() - t0
        self._huge = self._measure_huge()  # (populating is what allocated the pages; before stat can ask)
        self.populated = True
        huge, how = self._huge
        log.info("host arena: %s in memfd %d, %s in %.1f s (%s), %s; huge pages: %s of it, %s", format_size(self.size),
                 self.fd, "adopted with its contents" if self.adopted else "populated", seconds, self.populate_how,
                 "sealed against shrinking and growing" if self.sealed else "NOT sealed (a client could truncate it)",
                 format_size(huge), how)
        return seconds

    def huge(self) -> tuple[int, str]:
        """(bytes of the arena in huge pages, how it came to that), measured once populated.

        Huge pages matter to the NVMe tier: a page of 2 MiB is 2 MiB of physically
        contiguous memory, so one O_DIRECT request of several MiB from or into the arena
        is a few scatter-gather segments, where 4 KiB pages scattered over RAM cost one
        each — a drive that takes a bounded number per request (a virtio disk: 254) then
        gets requests of 1 MiB instead of 4, which halved the throughput measured here
        (docs/benchmarks.md)."""
        return self._huge or (0, "not known yet: the arena is being populated")

    def _measure_huge(self) -> tuple[int, str]:
        thp, hugetlb = _huge_bytes(self.array) if self.size else (0, 0)
        if hugetlb:  # (an arena handed back keeps the pages it had, whatever this start asked)
            return hugetlb, "hugetlb: reserved huge pages"
        if self._collapsed:  # (this mapping may map some with huge entries too, where its address allows)
            return max(thp, sum(self._collapsed)), ("transparent huge pages made by MADV_COLLAPSE (shmem_enabled: "
                                                    f"{_shmem_thp_setting()} gives none when pages fault in)")
        if thp:
            return thp, "transparent huge pages (MADV_HUGEPAGE)"
        if self.huge_pages == "off":
            return 0, "none: host_huge_pages = 'off'"
        setting = _shmem_thp_setting()
        if self._collapsed is not None and self.size < _HUGE:
            return 0, f"none: the arena ({format_size(self.size)}) is smaller than one huge page"
        if setting in _SHMEM_THP_ON:
            return 0, (f"none: shmem_enabled ({setting}) allows them, but the kernel had no free huge pages to "
                       "give (memory too fragmented); reserve huge pages and use host_huge_pages = 'hugetlb'")
        return 0, (f"none: the kernel gives shared memory no transparent huge pages (shmem_enabled: {setting}) "
                   "and refused to make them (MADV_COLLAPSE, Linux 6.1); set it to 'advise', or reserve huge pages "
                   "and use host_huge_pages = 'hugetlb'")

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        """A uint8 view of ``[offset, offset + nbytes)`` (no copy)."""
        return self.array[offset:offset + nbytes]

    def close(self) -> None:
        if self._populating is not None:  # stopped within a chunk: not unmapped under it
            self._populate_stop.set()
            self._populating.join()
            self._populating = None
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


def _map(fd: int, size: int, populate: bool = False) -> mmap.mmap:
    if size == 0:
        return mmap.mmap(-1, PAGE)
    flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


_SHMEM_THP_ON = ("always", "within_size", "advise", "force")
"""The ``shmem_enabled`` settings under which an arena that asks gets transparent huge pages."""


def _shmem_thp_setting() -> str:
    """The ``shmem_enabled`` setting in force for 2 MiB pages: the per-size one
    (``hugepages-2048kB/shmem_enabled``, Linux 6.11) unless it says ``inherit``, else the
    top-level one."""
    def chosen(path: str) -> str:
        text = _read_text(path)
        return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else text

    per_size = chosen("/sys/kernel/mm/transparent_hugepage/hugepages-2048kB/shmem_enabled")
    if per_size not in ("inherit", "unknown"):
        return per_size
    return chosen("/sys/kernel/mm/transparent_hugepage/shmem_enabled")


def _shmem_thp_at_fault() -> bool:
    """Pages of shared memory fault in huge where a mapping asks (``MADV_HUGEPAGE``)."""
    return _shmem_thp_setting() in _SHMEM_THP_ON


def _hugetlb_page() -> int:
    """The kernel's default huge page size (``Hugepagesize`` in /proc/meminfo; 2 MiB)."""
    for line in _read_text("/proc/meminfo").splitlines():
        if line.startswith("Hugepagesize:"):
            return int(line.split()[1]) << 10
    return 2 << 20


def _advise_huge(mm: mmap.mmap) -> None:
    """Ask for transparent huge pages for a mapping (best effort: a kernel or setting that
    gives none leaves small pages)."""
    try:
        mm.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError) as e:
        log.debug("MADV_HUGEPAGE refused: %s", e)


def _huge_bytes(view: np.ndarray) -> tuple[int, int]:
    """Bytes of the mapping that holds ``view`` mapped as transparent huge pages of shared
    memory, and as hugetlb pages (its ``/proc/self/smaps`` entry)."""
    start = view.ctypes.data
    inside, thp, hugetlb = False, 0, 0
    for line in _read_text("/proc/self/smaps").splitlines():
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= start < hi
        elif inside and head == "ShmemPmdMapped:":
            thp += int(line.split()[1]) << 10
        elif inside and head in ("Shared_Hugetlb:", "Private_Hugetlb:"):
            hugetlb += int(line.split()[1]) << 10
    return thp, hugetlb


def _read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return "unknown"


_MADV_POPULATE_WRITE = 23  # <linux/mman.h>; not in the mmap module before Python 3.13
_POPULATE_CHUNK = 256 << 20


def _populate(fd: int, mm: mmap.mmap, size: int, threads: int, stop: threading.Event | None = None, *,
              collapse: list[int] | None = None) -> str:
    """Allocate and map every page (``MADV_POPULATE_WRITE``), a chunk per task; with
    ``collapse`` (a list), each chunk's pages are first made huge where the kernel can
    (``_collapse``; the bytes made so are appended to the list), and only what is left
    is allocated in small pages."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))  # the temporary export ends at once; the address stays
    chunks = [(off, min(_POPULATE_CHUNK, size - off)) for off in range(0, size, _POPULATE_CHUNK)]

    def one(chunk: tuple[int, int]) -> int:
        # ctypes drops the GIL for the call, so the threads fault pages in in parallel
        if stop is not None and stop.is_set():
            return 0  # the arena is closing
        if collapse is not None and (made := _collapse(libc, fd, *chunk)):
            collapse.append(made)  # (list.append is atomic: the threads share the list)
        return 0 if libc.madvise(base + chunk[0], chunk[1], _MADV_POPULATE_WRITE) == 0 else ctypes.get_errno()

    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tierstore-populate") as pool:
        errs = [e for e in pool.map(one, chunks) if e]
    if not errs:
        made = f"; {format_size(sum(collapse))} made huge pages by MADV_COLLAPSE" if collapse else ""
        return f"MADV_POPULATE_WRITE, {threads} threads{made}"
    if all(e == errno.EINVAL for e in errs):  # a kernel before 5.14
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            raise CapacityExceeded(f"cannot allocate the {format_size(size)} host arena: {e.strerror}; lower "
                                   "host_bytes (or free memory)") from None
        return "fallocate; this kernel has no MADV_POPULATE_WRITE, so pages fault in on first touch"
    raise CapacityExceeded(f"cannot allocate the {format_size(size)} host arena: {os.strerror(errs[0])}; lower "
                           "host_bytes (or free memory)")


_HUGE = 2 << 20
"""A transparent huge page of shared memory (x86-64, arm64 with 4 KiB pages)."""
_MADV_COLLAPSE = 25  # <linux/mman.h>, Linux 6.1
_PROT_NONE, _PROT_RW, _MAP_SHARED, _MAP_PRIVATE_ANON = 0, 3, 0x01, 0x22


def _collapse(libc: ctypes.CDLL, fd: int, off: int, n: int) -> int:
    """Make ``[off, off + n)`` of the memfd ``fd`` (``off`` a multiple of 2 MiB) of
    transparent huge pages, where ``shmem_enabled`` gives none when pages fault in: one
    small page of each 2 MiB is allocated (``MADV_POPULATE_WRITE``, which keeps the bytes
    of an adopted arena), then ``MADV_COLLAPSE`` (Linux 6.1) makes each 2 MiB one huge
    page, the rest zero-filled (0.1 – 2.7 s per GiB measured here, as the machine's memory
    allowed, against 0.4 – 1.5 s in small pages: docs/store.md). It works through a mapping of the range at a 2 MiB-aligned
    address made for it and unmapped after: the arena's own mapping, and every client's,
    lie wherever the kernel put them, and the kernel collapses only where a mapping's
    address and the file offset agree to 2 MiB. The pages stay the memfd's, huge, for
    every mapping of it (each maps them with small page-table entries, which is all it
    takes: the bytes of a huge page are physically contiguous, so an O_DIRECT request
    over them is a few scatter-gather segments instead of one per 4 KiB). A kernel
    before 6.1, ``shmem_enabled`` = ``deny``, memory too fragmented, a page pinned by
    I/O meanwhile: those 2 MiB stay small pages, correct as before. The bytes made huge."""
    n = n // _HUGE * _HUGE
    if n <= 0 or off % _HUGE:
        return 0
    room = libc.mmap(None, n + _HUGE, _PROT_NONE, _MAP_PRIVATE_ANON, -1, 0)  # (address space only)
    if room in (None, ctypes.c_void_p(-1).value):
        return 0
    try:
        at = -(-room // _HUGE) * _HUGE
        if libc.mmap(at, n, _PROT_RW, _MAP_SHARED | _MAP_FIXED, fd, off) != at:
            return 0
        for p in range(at, at + n, _HUGE):
            if libc.madvise(p, PAGE, _MADV_POPULATE_WRITE) != 0:
                return 0  # (no memory: the populating that follows says so)
        if libc.madvise(at, n, _MADV_COLLAPSE) == 0:
            return n
        return _count_collapsed(libc, at, n)  # (failed in part, or all: a kernel that cannot refuses at once)
    finally:
        libc.munmap(room, n + _HUGE)


def _count_collapsed(libc: ctypes.CDLL, at: int, n: int) -> int:
    """After a collapse that failed, in part (memory short, a page busy, a memory cgroup's
    limit) or whole: each 2 MiB piece of ``[at, at + n)`` collapsed again, one at a time
    (one that is huge already succeeds at once); the bytes of those that are huge after."""
    return sum(_HUGE for p in range(at, at + n, _HUGE) if libc.madvise(p, _HUGE, _MADV_COLLAPSE) == 0)


def map_arena_fd(fd: int, size: int, *, read_only: bool = False,
                 huge: bool = False) -> tuple[mmap.mmap, np.ndarray]:
    """Map an arena fd received from the daemon; returns the mapping and a uint8 view
    (``read_only``: a ``PROT_READ`` mapping, whose view is not writeable; ``huge``: ask
    for transparent huge pages, as the daemon's own mapping does, so that a page this
    mapping touches before the daemon populated it is allocated huge too).

    The mapping's page tables are not filled here: that costs ~0.3 s per GiB, which a
    client that only asks for ``stat`` should not pay at connect. ``prefault_mapping``
    fills them in the background (the daemon already allocated the pages, so a fault
    here is a minor one: the first copy through an unfilled GiB costs ~1 s more)."""
    if not size:
        return _map(fd, 0), np.empty(0, np.uint8)
    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED,
                   prot=mmap.PROT_READ if read_only else mmap.PROT_READ | mmap.PROT_WRITE)
    if huge:
        _advise_huge(mm)
    return mm, np.frombuffer(mm, dtype=np.uint8)


def detach_mapping(view: np.ndarray, fd: int, *, read_only: bool = False) -> bool:
    """Turn a shared mapping of the arena, still referenced by views that outlive their
    client, into a private copy-on-write mapping of the same pages at the same address
    (``MAP_FIXED | MAP_PRIVATE``): the views go on reading, but a write through one lands
    in this process's own copy of the page, never in the pool. True when done."""
    if not view.nbytes:
        return True
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    prot = mmap.PROT_READ if read_only else mmap.PROT_READ | mmap.PROT_WRITE
    addr = view.ctypes.data
    # (MAP_NORESERVE: a private mapping of a hugetlb arena would otherwise reserve a huge page
    # per page up front, and fail for want of them; without the reservation, a write through a
    # stale view takes a huge page when it happens, and the process gets SIGBUS if none is free)
    got = libc.mmap(addr, view.nbytes, prot, mmap.MAP_PRIVATE | _MAP_FIXED | _MAP_NORESERVE, fd, 0)
    if got != addr:
        log.warning("could not detach the arena mapping from the pool: %s", os.strerror(ctypes.get_errno()))
        return False
    return True


_MAP_FIXED = 0x10
_MAP_NORESERVE = 0x4000
_MADV_POPULATE_READ = 22
_PREFAULT_CHUNK = 64 << 20


def prefault_mapping(view: np.ndarray, stop: threading.Event, *, read_only: bool = False) -> int:
    """Fill a mapping's page tables chunk by chunk (``MADV_POPULATE_READ``/``_WRITE``),
    stopping between chunks once ``stop`` is set; the bytes done. Best effort: a kernel
    without these advices, or a chunk the kernel refuses, ends it quietly (pages then
    fault in on first touch, as they would anyway)."""
    if not view.nbytes:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    advice = _MADV_POPULATE_READ if read_only else _MADV_POPULATE_WRITE
    base, done = view.ctypes.data, 0
    while done < view.nbytes and not stop.is_set():
        n = min(_PREFAULT_CHUNK, view.nbytes - done)
        if libc.madvise(base + done, n, advice) != 0:
            log.debug("prefaulting the arena mapping stopped at %d B: %s", done, os.strerror(ctypes.get_errno()))
            break
        done += n
    return done
