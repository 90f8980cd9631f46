"""The host-tier index log: which arena blocks hold which objects, kept in shared memory
so a restarted daemon that is handed back the arena (systemd's file-descriptor
store) can adopt every host-resident object.

A memfd with a 4 KiB header and two halves. Records are appended to the active half:
``len u32 | crc32c u32 | msgpack`` — ``[0, record]`` when an object's bytes become
valid in a host block (written before the store publishes it), ``[1, id]`` before a
host block is given back to the allocator. A record is the store's list
``[id, gen, namespace, key, kind, dtype, shape, nbytes, offset, durable, home]``. Replay stops at the first record that does
not check out (a torn append). When the active half fills up, the live set is written
to the other half and the header flips to it (one aligned 4-byte store of the
active half's number).

No fsync: the memfd lives in RAM and outlives the daemon only while systemd holds it.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import threading
from typing import Any, Callable, Iterable

import msgpack

from .checksum import crc32c

__all__ = ["HostIndexLog", "INDEX_BYTES", "index_bytes_for"]

INDEX_BYTES = 64 << 20
"""The smallest log: two halves of 32 MiB."""
_BYTES_PER_BLOCK = 256
"""Room per possible host block (one per 4 KiB page) in each half: a record is ~50 bytes
plus its namespace and key. The memfd is sparse: only the bytes written take memory."""


def index_bytes_for(host_bytes: int) -> int:
    """The log's size for a host tier of ``host_bytes``: every block it can hold, with a
    record of up to ``_BYTES_PER_BLOCK`` bytes each, fits in one half."""
    return max(INDEX_BYTES, _HEADER + 2 * (host_bytes // 4096) * _BYTES_PER_BLOCK)
_HEADER = 4096
_MAGIC = 0x54534849  # "IHST"
_HDR = struct.Struct("<IIQ")  # magic, active half, generation
_REC = struct.Struct("<II")

log = logging.getLogger(__name__)


class HostIndexLog:
    def __init__(self, fd: int | None = None, size: int = INDEX_BYTES) -> None:
        fresh = fd is None
        if fresh:
            fd = os.memfd_create("tierstore-host-index", os.MFD_CLOEXEC)
            os.ftruncate(fd, size)
        self.fd = fd
        self.size = os.fstat(fd).st_size
        self.half = (self.size - _HEADER) // 2
        self.mm = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED)
        self._lock = threading.Lock()  # appends from several store threads must not interleave
        if fresh or _HDR.unpack_from(self.mm, 0)[0] != _MAGIC:
            self._active, self._gen = 0, 0
            self._clear(0)
            _HDR.pack_into(self.mm, 0, _MAGIC, 0, 0)
        else:
            _, self._active, self._gen = _HDR.unpack_from(self.mm, 0)
        self._tail = None  # found by replay(); appends need it
        self.abandoned = False
        """The live set outgrew a half (``_compact``): the log records nothing more, and a
        daemon handed this memfd adopts nothing from it."""

    def _base(self, half: int) -> int:
        return _HEADER + half * self.half

    def _clear(self, half: int) -> None:
        base = self._base(half)
        self.mm[base:base + _REC.size] = b"\0" * _REC.size

    # ------------------------------------------------------------------ reading
    def replay(self) -> list[list[Any]]:
        """The host-resident objects the log describes (later records win)."""
        live: dict[int, list[Any]] = {}
        base = self._base(self._active)
        pos, end = base, base + self.half
        while pos + _REC.size <= end:
            n, crc = _REC.unpack_from(self.mm, pos)
            if n == 0 or pos + _REC.size + n > end:
                break
            payload = bytes(self.mm[pos + _REC.size:pos + _REC.size + n])
            if crc32c(payload) != crc:
                break  # a torn append: the daemon died in the middle of it
            try:
                rec = msgpack.unpackb(payload, raw=False)
            except Exception:
                break
            if not isinstance(rec, list) or len(rec) != 2:
                break
            if rec[0] == 0:
                live[rec[1][0]] = rec[1]
            elif rec[0] == 1:
                live.pop(rec[1], None)
            pos += _REC.size + n
        self._tail = pos
        return list(live.values())

    # ------------------------------------------------------------------ writing
    def start_empty(self) -> None:
        """Begin a fresh log (a daemon that adopted nothing)."""
        with self._lock:
            self._clear(self._active)
            self._tail = self._base(self._active)

    def append_host(self, rec: list[Any], live: Callable[[], Iterable[list[Any]]]) -> None:
        self._append(msgpack.packb([0, rec], use_bin_type=True), live)

    def append_drop(self, oid: int, live: Callable[[], Iterable[list[Any]]]) -> None:
        self._append(msgpack.packb([1, oid], use_bin_type=True), live)

    def _append(self, payload: bytes, live: Callable[[], Iterable[list[Any]]]) -> None:
        """Append one record; compact into the other half (from ``live()``) when full."""
        with self._lock:
            if self.abandoned:
                return
            if self._tail is None:
                raise RuntimeError("replay() or start_empty() first")
            if self._tail + _REC.size * 2 + len(payload) > self._base(self._active) + self.half:
                if not self._compact(live()):
                    return
            self._write(payload)

    def _write(self, payload: bytes) -> None:
        pos = self._tail
        end = pos + _REC.size + len(payload)
        # the terminator first, then the payload, then the length: a reader never sees
        # a length whose bytes are not there yet
        self.mm[end:end + _REC.size] = b"\0" * _REC.size
        self.mm[pos + _REC.size:end] = payload
        _REC.pack_into(self.mm, pos, len(payload), crc32c(payload))
        self._tail = end

    def _compact(self, records: Iterable[list[Any]]) -> bool:
        """Write the live set to the other half and flip to it; False (the log abandoned)
        when it does not fit there."""
        other = 1 - self._active
        self._tail = self._base(other)
        self._clear(other)
        for h in records:
            payload = msgpack.packb([0, h], use_bin_type=True)
            if self._tail + _REC.size * 2 + len(payload) > self._base(other) + self.half:
                self._abandon()
                return False
            self._write(payload)
        self._gen += 1
        self._active = other
        _HDR.pack_into(self.mm, 0, _MAGIC, other, self._gen)  # the flip
        return True

    def _abandon(self) -> None:
        # the header's magic goes first: a daemon handed this memfd then finds no log and
        # adopts nothing (its durable objects come back from NVMe, as after any restart)
        _HDR.pack_into(self.mm, 0, 0, self._active, self._gen)
        self.abandoned = True
        log.warning("the host index log (%d bytes) cannot hold the host tier's live set: it records nothing "
                    "more, and a daemon handed this arena at a restart will not adopt its host-resident objects",
                    self.size)

    def rewrite(self, records: Iterable[list[Any]]) -> None:
        """Replace the log by exactly ``records`` (after an adoption)."""
        with self._lock:
            if not self.abandoned:
                self._compact(records)

    def close(self) -> None:
        try:
            self.mm.close()
        except (BufferError, ValueError):
            pass
        os.close(self.fd)
