"""The GPU update path of the offloaded optimizer: each CUDA parameter's state is
copied host-to-device on a side stream while the previous parameter updates, updated
on the device, and written back device-to-host on another side stream, ordered by
events. ``Updates`` owns the order of the step and calls ``fetch`` / ``update`` /
``finish`` per parameter.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .state import StateTensors

__all__ = ["GpuUpdates", "GpuItem"]

Apply = Callable[[dict[str, Any], torch.Tensor, dict[str, str], dict[str, torch.Tensor]], None]


class GpuItem:
    """One parameter's state in flight through a GPU update."""

    __slots__ = ("key", "p", "leases", "dev", "host", "fetched", "stored")

    def __init__(self, key: tuple[int, int], p: torch.Tensor) -> None:
        self.key = key
        self.p = p
        self.leases: list[Any] = []
        self.dev: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # name -> (device copy, host view to write)
        self.host: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # scalar state kept on the host
        self.fetched: Any = None
        self.stored: Any = None


class GpuUpdates:
    """Updates of parameters on their GPU: the state tensors come from ``states``, the
    update rule is ``apply`` (the wrapped optimizer's), the groups come from ``groups``."""

    def __init__(self, states: StateTensors, groups: Callable[[], list[dict[str, Any]]], apply: Apply) -> None:
        self._states = states
        self._groups = groups
        self._apply = apply
        self._streams: Any = None  # per-device copy streams, made on the first GPU update

    def _side(self, device: torch.device, role: str) -> Any:
        if self._streams is None:
            from ..gpu import SideStreams

            self._streams = SideStreams()
        return self._streams.stream(device, role)

    def fetch(self, gi: int, pi: int, p: torch.Tensor, read: int, write: int) -> GpuItem:
        """Lease a parameter's state (version ``read`` to read, ``write`` to overwrite; the
        same one, ``rw``, where they are equal) and start its host-to-device copies on the
        side stream."""
        item = GpuItem((gi, pi), p)
        side = self._side(p.device, "in")
        try:
            # device buffers of earlier updates are freed on the compute stream: order after it
            side.wait_stream(torch.cuda.current_stream(p.device))
            for name in self._states.layout[(gi, pi)]:
                if read == write:  # single-version state: read and written back in place, one lease
                    ls = ld = self._states.checkout_state(gi, pi, name, read, "rw")
                    item.leases.append(ls)
                else:
                    ls = self._states.checkout_state(gi, pi, name, read, "r")
                    item.leases.append(ls)
                    ld = self._states.checkout_state(gi, pi, name, write, "w")
                    item.leases.append(ld)
                host = ls.tensor
                if host.dim() == 0:  # scalar state (e.g. Adam's step) stays where torch keeps it: the host
                    item.host[name] = (host.clone(), ld.tensor)
                    continue
                with torch.cuda.stream(side):
                    dev = torch.empty(host.shape, dtype=host.dtype, device=p.device)
                    dev.copy_(host, non_blocking=True)
                item.dev[name] = (dev, ld.tensor)
            item.fetched = torch.cuda.Event()
            item.fetched.record(side)
        except BaseException:
            side.synchronize()  # no copy may still read a view whose lease goes
            for lease in item.leases:
                lease.release()
            raise
        return item

    def update(self, item: GpuItem) -> None:
        gi, pi = item.key
        p = item.p
        group = self._groups()[gi]
        layout = self._states.layout[(gi, pi)]
        cur = torch.cuda.current_stream(p.device)
        cur.wait_event(item.fetched)
        views: dict[str, torch.Tensor] = {}
        for name, (dev, _) in item.dev.items():
            dev.record_stream(cur)  # allocated on the side stream, used (and freed) on this one
            views[name] = dev
        for name, (h, _) in item.host.items():
            views[name] = h
        self._apply(group, p, layout, views)
        side = self._side(p.device, "out")
        side.wait_stream(cur)  # the write-back starts after the update
        with torch.cuda.stream(side):
            for dev, dst in item.dev.values():
                dst.copy_(dev, non_blocking=True)
                dev.record_stream(side)
        for h, dst in item.host.values():
            dst.copy_(h)
        item.stored = torch.cuda.Event()
        item.stored.record(side)

    def finish(self, item: GpuItem) -> None:
        """Wait for the item's copies, then check its state back in."""
        try:
            if item.stored is not None:
                item.stored.synchronize()  # after the update, which waited for the fetch
            else:
                self._side(item.p.device, "in").synchronize()  # no copy may still read a leased view
        finally:
            for lease in item.leases:
                lease.release()
            item.leases = []
