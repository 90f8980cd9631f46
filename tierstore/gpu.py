"""The GPU tier: a few large device slabs per GPU, carved into blocks, shared with
clients through CUDA IPC (one handle per slab, never one per tensor).

Bookkeeping only, plus a thin backend over the CUDA runtime (``cupy.cuda.runtime``).
A block's location is one integer, ``device | slab | offset`` (see ``encode_loc``);
a client that opened the slab's IPC handle turns it into a device pointer with
``base + offset``. A client names devices by their UUID (``export``), since its
``CUDA_VISIBLE_DEVICES`` may number them differently from the daemon's.

Lifetimes: freeing an exported allocation before every importer closed its handle is
undefined behaviour in CUDA, and a client whose connection the daemon closed (at its
stop, say) may still map the slabs. So a slab any client ever opened is never freed
by ``close``: the daemon's exit releases it, after the journal is flushed and no
request is served. Slabs nobody opened (an in-process ``Store``) are freed.

Nothing here imports CUDA at module import; ``detect_backend`` says why the tier is
absent on a machine without it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

from .allocator import ExtentAllocator
from .errors import InvalidArgument

__all__ = ["GpuBackend", "CupyBackend", "GpuTier", "Slab", "detect_backend", "encode_loc", "decode_loc",
           "loc_device", "uuid_hex", "GPU_ALIGN", "MAX_SLAB_BYTES"]

log = logging.getLogger(__name__)

GPU_ALIGN = 512
"""Block alignment in a slab (covers every dtype and vectorised copy kernels)."""
_OFF_BITS = 40
_SLAB_BITS = 12
_DEV_BITS = 8
MAX_SLAB_BYTES = 1 << _OFF_BITS
"""1 TiB: a slab offset fits in 40 bits."""


def encode_loc(device: int, slab: int, offset: int) -> int:
    """One integer for (device, slab index, byte offset in the slab)."""
    if not (0 <= device < 1 << _DEV_BITS and 0 <= slab < 1 << _SLAB_BITS and 0 <= offset < 1 << _OFF_BITS):
        raise InvalidArgument(f"GPU location out of range: device {device}, slab {slab}, offset {offset}")
    return (device << (_SLAB_BITS + _OFF_BITS)) | (slab << _OFF_BITS) | offset


def loc_device(loc: int) -> int:
    return loc >> (_SLAB_BITS + _OFF_BITS)


def decode_loc(loc: int) -> tuple[int, int, int]:
    """(device, slab, offset) of a location from ``encode_loc``."""
    if not isinstance(loc, int) or isinstance(loc, bool) or loc < 0 or loc >= 1 << (_DEV_BITS + _SLAB_BITS + _OFF_BITS):
        raise InvalidArgument(f"{loc!r} is not a GPU location")
    return loc >> (_SLAB_BITS + _OFF_BITS), (loc >> _OFF_BITS) & ((1 << _SLAB_BITS) - 1), loc & ((1 << _OFF_BITS) - 1)


def uuid_hex(value: Any) -> str | None:
    """A device UUID as 32 lower-case hex digits, from what CUDA bindings return: 16 bytes
    (CuPy), torch's ``_CUuuid`` (``.bytes``, a list of ints), or text such as
    ``GPU-8f1e...`` (nvidia-smi, CUDA_VISIBLE_DEVICES). None when it is none of these."""
    if value is None:
        return None
    if hasattr(value, "bytes"):
        value = value.bytes
    if isinstance(value, (list, tuple)):
        value = bytes(value)
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).hex() if len(value) == 16 else None
    text = str(value).lower().removeprefix("gpu-").replace("-", "")
    return text if len(text) == 32 and all(c in "0123456789abcdef" for c in text) else None


class GpuBackend(Protocol):
    """What the tier needs from CUDA. Addresses are plain integers (device pointers,
    or host pointers for copies to and from the arena; unified addressing tells them apart)."""

    name: str

    def device_count(self) -> int: ...
    def device_uuid(self, device: int) -> str | None: ...
    def malloc(self, device: int, nbytes: int) -> int: ...
    def free(self, device: int, ptr: int) -> None: ...
    def ipc_handle(self, device: int, ptr: int) -> bytes: ...
    def copy(self, device: int, dst: int, src: int, nbytes: int) -> None:
        """Complete when it returns: the source may be freed, the block published."""
        ...
    def host_register(self, address: int, nbytes: int) -> None: ...
    def host_unregister(self, address: int) -> None: ...


class CupyBackend:
    """The CUDA runtime through ``cupy.cuda.runtime``: ``cudaMalloc`` slabs (so each slab
    is one IPC-exportable allocation), ``cudaIpcGetMemHandle``, and ``cudaMemcpy`` with
    ``cudaMemcpyDefault`` (the direction follows from unified addressing)."""

    name = "cupy"
    _DEFAULT = 4  # cudaMemcpyDefault

    def __init__(self) -> None:
        import cupy  # noqa: F401  (raises ImportError on hosts without it)
        from cupy.cuda import runtime

        self._cupy = cupy
        self._rt = runtime

    def device_count(self) -> int:
        return int(self._rt.getDeviceCount())

    def device_uuid(self, device: int) -> str | None:
        try:
            return uuid_hex(self._rt.getDeviceProperties(device).get("uuid"))
        except Exception as e:  # clients then number devices as the daemon does, and are told so
            log.warning("GPU tier: no UUID for device %d: %s", device, e)
            return None

    def malloc(self, device: int, nbytes: int) -> int:
        with self._cupy.cuda.Device(device):
            return int(self._rt.malloc(nbytes))

    def free(self, device: int, ptr: int) -> None:
        with self._cupy.cuda.Device(device):
            self._rt.free(ptr)

    def ipc_handle(self, device: int, ptr: int) -> bytes:
        with self._cupy.cuda.Device(device):
            return bytes(self._rt.ipcGetMemHandle(ptr))

    def copy(self, device: int, dst: int, src: int, nbytes: int) -> None:
        with self._cupy.cuda.Device(device):
            self._rt.memcpy(dst, src, nbytes, self._DEFAULT)
            # cudaMemcpy returns before a device-to-device copy (or a pageable host-to-device
            # one) has finished; the caller frees the source or publishes the block next
            self._rt.streamSynchronize(0)

    def host_register(self, address: int, nbytes: int) -> None:
        self._rt.hostRegister(address, nbytes, 0x01)  # cudaHostRegisterPortable

    def host_unregister(self, address: int) -> None:
        self._rt.hostUnregister(address)


def detect_backend() -> tuple[Any, str]:
    """(backend, reason) — backend None when no CUDA device can host the tier."""
    try:
        backend = CupyBackend()
    except ImportError as e:
        return None, f"cupy is not installed ({e}); install tierstore[cu12] for the GPU tier"
    except Exception as e:  # a broken CUDA install: report it, run without the tier
        return None, f"cupy failed to load: {e}"
    try:
        n = backend.device_count()
    except Exception as e:
        return None, f"no usable CUDA device: {e}"
    if n == 0:
        return None, "no CUDA device visible"
    return backend, f"{n} CUDA device(s) through cupy"


@dataclass
class Slab:
    device: int
    index: int
    size: int
    ptr: int
    handle: bytes
    alloc: ExtentAllocator
    mapped: set = field(default_factory=set)
    """Owners (client connections) that opened this slab's IPC handle."""
    exported: bool = False
    """A client opened it once: never freed by ``GpuTier.close`` (see the module notes)."""


