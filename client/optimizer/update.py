"""The offloaded optimizer's update loop: parameters updated from their state in the
pool, in a fixed order — one at a time, a bucket at a time, or on their GPU — each
step's next state fetched or hinted while the current one updates.

``Updates`` knows the order and the overlap; what a bucket is comes from ``Buckets``,
where state lives from ``StateTensors``, the CUDA path from ``GpuUpdates``. The step's
bookkeeping (which versions are current, the progress record) is the caller's.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary

from tierstore.errors import CapacityExceeded
from tierstore.units import format_size

from .buckets import Buckets
from .gpu import GpuItem, GpuUpdates
from .state import Item, Key, StateTensors, local, pytag, untag, wrap_like
from .tiles import step_tiled, tileable

log = logging.getLogger(__name__)

__all__ = ["Updates"]

Views = dict[str, torch.Tensor]


_SAME_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bit patterns (an integer view of the same width): compared bit for bit, a NaN
    equals itself."""
    t = t.detach()
    return t.view(_SAME_WIDTH[t.element_size()]) if t.is_floating_point() else t


def _fingerprint(p: torch.Tensor) -> int | None:
    """The sum of a CPU parameter's bit patterns (integer: the same whatever the threads),
    or ``None`` for a parameter elsewhere (reading one back would wait on its device). One
    pass over the parameter; a change that keeps the sum goes unseen (a reordering of the
    values, or the sign of as many positive as negative ones flipped)."""
    if p.device.type != "cpu" or not p.is_floating_point():
        return None
    return int(torch.sum(_bits(p), dtype=torch.int64))


