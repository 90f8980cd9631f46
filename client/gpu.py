"""CUDA on the client side, all of it: page-locking this process's mapping of the host
arena (``ArenaPinning``), the GPU tier's slabs (``SlabMap``, ``DeviceMap``) and the
side streams copies run on (``SideStreams``). The core's GPU tier is ``tierstore.gpu``.

Page-locking (``cudaHostRegister``) is lazy and piecewise: a piece of
``REGISTER_CHUNK`` bytes is registered when a CUDA copy first goes through it. So
connecting never touches CUDA (a forked DataLoader worker connects without a CUDA
context; a process that never moves CUDA tensors gets none), and a process page-locks
what it moves, not the whole arena (which costs O(size) per connection, up to tens of
GiB). The state and its reason are shown by ``Client.pinned`` /
``Client.pinned_reason`` and ``tierstore stat``.

The GPU tier's slabs are opened once per client (CUDA IPC, through CuPy: only
GPU-tier traffic needs it); CUDA tensors move in and out of them, or through the
pinned host arena (torch alone), on a side stream ordered with the caller's stream by
events. Device numbers differ between processes (each has its own
``CUDA_VISIBLE_DEVICES``): the daemon names its devices by UUID, and ``DeviceMap``
turns its numbers into this process's.

Nothing here loads torch or CUDA at import; ``tests/test_gpu.py`` exercises it on a
GPU host, ``tests/test_cuda_fallback.py`` the fallbacks without one.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading
from typing import Any

from tierstore.errors import InvalidArgument, TierstoreError

__all__ = ["ArenaPinning", "register_host_memory", "unregister_host_memory", "REGISTER_CHUNK", "DeviceMap",
           "SlabMap", "SideStreams", "is_cuda", "cuda_usable", "current_device", "on_callers_stream", "wait_on"]

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------- the caller's tensors and streams
def is_cuda(t: Any) -> bool:
    """Whether ``t`` is a CUDA tensor (never imports torch: a process without it has none)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(t, torch.Tensor) and t.device.type == "cuda"


def cuda_usable() -> bool:
    """Whether this process can use CUDA and CuPy (the GPU tier's slabs need both); it
    asks for the device count only, which creates no CUDA context."""
    import importlib.util

    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_available() and importlib.util.find_spec("cupy") is not None


def current_device() -> int:
    """This thread's current CUDA device."""
    import torch

    return torch.cuda.current_device()


def wait_on(device: Any, event: Any) -> None:
    """Later work on ``device``'s current stream waits for ``event`` (a side-stream copy)."""
    import torch

    torch.cuda.current_stream(device).wait_event(event)


def on_callers_stream(t: Any) -> Any:
    """A runner for a pool thread: for a CUDA tensor, it runs the call with the calling
    thread's current stream of ``t``'s device (captured now) as the current stream, so the
    copies order after the caller's work on ``t`` — a pool thread's own current stream is
    the default stream, which a caller on another stream does not order with. For any
    other tensor, the call as it is."""
    if not is_cuda(t):
        return _call
    import torch

    caller = torch.cuda.current_stream(t.device)

    def run(fn: Any, *args: Any, **kw: Any) -> Any:
        with torch.cuda.stream(caller):
            return fn(*args, **kw)
    return run


def _call(fn: Any, *args: Any, **kw: Any) -> Any:
    return fn(*args, **kw)


# ---------------------------------------------------------------------------- page-locking the arena
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


# ---------------------------------------------------------------------------- the GPU tier and side streams
class DeviceMap:
    """The daemon's device numbers <-> this process's, matched by device UUID."""

    def __init__(self, daemon_uuids: dict[int, str | None], local_uuids: list[str | None]) -> None:
        self.to_local: dict[int, int] = {}
        self.why = ""
        if any(u is None for u in daemon_uuids.values()) or any(u is None for u in local_uuids):
            # no UUIDs to match (a CUDA binding without them): the same numbering is assumed
            self.to_local = {d: d for d in daemon_uuids if d < len(local_uuids)}
            self.why = "device UUIDs unknown: the daemon's device numbers are taken as this process's"
            log.warning("GPU tier: %s", self.why)
        else:
            where = {u: i for i, u in enumerate(local_uuids)}
            self.to_local = {d: where[u] for d, u in daemon_uuids.items() if u in where}
        self.to_daemon = {v: k for k, v in self.to_local.items()}

    @classmethod
    def of_this_process(cls, daemon_uuids: dict[int, str | None]) -> "DeviceMap":
        import torch

        from tierstore.gpu import uuid_hex

        return cls(daemon_uuids, [uuid_hex(getattr(torch.cuda.get_device_properties(i), "uuid", None))
                                  for i in range(torch.cuda.device_count())])

    def local(self, daemon_device: int) -> int:
        if daemon_device not in self.to_local:
            raise TierstoreError(f"the daemon's GPU {daemon_device} is not visible in this process "
                                 "(CUDA_VISIBLE_DEVICES): read this object from a process that sees it")
        return self.to_local[daemon_device]

    def daemon(self, local_device: int) -> int:
        if local_device not in self.to_daemon:
            raise InvalidArgument(f"cuda:{local_device} of this process has no GPU tier in the daemon "
                                  f"(its devices here: {sorted(self.to_daemon)}); put to tier='host'")
        return self.to_daemon[local_device]


