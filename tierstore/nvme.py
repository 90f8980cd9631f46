"""NVMe tier mechanism: extents in preallocated data files, chunked parallel I/O,
a CRC32C per 1 MiB block written with the data and verified on every read.

One data file per configured directory; an object larger than a few chunks is
striped across the directories in chunk-aligned parts. Files grow by fallocate in
``grow_bytes`` steps, so a full filesystem surfaces as ``NoSpace`` on the request
that needed the space, never as a torn object; a tail that stays free is cut back
(``trim``). With ``grow_bytes`` 0 each file is
reserved whole when the tier opens instead, so no write the tier has room for ever
meets a full filesystem (where the filesystem cannot hold the reservation: a
warning, and growth in steps). Reads never grow a file. What to place here, and
when, is the store's policy; this module only moves bytes.

Length: the data files, their growth and trim, and the read and write paths (single, batched,
begun before all the bytes are there, read in order for a reader copying behind,
through staging buffers for memory the drive cannot DMA from as it is) share one set
of rules for chunks, alignment and checksums; they are kept together so those rules
are written once.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import logging
import mmap
import os
import queue
import threading
from concurrent.futures import Future

import numpy as np

from .allocator import ExtentAllocator
from .checksum import BLOCK_BYTES, crc32c
from .engine import IOEngine, dio_memory_alignment, probe_direct_io
from .extent import Extent
from .errors import CapacityExceeded, ChecksumMismatch, InvalidArgument, NoSpace, StorageError
from . import tierid
from .files import fallocate, open_own, refuse_link
from .groupsync import GroupSync
from .units import PAGE, align_up

__all__ = ["Extent", "NvmeTier", "PartialWrite", "StreamRead", "DATA_FILE", "LOCK_FILE"]

log = logging.getLogger(__name__)

DATA_FILE = "data.bin"
LOCK_FILE = "lock"
_FALLBACK_GROW_BYTES = 256 << 20
"""Growth step of a data file that could not be reserved whole."""
_HUGE = 2 << 20
_STREAM_CHUNK = 8 << 20
_STREAM_DEPTH = 6
"""A ``StreamRead``'s chunks (at most ``_STREAM_CHUNK``) in flight at once. (Against 16 MiB
chunks 4 at a time and 4 MiB chunks 8 at a time, 8 MiB 6 at a time copied 64 MiB - 1 GiB
out fastest: bench/nvme_paths.py, docs/benchmarks.md.)"""
_BOUNCE_BUFFERS = 8
"""Most staging buffers (of one chunk each) for transfers of memory that is not 4 KiB aligned."""


class _Drive:
    def __init__(self, index: int, directory: str, engine: IOEngine, direct_mode: str,
                 capacity: int) -> None:
        self.index = index
        self.directory = directory
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self._lock_fd = open_own(os.path.join(directory, LOCK_FILE), os.O_RDWR | os.O_CREAT)
        # the directory itself is locked too: a lock file someone removed (and the next store
        # made anew) would let two stores share the directory's files
        self._dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(self._dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = os.pread(self._lock_fd, 32, 0).decode(errors="replace").strip() or "another process"
            os.close(self._lock_fd)
            os.close(self._dir_fd)
            raise InvalidArgument(f"NVMe directory {directory} is in use by pid {other}; "
                                  "stop that store/daemon or configure another directory") from None
        try:
            self._open(directory, engine, direct_mode, capacity)
        except BaseException:
            os.close(self._lock_fd)
            os.close(self._dir_fd)
            raise

    def _open(self, directory: str, engine: IOEngine, direct_mode: str, capacity: int) -> None:
        """(the directory locked) Its data file, and how it is read and written."""
        os.ftruncate(self._lock_fd, 0)
        os.pwrite(self._lock_fd, str(os.getpid()).encode(), 0)
        if direct_mode == "off":
            self.direct, self.direct_reason = False, "O_DIRECT disabled by configuration"
        else:
            self.direct, self.direct_reason = probe_direct_io(directory)
            if direct_mode == "on" and not self.direct:
                raise InvalidArgument(f"direct_io=on but {self.direct_reason}")
        if not self.direct:
            log.warning("NVMe dir %s: %s", directory, self.direct_reason)
        self.path = os.path.join(directory, DATA_FILE)
        refuse_link(self.path)  # (the posix engine opens with O_NOFOLLOW; KvikIO takes a path)
        self.file = engine.open(self.path, direct=self.direct)
        self.file_size = os.fstat(self.file.fileno()).st_size
        # user memory aligned to the device's DMA alignment goes to the kernel as it is (the
        # posix engine; other engines keep their own rules: page-aligned buffers only)
        self.mem_align = dio_memory_alignment(self.path) if self.direct and engine.name == "posix" else PAGE
        # durable writes share fdatasyncs: each returns once one that began after its write completed
        self.sync = GroupSync(self.file.sync)
        self.alloc = ExtentAllocator(capacity)
        self.grow_lock = threading.Lock()
        self.peaks: collections.deque[tuple[float, int]] = collections.deque()
        """(time, peak high water) samples of the trim window, peaks decreasing (``NvmeTier.trim``)."""
        self.sampled_since: float | None = None

    def close(self) -> None:
        self.file.close()
        os.close(self._lock_fd)
        os.close(self._dir_fd)


class _BouncePool:
    """Staging buffers for O_DIRECT I/O of unaligned user memory: private memory, 2 MiB
    aligned and advised into transparent huge pages (which the kernel gives private memory
    under its common default, ``enabled = madvise``), so a request of several MiB is a few
    physically contiguous segments whatever the state of the machine's memory
    (``Arena.huge`` says why that matters)."""

    def __init__(self, count: int, size: int) -> None:
        self.count, self.size = count, size
        self._free: queue.SimpleQueue[np.ndarray] = queue.SimpleQueue()
        self._map = mmap.mmap(-1, count * size + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            self._map.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError):
            pass  # 4 KiB pages: the same bytes, in smaller requests on some drives
        whole = np.frombuffer(self._map, dtype=np.uint8)
        start = -whole.ctypes.data % _HUGE
        for i in range(count):
            self._free.put(whole[start + i * size:start + (i + 1) * size])

    def get(self) -> np.ndarray:
        return self._free.get()

    def put(self, buf: np.ndarray) -> None:
        self._free.put(buf)


def _aligned(buf: np.ndarray, align: int) -> bool:
    return buf.ctypes.data % align == 0


class NvmeTier:
    """Extent-managed, checksummed storage over one data file per directory."""

    def __init__(self, dirs: list[str], capacity_bytes: int, engine: IOEngine, *,
                 direct_io: str = "auto", chunk_bytes: int = 8 << 20, grow_bytes: int = 256 << 20,
                 trim_after_s: float = 0.0) -> None:
        if not dirs:
            raise InvalidArgument("the NVMe tier needs at least one directory (nvme_dirs)")
        self.engine = engine
        self.chunk_bytes = chunk_bytes
        # 0: the whole file at open; the step is for a filesystem that cannot hold it
        self.grow_bytes = max(align_up(grow_bytes or _FALLBACK_GROW_BYTES, PAGE), PAGE)
        self.trim_after_s = trim_after_s if grow_bytes else 0.0
        """A data file's tail that no extent reached for this long is given back (``trim``); 0: never."""
        self.trimmed_bytes = 0
        per_drive = capacity_bytes // len(dirs) // PAGE * PAGE
        self.drives: list[_Drive] = []
        try:
            for i, d in enumerate(dirs):
                self.drives.append(_Drive(i, d, engine, direct_io, per_drive))
            # (every directory locked) named as the tier's own, in its order
            self._unrecorded = tierid.check(dirs)
        except BaseException:
            for drv in self.drives:
                drv.close()
            raise
        self.capacity_bytes = per_drive * len(dirs)
        self.reserved = all(d.file_size >= d.alloc.capacity for d in self.drives)
        if grow_bytes == 0:
            self.reserved = self._reserve_files()
        self.direct = all(d.direct for d in self.drives)
        self.direct_reason = "; ".join(sorted({d.direct_reason for d in self.drives}))
        # at most _BOUNCE_BUFFERS unaligned chunks in flight: their pages are resident once used
        self._bounce = _BouncePool(min(engine.threads + 2, _BOUNCE_BUFFERS), chunk_bytes)
        self._lock = threading.Lock()  # guards the allocators and the stripe cursor
        self._next_drive = 0
        self.bytes_read = 0
        self.staged_bytes = 0
        """Bytes that went through a staging buffer (memory O_DIRECT could not take as it is)."""
        self.bytes_written = 0

    # -- space -----------------------------------------------------------------------------
    def _reserve_files(self) -> bool:
        """Reserve every data file at its full size; False (logged) where the filesystem
        cannot hold it: that drive's file then grows as objects need it."""
        ok = True
        for drv in self.drives:
            if drv.file_size >= drv.alloc.capacity:
                continue
            with drv.grow_lock:
                # fallocate(2) itself, not posix_fallocate: where the filesystem cannot reserve
                # space, glibc would write the whole file instead
                err = fallocate(drv.file.fileno(), drv.file_size, drv.alloc.capacity - drv.file_size)
                if err == 0:
                    drv.file_size = drv.alloc.capacity
                    continue
            ok = False
            log.warning("NVMe dir %s: the data file could not be reserved at %d bytes (%s); it grows as objects "
                        "need it, and a full filesystem fails the write that meets it (NoSpace)", drv.directory,
                        drv.alloc.capacity, os.strerror(err))
        return ok

    def record_identity(self) -> None:
        """Write each directory's ``tier.id`` where the tier has none yet (``tierstore.tierid``):
        once the journal's objects were found where these directories, in this order, hold
        them."""
        if self._unrecorded:
            tierid.record([d.directory for d in self.drives])
            self._unrecorded = False

    def geometry(self) -> tuple[int, int]:
        """How many drives, and the bytes each holds (the index checkpoint records both)."""
        return len(self.drives), self.drives[0].alloc.capacity

    @property
    def used_bytes(self) -> int:
        return sum(d.alloc.used_bytes for d in self.drives)

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    def fits(self, nbytes: int) -> bool:
        return align_up(max(nbytes, 1), PAGE) <= self.capacity_bytes

    def alloc(self, nbytes: int) -> list[Extent]:
        """Extents for an object of ``nbytes``; striped when it spans several chunks."""
        ndrv = len(self.drives)
        with self._lock:
            if ndrv > 1 and nbytes >= 2 * self.chunk_bytes:
                part = align_up(-(-nbytes // ndrv), self.chunk_bytes)
                parts = [(o, min(part, nbytes - o)) for o in range(0, nbytes, part)]
            else:
                parts = [(0, nbytes)]
            start = self._next_drive
            self._next_drive = (self._next_drive + 1) % ndrv
            extents: list[Extent] = []
            for k, (obj_off, n) in enumerate(parts):
                drv = self._pick_drive((start + k) % ndrv, n, taken={e.dev for e in extents})
                off = None if drv is None else drv.alloc.alloc(n)
                if off is None:
                    for e in extents:
                        self.drives[e.dev].alloc.free(e.file_offset, e.nbytes)
                    raise CapacityExceeded(
                        f"NVMe tier full: {nbytes} bytes requested, {self.free_bytes} free of "
                        f"{self.capacity_bytes}; free objects or raise nvme_bytes")
                extents.append(Extent(drv.index, off, obj_off, n))
        try:
            for e in extents:
                self._ensure_file_size(self.drives[e.dev], e.file_offset + align_up(max(e.nbytes, 1), PAGE))
        except BaseException:
            self.free(extents)
            raise
        return extents

    def alloc_many(self, sizes: list[int]) -> list[list[Extent] | Exception]:
        """``alloc`` for each of ``sizes`` (a group commit's batch), per object its extents
        or the error. On one drive, objects of up to a chunk are taken as one run of
        adjacent extents in one hold of the lock (a batch of small durable puts then
        costs one allocation, and its writes one request per run); otherwise, or when no
        free extent holds the run, one by one."""
        out: list[list[Extent] | Exception | None] = [None] * len(sizes)
        small = [i for i, n in enumerate(sizes) if n <= self.chunk_bytes] if len(self.drives) == 1 else []
        if len(small) > 1:
            drv = self.drives[0]
            with self._lock:
                offs = drv.alloc.alloc_run([sizes[i] for i in small])
            if offs is not None:
                try:
                    self._ensure_file_size(drv, offs[-1] + align_up(max(sizes[small[-1]], 1), PAGE))
                    for i, off in zip(small, offs):
                        out[i] = [Extent(drv.index, off, 0, sizes[i])]
                except Exception:  # the file cannot grow that far: one by one, each meeting it
                    with self._lock:
                        for i, off in zip(small, offs):
                            drv.alloc.free(off, sizes[i])
        for i, n in enumerate(sizes):
            if out[i] is None:
                try:
                    out[i] = self.alloc(n)
                except Exception as e:  # this object fails; the others go on
                    out[i] = e
        return out  # type: ignore[return-value]

    def _pick_drive(self, first: int, n: int, taken: set[int]) -> _Drive | None:
        ndrv = len(self.drives)
        for k in range(ndrv):
            drv = self.drives[(first + k) % ndrv]
            if drv.index not in taken and drv.alloc.largest_free >= align_up(max(n, 1), PAGE):
                return drv
        for k in range(ndrv):  # striping could not use distinct drives: allow reuse
            drv = self.drives[(first + k) % ndrv]
            if drv.alloc.largest_free >= align_up(max(n, 1), PAGE):
                return drv
        return None

    def free(self, extents: list[Extent]) -> None:
        with self._lock:
            for e in extents:
                self.drives[e.dev].alloc.free(e.file_offset, e.nbytes)

    def reserve(self, extents: list[Extent]) -> None:
        """Mark extents used (journal replay)."""
        with self._lock:
            for e in extents:
                if e.dev >= len(self.drives):
                    raise InvalidArgument(f"extent on drive {e.dev}, but only {len(self.drives)} configured")
                self.drives[e.dev].alloc.reserve(e.file_offset, e.nbytes)

    def reserve_all(self, extents: list[Extent]) -> None:
        """``reserve`` of every extent of every replayed object at once: all or nothing
        (ValueError or InvalidArgument, nothing reserved, when one is not free or two overlap)."""
        n = len(extents)
        dev = np.fromiter((e.dev for e in extents), np.int64, n)
        off = np.fromiter((e.file_offset for e in extents), np.int64, n)
        size = np.fromiter((e.nbytes for e in extents), np.int64, n)
        if n and (dev.min() < 0 or dev.max() >= len(self.drives)):
            raise InvalidArgument(f"an extent names a drive beyond the {len(self.drives)} configured")
        with self._lock:
            # each drive's extents are checked whole before they are applied; a later drive
            # that fails gives the earlier ones back
            done = []
            try:
                for i, drv in enumerate(self.drives):
                    mine = np.flatnonzero(dev == i)
                    if len(mine):
                        mine = mine[np.argsort(off[mine], kind="stable")]
                        drv.alloc.reserve_arrays(off[mine], size[mine])
                        done.append((drv, mine))
            except ValueError:
                for drv, mine in done:
                    for j in mine.tolist():
                        drv.alloc.free(int(off[j]), int(size[j]))
                raise

    def _ensure_file_size(self, drv: _Drive, end: int) -> None:
        if end <= drv.file_size:
            return
        with drv.grow_lock:
            if end <= drv.file_size:
                return
            new_size = min(max(align_up(end, self.grow_bytes), end), drv.alloc.capacity)
            try:
                os.posix_fallocate(drv.file.fileno(), drv.file_size, new_size - drv.file_size)
            except OSError as e:
                if e.errno != errno.ENOSPC or new_size == end:
                    raise _io_error(e, drv.path, "growing") from None
                # the growth step does not fit: take just what this request needs
                try:
                    os.posix_fallocate(drv.file.fileno(), drv.file_size, end - drv.file_size)
                except OSError as e2:
                    raise _io_error(e2, drv.path, "growing") from None
                new_size = end
            drv.file_size = new_size

    def trim(self, now: float) -> int:
        """Sample each data file's high water (the end of its topmost extent in use) and give
        back, by ``ftruncate``, what lies above the highest sample of the last
        ``trim_after_s`` seconds, rounded up to ``grow_bytes``, once that is at least one
        growth step: space a job freed returns to the filesystem, while a loop that frees
        and takes space again within the window never pays for growing its file anew.
        Only the free tail goes (a file holding one object near its end keeps its size).
        Returns the bytes given back; a failed truncate is logged and leaves the file as
        it was."""
        if self.trim_after_s <= 0:
            return 0
        given = 0
        with self._lock:  # no extent is taken while the tail is cut
            for drv in self.drives:
                peak, peaks = drv.alloc.take_peak(), drv.peaks
                while peaks and peaks[-1][1] <= peak:
                    peaks.pop()
                peaks.append((now, peak))
                while peaks[0][0] < now - self.trim_after_s:
                    peaks.popleft()
                if drv.sampled_since is None:
                    drv.sampled_since = now
                if now - drv.sampled_since < self.trim_after_s:
                    continue  # the window is not yet covered by samples
                target = min(align_up(peaks[0][1], self.grow_bytes), drv.alloc.capacity)
                if drv.file_size - target < self.grow_bytes:
                    continue
                with drv.grow_lock:
                    try:
                        os.ftruncate(drv.file.fileno(), target)
                    except OSError as e:
                        log.warning("NVMe dir %s: giving back the data file's free tail failed: %s", drv.directory,
                                    os.strerror(e.errno))
                        drv.sampled_since = now  # (not again at every pass)
                        continue
                    log.info("NVMe dir %s: data file trimmed from %d to %d bytes (its tail was free for %.0f s)",
                             drv.directory, drv.file_size, target, self.trim_after_s)
                    given += drv.file_size - target
                    drv.file_size = target
        self.trimmed_bytes += given
        return given

    # -- data ------------------------------------------------------------------------------
    def write(self, extents: list[Extent], src: np.ndarray, *, src_padded: np.ndarray | None = None,
              sync: bool = False) -> list[int]:
        """Write ``src`` (uint8, the whole object) to ``extents``; return per-block CRC32C.

        ``src_padded``, when given, is the same memory extended to a 4 KiB multiple
        (a host-arena block), so even the tail goes out without a bounce copy.
        """
        nbytes = src.nbytes
        crcs = [0] * (-(-nbytes // BLOCK_BYTES))
        chunks = list(self._chunks(extents))
        if len(chunks) == 1:  # one request: issue it here, a hand-off to the pool would only add latency
            self._inline(self._write_chunk, extents, *chunks[0], src, src_padded, crcs)
        else:
            # the chunks go out first; this thread computes the checksums of those written from
            # where they are while they are written, so no worker holds a request back for them.
            # A chunk copied into a staging buffer is checksummed by its worker as it copies,
            # block by block from the copy (still in cache): one pass over the source, not two
            futures, mine = [], []
            for e, c_off, c_len in chunks:
                staged = self._io_buffer(src, src_padded, c_off, c_len, self.drives[e.dev]) is None
                futures.append(self.engine.submit(self._write_chunk, e, c_off, c_len, src, src_padded,
                                                  crcs if staged else None))
                if not staged:
                    mine.append((c_off, c_len))
            try:
                for c_off, c_len in mine:
                    for b in range(c_off, c_off + c_len, BLOCK_BYTES):
                        crcs[b // BLOCK_BYTES] = crc32c(src[b:min(b + BLOCK_BYTES, c_off + c_len)])
            finally:
                self._gather(futures, extents)
        if sync:  # the journal record that names these bytes comes after this
            self.sync_drives({e.dev for e in extents})
        self.bytes_written += nbytes
        return crcs

    def write_many(self, writes: list[tuple[list[Extent], np.ndarray, np.ndarray | None]]) -> list[list[int] | Exception]:
        """Write several objects (each ``write``'s ``extents, src, src_padded``), unsynced;
        per object its CRC32Cs, or the error that failed its write.

        The group committer's write: small objects (one extent, one request) whose
        buffers the kernel can take as they are go out in one ``pwritev`` per run of
        adjacent extents on a drive, so a batch of page-sized puts costs a few requests,
        not one each. Larger objects go through ``write``."""
        out: list[list[int] | Exception | None] = [None] * len(writes)
        runs: dict[int, list[tuple[int, int, np.ndarray]]] = {}  # drive -> (file offset, index, buffer)
        for i, (extents, src, padded) in enumerate(writes):
            n = src.nbytes
            if len(extents) == 1 and 0 < n <= min(self.chunk_bytes, BLOCK_BYTES):
                drv = self.drives[extents[0].dev]
                io = self._io_buffer(src, padded, 0, n, drv)
                if io is not None:
                    out[i] = [crc32c(src)]
                    runs.setdefault(drv.index, []).append((extents[0].file_offset, i, io))
                    continue
            try:
                out[i] = self.write(extents, src, src_padded=padded) if n else []
            except Exception as e:  # this object fails; the others go on
                out[i] = e
        for dev, parts in runs.items():
            drv = self.drives[dev]
            parts.sort(key=lambda p: p[0])
            start = 0
            for k in range(1, len(parts) + 1):
                # a run ends at a gap between extents, or at the kernel's limit on buffers per call
                if k < len(parts) and parts[k][0] == parts[k - 1][0] + parts[k - 1][2].nbytes and k - start < 512:
                    continue
                run = parts[start:k]
                try:
                    _pwritev_all(drv.file.fileno(), [p[2] for p in run], run[0][0])
                except OSError as e:
                    err = _io_error(e, drv.path, "I/O on")
                    for p in run:
                        out[p[1]] = err
                start = k
        # (``write`` counted the objects it wrote: only the runs' are counted here)
        self.bytes_written += sum(writes[i][1].nbytes for parts in runs.values() for _, i, _ in parts
                                  if not isinstance(out[i], Exception))
        return out  # type: ignore[return-value]

    def sync_drives(self, devs: set[int]) -> None:
        """fdatasync the data files of drives ``devs`` (shared with concurrent syncs of the
        same file): every write to them that returned before this call is then on stable
        storage."""
        for dev in sorted(devs):
            drv = self.drives[dev]
            try:
                drv.sync.sync()
            except OSError as err:
                raise _io_error(err, drv.path, "syncing") from None

    def read(self, extents: list[Extent], dst: np.ndarray, checksums: list[int], *,
             dst_padded: np.ndarray | None = None, priority: int = 0) -> None:
        """Read the object into ``dst`` (uint8), verifying every block's CRC32C.

        ``priority`` 1 marks a prefetch: queued demand reads (0) go first. A read of one
        chunk is issued at once from the calling thread — a prefetch only while no
        request waits for the engine, so it never goes ahead of a queued demand read.
        """
        chunks = list(self._chunks(extents))
        if len(chunks) == 1 and (priority == 0 or not self.engine.queued()):
            self._inline(self._read_chunk, extents, *chunks[0], dst, dst_padded, checksums)
        else:
            # the workers only move bytes; this thread checks each chunk's blocks as it lands,
            # while the chunks after it are still being read
            # (a chunk read into a staging buffer is checked there by its worker, block by block
            # as it is copied out)
            futures, verify = [], []
            for e, c_off, c_len in chunks:
                drv = self.drives[e.dev]
                staged = self._io_buffer(dst, dst_padded, c_off, c_len, drv) is None
                futures.append(self.engine.submit(self._read_chunk, e, c_off, c_len, dst, dst_padded,
                                                  checksums if staged else None, priority=priority))
                verify.append(None if staged else
                              (dst, c_off, c_len, checksums, drv.path, e.file_offset + (c_off - e.obj_offset)))
            self._gather(futures, extents, verify=verify)
        self.bytes_read += dst.nbytes

    def read_device(self, extents: list[Extent], dst, checksums: list[int], to_host) -> None:
        """Read the object into ``dst``, contiguous uint8 device memory (a torch CUDA tensor
        or a CuPy array), through the engine files' ``pread_device`` (the kvikio engine:
        GPUDirect Storage where active), chunk by chunk; then verify each chunk's blocks
        on the host: ``to_host(view)`` copies a device chunk into a NumPy array (no CRC32C
        kernel ships with our dependencies; that copy is faster than the drive read)."""
        for e, off, n in self._chunks(extents):
            drv = self.drives[e.dev]
            pos = e.file_offset + (off - e.obj_offset)
            try:
                drv.file.pread_device(dst[off:off + n], pos)
            except OSError as err:
                raise _io_error(err, drv.path, "I/O on") from None
            self._verify(to_host(dst[off:off + n]), off, checksums, drv.path, pos)
        self.bytes_read += sum(e.nbytes for e in extents)

    def _chunks(self, extents: list[Extent], most: int | None = None):
        """(extent, object offset, bytes) of each chunk: at most ``most`` (else ``chunk_bytes``) bytes."""
        total = sum(e.nbytes for e in extents)
        # at least ~4 requests in flight per object, but never below one checksum block
        step = min(most or self.chunk_bytes, max(BLOCK_BYTES, total // 4 // BLOCK_BYTES * BLOCK_BYTES))
        for e in extents:
            for c in range(0, e.nbytes, step):
                yield e, e.obj_offset + c, min(step, e.nbytes - c)

    def _io_buffer(self, buf: np.ndarray, padded: np.ndarray | None, off: int, n: int, drv: _Drive):
        """The slice to hand the kernel directly, or None when a bounce is needed: with
        O_DIRECT, a whole number of pages at an address the drive's DMA alignment allows
        (``_Drive.mem_align``: a tensor from an ordinary allocator, 64 B past a page, goes
        direct where the device takes 4 B alignment, as NVMe drives do)."""
        if not drv.direct:
            return buf[off:off + n]
        if n % PAGE == 0:
            view = buf[off:off + n]
            return view if _aligned(view, drv.mem_align) else None
        if padded is not None:
            view = padded[off:off + align_up(n, PAGE)]
            return view if _aligned(view, drv.mem_align) and view.nbytes == align_up(n, PAGE) else None
        return None

    def _write_chunk(self, e: Extent, off: int, n: int, src: np.ndarray, padded: np.ndarray | None,
                     crcs: list[int] | None) -> None:
        """Write one chunk; its blocks' CRC32Cs into ``crcs`` unless None (the caller computes them)."""
        drv = self.drives[e.dev]
        data = src[off:off + n]
        pos = e.file_offset + (off - e.obj_offset)
        io = self._io_buffer(src, padded, off, n, drv)
        if io is not None:
            if crcs is not None:
                for b in range(0, n, BLOCK_BYTES):
                    crcs[(off + b) // BLOCK_BYTES] = crc32c(data[b:b + BLOCK_BYTES])
            drv.file.pwrite_from(io, pos)
            return
        self._count_staged(n)
        bounce = self._bounce.get()
        try:
            padded_n = align_up(n, PAGE)
            for b in range(0, n, BLOCK_BYTES):  # copy a block, checksum the copy while it is in cache
                m = min(BLOCK_BYTES, n - b)
                bounce[b:b + m] = data[b:b + m]
                if crcs is not None:
                    crcs[(off + b) // BLOCK_BYTES] = crc32c(bounce[b:b + m])
            if padded_n > n:
                bounce[n:padded_n] = 0
            drv.file.pwrite_from(bounce[:padded_n], pos)
        finally:
            self._bounce.put(bounce)

    def _read_chunk(self, e: Extent, off: int, n: int, dst: np.ndarray, padded: np.ndarray | None,
                    crcs: list[int] | None) -> None:
        """Read one chunk into ``dst``; its blocks are checked against ``crcs`` unless None
        (the caller checks them in ``dst``)."""
        drv = self.drives[e.dev]
        pos = e.file_offset + (off - e.obj_offset)
        io = self._io_buffer(dst, padded, off, n, drv)
        if io is not None:
            drv.file.pread_into(io, pos)
            if crcs is not None:
                self._verify(dst[off:off + n], off, crcs, drv.path, pos)
            return
        self._count_staged(n)
        bounce = self._bounce.get()
        try:
            drv.file.pread_into(bounce[:align_up(n, PAGE)], pos)
            for b in range(0, n, BLOCK_BYTES):  # check a block, copy it out while it is in cache
                m = min(BLOCK_BYTES, n - b)
                if crcs is not None:
                    self._verify(bounce[b:b + m], off + b, crcs, drv.path, pos + b)
                dst[off + b:off + b + m] = bounce[b:b + m]
        finally:
            self._bounce.put(bounce)

    def _count_staged(self, n: int) -> None:
        with self._lock:
            self.staged_bytes += n

    @staticmethod
    def _verify(data: np.ndarray, off: int, crcs: list[int], path: str, pos: int) -> None:
        for b in range(0, data.nbytes, BLOCK_BYTES):
            i = (off + b) // BLOCK_BYTES
            if i >= len(crcs) or crc32c(data[b:b + BLOCK_BYTES]) != crcs[i]:
                raise ChecksumMismatch(
                    f"block {i} (object bytes {off + b}..{off + min(b + BLOCK_BYTES, data.nbytes)}) "
                    f"read from {path} at offset {pos + b} fails its CRC32C; the stored copy is "
                    "corrupt and was not served")

    def _inline(self, fn, extents: list[Extent], *args) -> None:
        try:
            fn(*args)
        except OSError as e:
            path = self.drives[extents[0].dev].path if extents else "?"
            raise _io_error(e, path, "I/O on") from None

    def _gather(self, futures: list[Future], extents: list[Extent], verify: list[tuple | None] | None = None) -> None:
        """Wait for every chunk; raise the first failure. ``verify``: per future, the
        ``_verify`` arguments of its chunk, checked as soon as that chunk has landed (None:
        its worker checked it)."""
        first: BaseException | None = None
        for i, f in enumerate(futures):
            try:
                f.result()
                if verify is not None and verify[i] is not None and first is None:
                    dst, off, n, crcs, path, pos = verify[i]
                    self._verify(dst[off:off + n], off, crcs, path, pos)
            except BaseException as e:  # keep waiting: no chunk may still be writing into a buffer we return
                first = first or e
        if first is None:
            return
        if isinstance(first, OSError):
            path = self.drives[extents[0].dev].path if extents else "?"
            raise _io_error(first, path, "I/O on") from None
        raise first

    def close(self) -> None:
        for d in self.drives:
            d.close()

    def describe(self) -> list[dict]:
        with self._lock:
            return [{"dir": d.directory, "direct": d.direct, "reason": d.direct_reason,
                     "dio_mem_align": d.mem_align, "capacity_bytes": d.alloc.capacity,
                     "used_bytes": d.alloc.used_bytes, "file_bytes": d.file_size,
                     "reserved": d.file_size >= d.alloc.capacity, "high_water_bytes": d.alloc.high_water()}
                    for d in self.drives]


class PartialWrite:
    """A write of one object to its extents begun before all its bytes are there (a put
    through the daemon whose client is still copying into the arena): ``advance(filled)``
    sends the bytes below ``filled`` not sent yet, in whole checksum blocks, each request
    at most a chunk and never across one (a chunk's first bytes go as soon as they are
    there: the drive starts on the first piece the client copies, not on the first whole
    chunk), to the engine's workers, which checksum and write them; ``finish`` sends the
    rest and waits for all, returning the CRC32Cs; ``cancel`` sends nothing more and
    waits for what went out (the extents may then be reused: no request of this write is
    left to land in them)."""

    def __init__(self, tier: "NvmeTier", extents: list[Extent], src: np.ndarray, padded: np.ndarray | None) -> None:
        self.tier, self.extents, self.src, self.padded = tier, extents, src, padded
        self.chunks = sorted(tier._chunks(extents), key=lambda c: c[1])
        self.crcs = [0] * (-(-src.nbytes // BLOCK_BYTES))
        self.futures: list[Future] = []
        self.sent = 0  # chunks handed to the engine whole
        self.within = 0  # bytes of chunk ``sent`` handed to it already
        self.sent_bytes = 0
        self._lock = threading.Lock()

    def advance(self, filled: int) -> int:
        """Send what lies below ``filled`` (whole blocks of it, or the object's end); the
        bytes sent by this call."""
        with self._lock:
            before = self.sent_bytes
            while self.sent < len(self.chunks):
                e, off, n = self.chunks[self.sent]
                start = off + self.within
                end = off + n if off + n <= filled else off + (filled - off) // BLOCK_BYTES * BLOCK_BYTES
                if end <= start:
                    break
                self.futures.append(self.tier.engine.submit(self.tier._write_chunk, e, start, end - start,
                                                            self.src, self.padded, self.crcs))
                self.sent_bytes += end - start
                if end == off + n:
                    self.sent, self.within = self.sent + 1, 0
                else:
                    self.within = end - off
                    break
            return self.sent_bytes - before

    def finish(self, *, sync: bool) -> list[int]:
        """Send what is left, wait for every chunk (raising the first failure), sync the
        drives written if asked; the object's CRC32Cs."""
        self.advance(self.src.nbytes)
        self.tier._gather(self.futures, self.extents)
        if sync:
            self.tier.sync_drives({e.dev for e in self.extents})
        self.tier.bytes_written += self.src.nbytes
        return self.crcs

    def cancel(self) -> None:
        with self._lock:
            self.sent = len(self.chunks)
        for f in self.futures:
            f.cancel()  # still queued: never runs (those under way are waited for below)
        for f in self.futures:
            try:
                f.result()
            except BaseException:  # (the write is abandoned: its errors go with it)
                pass


class StreamRead:
    """A read of one object left running while its reader copies behind it (a get through
    the daemon): the chunks go to the engine's workers in order, ``_STREAM_DEPTH`` at a
    time (all at once, they would land together and the reader could copy nothing
    early), each read and its blocks checked by its worker. ``landed()``: how many of the
    object's first bytes are in place and checked; ``when(upto, fn)`` calls
    ``fn(landed, error)`` once that prefix reaches ``upto`` or the read fails (on the
    thread that settles it); ``cancel(error)`` sends no more chunks and fails what waits;
    ``on_done(fn)`` calls ``fn()`` once the read is over (every chunk back, or, failed or
    cancelled, every chunk sent back), after which nothing of it lands in ``dst``."""

    def __init__(self, tier: "NvmeTier", extents: list[Extent], dst: np.ndarray, checksums: list[int],
                 padded: np.ndarray | None) -> None:
        self.tier, self.nbytes = tier, dst.nbytes
        chunks = sorted(tier._chunks(extents, _STREAM_CHUNK), key=lambda c: c[1])
        self._ends = [off + n for _, off, n in chunks]
        self._ok = [False] * len(chunks)
        self._prefix = 0  # chunks landed in order from the first
        self._finished = 0  # chunks back from the engine
        self._error: BaseException | None = None
        self._waiters: list[tuple[int, object]] = []
        self._on_done: list = []
        self._lock = threading.Lock()
        self._chunks, self._dst, self._padded, self._checksums = chunks, dst, padded, checksums
        self._sent = 0
        for _ in range(min(_STREAM_DEPTH, len(chunks))):
            self._send_next()

    def landed(self) -> int:
        with self._lock:
            return self._landed()

    def when(self, upto: int, fn) -> None:
        with self._lock:
            landed = self._landed()
            if self._error is None and landed < upto:
                self._waiters.append((upto, fn))
                return
            err = None if landed >= upto else self._error  # (bytes in and checked stand, whatever came after)
        fn(landed, err)

    def on_done(self, fn) -> None:
        with self._lock:
            if not self._over():
                self._on_done.append(fn)
                return
        fn()

    def cancel(self, error: BaseException) -> None:
        """Send nothing more; whatever waits (and waits from now on) gets ``error``."""
        with self._lock:
            self._error = self._error or error
            calls = self._ready()
        self._run(calls)

    def _send_next(self) -> None:
        with self._lock:
            if self._sent == len(self._chunks) or self._error is not None:
                return
            i, self._sent = self._sent, self._sent + 1
        e, off, n = self._chunks[i]
        try:
            f = self.tier.engine.submit(self.tier._read_chunk, e, off, n, self._dst, self._padded, self._checksums)
        except BaseException as err:  # (an engine that is closing): the read fails, nothing of it is lost
            with self._lock:
                self._finished += 1  # (back at once: it never went out)
                self._error = self._error or err
                calls = self._ready()
            self._run(calls)
            return
        f.add_done_callback(lambda f, i=i: self._landed_chunk(i, f))

    def _landed_chunk(self, i: int, f: Future) -> None:
        e = f.exception()
        if isinstance(e, OSError):
            e = _io_error(e, self.tier.drives[self._chunks[i][0].dev].path, "reading")
        with self._lock:
            self._finished += 1
            if e is not None:
                self._error = self._error or e  # (nothing more is sent: over once those out are back)
            else:
                self._ok[i] = True
                while self._prefix < len(self._ok) and self._ok[self._prefix]:
                    self._prefix += 1
            more = self._error is None and self._sent < len(self._chunks)
            if self._over() and self._error is None:
                self.tier.bytes_read += self.nbytes
            calls = self._ready()
        if more:
            self._send_next()
        self._run(calls)

    def _ready(self) -> list:
        """(under the lock) The calls now due: the waiters whose bytes are in (all, on an
        error) and, once the read is over, the ``on_done`` callbacks; taken off their lists."""
        landed, err = self._landed(), self._error
        if err is not None:
            ready, self._waiters = self._waiters, []
        else:
            ready = [w for w in self._waiters if w[0] <= landed]
            self._waiters = [w for w in self._waiters if w[0] > landed]
        done, self._on_done = (self._on_done, []) if self._over() else ([], self._on_done)
        return [lambda fn=fn: fn(landed, err) for _, fn in ready] + done

    @staticmethod
    def _run(calls: list) -> None:
        """(no lock held) Make ``_ready``'s calls; one that fails is logged, the rest still run."""
        for fn in calls:
            try:
                fn()
            except Exception:
                log.exception("a callback of a streamed read failed")

    def _landed(self) -> int:
        return self._ends[self._prefix - 1] if self._prefix else 0

    def _over(self) -> bool:
        """(under the lock) Every chunk sent is back and none is left to send."""
        return self._finished == self._sent and (self._error is not None or self._sent == len(self._chunks))


def _pwritev_all(fd: int, bufs: list[np.ndarray], offset: int) -> None:
    """Write ``bufs`` back to back at ``offset``, going on after a short write."""
    views = [memoryview(b).cast("B") for b in bufs]
    while views:
        n = os.pwritev(fd, views, offset)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        offset += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if n:
            views[0] = views[0][n:]


def _io_error(e: OSError, path: str, doing: str) -> Exception:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return NoSpace(f"no space left {doing} {path}: free space on that filesystem or lower nvme_bytes")
    return StorageError(f"{os.strerror(e.errno) if e.errno else e} {doing} {path}; "
                        "check the drive and the directory's permissions")


