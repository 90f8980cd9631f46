"""The offloaded optimizer's front: ``OffloadedOptimizer``, a ``torch.optim`` optimizer
whose per-parameter state lives in a tierstore pool, and ``offload_optimizer``.

The front owns the step: which parameters it updates, and its end. The rest is in
components it builds and holds, each in its own module: the state's objects in the
pool (``state.StateTensors``), the progress records, resume and rewind
(``progress.Progress``), buckets (``buckets.Buckets``), the update loop
(``update.Updates``, with the CUDA path in ``gpu.GpuUpdates``), the wrapped
optimizer's state format (``state_dict``) and update in backward
(``backward.BackwardUpdates``). It talks to the pool only through
``tierstore.contract.Pool``.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import weakref
from typing import Any, Callable, Iterable, Iterator

import torch

from tierstore.contract import Pool
from tierstore.errors import InvalidArgument

from ..claims import PrefixMark, claim_prefix

from .backward import BackwardUpdates, refuse_offloaded_parameters
from .buckets import DEFAULT_BUCKET_BYTES, Buckets
from .tiles import ELEMENTWISE
from .progress import Progress
from .state import Item, Key, StateTensors, local
from .state_dict import (Placeholders, PoolState, checked_state, finish_lazy_load, in_rule_format, pack, placed,
                         set_param_state)
from .update import Updates

__all__ = ["OffloadedOptimizer", "offload_optimizer", "offloaded"]

log = logging.getLogger(__name__)


def _alive(ref: "weakref.ref[Any]") -> Any:
    obj = ref()
    if obj is None:
        raise ReferenceError("the offloaded optimizer these belong to was deleted")
    return obj


def _weakly(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` called through a weak reference to its object."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any, **kwargs: Any) -> Any:
        return _alive(ref)(*args, **kwargs)
    return call


class _StepWork:
    """What the step under way has done so far; a completed step starts a new one."""

    __slots__ = ("updated", "fresh")

    def __init__(self) -> None:
        self.updated: set[Key] = set()  # (group, index) updated in this step
        self.fresh: set[Key] = set()  # among them, those whose state this step made


class OffloadedOptimizer(torch.optim.Optimizer):
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
    With ``drop_grads=True`` too, each gradient is set to ``None`` once its update has
    used it, so a step never holds every gradient at once (the process's peak falls by
    about the gradients' bytes); after such a backward the updated parameters have no
    gradient to read.

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
                 crash_consistent: bool | None = None, update_in_backward: bool = False,
                 drop_grads: bool = False) -> None:
        if not isinstance(inner, torch.optim.Optimizer):
            raise TypeError(f"offload_optimizer wraps a torch.optim.Optimizer, got {type(inner).__name__}")
        if isinstance(inner, OffloadedOptimizer):
            raise TypeError("this optimizer is offloaded already (offload_optimizer was given what an earlier "
                            "offload_optimizer returned): wrap the plain torch.optim optimizer, once")
        if tier not in (None, "host", "nvme", "gpu"):
            raise InvalidArgument(f"tier must be one of None, 'host', 'nvme', 'gpu'; got {tier!r}")
        if update not in ("auto", "cpu", "gpu"):
            raise ValueError(f"update must be 'auto', 'cpu' or 'gpu', got {update!r}")
        if update == "gpu" and not all(p.is_cuda for g in inner.param_groups for p in g["params"]):
            raise ValueError("update='gpu' needs every parameter on a CUDA device; use 'cpu' or 'auto'")
        if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or bucket_bytes < 0:
            raise ValueError(f"bucket_bytes must be an int >= 0, got {bucket_bytes!r}")
        if update_in_backward:
            refuse_offloaded_parameters(inner.param_groups)
        if drop_grads and not update_in_backward:
            raise ValueError("drop_grads needs update_in_backward=True (only an update in backward is done "
                             "with a gradient before backward ends)")
        closure = inspect.signature(inner.step).parameters.get("closure")
        if closure is not None and closure.default is inspect.Parameter.empty:
            raise TypeError(f"{type(inner).__name__} needs a closure for every step and keeps one state for all "
                            "parameters; offload_optimizer wraps optimizers whose state is per parameter "
                            "(Adam, AdamW, SGD, Adagrad, RMSprop, ...)")
        self.update = update
        self.bucket_bytes = bucket_bytes
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
        super().__init__(inner.param_groups, inner.defaults)
        self.state_tensors = StateTensors(store, prefix=self.prefix, tier=tier, durable=durable,
                                          versions=self.versions)
        """The state's objects in the pool: layout, current versions, handles."""
        self.progress = Progress(self.state_tensors)
        """Completed steps, the progress records and the torn-step marker."""
        # the parts are handed this optimizer weakly: no reference cycle keeps it alive, so a
        # deleted one goes at once, and its update-in-backward hooks (which hold it weakly) stop
        me = weakref.ref(self)

        def groups() -> list[dict[str, Any]]:
            return _alive(me).param_groups
        on_gpu, needs_master = _weakly(self._on_gpu), _weakly(self._needs_master)
        self.buckets = Buckets(self.state_tensors, on_gpu, bucket_bytes)
        """Which parameters are updated together."""
        self._updates = Updates(inner, groups, self.state_tensors, self.buckets,
                                on_gpu=on_gpu, needs_master=needs_master)
        self.state = PoolState(groups, self.state_tensors,  # type: ignore[assignment]
                               _weakly(self._set_state))  # the pool's, not a dict
        self._in_step = _StepWork()
        self._lazy: Placeholders | None = None  # set inside lazy_state_dict()
        self._taken_over: str | None = None
        """The prefix of a newer offloaded optimizer on this pool that took this one's over."""
        self._mark = PrefixMark(store, self.prefix)
        """This optimizer's mark under its prefix: a newer optimizer on the same prefix in any
        process or connection puts its own there."""
        self._owner_seen = -1  # the completed step count at which the mark was last found ours
        self._load_failed: str | None = None
        """Why a ``load_state_dict`` that failed part-way left the state incomplete (``None``: it
        is whole); until a load succeeds or ``free()``, ``step()`` and ``state_dict()`` raise."""
        claim_prefix(store, self.prefix, self, frees_all=True)
        if resume and self.progress.resume(self.param_groups, self._needs_master):
            self._check_resumed_shapes()
            self.state_tensors.masters_into(self.param_groups)  # parameters come back from their masters
            self._mark_owner()
        else:
            self._clear_pool()
            if initial is not None:
                self.load_state_dict(initial)
        self.drop_grads = drop_grads
        """Whether an update in backward sets its parameters' gradients to ``None``."""
        self.backward = BackwardUpdates(self) if update_in_backward else None
        """The update-in-backward hooks (``None`` without ``update_in_backward``)."""

    def _check_resumed_shapes(self) -> None:
        """``ValueError`` where the state resumed does not fit this model's parameters (a
        model changed between runs, as many parameters but other shapes), before any step
        updates one: an fp32 master of another shape, or (under the elementwise rules,
        whose state tensors are the parameter's shape) a state tensor of as many
        dimensions as its parameter and another shape."""
        states = self.state_tensors
        shapes = {e["key"]: tuple(e["shape"]) for e in self.store.ls(states.prefix + "/")}
        elementwise = type(self.inner) in ELEMENTWISE
        for (gi, pi), layout in states.layout.items():
            if gi >= len(self.param_groups) or pi >= len(self.param_groups[gi]["params"]):
                continue  # (``masters_into`` says so)
            want = tuple(local(self.param_groups[gi]["params"][pi])[1].shape)
            for name, tag in layout.items():
                if tag not in ("tensor", "dtensor") or (name != "master" and not elementwise):
                    continue
                have = shapes.get(states.key(gi, pi, name, states.cur.get((gi, pi), 0)))
                if have is None or (name != "master" and len(have) != len(want)) or have == want:
                    continue
                raise ValueError(
                    f"the optimizer state under {self.prefix!r} (step {self.completed_steps}) holds {name!r} of "
                    f"shape {list(have)} for parameter {gi}.{pi}, whose shape is {list(want)}: the model changed "
                    "since that run; load a checkpoint that fits it (load_state_dict) or start afresh (resume=False)")

    @property
    def completed_steps(self) -> int:
        """Optimizer steps completed (and, after a resume, recovered from the pool)."""
        return self.progress.completed

    @property
    def updated_this_step(self) -> set[Key]:
        """The parameters (group, index) the step under way has updated so far."""
        return self._in_step.updated

    def _on_gpu(self, p: torch.Tensor) -> bool:
        """Does this parameter's update run on its GPU?"""
        return p.is_cuda and self.update != "cpu"

    def _needs_master(self, p: torch.Tensor) -> bool:
        if p.is_cuda and not self._on_gpu(p):
            return True  # the host update needs an fp32 host copy of the parameter
        want = p.dtype in (torch.float16, torch.bfloat16) if self.master_weights is None else bool(self.master_weights)
        if want and local(p)[0] == "dtensor":
            raise ValueError("fp32 master weights of sharded (FSDP2) parameters are not supported; use FSDP2's "
                             "MixedPrecisionPolicy with fp32 parameters instead, or master_weights=False")
        return want

    # ------------------------------------------------------------------ step
    @torch._disable_dynamo  # (``torch.compile(opt.step)`` runs it as it is: its work is the pool's I/O)
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        self._check_owner()
        self._check_loaded()
        if self.backward is not None:
            self.backward.check_not_superseded()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.backward is not None:  # what backward left to do, and a check that it was right to
            self.backward.finish()
        done = self._in_step.updated
        work = [(gi, pi, p) for gi, g in enumerate(self.param_groups) for pi, p in enumerate(g["params"])
                if p.grad is not None and (gi, pi) not in done]
        self.update_now(work)
        self._complete_step(work)
        return loss

    def deferred(self) -> Any:
        """A context: backward inside it leaves the update to ``step()`` (with
        ``update_in_backward``; without, it changes nothing). For every micro-batch of
        gradient accumulation but the last, and for a backward whose gradients are
        clipped or unscaled before ``step()``."""
        return self.backward.deferred() if self.backward is not None else contextlib.nullcontext()

    def _mark_owner(self) -> None:
        """Put this optimizer's mark under its prefix, over any other's."""
        self._mark.put()
        self._owner_seen = -1

    def _check_owner(self, *, again: bool = False) -> None:
        """Raise if a newer optimizer took this one's prefix over: one in this process on the
        same pool (at once), or one anywhere on the same namespace (its mark replaced ours;
        looked up once a step, and ``again`` before a step's progress record is written)."""
        due = again or self._owner_seen != self.completed_steps
        if self._taken_over is None and due:
            if not self._mark.ours():
                self._taken_over = self.prefix
            else:
                self._owner_seen = self.completed_steps
        if self._taken_over is not None:
            raise InvalidArgument(
                f"this offloaded optimizer's state (prefix {self.prefix!r}) was taken over by a newer one on the "
                f"same pool (prefix {self._taken_over!r}: in this process, or in another process or connection "
                "on the same namespace, e.g. a relaunched job); step the newer one, or give each optimizer a "
                "prefix of its own (e.g. prefix='opt_g' and prefix='opt_d')")

    def update_now(self, work: list[Item]) -> None:
        """Update the parameters ``work`` names, in that order, each read from its current
        version, as part of the step under way (``step()``, and update in backward); the
        step's end makes the versions they wrote current."""
        if not work:
            return
        self._check_owner()
        self.progress.begin_updates()
        cur = self.state_tensors.cur
        ver = {(gi, pi): cur.get((gi, pi), 0) for gi, pi, _ in work}
        self._in_step.fresh.update(key for key in ver if not self.state_tensors.layout.get(key))  # state made now
        self._updates.run(work, ver)
        self._in_step.updated.update(ver)

    def _complete_step(self, work: list[Item]) -> None:
        """The step's end: the versions it wrote become current, the progress record says so
        (written last, after every parameter), and the next step's first state is hinted."""
        self._check_owner(again=True)  # a step taken over meanwhile is not recorded as this one's
        self.progress.complete(self._in_step.updated, self._in_step.fresh)
        self._in_step = _StepWork()
        self.store.step()
        # the next step starts where this one did: its first state comes up meanwhile (during the
        # forward pass, and the backward up to the first update when updating in backward)
        first = self.backward.first_items() if self.backward is not None else []
        if not first and work:
            first = work[:self.buckets.end(work, 0)]
        if first:
            self.state_tensors.hint(first, self.state_tensors.cur)

    def rewind_to(self, step: int) -> None:
        """Go back to the state after ``step``, the step before the last completed one (or
        stay, if it is the last): a rank one step ahead of the others of its job after a
        failure (see ``tierstore.client.distributed.agree_on_step``). Needs two versions
        (``crash_consistent=True``): the last step wrote its state beside the previous
        one's, and the previous progress record names those. Parameters with fp32 masters
        come back from them; others are the caller's to restore."""
        self._check_owner(again=True)  # a taken-over optimizer touches nothing under the prefix
        if step == self.progress.completed:
            return
        self.progress.rewind(step)
        self.state_tensors.masters_into(self.param_groups)
        self.progress.write()
        log.info("rewound optimizer state under %r to step %d", self.prefix, step)

    # ------------------------------------------------------------------ state dicts
    def _set_state(self, gi: int, pi: int, st: dict[str, Any]) -> None:
        """One parameter's state (the wrapped optimizer's form) into the pool, and a progress
        record naming it (``optimizer.state[p] = ...``)."""
        p = self.param_groups[gi]["params"][pi]
        set_param_state(self.state_tensors, gi, pi, p, st, master=self._needs_master(p))
        self.progress.write()

    @torch._disable_dynamo
    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's own format: state keyed by integer ids in parameter-group
        order (``torch.distributed.checkpoint.state_dict.get_state_dict`` turns them into
        parameter names); FSDP2 / tensor-parallel state as DTensors sharded like their
        parameters. fp32 masters are not part of it (they are rebuilt from the parameters).
        Hooks registered with ``register_state_dict_pre_hook`` / ``_post_hook`` run as
        torch's own ``state_dict`` runs them."""
        self._check_loaded()
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        state_dict = pack(self.state_tensors, self.param_groups, self._lazy)
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def _check_loaded(self) -> None:
        """Raise while a ``load_state_dict`` that failed part-way has left the state incomplete."""
        if self._load_failed is not None:
            raise InvalidArgument(
                f"this offloaded optimizer's state is incomplete: a load_state_dict failed part-way "
                f"({self._load_failed}); load a state dict again, or call free() to start from no state")

    @contextlib.contextmanager
    def lazy_state_dict(self) -> Iterator[Placeholders]:
        """Inside: ``state_dict()`` (so ``get_state_dict``) gives cheap placeholders for the
        state tensors, which the ``Placeholders`` it yields can fetch from the pool one at a
        time (how ``tierstore.client.dcp`` streams a checkpoint). The placeholders have no
        data: such a state dict goes to ``dcp_save`` / ``dcp_load`` only."""
        self._lazy = Placeholders(self.state_tensors)
        try:
            yield self._lazy
        finally:
            self._lazy = None

    @torch.no_grad()
    def make_state(self) -> None:
        """What ``get_state_dict`` does to an optimizer without state (a zero-gradient step
        with every learning rate 0, so that the state exists to be loaded into), a bucket
        at a time: zero gradients for one bucket's parameters at once instead of all of
        them. Nothing happens when some parameter has state or a gradient, as there."""
        self._check_owner(again=True)  # a taken-over optimizer touches nothing under the prefix
        if len(self.state) or self.completed_steps or \
                any(p.grad is not None for g in self.param_groups for p in g["params"]):
            return  # (a rule without state has none after its steps either: it needs nothing made)
        work = [(gi, pi, p) for gi, g in enumerate(self.param_groups) for pi, p in enumerate(g["params"])
                if p.requires_grad]
        lrs = [g.get("lr") for g in self.param_groups]
        for g in self.param_groups:
            if "lr" in g:
                g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
        try:
            k = 0
            while k < len(work):
                end = self.buckets.first_end(work, k)
                for _, _, p in work[k:end]:
                    p.grad = torch.zeros_like(p)
                try:
                    self.update_now(work[k:end])
                finally:
                    for _, _, p in work[k:end]:
                        p.grad = None
                k = end
            self._complete_step(work)
        finally:
            for g, lr in zip(self.param_groups, lrs):
                if lr is not None:
                    g["lr"] = lr

    def loaded_in_place(self, ph: Placeholders) -> None:
        """A load put every placeholder's tensor into the pool itself (``dcp_load``): take
        over what it filled in place (python scalars, the groups' settings), make fp32
        masters again from the parameters, and start the step count there, as
        ``load_state_dict`` does."""
        self._check_owner(again=True)  # a taken-over optimizer touches nothing under the prefix
        finish_lazy_load(self.state_tensors, self.param_groups, ph, self._needs_master)
        self.progress.completed = 0
        self.progress.write()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the wrapped optimizer's format, as ``torch.optim.Optimizer.load_state_dict``
        does: saved parameter ids of any kind (integers, or the parameter names
        ``set_state_dict`` passes) are matched to this optimizer's parameters by position
        in their groups; DTensor state (as DCP loads it, resharded to this rank's layout)
        is stored as this rank's local shard."""
        self._check_owner(again=True)  # a taken-over optimizer touches nothing under the prefix
        state_dict = dict(state_dict)  # (shallow, as torch's: a pre-hook may change it)
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        # checked whole before anything changes: a state dict refused leaves the optimizer as it was
        found, settings = placed(self.param_groups, state_dict)
        as_saved = [dict(g, **values) for g, values in zip(self.param_groups, settings)]
        found = [(key, checked_state(key, st)) for key, st in in_rule_format(self.inner, as_saved, found)]
        for g, values in zip(self.param_groups, settings):
            g.update(values)
        # the state is replaced in place (each put replaces its key) rather than freed and put
        # again: the progress records go first, so a process that dies meanwhile resumes
        # fresh, as after a clear; objects the new state does not name go last
        states = self.state_tensors
        self.progress.forget()
        self._load_failed = "begun"
        old = {e["key"]: e["handle"] for e in states.store.ls(states.prefix + "/")}
        states.layout, states.cur = {}, {}
        self.progress.completed = 0
        try:
            for (gi, pi), st in found:
                p = self.param_groups[gi]["params"][pi]
                set_param_state(states, gi, pi, p, st, master=self._needs_master(p))
            states.free_others(old, states.keys_in_layout() | {self._mark.key})
            self.progress.write()
        except BaseException as e:
            self._load_failed = f"{type(e).__name__}: {e}"
            raise
        self._load_failed = None
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def free(self) -> None:
        """Free every object this optimizer keeps in the pool."""
        self._check_owner(again=True)  # a taken-over optimizer touches nothing under the prefix
        self._clear_pool()

    def _clear_pool(self) -> None:
        self.state_tensors.free_all()
        self.state_tensors.layout = {}
        self.state_tensors.cur = {}
        self.progress.cleared()
        self._mark_owner()
        self._load_failed = None


def offload_optimizer(optimizer: torch.optim.Optimizer, client: Pool, *, tier: str | None = "nvme",
                      prefix: str = "opt", master_weights: bool | None = None, durable: bool = False,
                      resume: bool = False, update: str = "auto", bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                      crash_consistent: bool | None = None, update_in_backward: bool = False,
                      drop_grads: bool = False) -> OffloadedOptimizer:
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
    ``drop_grads`` (with ``update_in_backward``): set each gradient to ``None`` once its
    update has used it, so the step's peak memory does not hold every gradient.
    """
    return OffloadedOptimizer(optimizer, client, tier=tier, prefix=prefix, master_weights=master_weights,
                              durable=durable, resume=resume, update=update, bucket_bytes=bucket_bytes,
                              crash_consistent=crash_consistent, update_in_backward=update_in_backward,
                              drop_grads=drop_grads)


def offloaded(optimizer_class: type[torch.optim.Optimizer], client: Pool, *, tier: str | None = "nvme",
              prefix: str = "opt", **offload_kw: Any) -> Callable[..., OffloadedOptimizer]:
    """An optimizer *class* stand-in, for APIs that construct the optimizer themselves,
    e.g. ``ZeroRedundancyOptimizer(params, optimizer_class=offloaded(AdamW, client), lr=...)``."""

    def make(params: Iterable[Any], **kwargs: Any) -> OffloadedOptimizer:
        return OffloadedOptimizer(optimizer_class(params, **kwargs), client, tier=tier, prefix=prefix, **offload_kw)

    make.__name__ = f"Offloaded{optimizer_class.__name__}"
    return make
