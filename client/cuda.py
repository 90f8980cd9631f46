"""CUDA on the client side: page-lock (``cudaHostRegister``) this process's mapping of
the shared host arena, so copies between it and GPU tensors run at pinned speed.

Detected once per client; the reason is kept beside the flag and shown by
``Client.pinned_reason``. Nothing here runs (or imports torch) on a machine
without a CUDA device.
"""

from __future__ import annotations

import logging
import sys

__all__ = ["register_host_memory", "unregister_host_memory", "REGISTER_CHUNK"]

log = logging.getLogger(__name__)

REGISTER_CHUNK = 1 << 30
"""Arenas are registered in pieces of this size: some drivers refuse one huge range."""

_PORTABLE = 0x01  # cudaHostRegisterPortable: pinned for every CUDA context of the process
_READ_ONLY = 0x08  # cudaHostRegisterReadOnly: the range is mapped PROT_READ (the device only reads it)


def _cuda():
    torch = sys.modules.get("torch")
    if torch is None:
        return None, "torch is not imported in this process"
    if not torch.cuda.is_available():
        return None, "no CUDA device visible"
    return torch, ""


def register_host_memory(address: int, size: int, *, read_only: bool = False) -> tuple[list[tuple[int, int]], str]:
    """Register ``[address, address + size)``; returns (registered pieces, reason).
    ``read_only``: a ``PROT_READ`` mapping (cudaHostRegisterReadOnly; devices without
    ``hostRegisterReadOnlySupported`` refuse it and copies from it stay pageable).

    An empty list means pageable copies, with the reason (no CUDA, RLIMIT_MEMLOCK,
    driver refusal) — never an exception.
    """
    flags = _PORTABLE | (_READ_ONLY if read_only else 0)
    torch, why = _cuda()
    if torch is None:
        return [], why
    cudart = torch.cuda.cudart()
    done: list[tuple[int, int]] = []
    for off in range(0, size, REGISTER_CHUNK):
        n = min(REGISTER_CHUNK, size - off)
        err = cudart.cudaHostRegister(address + off, n, flags)
        code = int(getattr(err, "value", err))
        if code != 0:
            unregister_host_memory(done)
            reason = f"cudaHostRegister failed with error {code} at offset {off}; copies stay pageable " \
                     "(check RLIMIT_MEMLOCK / LimitMEMLOCK)"
            log.warning(reason)
            return [], reason
        done.append((address + off, n))
    return done, f"registered {size} bytes in {len(done)} piece(s) with cudaHostRegister"


def unregister_host_memory(pieces: list[tuple[int, int]]) -> None:
    torch, _ = _cuda()
    if torch is None:
        return
    for address, _n in pieces:
        torch.cuda.cudart().cudaHostUnregister(address)