class Updates:
    """Runs the wrapped optimizer's update rule on state checked out of the pool."""

    def __init__(self, inner: torch.optim.Optimizer, groups: Callable[[], list[dict[str, Any]]],
                 states: StateTensors, buckets: Buckets, *, on_gpu: Callable[[torch.Tensor], bool],
                 needs_master: Callable[[torch.Tensor], bool]) -> None:
        self._inner = inner
        self._groups = groups
        self._states = states
        self._buckets = buckets
        self._on_gpu = on_gpu
        self._needs_master = needs_master
        self.gpu = GpuUpdates(states, groups, self.apply)
        self._written: WeakIdKeyDictionary = WeakIdKeyDictionary()
        """Each parameter with a master: its version (``_version``) once its update wrote it
        (``_master_of``)."""

    def _wrote(self, p: torch.Tensor) -> None:
        self._written[p] = (p._version, p.data_ptr(), _fingerprint(p))

    def _master_of(self, p: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
        """``p``'s master, made ``p`` again where something changed ``p`` since its last
        update wrote it (``load_state_dict``, a ``mul_``, a ``fill_``, and writes through
        ``p.data``, which leave ``_version`` as it was: ``p.data.clamp_(...)``, ``p.data =
        t``): the update then starts from the parameter as the model has it, as the plain
        optimizer's does, instead of silently undoing the change. Seen by the version, the
        storage, or (a CPU parameter) a sum of its bit patterns; confirmed bit for bit
        against the master's rounding (a parameter offload writing the same values back
        keeps the master)."""
        seen = self._written.get(p)
        if seen is None:
            return master
        version, ptr, print_ = seen
        if p._version == version and p.data_ptr() == ptr and (print_ is None or _fingerprint(p) == print_):
            return master
        rounded = master.to(p.device, p.dtype)
        if not torch.equal(_bits(p), _bits(rounded)):
            log.info("a parameter of shape %s was changed since the optimizer's last update: its fp32 master "
                     "starts again from it", tuple(p.shape))
            master.copy_(p.detach())
        return master

    def run(self, work: list[Item], ver: dict[Key, int]) -> None:
        """Update the parameters ``work`` names, in that order, each from version ``ver`` of
        its state into the version it writes."""
        states, buckets, gpu = self._states, self._buckets, self.gpu
        saved_groups = self._inner.param_groups
        pending: list[GpuItem] = []  # updated on the GPU, state still being written back
        nxt: GpuItem | None = None
        try:
            k = 0
            while k < len(work):
                gi, pi, p = work[k]
                read = ver[(gi, pi)]
                if not states.layout.get((gi, pi)):  # first steps (or no state): those after it go along
                    end = buckets.first_end(work, k)
                    self.first(work[k:end])
                    k = end
                    continue
                if not self._on_gpu(p):
                    end = buckets.end(work, k)
                    if end < len(work):  # overlap the next bucket's fetch with this update
                        states.hint(work[end:buckets.end(work, end)], ver)
                    if end == k + 1:
                        self.one(gi, pi, p, read, states.write_version(read))
                    else:
                        self.bucket(work[k:end], ver)
                    k = end
                    continue
                item = nxt if nxt is not None and nxt.key == (gi, pi) else \
                    gpu.fetch(gi, pi, p, read, states.write_version(read))
                nxt = None
                if k + 1 < len(work):
                    g2, p2, q = work[k + 1]
                    if self._on_gpu(q) and states.layout.get((g2, p2)):
                        v2 = ver[(g2, p2)]
                        nxt = gpu.fetch(g2, p2, q, v2, states.write_version(v2))  # H2D overlaps this update
                    else:
                        states.hint(work[k + 1:buckets.end(work, k + 1)], ver)
                if k + 2 < len(work):
                    states.hint(work[k + 2:k + 3], ver)  # the pool brings it up from NVMe meanwhile
                pending.append(item)
                gpu.update(item)
                while len(pending) > 1:
                    gpu.finish(pending.pop(0))
                k += 1
        finally:
            self._inner.param_groups = saved_groups
            for item in pending + ([nxt] if nxt is not None else []):
                gpu.finish(item)

    def bucket(self, items: list[Item], versions: dict[Key, int]) -> None:
        """Update several small parameters of one group together: their state tensors are
        checked out with one ``checkout_each`` (each new version from the current one),
        updated by one call of the wrapped optimizer and checked in with one message."""
        states = self._states
        gi = items[0][0]
        wanted = [(g, pi, name, states.write_version(versions[(g, pi)]), versions[(g, pi)])
                  for g, pi, _ in items for name in states.layout[(g, pi)]]
        try:
            leases = states.checkout_states(wanted)
        except CapacityExceeded:
            # more than the host tier holds at once (nothing was taken): smaller buckets from now on
            self._buckets.shrink(items)
            half = len(items) // 2
            for part in (items[:half], items[half:]):
                if len(part) == 1:
                    g, pi, p = part[0]
                    self.one(g, pi, p, versions[(g, pi)], states.write_version(versions[(g, pi)]))
                else:
                    self.bucket(part, versions)
            return
        try:
            updates, i = [], 0
            for g, pi, p in items:
                layout = states.layout[(g, pi)]
                updates.append((p, layout, {name: leases[i + j].tensor for j, name in enumerate(layout)}))
                i += len(layout)
            self.apply_many(self._groups()[gi], updates)
        finally:
            leases.release()

    def one(self, gi: int, pi: int, p: torch.Tensor, read: int, write: int) -> None:
        """Update one parameter on the CPU (its first update makes its state in the pool)."""
        states = self._states
        group = self._groups()[gi]
        layout = states.layout.get((gi, pi))
        if layout is None:
            self.first([(gi, pi, p)])
            return
        try:
            # two versions: out of place, version `read` stays intact until the step completes
            # (the pool hands its bytes to version `write`); one version: in place (`write` is `read`)
            leases = states.checkout_states([(gi, pi, name, write, read) for name in layout])
        except CapacityExceeded as e:
            need = sum(int(states.store.info(states.lookup(gi, pi, n, write))["nbytes"]) for n in layout)
            raise CapacityExceeded(
                f"{e}. Updating parameter {gi}.{pi} holds the new version of each of its {len(layout)} state "
                f"tensors (each made from the old version in place): the host tier needs at least about "
                f"{format_size(need)} free for it (plus the prefetch budget)") from None
        try:
            self.apply(group, p, layout, {name: lease.tensor for name, lease in zip(layout, leases)})
        finally:
            leases.release()

    def first(self, items: list[Item]) -> None:
        """The first step of parameters of one group: the wrapped optimizer creates their
        state in one call (its update of each is the same as alone: elementwise, per
        parameter), which then moves into the pool (with an fp32 master where one is kept)."""
        states = self._states
        group = self._groups()[items[0][0]]
        targets = []
        for gi, pi, p in items:
            if self._needs_master(p):
                host_update = p.is_cuda and not self._on_gpu(p)
                target = p.detach().to("cpu" if host_update else p.device, torch.float32, copy=True)
                target.grad = p.grad.to(target.device, torch.float32)
            else:
                target = p
            targets.append(target)
        self._inner.param_groups = [dict(group, params=targets)]
        self._inner.step()
        for (gi, pi, p), target in zip(items, targets):
            state = self._inner.state.pop(target, {})
            # a rule that keeps no state (SGD without momentum) leaves an empty layout: the parameter
            # is in optimizer.state (as torch's own defaultdict has it), and every update is a first one
            layout = states.layout[(gi, pi)] = {}
            for name, v in state.items():
                try:
                    layout[name], t = local(v) if isinstance(v, torch.Tensor) else pytag(v)
                except TypeError as e:
                    raise TypeError(f"parameter {gi}.{pi}'s state {name!r} made by {type(self._inner).__name__}: "
                                    f"{e}") from None
                states.put_both(gi, pi, name, t)
            if target is not p:
                layout["master"] = "tensor"
                states.put_both(gi, pi, "master", target.detach())
                p.copy_(target)
                self._wrote(p)
                target.grad = None

    def apply(self, group: dict[str, Any], p: torch.Tensor, layout: dict[str, str], views: Views) -> None:
        """Run the wrapped optimizer's update of ``p`` on state ``views`` (written in place;
        with a master in ``views``, the update runs on it and is rounded into ``p``)."""
        self.apply_many(group, [(p, layout, views)])

    def apply_many(self, group: dict[str, Any], updates: list[tuple[torch.Tensor, dict[str, str], Views]]) -> None:
        """``apply`` to several parameters of ``group`` by one call of the wrapped optimizer
        (its update of each parameter is the same as alone: elementwise, per parameter);
        a large one of an elementwise rule a tile at a time (``tiles``), the same bits."""
        inner = self._inner
        targets = []
        try:
            for p, layout, views in updates:
                state: dict[str, Any] = {}
                for name, tag in layout.items():
                    if name == "master":
                        continue
                    if tag == "tensor":
                        state[name] = views[name]
                    elif tag == "dtensor":  # writes through the local shard land in the pool
                        state[name] = wrap_like(views[name], p)
                    else:
                        state[name] = untag(tag, views[name])
                master = views.get("master") if "master" in layout else None
                if master is not None:
                    target = self._master_of(p, master)
                    target.grad = p.grad.to(target.device, torch.float32)  # device-to-host when updating on the host
                else:
                    target = p
                inner.state[target] = state
                targets.append(target)
            whole = []
            for target in targets:
                if tileable(inner, group, target, inner.state[target]):  # a large parameter a tile at a time
                    inner.state[target] = step_tiled(inner, group, target, inner.state[target])
                else:
                    whole.append(target)
            if whole:
                inner.param_groups = [dict(group, params=whole)]
                inner.step()
            for (p, layout, views), target in zip(updates, targets):
                new_state = inner.state.get(target, {})
                for name, tag in layout.items():  # python scalars changed by the update go back into their views
                    if name != "master" and tag not in ("tensor", "dtensor"):
                        views[name].fill_(new_state[name])
                if target is not p:
                    p.copy_(target)  # the parameter is the master rounded to its dtype
                    self._wrote(p)
        finally:
            for (p, _, _), target in zip(updates, targets):
                inner.state.pop(target, None)  # the views go with their leases
                if target is not p:
                    target.grad = None
