"""The client side of the GPU tier: open the daemon's device slabs once (CUDA IPC)
and move CUDA tensors in and out of them, or through the pinned host arena, on a
side stream ordered with the caller's stream by events.

Nothing here runs without CUDA; ``tests/test_gpu.py`` exercises it on a GPU host.
"""

from __future__ import annotations

import logging
from typing import Any

from tierstore.errors import TierstoreError
from tierstore.gpu import decode_loc

__all__ = ["SlabMap", "SideStreams"]

log = logging.getLogger(__name__)


class SlabMap:
    """This process's mappings of the GPU tier's slabs, opened once per client."""

    def __init__(self, slabs: list[dict[str, Any]]) -> None:
        import cupy
        from cupy.cuda import runtime

        self._cupy, self._rt = cupy, runtime
        self._slabs: dict[tuple[int, int], tuple[int, int]] = {}
        try:
            for s in slabs:
                with cupy.cuda.Device(int(s["device"])):
                    ptr = runtime.ipcOpenMemHandle(bytes(s["handle"]), runtime.cudaIpcMemLazyEnablePeerAccess)
                self._slabs[(int(s["device"]), int(s["slab"]))] = (int(ptr), int(s["size"]))
        except BaseException:
            self.close()
            raise

    def tensor(self, loc: int, nbytes: int) -> Any:
        """A uint8 CUDA tensor viewing ``nbytes`` of the GPU tier at ``loc`` (zero-copy)."""
        import torch

        device, slab, off = decode_loc(loc)
        entry = self._slabs.get((device, slab))
        if entry is None:
            raise TierstoreError(f"daemon named GPU slab {slab} on device {device}, which this client has not opened")
        ptr, size = entry
        if off + nbytes > size:
            raise TierstoreError(f"daemon named GPU bytes [{off}, {off + nbytes}) outside slab {slab} ({size} bytes)")
        cp = self._cupy
        mem = cp.cuda.UnownedMemory(ptr + off, max(nbytes, 1), self, device_id=device)
        arr = cp.ndarray((nbytes,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(mem, 0))
        return torch.as_tensor(arr, device=f"cuda:{device}")

    def close(self) -> None:
        for (device, _), (ptr, _) in list(self._slabs.items()):
            try:
                with self._cupy.cuda.Device(device):
                    self._rt.ipcCloseMemHandle(ptr)
            except Exception as e:  # closing must go on for the others
                log.warning("closing a GPU slab mapping failed: %s", e)
        self._slabs.clear()


class SideStreams:
    """Copy streams per device and direction (``"in"``: host-to-device, ``"out"``:
    device-to-host; separate, so the two directions of PCIe overlap). A copy waits for
    the caller's stream (so the source is ready), runs on the side stream, and returns
    an event the caller's stream (or the host, before a commit or release) waits on."""

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

    def copy(self, dst: Any, src: Any, device: Any) -> Any:
        """``dst.copy_(src)`` on the side stream after the current stream's work; the
        event recorded after it. Tensors used across streams are marked with ``record_stream``."""
        import torch

        side = self.stream(device, "out" if src.is_cuda and not dst.is_cuda else "in")
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(side)
        for t in (dst, src):
            if t.is_cuda:
                t.record_stream(side)
        return ev
