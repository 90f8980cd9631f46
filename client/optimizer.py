"""Optimizer-state offload: a ``torch.optim`` optimizer whose per-parameter state
(and fp32 master weights) lives in a tierstore pool.

This module owns the step's order, the state versions (two, crash-consistent, or one), buckets, resume and
the state-dict format; the GPU update path is in ``optimizer_gpu``. It talks to the
pool only through ``tierstore.contract.Pool``, so a daemon ``Client`` and an
in-process ``Store`` both work.

Length: one concept, the offloaded optimizer's step; update in backward is in
``backward``, the CUDA update path in ``optimizer_gpu``.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch

from tierstore.contract import Pool, PoolLease
from tierstore.errors import CapacityExceeded, NotFound, StaleHandle, TierstoreError
from tierstore.units import align_up, format_size

if TYPE_CHECKING:
    from tierstore.batch import LeaseGroup

from .backward import BackwardUpdates
from .optimizer_gpu import GpuUpdates, _GpuItem

__all__ = ["OffloadedOptimizer", "offload_optimizer", "offloaded", "DEFAULT_BUCKET_BYTES", "TornState"]

log = logging.getLogger(__name__)

_OPT_STREAM = "optim"

DEFAULT_BUCKET_BYTES = 16 << 20
"""Default ``bucket_bytes`` of ``offload_optimizer``: small parameters are updated
together, up to this many bytes of state at a time."""
_BUCKET_MAX = 256
"""Most parameters in one bucket (each has a few state tensors: well below one
``checkout_each`` list's 4096)."""


def _pytag(v: Any) -> tuple[str, torch.Tensor]:
    """Non-tensor optimizer state (python numbers) stored as 0-d tensors, tagged by type."""
    if isinstance(v, bool):
        return "bool", torch.tensor(v)
    if isinstance(v, int):
        return "int", torch.tensor(v, dtype=torch.int64)
    if isinstance(v, float):
        return "float", torch.tensor(v, dtype=torch.float64)
    raise TypeError(f"cannot offload optimizer state of type {type(v).__name__}")


def _untag(tag: str, t: torch.Tensor) -> Any:
    return {"bool": bool, "int": int, "float": float}[tag](t.item())


def _dtensor_cls() -> Any:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without distributed
        return None
    return DTensor


def _local(v: torch.Tensor) -> tuple[str, torch.Tensor]:
    """(tag, plain tensor): sharded (FSDP2) state is stored as this rank's local shard."""
    dt = _dtensor_cls()
    if dt is not None and isinstance(v, dt):
        return "dtensor", v.to_local()
    return "tensor", v


def _wrap_like(local: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A DTensor over ``local`` sharded like the parameter ``p``."""
    return _dtensor_cls().from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                     stride=p.stride())

class _PoolState(MutableMapping):
    """``optimizer.state`` of an offloaded optimizer: parameter -> its state, read from the
    pool on access (copies), written into the pool on assignment. It is non-empty once any
    parameter has state, so tools that test ``optimizer.state`` (DCP's ``get_state_dict``
    runs a zero-gradient step on an optimizer whose state looks empty) see the pool's."""

    def __init__(self, opt: "OffloadedOptimizer") -> None:
        self._opt = opt
        self._index: dict[int, tuple[int, int]] = {}  # id(parameter) -> (group, index)

    def _where(self, p: Any) -> tuple[int, int] | None:
        groups = self._opt.param_groups
        where = self._index.get(id(p))
        if where is None or where[0] >= len(groups) or where[1] >= len(groups[where[0]]["params"]) \
                or groups[where[0]]["params"][where[1]] is not p:  # groups changed since: index them again
            self._index = {id(q): (gi, pi) for gi, g in enumerate(groups) for pi, q in enumerate(g["params"])}
            where = self._index.get(id(p))
        return where

    def __getitem__(self, p: Any) -> dict[str, Any]:
        where = self._where(p)
        if where is None or where not in self._opt._layout:
            return {}  # as the defaultdict of torch.optim.Optimizer.state does, without storing it
        return self._opt._param_state(*where)

    def __setitem__(self, p: Any, st: dict[str, Any]) -> None:
        where = self._where(p)
        if where is None:
            raise KeyError("not a parameter of this optimizer")
        self._opt._set_param_state(*where, dict(st))
        self._opt._put_progress()

    def __delitem__(self, p: Any) -> None:
        raise TypeError("the state of an offloaded optimizer's parameter cannot be deleted on its own; "
                        "use load_state_dict or free()")

    def __iter__(self):
        for gi, pi in sorted(self._opt._layout):
            yield self._opt.param_groups[gi]["params"][pi]

    def __len__(self) -> int:
        return len(self._opt._layout)


class TornState(TierstoreError):
    """A resume found single-version optimizer state that a process stopped updating in
    the middle of a step (``crash_consistent=False``): it cannot continue from it."""

    code = "TornState"


class _StepWork:
    """What the step under way has done so far; a completed step starts a new one."""

    __slots__ = ("updated", "fresh")

    def __init__(self) -> None:
        self.updated: set[tuple[int, int]] = set()  # (group, index) updated in this step
        self.fresh: set[tuple[int, int]] = set()  # among them, those whose state this step made


class OffloadedOptimizer(GpuUpdates, torch.optim.Optimizer):
    """A ``torch.optim`` optimizer whose per-parameter state lives in a tierstore pool.

    ``step()`` walks the parameters in a fixed order. For each one it checks the
    state out of the pool (the next parameter's state is already being prefetched),
    updates it with the wrapped optimizer's own update rule, and checks it back in.
    Small parameters go in buckets (``bucket_bytes`` of state at most): one check-out
    message, one call of the wrapped optimizer and one check-in for the bucket.
    Crash-consistent state (``crash_consistent=True``, the default but for
    ``tier="host"``) is double-buffered (two versions per tensor): a step reads each
    parameter's current version and writes the other one, and a small progress record,
    written after the last parameter, names the step and each parameter's current
    version, so a process killed mid-step resumes from the last completed step with
    nothing half-updated. Single-version state (``crash_consistent=False``) costs the
    state's bytes once: each update is made in place, and a marker object present from a
    step's first update to its progress record makes a resume after a process killed
    mid-step fail with ``TornState`` instead of continuing from a half-updated state. A
    parameter without a gradient in a step keeps its state as it is (its current
    version does not change), as the wrapped optimizer would.

    ``update_in_backward=True``: each parameter is updated as soon as its gradient is
    final, from a post-accumulate-grad hook, while backward still runs (``backward``).

    Parameters that are not fp32 (bf16/fp16 training) get an fp32 master copy in the
    pool; the update runs on the master and is copied (rounded) into the parameter.

    CUDA parameters: ``update="gpu"`` (the default for them) fetches each parameter's
    state host-to-device on a side stream while the previous parameter updates, runs
    the update on the GPU and writes the state back device-to-host on the side stream,
    ordered by events. ``update="cpu"`` (ZeRO-Offload style) copies the gradient to
    the host, updates an fp32 host master and the state in the pool, and copies the
    parameter back to the GPU.
    """

    def __init__(self, inner: torch.optim.Optimizer, store: Pool, *, tier: str | None = "nvme",
                 prefix: str = "opt", master_weights: bool | None = None, durable: bool = False,
                 resume: bool = False, update: str = "auto", bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 crash_consistent: bool | None = None, update_in_backward: bool = False) -> None:
        if not isinstance(inner, torch.optim.Optimizer):
            raise TypeError(f"offload_optimizer wraps a torch.optim.Optimizer, got {type(inner).__name__}")
        if update not in ("auto", "cpu", "gpu"):
            raise ValueError(f"update must be 'auto', 'cpu' or 'gpu', got {update!r}")
        if update == "gpu" and not all(p.is_cuda for g in inner.param_groups for p in g["params"]):
            raise ValueError("update='gpu' needs every parameter on a CUDA device; use 'cpu' or 'auto'")
        if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or bucket_bytes < 0:
            raise ValueError(f"bucket_bytes must be an int >= 0, got {bucket_bytes!r}")
        self.update = update
        self.bucket_bytes = bucket_bytes
        self._bucket_limit = bucket_bytes  # lowered when a bucket does not fit in the host tier at once
        self._streams: Any = None  # per-device copy streams, made on first GPU update
        self._handles: dict[str, Any] = {}  # key -> handle, so a step does not look every key up
        closure = inspect.signature(inner.step).parameters.get("closure")
        if closure is not None and closure.default is inspect.Parameter.empty:
            raise TypeError(f"{type(inner).__name__} needs a closure for every step and keeps one state for all "
                            "parameters; offload_optimizer wraps optimizers whose state is per parameter "
                            "(Adam, AdamW, SGD, Adagrad, RMSprop, ...)")
        initial = None
        if any(len(s) for s in inner.state.values()):
            # set up by the constructor (Adagrad) or by steps taken before wrapping: it moves into the pool
            initial = inner.state_dict()
            inner.state.clear()
        self.inner = inner
        self.store = store
        self.tier = tier
        self.prefix = prefix.rstrip("/")
        self.master_weights = master_weights
        self.durable = durable
        if crash_consistent is None:
            # host-tier bytes do not survive the daemon anyway: unless asked, they cost their size once
            crash_consistent = durable or tier != "host"
        self.crash_consistent = bool(crash_consistent)
        self.versions = 2 if self.crash_consistent else 1
        """State versions kept in the pool per state tensor: 2 (crash-consistent) or 1."""
        self._torn_marked = False  # single-version: the torn-step marker is in the pool
        super().__init__(inner.param_groups, inner.defaults)
        # (group, index) -> {name: tag}; tag is "tensor" or the python type of a scalar
        self._layout: dict[tuple[int, int], dict[str, str]] = {}
        self._completed = 0
        self._cur: dict[tuple[int, int], int] = {}  # (group, index) -> current state version (0 or 1)
        self.state = _PoolState(self)  # type: ignore[assignment]  # the pool's, not a dict
        self._last_record: list[int] | None = None  # the progress record last written or resumed from
        self._in_step = _StepWork()
        if not (resume and self._resume()):
            self._clear_pool()
            if initial is not None:
                self.load_state_dict(initial)
        self.backward = BackwardUpdates(self) if update_in_backward else None
        """The update-in-backward hooks (``None`` without ``update_in_backward``)."""

    # ------------------------------------------------------------------ keys
    def _key(self, gi: int, pi: int, name: str, version: int) -> str:
        tag = self._layout.get((gi, pi), {}).get(name, "tensor")
        suffix = "" if tag == "tensor" else f"#{tag}"  # python scalars keep their type in the key
        return f"{self.prefix}/{gi}.{pi}/{name}{suffix}@{version}"

    def _progress_key(self) -> str:
        return f"{self.prefix}/_progress"

    def _prev_progress_key(self) -> str:
        return f"{self.prefix}/_progress.prev"

    def _torn_key(self) -> str:
        return f"{self.prefix}/_torn"

    @property
    def completed_steps(self) -> int:
        """Optimizer steps completed (and, after a resume, recovered from the pool)."""
        return self._completed

    def _on_gpu(self, p: torch.Tensor) -> bool:
        """Does this parameter's update run on its GPU?"""
        return p.is_cuda and self.update != "cpu"

    def _needs_master(self, p: torch.Tensor) -> bool:
        if p.is_cuda and not self._on_gpu(p):
            return True  # the host update needs an fp32 host copy of the parameter
        want = p.dtype in (torch.float16, torch.bfloat16) if self.master_weights is None else bool(self.master_weights)
        if want and _local(p)[0] == "dtensor":
            raise ValueError("fp32 master weights of sharded (FSDP2) parameters are not supported; use FSDP2's "
                             "MixedPrecisionPolicy with fp32 parameters instead, or master_weights=False")
        return want

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.backward is not None:  # what backward left to do, and a check that it was right to
            self.backward.finish()
        done = self._in_step.updated
        work = [(gi, pi, p) for gi, g in enumerate(self.param_groups) for pi, p in enumerate(g["params"])
                if p.grad is not None and (gi, pi) not in done]
        self._update_params(work)
        self._complete_step(work)
        return loss

    def deferred(self) -> Any:
        """A context: backward inside it leaves the update to ``step()`` (with
        ``update_in_backward``; without, it changes nothing). For every micro-batch of
        gradient accumulation but the last, and for a backward whose gradients are
        clipped or unscaled before ``step()``."""
        return self.backward.deferred() if self.backward is not None else contextlib.nullcontext()

    def _write_version(self, read: int) -> int:
        """The version an update that reads version ``read`` writes: the other one, or (single
        version) the same, in place."""
        return 1 - read if self.versions == 2 else read

    def _update_params(self, work: list[tuple[int, int, torch.Tensor]]) -> None:
        """Update the parameters ``work`` names, in that order, each read from its current
        version; the step under way records them (``_complete_step`` makes them current)."""
        if not work:
            return
        self._begin_updates()
        ver = {(gi, pi): self._cur.get((gi, pi), 0) for gi, pi, _ in work}
        self._in_step.fresh.update(key for key in ver if key not in self._layout)  # state made this step
        saved_groups = self.inner.param_groups
        pending: list[_GpuItem] = []  # updated on the GPU, state still being written back
        nxt: _GpuItem | None = None
        try:
            k = 0
            while k < len(work):
                gi, pi, p = work[k]
                read = ver[(gi, pi)]
                if not (self._on_gpu(p) and (gi, pi) in self._layout):
                    end = self._bucket_end(work, k)
                    if end < len(work):  # overlap the next bucket's fetch with this update
                        self._prefetch(work[end:self._bucket_end(work, end)], ver)
                    if end == k + 1:
                        self._step_one(gi, pi, p, read, self._write_version(read))
                    else:
                        self._step_bucket(work[k:end], ver)
                    k = end
                    continue
                item = nxt if nxt is not None and nxt.key == (gi, pi) else \
                    self._gpu_fetch(gi, pi, p, read, self._write_version(read))
                nxt = None
                if k + 1 < len(work):
                    g2, p2, q = work[k + 1]
                    if self._on_gpu(q) and (g2, p2) in self._layout:
                        v2 = ver[(g2, p2)]
                        nxt = self._gpu_fetch(g2, p2, q, v2, self._write_version(v2))  # H2D overlaps this update
                    else:
                        self._prefetch(work[k + 1:self._bucket_end(work, k + 1)], ver)
                if k + 2 < len(work):
                    self._prefetch(work[k + 2:k + 3], ver)  # the pool brings it up from NVMe meanwhile
                pending.append(item)
                self._gpu_update(item)
                while len(pending) > 1:
                    self._gpu_finish(pending.pop(0))
                k += 1
        finally:
            self.inner.param_groups = saved_groups
            for item in pending + ([nxt] if nxt is not None else []):
                self._gpu_finish(item)
        self._in_step.updated.update(ver)

    def _begin_updates(self) -> None:
        """Before a step's first update. Single-version state is updated in place, so from
        here until the step's progress record a process that dies leaves a torn state: a
        marker object says so to a resume."""
        if self.versions == 1 and not self._torn_marked:
            self.store.put(torch.tensor([self._completed + 1], dtype=torch.int64), key=self._torn_key(),
                           replace=True, durable=self.durable)
            self._torn_marked = True

    def _complete_step(self, work: list[tuple[int, int, torch.Tensor]]) -> None:
        """The step's end: the versions it wrote become current, the progress record says so
        (written last, after every parameter), and the next step's first state is hinted."""
        st = self._in_step
        for key in st.updated:
            if key not in self._layout:
                continue
            if key in st.fresh or self.versions == 1:  # made this step (both versions equal), or in place
                self._cur[key] = (self._completed + 1) % 2 if self.versions == 2 else 0
            else:
                self._cur[key] = 1 - self._cur.get(key, 0)
        self._completed += 1
        self._put_progress(keep_previous=True)
        if self._torn_marked:  # the progress record names a whole step again: nothing is torn
            h = self.store.lookup(self._torn_key())
            if h is not None:
                self.store.free(h)
            self._torn_marked = False
        self._in_step = _StepWork()
        self.store.step()
        # the next step starts where this one did: its first state comes up meanwhile (during the
        # forward pass, and the backward up to the first update when updating in backward)
        first = self.backward.first_items() if self.backward is not None else []
        if not first and work:
            first = work[:self._bucket_end(work, 0)]
        if first:
            self._prefetch(first, self._cur)

    def _put_progress(self, keep_previous: bool = False) -> None:
        """The progress record: [completed steps, then (group, index, current version) per
        parameter with state]. One put, so it names one consistent set of versions.
        ``keep_previous`` (a step's end, two versions kept): the record it replaces is kept
        first as the previous one, whose versions the step left intact (``rewind_to``)."""
        rec = [self._completed]
        for (gi, pi), v in sorted(self._cur.items()):
            rec += [gi, pi, v]
        if keep_previous and self.versions == 2 and self._last_record is not None:
            # before the new record: a crash between the two leaves both naming the old step
            self.store.put(torch.tensor(self._last_record, dtype=torch.int64), key=self._prev_progress_key(),
                           replace=True, durable=self.durable)
        self.store.put(torch.tensor(rec, dtype=torch.int64), key=self._progress_key(), replace=True,
                       durable=self.durable)
        self._last_record = rec

    def _prefetch(self, items: list[tuple[int, int, torch.Tensor]], versions: dict[tuple[int, int], int]) -> None:
        """Hint the pool to bring up the state ``items`` will read (one message, not waited for)."""
        hs = []
        for gi, pi, _ in items:
            for name in self._layout.get((gi, pi), ()):
                h = self._lookup(gi, pi, name, versions[(gi, pi)])
                if h is not None:
                    hs.append(h)
        if hs:
            try:
                self.store.prefetch(hs, wait=False)  # a hint: not waited for
            except (NotFound, StaleHandle):  # a key re-bound behind our back: found again at its check-out
                log.debug("prefetch hint named a re-bound optimizer state; skipped")

    def _state_bytes(self, gi: int, pi: int, p: torch.Tensor) -> int:
        """About how many host-tier bytes a parameter's state takes checked out (fp32 per
        element; every object in whole pages)."""
        layout = self._layout.get((gi, pi), {})
        n = sum(1 for tag in layout.values() if tag in ("tensor", "dtensor"))
        return n * align_up(max(4 * _local(p)[1].numel(), 1)) + (len(layout) - n) * align_up(8)

    def _bucketable(self, gi: int, pi: int, p: torch.Tensor) -> bool:
        return (gi, pi) in self._layout and not self._on_gpu(p) and self._state_bytes(gi, pi, p) <= self._bucket_limit

    def _bucket_end(self, work: list[tuple[int, int, torch.Tensor]], k: int) -> int:
        """End (exclusive) of the bucket starting at ``work[k]``: the parameters after it in
        the same group that are updated on the CPU with state already in the pool, up to
        ``bucket_bytes`` of state and ``_BUCKET_MAX`` parameters (one alone otherwise)."""
        gi, pi, p = work[k]
        if not self._bucketable(gi, pi, p):
            return k + 1
        total, end = self._state_bytes(gi, pi, p), k + 1
        while end < len(work) and end - k < _BUCKET_MAX:
            g2, p2, q = work[end]
            if g2 != gi or not self._bucketable(g2, p2, q):
                break
            total += self._state_bytes(g2, p2, q)
            if total > self._bucket_limit:
                break
            end += 1
        return end

    def _step_bucket(self, items: list[tuple[int, int, torch.Tensor]], versions: dict[tuple[int, int], int]) -> None:
        """Update several small parameters of one group together: their state tensors are
        checked out with one ``checkout_each`` (each new version from the current one),
        updated by one call of the wrapped optimizer and checked in with one message."""
        gi = items[0][0]
        wanted = [(g, pi, name, self._write_version(versions[(g, pi)]), versions[(g, pi)])
                  for g, pi, _ in items for name in self._layout[(g, pi)]]
        try:
            leases = self._checkout_states(wanted)
        except CapacityExceeded:
            # more than the host tier holds at once (nothing was taken): smaller buckets from now on
            need = sum(self._state_bytes(g, pi, p) for g, pi, p in items)
            self._bucket_limit = min(self._bucket_limit, need // 2)
            log.info("a bucket of %d parameters (%s of state) does not fit in the host tier at once: "
                     "updating at most %s together", len(items), format_size(need), format_size(self._bucket_limit))
            half = len(items) // 2
            for part in (items[:half], items[half:]):
                if len(part) == 1:
                    g, pi, p = part[0]
                    self._step_one(g, pi, p, versions[(g, pi)], self._write_version(versions[(g, pi)]))
                else:
                    self._step_bucket(part, versions)
            return
        try:
            updates, i = [], 0
            for g, pi, p in items:
                layout = self._layout[(g, pi)]
                updates.append((p, layout, {name: leases[i + j].tensor for j, name in enumerate(layout)}))
                i += len(layout)
            self._update_many(self.param_groups[gi], updates)
        finally:
            leases.release()

    def _step_one(self, gi: int, pi: int, p: torch.Tensor, read: int, write: int) -> None:
        group = self.param_groups[gi]
        layout = self._layout.get((gi, pi))
        master_needed = self._needs_master(p)
        leases = None
        try:
            host_update = p.is_cuda and not self._on_gpu(p)
            if layout is None:
                # first step of this parameter: let the optimizer create its state, then move it to the pool
                if master_needed:
                    target = p.detach().to("cpu" if host_update else p.device, torch.float32, copy=True)
                    target.grad = p.grad.to(target.device, torch.float32)
                else:
                    target = p
                self.inner.param_groups = [dict(group, params=[target])]
                self.inner.step()
                state = self.inner.state.pop(target, {})
                layout = self._layout[(gi, pi)] = {}
                for name, v in state.items():
                    if isinstance(v, torch.Tensor):
                        layout[name], t = _local(v)
                    else:
                        layout[name], t = _pytag(v)
                    self._put_both(gi, pi, name, t)
                if master_needed:
                    layout["master"] = "tensor"
                    self._put_both(gi, pi, "master", target.detach())
                    p.copy_(target)
                    target.grad = None
                return
            try:
                # two versions: out of place, version `read` stays intact until the step completes
                # (the pool hands its bytes to version `write`); one version: in place (`write` is `read`)
                leases = self._checkout_states([(gi, pi, name, write, read) for name in layout])
            except CapacityExceeded as e:
                need = sum(int(self.store.info(self._lookup(gi, pi, n, write))["nbytes"]) for n in layout)
                raise CapacityExceeded(
                    f"{e}. Updating parameter {gi}.{pi} holds the new version of each of its {len(layout)} state "
                    f"tensors (each made from the old version in place): the host tier needs at least about "
                    f"{format_size(need)} free for it (plus the prefetch budget)") from None
            self._update(group, p, layout, {name: lease.tensor for name, lease in zip(layout, leases)})
        finally:
            if leases is not None:
                leases.release()

    def _update(self, group: dict[str, Any], p: torch.Tensor, layout: dict[str, str],
                views: dict[str, torch.Tensor]) -> None:
        """Run the wrapped optimizer's update of ``p`` on state ``views`` (written in place;
        with a master in ``views``, the update runs on it and is rounded into ``p``)."""
        self._update_many(group, [(p, layout, views)])

    def _update_many(self, group: dict[str, Any],
                     updates: list[tuple[torch.Tensor, dict[str, str], dict[str, torch.Tensor]]]) -> None:
        """``_update`` of several parameters of ``group`` by one call of the wrapped
        optimizer (its update of each parameter is the same as alone: elementwise, per
        parameter)."""
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
                        state[name] = _wrap_like(views[name], p)
                    else:
                        state[name] = _untag(tag, views[name])
                master = views.get("master") if "master" in layout else None
                if master is not None:
                    target = master
                    target.grad = p.grad.to(target.device, torch.float32)  # device-to-host when updating on the host
                else:
                    target = p
                self.inner.state[target] = state
                targets.append(target)
            self.inner.param_groups = [dict(group, params=targets)]
            self.inner.step()
            for (p, layout, views), target in zip(updates, targets):
                new_state = self.inner.state.get(target, {})
                for name, tag in layout.items():  # python scalars changed by the update go back into their views
                    if name != "master" and tag not in ("tensor", "dtensor"):
                        views[name].fill_(new_state[name])
                if target is not p:
                    p.copy_(target)  # the parameter is the master rounded to its dtype
        finally:
            for (p, _, _), target in zip(updates, targets):
                self.inner.state.pop(target, None)  # the views go with their leases
                if target is not p:
                    target.grad = None

    def _put_both(self, gi: int, pi: int, name: str, t: torch.Tensor) -> None:
        """Put ``t`` as every version kept of a state tensor (both, or version 0 alone)."""
        t = t.detach().contiguous()
        for version in range(self.versions):
            key = self._key(gi, pi, name, version)
            self._handles[key] = self.store.put(t, key=key, tier=self.tier, replace=True, durable=self.durable)

    def _lookup(self, gi: int, pi: int, name: str, version: int) -> Any:
        """The handle of a state tensor, looked up once (keys keep their objects while we run)."""
        key = self._key(gi, pi, name, version)
        h = self._handles.get(key)
        if h is None:
            h = self.store.lookup(key)
            if h is not None:
                self._handles[key] = h
        return h

    def _checkout_state(self, gi: int, pi: int, name: str, version: int, mode: str) -> PoolLease:
        """Check out one state tensor's ``version`` (the GPU update path)."""
        key = self._key(gi, pi, name, version)

        def checkout() -> PoolLease:
            h = self._lookup(gi, pi, name, version)
            if h is None:
                raise RuntimeError(f"optimizer state {key} is missing from the pool; "
                                   "was it freed, or is this prefix used by another job?")
            return self.store.checkout(h, mode, stream=_OPT_STREAM)

        try:
            return checkout()
        except (NotFound, StaleHandle):
            self._handles.pop(key, None)  # the key was re-bound behind our back: look it up again
            return checkout()

    def _checkout_states(self, wanted: list[tuple[int, int, str, int, int]]) -> LeaseGroup:
        """Leases on state tensors to update, ``(group, index, name, version, source)`` each:
        ``w`` on that version starting with the bytes of version ``source``, or ``rw`` on it
        where ``source`` is ``version`` (single-version state, updated in place); sent together
        (through a daemon, one message). Returns them in order, as a ``LeaseGroup``."""

        def requests() -> list[tuple[Any, str, Any]]:
            reqs = []
            for gi, pi, name, version, source in wanted:
                dst, src = self._lookup(gi, pi, name, version), self._lookup(gi, pi, name, source)
                if dst is None or src is None:
                    k = self._key(gi, pi, name, version if dst is None else source)
                    raise RuntimeError(f"optimizer state {k} is missing from the pool; "
                                       "was it freed, or is this prefix used by another job?")
                reqs.append((dst, "rw", None) if source == version else (dst, "w", src))
            return reqs

        try:
            return self.store.checkout_each(requests(), stream=_OPT_STREAM)
        except (NotFound, StaleHandle):
            for gi, pi, name, version, source in wanted:  # a key was re-bound behind our back: look them up again
                for v in (version, source):
                    self._handles.pop(self._key(gi, pi, name, v), None)
            return self.store.checkout_each(requests(), stream=_OPT_STREAM)

    # ------------------------------------------------------------------ resume / cleanup
    def _clear_pool(self) -> None:
        self._handles.clear()
        self._torn_marked = False
        for k in self.store.keys(prefix=self.prefix + "/"):
            h = self.store.lookup(k)
            if h is not None:
                self.store.free(h)

    def _resume(self) -> bool:
        """Take up the state under the prefix; False when there is none to take up."""
        h = self.store.lookup(self._progress_key())
        if h is None:
            log.info("resume: no progress record under %r; starting fresh", self.prefix)
            return False
        rec = [int(x) for x in self.store.get(h).reshape(-1).tolist()]
        self._completed = rec[0]
        self._last_record = rec
        torn = self.store.lookup(self._torn_key())
        if torn is not None:
            raise TornState(
                f"the optimizer state under {self.prefix!r} was being updated in place (crash_consistent=False) "
                f"when its process stopped during step {self._completed + 1}: some parameters hold that step's "
                f"state, others step {self._completed}'s. Load a checkpoint (load_state_dict) or start afresh "
                "(resume=False); crash_consistent=True keeps state a killed process resumes from")
        if (len(rec) - 1) % 3:
            raise ValueError(f"the progress record under {self.prefix!r} is malformed ({len(rec)} numbers); "
                             "was this prefix written by something else?")
        named = {(rec[i], rec[i + 1]): rec[i + 2] for i in range(1, len(rec), 3)}
        legacy = len(rec) == 1  # a record of the step count only: every version is the step's parity
        for k in self.store.keys(prefix=self.prefix + "/"):
            rest = k[len(self.prefix) + 1:]
            if rest.startswith("_") or "@" not in rest:
                continue
            idx, name = rest.split("/", 1)
            gi, pi = (int(x) for x in idx.split("."))
            if not legacy and (gi, pi) not in named:
                continue  # first written by a step that did not complete: not part of the resumed state
            name = name.rsplit("@", 1)[0]
            name, _, tag = name.partition("#")
            self._layout.setdefault((gi, pi), {})[name] = tag or "tensor"
        self._cur = {key: (self._completed % 2 if legacy else named[key]) for key in self._layout}
        self._settle_versions()
        self._params_from_masters()
        log.info("resumed %d parameters' optimizer state at step %d", len(self._layout), self._completed)
        return True

    def _params_from_masters(self) -> None:
        for (gi, pi), layout in self._layout.items():
            if gi >= len(self.param_groups) or pi >= len(self.param_groups[gi]["params"]):
                raise ValueError(f"pool state under {self.prefix!r} names parameter {gi}.{pi}, which this "
                                 "optimizer does not have; wrong prefix or a different model?")
            p = self.param_groups[gi]["params"][pi]
            if "master" in layout:
                with torch.no_grad():
                    m = self.store.get(self.store.lookup(self._key(gi, pi, "master", self._cur[(gi, pi)])))
                    p.copy_(m)  # parameters come back from their masters

    def rewind_to(self, step: int) -> None:
        """Go back to the state after ``step``, the step before the last completed one (or
        stay, if it is the last): a rank one step ahead of the others of its job after a
        failure (see ``tierstore.client.distributed.agree_on_step``). Needs two versions
        (``crash_consistent=True``): the last step wrote its state beside the previous
        one's, and the previous progress record names those. Parameters with fp32 masters
        come back from them; others are the caller's to restore."""
        if step == self._completed:
            return
        if step != self._completed - 1:
            raise ValueError(f"can go back one step only, from {self._completed} to {self._completed - 1}, "
                             f"not to {step}; restore a checkpoint instead")
        h = self.store.lookup(self._prev_progress_key()) if self.versions == 2 else None
        rec = [int(x) for x in self.store.get(h).reshape(-1).tolist()] if h is not None else None
        if rec is None or rec[0] != step:
            raise ValueError(f"the state of step {step} is not kept under {self.prefix!r} (it is with "
                             "crash_consistent=True, for the step before the last); restore a checkpoint instead")
        named = {(rec[i], rec[i + 1]): rec[i + 2] for i in range(1, len(rec), 3)}
        for key in list(self._layout):
            if key in named:
                continue
            if "master" in self._layout[key]:  # the step wrote its first state over the value before
                raise ValueError(f"parameter {key[0]}.{key[1]} got its state and fp32 master in step "
                                 f"{self._completed}, so its value before that step is not kept; restore a "
                                 "checkpoint instead")
        for key in list(self._layout):
            if key not in named:  # first met in the step undone: it has no state before it
                del self._layout[key]
        self._cur = {key: named[key] for key in self._layout}
        self._completed = step
        self._params_from_masters()
        self._put_progress()
        log.info("rewound optimizer state under %r to step %d", self.prefix, step)

    def _settle_versions(self) -> None:
        """After a resume, keep the versions this optimizer keeps, whatever kept the state
        before: a second version is made where there is one alone, and single-version state
        moves to version 0 with the other freed. The progress record is rewritten before
        anything it names is freed."""
        moved, extra = [], []
        for (gi, pi), layout in self._layout.items():
            cur = self._cur[(gi, pi)]
            for name in layout:
                here, other = self._lookup(gi, pi, name, cur), self._lookup(gi, pi, name, 1 - cur)
                if here is None:
                    raise ValueError(f"the progress record under {self.prefix!r} names version {cur} of "
                                     f"{self._key(gi, pi, name, cur)}, which the pool does not hold")
                if self.versions == 2 and other is None:
                    self._handles[self._key(gi, pi, name, 1 - cur)] = self.store.put(
                        self.store.get(here), key=self._key(gi, pi, name, 1 - cur), tier=self.tier, replace=True,
                        durable=self.durable)
                elif self.versions == 1 and cur != 0:
                    self._handles[self._key(gi, pi, name, 0)] = self.store.put(
                        self.store.get(here), key=self._key(gi, pi, name, 0), tier=self.tier, replace=True,
                        durable=self.durable)
                    extra.append(self._key(gi, pi, name, 1))
                    moved.append((gi, pi))
                elif self.versions == 1 and other is not None:
                    extra.append(self._key(gi, pi, name, 1))
        for key in moved:
            self._cur[key] = 0
        if moved:
            self._put_progress()
        for k in extra:
            self._handles.pop(k, None)
            h = self.store.lookup(k)
            if h is not None:
                self.store.free(h)

    # ------------------------------------------------------------------ state dicts
    def _param_state(self, gi: int, pi: int) -> dict[str, Any]:
        """One parameter's current state as the wrapped optimizer keeps it (copies out of
        the pool; sharded state as a DTensor like the parameter; no fp32 master)."""
        st: dict[str, Any] = {}
        p = self.param_groups[gi]["params"][pi]
        for name, tag in self._layout.get((gi, pi), {}).items():
            if name == "master":
                continue
            t = self.store.get(self._lookup(gi, pi, name, self._cur[(gi, pi)]))
            if tag == "dtensor":
                st[name] = _wrap_like(t, p)
            else:
                st[name] = t if tag == "tensor" else _untag(tag, t)
        return st

    def _set_param_state(self, gi: int, pi: int, st: dict[str, Any]) -> None:
        """Put one parameter's state (the wrapped optimizer's form) into the pool as both
        versions, with a fresh fp32 master where one is kept."""
        p = self.param_groups[gi]["params"][pi]
        layout = self._layout[(gi, pi)] = {}
        for name, v in st.items():
            if isinstance(v, torch.Tensor):
                layout[name], v = _local(v)
                # as torch does: floating state follows the dtype of what is updated (the fp32
                # master where there is one, else the parameter), except "step"
                if v.is_floating_point() and name != "step":
                    v = v.to(torch.float32 if self._needs_master(p) else p.dtype)
                t = v
            else:
                layout[name], t = _pytag(v)
            self._put_both(gi, pi, name, t)
        if self._needs_master(p):
            layout["master"] = "tensor"
            self._put_both(gi, pi, "master", p.detach().float())
        self._cur[(gi, pi)] = 0

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's own format: state keyed by integer ids in parameter-group
        order (``torch.distributed.checkpoint.state_dict.get_state_dict`` turns them into
        parameter names); FSDP2 / tensor-parallel state as DTensors sharded like their
        parameters. fp32 masters are not part of it (they are rebuilt from the parameters)."""
        packed: dict[int, dict[str, Any]] = {}
        groups = []
        idx = 0
        for gi, group in enumerate(self.param_groups):
            ids = []
            for pi in range(len(group["params"])):
                if self._layout.get((gi, pi)):
                    packed[idx] = self._param_state(gi, pi)
                ids.append(idx)
                idx += 1
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
        return {"state": packed, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the wrapped optimizer's format, as ``torch.optim.Optimizer.load_state_dict``
        does: saved parameter ids of any kind (integers, or the parameter names
        ``set_state_dict`` passes) are matched to this optimizer's parameters by position
        in their groups; DTensor state (as DCP loads it, resharded to this rank's layout)
        is stored as this rank's local shard."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"state_dict has {len(groups)} parameter groups, the optimizer {len(self.param_groups)}")
        idx_of: dict[Any, tuple[int, int]] = {}
        for gi, (g, saved) in enumerate(zip(self.param_groups, groups)):
            if len(g["params"]) != len(saved["params"]):
                raise ValueError(f"parameter group {gi} has {len(g['params'])} parameters, the state_dict "
                                 f"{len(saved['params'])}")
            for k, v in saved.items():
                if k != "params":
                    g[k] = v
            for pi, i in enumerate(saved["params"]):
                idx_of[i] = (gi, pi)
        placed = []
        for i, st in state_dict["state"].items():
            where = idx_of.get(i)
            if where is None and isinstance(i, str) and i.isdigit():
                where = idx_of.get(int(i))  # integer ids that went through a text format
            if where is None:
                raise ValueError(f"state_dict has state for parameter {i!r}, which none of its parameter "
                                 "groups lists; was it saved from a different model or optimizer?")
            placed.append((where, st))
        self._clear_pool()
        self._layout = {}
        self._cur = {}
        self._completed = 0
        for (gi, pi), st in placed:
            self._set_param_state(gi, pi, st)
        self._put_progress()

    def free(self) -> None:
        """Free every object this optimizer keeps in the pool."""
        self._clear_pool()
        self._layout = {}
        self._cur = {}


def offload_optimizer(optimizer: torch.optim.Optimizer, client: Pool, *, tier: str | None = "nvme",
                      prefix: str = "opt", master_weights: bool | None = None, durable: bool = False,
                      resume: bool = False, update: str = "auto", bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                      crash_consistent: bool | None = None, update_in_backward: bool = False) -> OffloadedOptimizer:
    """Wrap ``optimizer`` so its state lives in the pool (see ``OffloadedOptimizer``).

    ``tier``: where new state goes (``"host"``, ``"nvme"``, or ``None``: the host tier
    while it has room, then NVMe, cached by the eviction policy). ``resume=True``
    finds the state by key (``prefix``) and continues from the last completed step;
    otherwise any old state under ``prefix`` is freed. ``durable=True`` makes the
    state survive a daemon crash too (each check-in is then written through).
    ``update``: where CUDA parameters are updated, ``"gpu"`` (default) or ``"cpu"``.
    ``bucket_bytes``: parameters updated on the CPU whose state is smaller are updated
    together, up to this many bytes of state (16 MiB) at a time: one check-out message,
    one update call and one check-in for them all. ``0``: one parameter at a time.
    ``crash_consistent``: keep two versions of each state tensor, so a process killed
    mid-step resumes from the last completed step (twice the state's bytes in the pool),
    or one, updated in place (the state's bytes once; a resume after a process killed
    mid-step raises ``TornState``). Default: one for ``tier="host"`` unless ``durable``,
    two otherwise. ``update_in_backward``: update each parameter as soon as its gradient
    is final, during backward (``BackwardUpdates``; docs/training.md says what composes).
    """
    return OffloadedOptimizer(optimizer, client, tier=tier, prefix=prefix, master_weights=master_weights,
                              durable=durable, resume=resume, update=update, bucket_bytes=bucket_bytes,
                              crash_consistent=crash_consistent, update_in_backward=update_in_backward)


def offloaded(optimizer_class: type[torch.optim.Optimizer], client: Pool, *, tier: str | None = "nvme",
              prefix: str = "opt", **offload_kw: Any) -> Callable[..., OffloadedOptimizer]:
    """An optimizer *class* stand-in, for APIs that construct the optimizer themselves,
    e.g. ``ZeroRedundancyOptimizer(params, optimizer_class=offloaded(AdamW, client), lr=...)``."""

    def make(params: Iterable[Any], **kwargs: Any) -> OffloadedOptimizer:
        return OffloadedOptimizer(optimizer_class(params, **kwargs), client, tier=tier, prefix=prefix, **offload_kw)

    make.__name__ = f"Offloaded{optimizer_class.__name__}"
    return make
