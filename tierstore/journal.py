"""The NVMe index journal: append-only, self-validating records, replayed on open.

Framing of one record: ``magic u32 | length u32 | crc32c(payload) u32 | payload``, the
payload a msgpack map. A record counts only if its magic, its length and its CRC all
check out (a flipped length byte gives the wrong payload slice, which fails the CRC).
Replay (``scan``) walks the file record by record; at anything that does not check
out it searches forward for the next magic whose record checks out and goes on from
there, so a flipped byte, a zeroed page or a cut in the middle costs the records it
touches and no others. What cannot be resynchronised at the end is a torn tail.

Redundancy against the loss of single records: for ``ECHO_BYTES`` of journal after
a free or a namespace claim, every record appended repeats it (``fr``: freed ids,
``own``: ``[namespace, uid]`` pairs), so the loss of the free record (or the claim)
is made good by any intact record of the next two pages. Interpreting the records is
``durability.py``'s business; this module frames, appends, scans and rewrites.

Compaction rewrites the live records to a new file and renames it over the old one
(atomic on POSIX). A journal that replay found damaged is kept aside first
(``keep_aside``: ``journal.damaged-<UTC time>``), so no recovery decision is final.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import shutil
import struct
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import msgpack

from .checksum import crc32c
from .errors import NoSpace, StorageError
from .files import FALLOC_KEEP_SIZE, create_fresh, fallocate, fsync_dir, open_own
from .groupsync import GroupSync

__all__ = ["Journal", "ReplayResult", "JOURNAL_FILE", "ECHO_BYTES", "mapped", "scan", "pack"]

log = logging.getLogger(__name__)

JOURNAL_FILE = "journal.log"
DAMAGED_PREFIX = "journal.damaged-"
_MAGIC = 0x314A5354  # "TSJ1" little-endian
_MAGIC_BYTES = struct.pack("<I", _MAGIC)
_HEADER = struct.Struct("<III")
_MAX_RECORD = 64 << 20
ECHO_BYTES = 8192
"""How far past a free or a namespace claim later records repeat it: two pages, so
neither a zeroed page nor a flipped byte takes every copy."""
_WINDOW = 64 << 20
"""How much of a mapped journal a scan reads before it gives the pages back."""
SLACK_BYTES = 1 << 20
"""Room the journal keeps allocated past its end (``fallocate`` keeping its size), renewed
as appends use it: a filesystem that filled up meanwhile still takes the next start's
record, and the frees and durable puts of about that many bytes."""
START_ROOM = 64 << 10
"""Of that room, what appends leave for the next start's record when it cannot be renewed
(the filesystem is full): they fail with ``NoSpace`` instead, so a store that filled its
filesystem still starts again."""


@dataclass
class ReplayResult:
    records: list[dict[str, Any]] = field(default_factory=list)
    payloads: list[bytes] = field(default_factory=list)
    """Each record's payload as found (``pack`` of it): kept, not packed again, by replay."""
    torn_bytes: int = 0
    """Bytes at the end that hold no valid record (an append cut short, or damage)."""
    corrupt_records: int = 0
    """Damaged stretches in the middle (each one or more records) that were skipped."""
    corrupt_bytes: int = 0
    """Bytes in those stretches."""
    cut_bytes: int = 0
    """Bytes the index checkpoint covered that the journal no longer holds (it was cut,
    emptied or removed): the checkpoint stood in for them."""


def scan(data: Any, start: int = 0,
         release: Callable[[int], None] | None = None) -> Iterator[tuple[int, int, dict[str, Any] | None]]:
    """``(start, end, record)`` for each valid record of a journal image (``bytes``, or a
    read-only ``mmap`` of the file) from offset ``start``, in order, and ``(start, end,
    None)`` for each stretch that holds none (the last one may be a torn tail).
    ``release(offset)``: told, now and then, that nothing before ``offset`` is read again
    (a mapping gives those pages back: a large journal is scanned in bounded memory)."""
    pos, n = start, len(data)
    while pos < n:
        rec, end = _parse_at(data, pos)
        if rec is not None:
            yield pos, end, rec
            pos = end
        else:
            nxt = _resync(data, pos + 1, release)
            yield pos, (n if nxt is None else nxt), None
            if nxt is None:
                return
            pos = nxt
        if release is not None:
            release(pos)


