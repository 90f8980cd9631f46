"""Block checksums: CRC32C per 1 MiB block, from the fastest implementation installed.

Two implementations compute the same CRC32C (Castagnoli) and both release the GIL:
``fastcrc`` (carry-less-multiply folding, ~28 GB/s on one core of an AVX-512 machine)
and ``crc32c`` (the SSE4.2 instruction, ~13 GB/s). The faster is used when it imports
and gives the right answer on a check vector; ``TIERSTORE_CRC32C=crc32c`` (or
``fastcrc``) picks one, for a benchmark to compare them. What is on disk does not
depend on the choice.
"""

from __future__ import annotations

import os

__all__ = ["BLOCK_BYTES", "IMPLEMENTATION", "crc32c", "block_checksums"]

BLOCK_BYTES = 1 << 20
"""Unit of checksumming on the NVMe tier; I/O chunks are multiples of it."""

_CHECK = (b"123456789", 0xE3069283)  # the CRC-32C catalogue's check value


def _fastcrc():
    from fastcrc import crc32
    fn = crc32.iscsi
    return lambda data, value=0: fn(data, value)


def _crc32c():
    import crc32c as mod
    return mod.crc32c


def _choose():
    wanted = os.environ.get("TIERSTORE_CRC32C", "")
    if wanted not in ("", "fastcrc", "crc32c"):
        raise ImportError(f"TIERSTORE_CRC32C={wanted!r}: expected 'fastcrc' or 'crc32c'")
    order = [wanted] if wanted else ["fastcrc", "crc32c"]
    for name in order:
        try:
            fn = {"fastcrc": _fastcrc, "crc32c": _crc32c}[name]()
        except ImportError:
            continue
        data, want = _CHECK
        if fn(data) == want and fn(data[4:], fn(data[:4])) == want:
            return name, fn
    raise ImportError(f"no CRC32C implementation among {order} imports and checks out (pip install fastcrc)")


IMPLEMENTATION, _impl = _choose()
"""Which implementation computes the checksums: ``"fastcrc"`` or ``"crc32c"``."""


def crc32c(data, value: int = 0) -> int:
    """CRC32C of ``data``; ``value``: the CRC of the bytes before it (to continue one)."""
    return _impl(data, value)


def block_checksums(buf, nbytes: int) -> list[int]:
    """CRC32C of each BLOCK_BYTES block of the first ``nbytes`` of ``buf``."""
    mv = memoryview(buf).cast("B")
    return [_impl(mv[o:min(o + BLOCK_BYTES, nbytes)]) for o in range(0, nbytes, BLOCK_BYTES)]
