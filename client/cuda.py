"""CUDA on the client side: page-lock (``cudaHostRegister``) this process's mapping of
the shared host arena, so copies between it and GPU tensors run at pinned speed.

Registration is lazy and piecewise: a piece of ``REGISTER_CHUNK`` bytes is registered
when a CUDA copy first goes through it. So connecting never touches CUDA (a forked
DataLoader worker connects without a CUDA context; a process that never moves CUDA
tensors gets none), and a process page-locks what it moves, not the whole arena (which
costs O(size) per connection, up to tens of GiB). The state and its reason are shown by
``Client.pinned`` / ``Client.pinned_reason`` and ``tierstore stat``.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading
from typing import Any

__all__ = ["ArenaPinning", "register_host_memory", "unregister_host_memory", "REGISTER_CHUNK"]

log = logging.getLogger(__name__)

REGISTER_CHUNK = 1 << 30
"""Arenas are registered in pieces of this size: some drivers refuse one huge range, and
a piece is the unit of lazy registration."""

_PORTABLE = 0x01  # cudaHostRegisterPortable: pinned for every CUDA context of the process
_READ_ONLY = 0x08  # cudaHostRegisterReadOnly: the range is mapped PROT_READ (the device only reads it)


def _cuda():
    torch = sys.modules.get("torch")
    if torch is None:
        return None, "torch is not imported in this process"
    if not torch.cuda.is_available():
        return None, "no CUDA device visible"
    return torch, ""


def _loaded_cudart() -> Any:
    """The CUDA runtime library torch loaded (found among this process's mappings), or None."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart" in line and "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path)  # already loaded: the same library, the same per-thread state
        except OSError:
            continue
    return None


def clear_cuda_error() -> bool:
    """``cudaGetLastError()``: a failed ``cudaHostRegister`` leaves its error as the
    thread's last CUDA error, and PyTorch's check after its next kernel launch
    (``cudaGetLastError``) would raise it as that kernel's failure. ``torch.cuda.cudart()``
    binds no ``cudaGetLastError``, so the runtime torch loaded is called directly.
    False when it could not be found (then the next launch may raise the stale error)."""
    lib = _loaded_cudart()
    if lib is None:
        log.warning("could not clear the CUDA error of a failed cudaHostRegister (no libcudart among the "
                    "loaded libraries); the next kernel launch on this thread may report it")
        return False
    lib.cudaGetLastError()
    return True


def register_host_memory(address: int, size: int, *, read_only: bool = False) -> tuple[list[tuple[int, int]], str]:
    """Register ``[address, address + size)``; returns (registered pieces, reason).
    ``read_only``: a ``PROT_READ`` mapping (cudaHostRegisterReadOnly; devices without
    ``hostRegisterReadOnlySupported`` refuse it and copies from it stay pageable).

    An empty list means pageable copies, with the reason (no CUDA, RLIMIT_MEMLOCK,
    driver refusal) — never an exception. A refusal's CUDA error is cleared.
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
            clear_cuda_error()  # the fallback to pageable copies must not fail the next kernel
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


class ArenaPinning:
    """This process's page-locking of one arena mapping ``[base, base + size)``, in
    ``REGISTER_CHUNK`` pieces from the arena's start, each registered before the first
    CUDA copy through it (``ensure``) — by the client's own copies, and for a check-out
    view once the process has initialised CUDA (``ensure_if_cuda``), as its holder may
    copy it to a GPU. A refusal stops further registration: later copies of
    unregistered pieces are pageable, and ``reason`` says why."""

    def __init__(self, base: int, size: int, *, read_only: bool = False) -> None:
        self.base, self.size, self.read_only = base, size, read_only
        self._pieces: dict[int, tuple[int, int]] = {}  # piece index -> (address, bytes)
        self._refused: str | None = None
        self._lock = threading.Lock()  # two copies through one new piece register it once
        self.reason = "not page-locked yet: the arena is registered piece by piece on the first CUDA copy " \
                      "through it" if size else "empty arena"

    @property
    def pinned(self) -> bool:
        """Every piece a CUDA copy went through so far is page-locked (and there was one)."""
        return bool(self._pieces) and self._refused is None

    def ensure(self, offset: int, nbytes: int) -> bool:
        """Register the pieces holding arena bytes ``[offset, offset + nbytes)``; True when
        the state (``pinned`` / ``reason``) changed."""
        if nbytes <= 0 or self._refused is not None:
            return False
        first, last = offset // REGISTER_CHUNK, (offset + nbytes - 1) // REGISTER_CHUNK
        if all(i in self._pieces for i in range(first, last + 1)):
            return False
        with self._lock:
            for i in range(first, last + 1):
                if i in self._pieces or self._refused is not None:
                    continue
                addr, n = self.base + i * REGISTER_CHUNK, min(REGISTER_CHUNK, self.size - i * REGISTER_CHUNK)
                pieces, why = register_host_memory(addr, n, read_only=self.read_only)
                if not pieces:
                    self._refused = self.reason = why
                    return True
                self._pieces[i] = (addr, n)
            got = sum(n for _, n in self._pieces.values())
            self.reason = f"{got} of {self.size} arena bytes page-locked with cudaHostRegister in " \
                          f"{len(self._pieces)} piece(s), registered on first use"
        return True

    def ensure_if_cuda(self, offset: int, nbytes: int) -> bool:
        """``ensure`` where this process already has CUDA initialised (never initialising it)."""
        torch = sys.modules.get("torch")
        if torch is None or not torch.cuda.is_initialized():
            return False
        return self.ensure(offset, nbytes)

    def spans(self, offset: int, nbytes: int) -> list[tuple[int, int]]:
        """``[offset, offset + nbytes)`` cut at piece boundaries, as (offset, bytes): a copy
        runs per registration, never across two."""
        out = []
        end = offset + nbytes
        while offset < end:
            n = min(end, (offset // REGISTER_CHUNK + 1) * REGISTER_CHUNK) - offset
            out.append((offset, n))
            offset += n
        return out

    def close(self) -> None:
        with self._lock:
            unregister_host_memory(list(self._pieces.values()))
            self._pieces.clear()
