"""The client side of the GPU tier: open the daemon's device slabs once (CUDA IPC, through
CuPy: only GPU-tier traffic needs it) and move CUDA tensors in and out of them, or
through the pinned host arena (torch alone), on a side stream ordered with the caller's
stream by events.

Device numbers differ between processes (each has its own ``CUDA_VISIBLE_DEVICES``):
the daemon names its devices by UUID, and ``DeviceMap`` turns its numbers into this
process's. Nothing here runs without CUDA; ``tests/test_gpu.py`` exercises it on a GPU
host.
"""

from __future__ import annotations

import logging
from typing import Any

from tierstore.errors import InvalidArgument, TierstoreError
from tierstore.gpu import decode_loc, uuid_hex

__all__ = ["DeviceMap", "SlabMap", "SideStreams"]

log = logging.getLogger(__name__)


class DeviceMap:
    """The daemon's device numbers <-> this process's, matched by device UUID."""

    def __init__(self, daemon_uuids: dict[int, str | None], local_uuids: list[str | None]) -> None:
        self.to_local: dict[int, int] = {}
        self.why = ""
        if any(u is None for u in daemon_uuids.values()) or any(u is None for u in local_uuids):
            # no UUIDs to match (an older daemon, or a binding without them): same numbering assumed
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