@contextmanager
def mapped(path: str) -> Iterator[tuple[Any, Callable[[int], None]]]:
    """The file at ``path`` mapped read-only, for ``scan``, with the ``release`` that gives
    back the pages read (``b""`` for an empty file). A journal of any size is scanned in a
    few windows' worth of memory, never read whole into it."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if not size:
            yield b"", lambda upto: None
            return
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
    done = 0

    def release(upto: int) -> None:
        nonlocal done
        upto -= upto % mmap.PAGESIZE
        if upto - done >= _WINDOW:
            mm.madvise(mmap.MADV_DONTNEED, 0, upto)
            done = upto
    try:
        mm.madvise(mmap.MADV_SEQUENTIAL)
        yield mm, release
    finally:
        try:
            mm.close()
        except BufferError:  # (a view of it still held by the caller: the mapping goes with it)
            pass


class Journal:
    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, JOURNAL_FILE)
        self.directory = directory
        # one appender at a time (records must not interleave); reentrant so the store can
        # hold it across 'check, append, publish' and compaction can exclude appends
        self.lock = threading.RLock()
        self._fd = -1
        self.appended = 0
        self._pos = 0  # bytes in the file: where the next record starts
        self._slack_end = 0  # where the room allocated past the end ends (``_keep_slack``)
        self._echo: deque[tuple[int, str, Any]] = deque()  # (end of the original, field, value)
        # group commit: records appended with sync=False are made durable by ``commit``,
        # which shares one fdatasync among every caller waiting at the time
        self._group = GroupSync(self._fdatasync)
        self._fd_guard = threading.Lock()  # the fd is not swapped or closed under a running fdatasync
        self._sync_failed: str | None = None
        self.rewrites = 0
        """Times the file was replaced (``rewrite``): a prefix of the journal before one is
        not a prefix of the journal after it."""

    # -- replay ----------------------------------------------------------------------------
    def replay(self) -> ReplayResult:
        """Every valid record, in order. Nothing is changed on disk: the caller rewrites a
        damaged journal (after ``keep_aside``) once it has rebuilt the index."""
        res = ReplayResult()
        for rec, payload in self.stream(res):
            res.records.append(rec)
            res.payloads.append(payload)
        return res

    def stream(self, res: ReplayResult, start: int = 0) -> Iterator[tuple[dict[str, Any], bytes]]:
        """``replay`` one record at a time: ``(record, payload as found)`` for each valid
        record, in order, counting the damage in ``res`` (complete once exhausted) instead
        of collecting the records, so a caller that uses each record as it comes never
        holds them all. ``start``: the records from this offset on (a record boundary:
        the end of what an index checkpoint covers), scanned as a journal of their own."""
        if not os.path.exists(self.path):
            return
        with mapped(self.path) as (data, release):
            header, n = _HEADER.size, len(data)
            for begin, end, rec in scan(data, start, release):
                if rec is not None:
                    yield rec, data[begin + header:end]
                elif end == n:
                    res.torn_bytes = end - begin
                    log.warning("journal %s: %d bytes at the end hold no valid record (torn tail); dropped",
                                self.path, res.torn_bytes)
                else:
                    res.corrupt_records += 1
                    res.corrupt_bytes += end - begin
                    log.error("journal %s: %d damaged bytes at offset %d skipped", self.path, end - begin, begin)

    def keep_aside(self) -> str | None:
        """Keep the journal as it is now under ``journal.damaged-<UTC time>`` (a hard link:
        the rewrite that follows replaces the name, not these bytes). Returns its path."""
        if not os.path.exists(self.path):
            return None
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        for n in range(1000):
            dst = os.path.join(self.directory, DAMAGED_PREFIX + stamp + (f".{n}" if n else ""))
            try:
                os.link(self.path, dst)
            except FileExistsError:
                continue
            except OSError:
                try:  # a filesystem without hard links: a copy
                    shutil.copyfile(self.path, dst)
                except OSError as e:
                    log.error("journal %s: could not keep a copy as found at %s: %s", self.path, dst, e)
                    return None
            fsync_dir(self.directory)
            return dst
        return None

    # -- append ----------------------------------------------------------------------------
    def open_for_append(self) -> None:
        if self._fd >= 0:  # (a rewrite that failed after its rename left the new file open)
            os.close(self._fd)
        self._fd = open_own(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        st = os.fstat(self._fd)
        self._pos = st.st_size
        fsync_dir(self.directory)
        self._keep_slack()
        if not self._slack_end:  # not renewed (a full filesystem): what the last run left past the end
            past = st.st_blocks * 512 - -(-st.st_size // 4096) * 4096
            if past > 0:
                self._slack_end = self._pos + past

    def _keep_slack(self) -> None:
        """(under lock, or before appends begin) Allocate ``SLACK_BYTES`` past the end once
        less than half of it is left; where the filesystem cannot (full, or no fallocate)
        the journal goes on as it is."""
        if self._pos + SLACK_BYTES // 2 <= self._slack_end:
            return
        self._renew_slack()

    def _renew_slack(self) -> bool:
        """(under lock) Allocate ``SLACK_BYTES`` past the end now; whether it was."""
        if fallocate(self._fd, self._pos, SLACK_BYTES, FALLOC_KEEP_SIZE) == 0:
            self._slack_end = self._pos + SLACK_BYTES
            return True
        return False

    def append(self, record: dict[str, Any], *, sync: bool = True, start: bool = False) -> None:
        """Append one record; with ``sync`` it is on stable storage when this returns
        (an fdatasync of its own, under the lock). Without, it is written but durable
        only once a ``commit`` called after this returned has returned.
        A free (``op: free``) or a namespace claim (``op: ns``) is repeated by the records
        of the next ``ECHO_BYTES``. ``start``: a start's own record, which may use the
        room kept for it (``START_ROOM``)."""
        self.append_many([record], sync=sync, start=start)

    def append_many(self, records: list[dict[str, Any]], *, sync: bool = False,
                    start: bool = False) -> list[bytes | None]:
        """Append ``records`` in order with one write (``append``'s rules for each): all of
        them, or, if the write fails, none. Per record its payload as written (``pack`` of
        it), or None where it carries repeats of earlier frees or claims. ``NoSpace`` where
        the filesystem is full (or they would reach into the room kept for the next start)."""
        with self.lock:
            if self._fd < 0:
                raise StorageError("journal is closed")
            if self._sync_failed is not None:
                raise StorageError(self._sync_failed)
            pos, blobs, echoes, payloads = self._pos, [], [], []
            for record in records:
                # what this record repeats: the frees and claims of the last ECHO_BYTES before it
                repeat = [(name, value) for end, name, value in (*self._echo, *echoes) if end + ECHO_BYTES > pos]
                if repeat:
                    record = dict(record)
                    for name, value in repeat:
                        record.setdefault(name, []).append(value)
                payload = pack(record)
                payloads.append(None if repeat else payload)
                blob = _frame(payload)
                blobs.append(blob)
                pos += len(blob)
                op = record.get("op")
                if op == "free":
                    echoes.append((pos, "fr", record["id"]))
                elif op == "ns":
                    echoes.append((pos, "own", [record["name"], record["uid"]]))
            blob = blobs[0] if len(blobs) == 1 else b"".join(blobs)
            if self._slack_end and pos > self._slack_end - START_ROOM and not start:
                self._renew_slack()  # (the filesystem may have room again)
                if self._slack_end and pos > self._slack_end - START_ROOM:
                    raise NoSpace(f"journal append to {self.path} failed: its filesystem is full, and the "
                                  f"journal's last {START_ROOM >> 10} KiB of room are kept for the next start; free "
                                  "space on that filesystem")
            synced = False
            try:
                n = os.write(self._fd, blob)
                if n != len(blob):
                    raise OSError(errno.ENOSPC, "short write")
                if sync:
                    synced = True
                    os.fdatasync(self._fd)  # the caller's promise (durable / freed) rests on this
            except OSError as e:
                if synced:  # as a failed commit: what earlier appends left unsynced may be lost too
                    self._sync_failure(e)
                # not appended: take back what reached the file, so a restart does not act on a
                # record whose caller was told it failed (if even that fails, the partial record
                # is a damaged stretch that replay skips, and the next record starts after it)
                had = self._slack_end - self._pos
                try:
                    os.ftruncate(self._fd, self._pos)  # (which frees the room past the end too ...)
                except OSError:
                    self._pos = _size(self._fd, self._pos)
                self._slack_end = 0
                if had > 0 and fallocate(self._fd, self._pos, had, FALLOC_KEEP_SIZE) == 0:
                    self._slack_end = self._pos + had  # (... taken again: it was just given back)
                kind = NoSpace if e.errno in (errno.ENOSPC, errno.EDQUOT) else StorageError
                raise kind(f"journal append to {self.path} failed: {os.strerror(e.errno)}; "
                           "free space on that filesystem or check the drive") from None
            self._pos = pos
            self._keep_slack()
            self.appended += len(blob)
            self._echo.extend(echoes)
            while self._echo and self._echo[0][0] + ECHO_BYTES <= self._pos:
                self._echo.popleft()
            return payloads

    def commit(self) -> None:
        """Group commit: return once every record appended before this call is on stable
        storage. Call it *outside* the lock: callers that arrive while an fdatasync runs
        share the next one. A failed fdatasync leaves the journal's state on disk unknown
        (the kernel may have dropped the pages it could not write), so every append and
        commit from then on fails until the store is restarted (replay then decides)."""
        if self._sync_failed is not None:
            raise StorageError(self._sync_failed)
        try:
            self._group.sync()
        except OSError as e:
            self._sync_failure(e)
            raise StorageError(self._sync_failed) from None

    def _sync_failure(self, e: OSError) -> None:
        """An fdatasync failed: from now on every append and commit fails (see ``commit``)."""
        self._sync_failed = (f"journal sync of {self.path} failed ({os.strerror(e.errno)}); records "
                             "appended since the last good sync may be lost: check the drive and restart")
        log.error("%s", self._sync_failed)

    @property
    def sync_failed(self) -> bool:
        """An fdatasync failed: what the file holds since the last good one is unknown."""
        return self._sync_failed is not None

    def _fdatasync(self) -> None:
        with self._fd_guard:
            if self._fd < 0:
                return  # closed: close fsynced every record first (or, failing, set _sync_failed)
            os.fdatasync(self._fd)

    @property
    def position(self) -> int:
        """(under ``lock``) Bytes in the file: where the next record starts."""
        return self._pos

    def size(self) -> int:
        try:
            return os.stat(self.path).st_size
        except FileNotFoundError:
            return 0

    def rewrite(self, records: Iterator[dict[str, Any] | bytes], *,
                before_replace: Callable[[], None] | None = None,
                after_replace: Callable[[], None] | None = None) -> None:
        """Compaction: replace the journal with exactly ``records`` (maps, or payloads
        already packed by ``pack``), atomically. ``before_replace`` runs once the new file
        is complete and synced, just before it takes the journal's name; ``after_replace``
        once it has it (the rename synced). Once the rename is done the journal is the new
        file whatever else fails: a failed sync of the directory then fails every later
        append, as a failed ``fdatasync`` does."""
        tmp = self.path + ".compact"
        with self.lock:
            fd = create_fresh(tmp)
            try:
                buf = bytearray()
                for rec in records:
                    buf += _frame(rec) if isinstance(rec, bytes) else _encode(rec)
                    if len(buf) > (4 << 20):
                        _write_all(fd, buf)
                        buf.clear()
                _write_all(fd, buf)
                os.fsync(fd)  # the new file must be complete before it replaces the old
            except OSError as e:
                os.close(fd)
                os.unlink(tmp)
                raise StorageError(f"journal compaction into {tmp} failed: {os.strerror(e.errno)}") from None
            os.close(fd)
            if before_replace is not None:
                before_replace()
            os.replace(tmp, self.path)
            failed: OSError | None = None
            try:
                fsync_dir(self.directory)
            except OSError as e:
                failed = e
            with self._fd_guard:  # the new file holds every record so far, fsynced above
                if self._fd >= 0:
                    os.close(self._fd)
                self._fd = open_own(self.path, os.O_WRONLY | os.O_APPEND)
            self._pos = os.fstat(self._fd).st_size
            self._slack_end = 0
            self._keep_slack()
            self._echo.clear()  # the new file holds the state itself: nothing freed is in it
            self.rewrites += 1
            if failed is not None:  # which name the directory holds after a crash is unknown
                self._sync_failure(failed)
                raise StorageError(self._sync_failed or "journal directory sync failed")
            if after_replace is not None:
                after_replace()
        log.info("journal compacted to %d bytes", self._pos)

    def close(self) -> None:
        with self.lock:
            if self._fd >= 0 and self._echo:
                try:  # the last frees and claims get their repeat, too
                    self.append({"op": "close"})
                except (StorageError, NoSpace) as e:
                    log.warning("journal: closing record not written: %s", e)
            if self._fd >= 0:
                with self._fd_guard:
                    try:
                        os.fsync(self._fd)
                    except OSError as e:
                        self._sync_failed = f"journal sync of {self.path} at close failed ({os.strerror(e.errno)})"
                        raise
                    finally:
                        os.close(self._fd)
                        self._fd = -1


def pack(record: dict[str, Any]) -> bytes:
    """A record's payload as it is framed in the journal: what the store keeps of each
    durable object's last record (a few dozen bytes, where the map is several hundred)."""
    return msgpack.packb(record, use_bin_type=True)


def _encode(record: dict[str, Any]) -> bytes:
    return _frame(pack(record))


def _frame(payload: bytes) -> bytes:
    return _HEADER.pack(_MAGIC, len(payload), crc32c(payload)) + payload


def _write_all(fd: int, buf: bytes | bytearray) -> None:
    mv = memoryview(buf)
    while mv:
        mv = mv[os.write(fd, mv):]


def _size(fd: int, default: int) -> int:
    try:
        return os.fstat(fd).st_size
    except OSError:
        return default


def _parse_at(data: bytes, pos: int) -> tuple[dict | None, int]:
    if pos + _HEADER.size > len(data):
        return None, pos
    magic, length, crc = _HEADER.unpack_from(data, pos)
    end = pos + _HEADER.size + length
    if magic != _MAGIC or length > _MAX_RECORD or end > len(data):
        return None, pos
    payload = data[pos + _HEADER.size:end]
    if crc32c(payload) != crc:
        return None, pos
    try:
        rec = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception:  # a CRC-valid but undecodable payload is still corrupt
        return None, pos
    return (rec, end) if isinstance(rec, dict) else (None, pos)


def _resync(data: Any, start: int, release: Callable[[int], None] | None = None) -> int | None:
    """Offset of the next valid record at or after ``start``, or None (the rest is a torn
    tail). Searched a window at a time, ``release`` told as each is passed."""
    pos, n = start, len(data)
    while pos < n:
        stop = min(n, pos + _WINDOW)
        hit = data.find(_MAGIC_BYTES, pos, stop + len(_MAGIC_BYTES) - 1)  # (one that straddles ``stop`` too)
        if hit == -1:
            pos = stop
            if release is not None:
                release(pos)
            continue
        if _parse_at(data, hit)[0] is not None:
            return hit
        pos = hit + 1
    return None
