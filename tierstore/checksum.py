"""Block checksums: CRC32C (hardware-accelerated, releases the GIL) per 1 MiB block."""

from __future__ import annotations

import crc32c as _crc

__all__ = ["BLOCK_BYTES", "crc32c", "block_checksums"]

BLOCK_BYTES = 1 << 20
"""Unit of checksumming on the NVMe tier; I/O chunks are multiples of it."""


def crc32c(data, value: int = 0) -> int:
    """CRC32C of ``data``; ``value``: the CRC of the bytes before it (to continue one)."""
    return _crc.crc32c(data, value)


def block_checksums(buf, nbytes: int) -> list[int]:
    """CRC32C of each BLOCK_BYTES block of the first ``nbytes`` of ``buf``."""
    mv = memoryview(buf).cast("B")
    return [_crc.crc32c(mv[o:min(o + BLOCK_BYTES, nbytes)]) for o in range(0, nbytes, BLOCK_BYTES)]