class SlabMap:
    """This process's mappings of the GPU tier's slabs, opened once per client."""

    def __init__(self, slabs: list[dict[str, Any]]) -> None:
        try:
            import cupy
            from cupy.cuda import runtime
        except ImportError as e:
            raise InvalidArgument(f"the GPU tier needs CuPy in the client process too ({e}); install "
                                  "tierstore[cu12] (or [cu13]), or put to tier='host'") from None
        self._cupy, self._rt = cupy, runtime
        self.devices = DeviceMap.of_this_process({int(s["device"]): s.get("uuid") for s in slabs})
        self._slabs: dict[tuple[int, int], tuple[int, int, int]] = {}  # (daemon device, slab) -> (local, ptr, size)
        try:
            for s in slabs:
                d = int(s["device"])
                if d not in self.devices.to_local:
                    continue  # a device this process does not see: its objects are read elsewhere
                local = self.devices.local(d)
                with cupy.cuda.Device(local):
                    ptr = runtime.ipcOpenMemHandle(bytes(s["handle"]), runtime.cudaIpcMemLazyEnablePeerAccess)
                self._slabs[(d, int(s["slab"]))] = (local, int(ptr), int(s["size"]))
        except BaseException:
            self.close()
            raise

    def tensor(self, loc: int, nbytes: int) -> Any:
        """A uint8 CUDA tensor viewing ``nbytes`` of the GPU tier at ``loc`` (zero-copy)."""
        import torch

        from tierstore.gpu import decode_loc

        device, slab, off = decode_loc(loc)
        entry = self._slabs.get((device, slab))
        if entry is None:
            self.devices.local(device)  # says so when the device is not visible here
            raise TierstoreError(f"daemon named GPU slab {slab} on device {device}, which this client has not opened")
        local, ptr, size = entry
        if off + nbytes > size:
            raise TierstoreError(f"daemon named GPU bytes [{off}, {off + nbytes}) outside slab {slab} ({size} bytes)")
        cp = self._cupy
        mem = cp.cuda.UnownedMemory(ptr + off, max(nbytes, 1), self, device_id=local)
        arr = cp.ndarray((nbytes,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(mem, 0))
        return torch.as_tensor(arr, device=f"cuda:{local}")

    def close(self) -> None:
        for local, ptr, _ in list(self._slabs.values()):
            try:
                with self._cupy.cuda.Device(local):
                    self._rt.ipcCloseMemHandle(ptr)
            except Exception as e:  # closing must go on for the others
                log.warning("closing a GPU slab mapping failed: %s", e)
        self._slabs.clear()


class SideStreams:
    """Copy streams per device and direction (``"in"``: host-to-device, ``"out"``:
    device-to-host; separate, so the two directions of PCIe overlap). A copy waits for
    the current stream (so the source is ready; ``put_async`` runs under the caller's),
    runs on the side stream, and returns an event the caller's stream (or the host,
    before a commit or release) waits on."""

    def __init__(self) -> None:
        self._streams: dict[tuple[int, str], Any] = {}

    def stream(self, device: Any, role: str = "in") -> Any:
        import torch

        idx = torch.device(device).index or 0
        s = self._streams.get((idx, role))
        if s is None:
            s = self._streams[(idx, role)] = torch.cuda.Stream(device=idx)
        return s

    def synchronize(self) -> None:
        for s in self._streams.values():
            s.synchronize()

    def copy(self, pairs: list[tuple[Any, Any]], device: Any) -> Any:
        """``dst.copy_(src)`` for each pair, on the side stream after the current stream's
        work; the event recorded after them. Tensors used across streams are marked with
        ``record_stream``, so their memory is not reused while the copy may run."""
        import torch

        dst0, src0 = pairs[0]
        side = self.stream(device, "out" if src0.is_cuda and not dst0.is_cuda else "in")
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(side)
        for dst, src in pairs:
            for t in (dst, src):
                if t.is_cuda:
                    t.record_stream(side)
        return ev
