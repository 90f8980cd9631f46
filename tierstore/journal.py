"""The NVMe index journal: append-only, checksummed records, replayed on open.

Record layout: ``magic u32 | length u32 | crc32c(payload) u32 | payload (msgpack map)``.
A record is valid only if its magic, length and CRC all check out. Replay stops at a
torn tail and truncates it; a corrupt record in the middle is skipped (and counted)
so one flipped byte cannot hide every record after it. Compaction rewrites the live
records to a new file and renames it over the old one (atomic on POSIX).
"""

from __future__ import annotations

import logging
import os
import struct
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator

import msgpack

from .checksum import crc32c
from .errors import StorageError

__all__ = ["Journal", "ReplayResult", "JOURNAL_FILE"]

log = logging.getLogger(__name__)

JOURNAL_FILE = "journal.log"
_MAGIC = 0x314A5354  # "TSJ1" little-endian
_HEADER = struct.Struct("<III")
_MAX_RECORD = 64 << 20


@dataclass
class ReplayResult:
    records: list[dict[str, Any]] = field(default_factory=list)
    torn_bytes: int = 0
    """Bytes dropped from the tail (an append cut short by a crash)."""
    corrupt_records: int = 0
    """Records in the middle whose checksum failed; skipped."""


class Journal:
    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, JOURNAL_FILE)
        self.directory = directory
        # one appender at a time (records must not interleave); reentrant so the store can
        # hold it across 'check, append, publish' and compaction can exclude appends
        self.lock = threading.RLock()
        self._fd = -1
        self.appended = 0

    # -- replay ----------------------------------------------------------------------------
    def replay(self) -> ReplayResult:
        """Read every valid record; truncate a torn tail. Call before ``open_for_append``."""
        res = ReplayResult()
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return res
        pos, good_end = 0, 0
        n = len(data)
        while pos < n:
            rec, end = _parse_at(data, pos)
            if rec is not None:
                res.records.append(rec)
                pos = good_end = end
                continue
            nxt = _resync(data, pos + 1)
            if nxt is None:
                res.torn_bytes = n - pos
                break
            res.corrupt_records += 1
            log.error("journal %s: corrupt record at offset %d skipped", self.path, pos)
            pos = nxt
        if res.torn_bytes:
            log.warning("journal %s: torn tail of %d bytes dropped", self.path, res.torn_bytes)
            with open(self.path, "r+b") as f:
                f.truncate(good_end)
                os.fsync(f.fileno())
        return res

    # -- append ----------------------------------------------------------------------------
    def open_for_append(self) -> None:
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        _fsync_dir(self.directory)

    def append(self, record: dict[str, Any], *, sync: bool = True) -> None:
        """Append one record; with ``sync`` it is on stable storage when this returns."""
        blob = _encode(record)
        with self.lock:
            if self._fd < 0:
                raise StorageError("journal is closed")
            try:
                os.write(self._fd, blob)
                if sync:
                    os.fdatasync(self._fd)  # the caller's promise (durable / freed) rests on this
            except OSError as e:
                raise StorageError(f"journal append to {self.path} failed: {os.strerror(e.errno)}") from None
            self.appended += len(blob)

    def size(self) -> int:
        try:
            return os.stat(self.path).st_size
        except FileNotFoundError:
            return 0

    def rewrite(self, records: Iterator[dict[str, Any]]) -> None:
        """Compaction: replace the journal with exactly ``records``, atomically."""
        tmp = self.path + ".compact"
        with self.lock:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                buf = bytearray()
                for rec in records:
                    buf += _encode(rec)
                    if len(buf) > (4 << 20):
                        os.write(fd, buf)
                        buf.clear()
                os.write(fd, buf)
                os.fsync(fd)  # the new file must be complete before it replaces the old
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
            _fsync_dir(self.directory)
            if self._fd >= 0:
                os.close(self._fd)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        log.info("journal compacted to %d bytes", self.size())

    def close(self) -> None:
        with self.lock:
            if self._fd >= 0:
                os.fsync(self._fd)
                os.close(self._fd)
                self._fd = -1


def _encode(record: dict[str, Any]) -> bytes:
    payload = msgpack.packb(record, use_bin_type=True)
    return _HEADER.pack(_MAGIC, len(payload), crc32c(payload)) + payload


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


def _resync(data: bytes, start: int) -> int | None:
    """Offset of the next valid record after ``start``, or None (the rest is a torn tail)."""
    magic = struct.pack("<I", _MAGIC)
    pos = data.find(magic, start)
    while pos != -1:
        rec, _ = _parse_at(data, pos)
        if rec is not None:
            return pos
        pos = data.find(magic, pos + 1)
    return None


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