class GpuTier:
    """Device slabs (``bytes_per_device`` split into slabs of at most ``slab_bytes``) on
    each of ``devices`` (default: every visible device), and block allocation in them."""

    def __init__(self, bytes_per_device: int, slab_bytes: int, backend: GpuBackend,
                 devices: list[int] | None = None) -> None:
        if bytes_per_device <= 0:
            raise InvalidArgument("gpu_bytes must be positive for a GPU tier")
        if not 0 < slab_bytes <= MAX_SLAB_BYTES:
            raise InvalidArgument(f"gpu_slab_bytes must be in (0, {MAX_SLAB_BYTES}]")
        self.backend = backend
        count = backend.device_count()
        self.devices = list(range(count)) if devices is None else list(devices)
        for d in self.devices:
            if not 0 <= d < count:
                raise InvalidArgument(f"GPU {d} does not exist ({count} visible)")
        self.slabs: dict[int, list[Slab]] = {}
        self._pinned: list[int] = []
        try:
            for d in self.devices:
                self.slabs[d] = []
                left = bytes_per_device
                while left > 0:
                    size = min(slab_bytes, left) // GPU_ALIGN * GPU_ALIGN
                    if size == 0:
                        break
                    ptr = backend.malloc(d, size)
                    slab = Slab(d, len(self.slabs[d]), size, ptr, b"", ExtentAllocator(size, align=GPU_ALIGN))
                    self.slabs[d].append(slab)
                    slab.handle = backend.ipc_handle(d, ptr)
                    left -= size
        except BaseException:
            self._free_all()
            raise
        log.info("GPU tier: %d byte(s) on device(s) %s in %d slab(s) (%s)", bytes_per_device, self.devices,
                 sum(len(v) for v in self.slabs.values()), backend.name)

    # ------------------------------------------------------------------ blocks
    def alloc(self, nbytes: int, device: int = 0) -> int | None:
        """A block of ``nbytes`` on ``device`` (location), or None when no slab has room."""
        slabs = self.slabs.get(device)
        if slabs is None:
            raise InvalidArgument(f"GPU {device} has no GPU tier (devices: {self.devices})")
        for s in slabs:
            off = s.alloc.alloc(nbytes)
            if off is not None:
                return encode_loc(device, s.index, off)
        return None

    def free(self, loc: int, nbytes: int) -> None:
        self._slab(loc)[0].alloc.free(decode_loc(loc)[2], nbytes)

    def fence(self, owner: Any, loc: int, nbytes: int) -> None:
        """Hold a block back from reuse while ``owner`` may still write into it (see
        ``ExtentAllocator.fence``)."""
        self._slab(loc)[0].alloc.fence(owner, decode_loc(loc)[2], nbytes)

    def unfence(self, owner: Any) -> None:
        for v in self.slabs.values():
            for s in v:
                s.alloc.unfence(owner)

    def held_bytes(self) -> int:
        return sum(s.alloc.held_bytes for v in self.slabs.values() for s in v)

    def ptr(self, loc: int) -> int:
        """The device pointer of a block, in this process."""
        slab, off = self._slab(loc)
        return slab.ptr + off

    def read(self, loc: int, dst: int, nbytes: int) -> None:
        """Copy a block's first ``nbytes`` to address ``dst`` (host or device)."""
        self.backend.copy(loc_device(loc), dst, self.ptr(loc), nbytes)

    def write(self, loc: int, src: int, nbytes: int) -> None:
        """Copy ``nbytes`` from address ``src`` (host or device) into a block."""
        self.backend.copy(loc_device(loc), self.ptr(loc), src, nbytes)

    def copy_block(self, dst: int, src: int, nbytes: int) -> None:
        """Copy ``nbytes`` from GPU-tier block ``src`` to block ``dst`` (both on one device)."""
        self.backend.copy(loc_device(dst), self.ptr(dst), self.ptr(src), nbytes)

    def rounded(self, nbytes: int) -> int:
        return max(nbytes, 1) + (-max(nbytes, 1)) % GPU_ALIGN

    def fits(self, nbytes: int) -> bool:
        """Whether a block of ``nbytes`` fits in a slab (every device's slabs are the same sizes)."""
        return any(self.rounded(nbytes) <= s.size for s in self.slabs.get(0, []))

    def _slab(self, loc: int) -> tuple[Slab, int]:
        d, i, off = decode_loc(loc)
        slabs = self.slabs.get(d)
        if slabs is None or i >= len(slabs):
            raise InvalidArgument(f"GPU location {loc} names no slab")
        return slabs[i], off

    # ------------------------------------------------------------------ accounting
    def capacity(self, device: int | None = None) -> int:
        return sum(s.size for d, v in self.slabs.items() if device in (None, d) for s in v)

    def used(self, device: int | None = None) -> int:
        return sum(s.alloc.used_bytes for d, v in self.slabs.items() if device in (None, d) for s in v)

    def over(self, fraction: float) -> list[int]:
        """Devices whose use passed ``fraction`` of their capacity."""
        return [d for d in self.devices if self.used(d) > fraction * self.capacity(d)]

    def pin_host(self, address: int, nbytes: int, chunk: int = 1 << 30) -> tuple[bool, str]:
        """Page-lock this process's mapping of the host arena (in ``chunk`` pieces, as some
        drivers refuse one huge range), so moves between the tiers run at pinned speed.
        (pinned, reason); a refusal (RLIMIT_MEMLOCK, driver limits) leaves copies pageable."""
        done: list[int] = []
        for off in range(0, nbytes, chunk):
            try:
                self.backend.host_register(address + off, min(chunk, nbytes - off))
            except Exception as e:
                for a in done:
                    self.backend.host_unregister(a)
                reason = f"cudaHostRegister failed at offset {off}: {e}; GPU-tier moves use pageable copies " \
                         "(raise RLIMIT_MEMLOCK / LimitMEMLOCK)"
                log.warning(reason)
                return False, reason
            done.append(address + off)
        self._pinned = done
        return True, f"registered {nbytes} bytes in {len(done)} piece(s) with cudaHostRegister"

    # ------------------------------------------------------------------ sharing
    def export(self) -> list[dict[str, Any]]:
        """What a client needs to open every slab: device, index, size, IPC handle."""
        uuids = {d: self.backend.device_uuid(d) for d in self.slabs}
        return [{"device": s.device, "uuid": uuids[s.device], "slab": s.index, "size": s.size, "handle": s.handle}
                for v in self.slabs.values() for s in v]

    def attach(self, owner: Any) -> None:
        for v in self.slabs.values():
            for s in v:
                s.mapped.add(owner)
                s.exported = True

    def detach(self, owner: Any) -> None:
        for v in self.slabs.values():
            for s in v:
                s.mapped.discard(owner)

    def mapped_by(self) -> int:
        return len({o for v in self.slabs.values() for s in v for o in s.mapped})

    def describe(self) -> dict[str, Any]:
        return {"capacity_bytes": self.capacity(), "used_bytes": self.used(),
                "free_bytes": self.capacity() - self.used(), "fenced_bytes": self.held_bytes(),
                "backend": self.backend.name,
                "devices": {str(d): {"capacity_bytes": self.capacity(d), "used_bytes": self.used(d),
                                     "slabs": len(self.slabs[d])} for d in self.devices},
                "mapped_by": self.mapped_by()}

    def close(self) -> bool:
        """Unregister the host arena (always: it is unmapped next, and a registered range
        must not be), then free the slabs no client ever opened. False when some were
        left to the process exit (see the module notes)."""
        for a in self._pinned:
            try:
                self.backend.host_unregister(a)
            except Exception as e:
                log.warning("GPU tier: cudaHostUnregister failed: %s", e)
        self._pinned = []
        kept = sum(1 for v in self.slabs.values() for s in v if s.exported)
        if kept:
            log.info("GPU tier: %d slab(s) that clients opened are left to the process exit (%d client(s) "
                     "still attached)", kept, self.mapped_by())
        self._free_all(keep_exported=True)
        return kept == 0

    def _free_all(self, keep_exported: bool = False) -> None:
        for v in self.slabs.values():
            for s in v:
                if keep_exported and s.exported:
                    continue
                try:
                    self.backend.free(s.device, s.ptr)
                except Exception as e:  # freeing must go on for the others
                    log.error("GPU tier: freeing slab %d on device %d failed: %s", s.index, s.device, e)
        self.slabs = {d: [] for d in self.slabs}
