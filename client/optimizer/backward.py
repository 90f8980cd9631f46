"""Update-in-backward for the offloaded optimizer: each parameter is updated as soon as
its gradient is final, from a post-accumulate-grad hook, while backward still runs, so
the state's reads from the pool and its write-backs overlap the rest of backward instead
of following it.

This module owns the hooks, the parameters waiting to fill a bucket, the order in which
gradients became final (learned each step, for prefetch hints) and the checks that
nothing changed a gradient after its update used it. The update itself
(``OffloadedOptimizer.update_now``), buckets, the state versions and the step's end
belong to the optimizer and its components.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from typing import TYPE_CHECKING, Any, Iterator

import torch

from tierstore.errors import InvalidArgument

from ..claims import BACKWARD_UPDATES, PARAM_OFFLOAD, held_by
from .state import Item as _Item
from .state import local as _local

if TYPE_CHECKING:
    from .offloaded import OffloadedOptimizer

__all__ = ["BackwardUpdates", "refuse_offloaded_parameters"]

log = logging.getLogger(__name__)

_OWNER = BACKWARD_UPDATES
"""A parameter's attribute naming (weakly) the hooks that update it in backward: a new
offloaded optimizer over the same parameters (a resume in the same process) takes them
over, so no parameter is updated twice in one backward."""


def _reduced_after_backward(params: list[torch.Tensor]) -> bool:
    """Could a gradient still change after its post-accumulate-grad hook? Under
    ``torch.distributed`` with plain (not DTensor) parameters, DDP all-reduces gradients
    and writes the averaged ones only at the end of backward (ZeroRedundancyOptimizer
    runs on DDP). FSDP2 calls the hooks of its sharded parameters after the reduce-scatter,
    with the final gradient."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without DTensor: nothing is FSDP2-sharded
        return True
    return any(not isinstance(p, DTensor) for p in params)


def _sample(grad: torch.Tensor) -> torch.Tensor:
    """A few of a gradient's values (a copy). In-place changes bump a tensor's version, but
    not all of them: GradScaler's unscaling kernel leaves it as it is, and scales every
    nonzero value, so a sample shows it where the version does not."""
    if grad.layout != torch.strided:  # (a sparse gradient, nn.Embedding(sparse=True)'s: its values)
        grad = grad._values()
    flat = _local(grad)[1].detach().reshape(-1)  # a DTensor: this rank's shard
    stride = max(1, flat.numel() // 8)
    return flat[::stride][:8].clone()


def refuse_offloaded_parameters(groups: list[dict[str, Any]]) -> None:
    """Raise ``ValueError`` where a parameter of ``groups`` is kept in the pool by
    ``offload_parameters``: an update in backward cannot run on it."""
    if any(held_by(p, PARAM_OFFLOAD) is not None for g in groups for p in g["params"]):
        raise ValueError("update_in_backward=True over parameters that offload_parameters keeps in the pool: "
                         "both hook each parameter's gradient, and the offload releases a parameter's bytes "
                         "when its gradient is in; use update_in_backward=False (the step after "
                         "materialize()), or keep the parameters in memory")


class BackwardUpdates:
    """The update-in-backward hooks of one ``OffloadedOptimizer`` (its ``backward``).

    A parameter's hook fires once its gradient for this backward is final. Small
    parameters wait until a bucket of their group is full (``bucket_bytes``), larger ones
    are updated at once; what still waits when backward ends is updated by a callback
    at its end (and, at the latest, by ``step()``). Before each update the state of the
    parameters whose gradients came next in the previous step gets a prefetch hint, so
    the pool reads it from NVMe while this one updates.

    ``step()`` then updates only what had no update in backward (a gradient set by hand,
    or a backward run in ``deferred()``), completes the step and checks that no gradient
    changed after its update used it (clipping or loss-scale unscaling between backward
    and ``step()`` need every gradient before any update: run those backwards in
    ``deferred()``).
    """

    def __init__(self, opt: OffloadedOptimizer) -> None:
        self._opt = weakref.ref(opt)  # the hooks live on the parameters: they must not keep the optimizer
        params = [p for g in opt.param_groups for p in g["params"]]
        self.enabled = not _reduced_after_backward(params)
        """Whether backward updates parameters (False where a gradient may change after its
        hook: under DDP; ``step()`` then updates them all)."""
        if not self.enabled:
            log.warning("update_in_backward: under torch.distributed with parameters that are not FSDP2 "
                        "shards (DDP, ZeroRedundancyOptimizer), a gradient is final only after the all-reduce "
                        "at the end of backward; the updates stay in step()")
        self._deferred = 0
        self._waiting: dict[int, list[_Item]] = {}  # group -> parameters waiting for their bucket to fill
        # (group, index) -> (gradient, its version, a sample of its values) when its update used it
        self._used: dict[tuple[int, int], tuple[torch.Tensor, int, torch.Tensor]] = {}
        self._seen: list[tuple[int, int]] = []  # this step's order of final gradients
        self._order: list[tuple[int, int]] = []  # the last step's, for prefetch hints
        self._pos: dict[tuple[int, int], int] = {}
        self._queued = False  # the end-of-backward callback is queued for the backward under way
        self._hooks: list[Any] = []
        self.superseded = False
        """Whether a newer optimizer over the same parameters took these hooks over."""
        refuse_offloaded_parameters(opt.param_groups)
        if self.enabled:
            for gi, g in enumerate(opt.param_groups):
                for pi, p in enumerate(g["params"]):
                    if not p.requires_grad:
                        continue
                    owner = getattr(p, _OWNER, None)
                    old = owner() if owner is not None else None
                    if old is not None and old is not self and old._hooks:
                        log.info("update_in_backward: a new optimizer takes over parameters another one updated")
                        old.remove()
                        old.superseded = True
                    setattr(p, _OWNER, weakref.ref(self))
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._hook(gi, pi)))
            weakref.finalize(opt, self.remove)  # a deleted optimizer's hooks come off with it

    # ------------------------------------------------------------------ public
    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Backward inside this block leaves the update to ``step()``: for every
        micro-batch of gradient accumulation but the last, and for a backward whose
        gradients are clipped or unscaled (``GradScaler``) before ``step()``."""
        self._deferred += 1
        try:
            yield
        finally:
            self._deferred -= 1

    @property
    def active(self) -> bool:
        """Whether the hooks are on and their optimizer alive."""
        return bool(self._hooks) and self._opt() is not None

    def check_not_superseded(self) -> None:
        """Raise where a newer update-in-backward optimizer over these parameters took the
        hooks: the two would update each parameter twice, in an order plain training never has."""
        if self.superseded:
            raise InvalidArgument(
                "a newer offloaded optimizer with update_in_backward=True took over this one's parameters (their "
                "gradients now update that one in backward): step the newer optimizer; two optimizers over the "
                "same parameters cannot both update in backward")

    def remove(self) -> None:
        """Take the hooks off the parameters (``step()`` then updates every parameter)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.enabled = False

    def finish(self) -> None:
        """From ``step()``: update what still waits, check that the gradients used in backward
        are the ones ``step()`` sees, and keep this step's order for the next one's hints."""
        self._update_waiting()
        self._queued = False  # a backward that raised may have left its end-of-backward callback unrun
        changed = [key for key, (g, version, sample) in self._used.items() if self._grad_of(key) is not g
                   or g._version != version or not torch.equal(_sample(g), sample)]
        self._used = {}
        if self._seen:
            self._order = self._seen
            self._pos = {key: i for i, key in enumerate(self._order)}
        self._seen = []
        if changed:
            gi, pi = changed[0]
            more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
            raise RuntimeError(
                f"the gradient of parameter {gi}.{pi}{more} changed after backward used it "
                "to update the parameter (update_in_backward): clipping (clip_grad_norm_) and GradScaler's "
                "unscaling need every gradient before any update; run such a backward in `with opt.deferred():` "
                "or use update_in_backward=False")

    def first_items(self) -> list[_Item]:
        """The parameters whose gradients came first in the last step, about one bucket's
        worth: the next step's first updates, hinted at the end of a step."""
        return self._following(-1)

    # ------------------------------------------------------------------ hooks
    def _hook(self, gi: int, pi: int) -> Any:
        def on_final_grad(p: torch.Tensor) -> None:
            self._on_grad(gi, pi, p)

        return on_final_grad

    @torch.no_grad()
    def _on_grad(self, gi: int, pi: int, p: torch.Tensor) -> None:
        opt = self._opt()
        if opt is None or self._deferred or p.grad is None:
            return
        key = (gi, pi)
        if key in opt.updated_this_step or any((g, i) == key for g, i, _ in self._waiting.get(gi, ())):
            raise RuntimeError(
                f"parameter {gi}.{pi} got a gradient again after its update in backward, before step(): with "
                "update_in_backward, run every micro-batch of gradient accumulation but the last in "
                "`with opt.deferred():`, and call step() after each backward that updates (a step that "
                "GradScaler skipped has already updated in backward: scale in `opt.deferred()` too); a backward "
                "meant for another optimizer that reaches these parameters (a GAN's generator loss through the "
                "discriminator) also goes in `opt.deferred()`, and so does a reentrant checkpoint "
                "(use_reentrant=True) whose parameters are also used outside it (or use use_reentrant=False)")
        self._seen.append(key)
        if not self._queued:
            # what still waits for its bucket when backward ends is updated then, not in step()
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._queued = True
        waiting = self._waiting.setdefault(gi, [])
        waiting.append((gi, pi, p))
        while waiting:
            end = opt.buckets.end(waiting, 0)
            if end == len(waiting) and opt.buckets.bucketable(*waiting[0]):
                return  # the bucket may take more
            self._update(opt, waiting[:end])
            del waiting[:end]

    def _end_of_backward(self) -> None:
        self._queued = False
        with torch.no_grad():
            self._update_waiting()

    def _update_waiting(self) -> None:
        opt = self._opt()
        for gi in list(self._waiting):
            items = self._waiting.pop(gi)
            while items and opt is not None:
                end = opt.buckets.end(items, 0)
                self._update(opt, items[:end])
                del items[:end]

    def _update(self, opt: OffloadedOptimizer, items: list[_Item]) -> None:
        """Update ``items`` (one bucket, or one parameter) now; first hint the state of the
        parameters whose gradients came next in the last step."""
        nxt = self._following(self._pos.get((items[-1][0], items[-1][1]), -2))
        if nxt:
            opt.state_tensors.hint(nxt, opt.state_tensors.cur)
        opt.update_now(items)
        for gi, pi, p in items:
            if opt.drop_grads:
                p.grad = None  # used: nothing can change it after its update now
            else:
                self._used[(gi, pi)] = (p.grad, p.grad._version, _sample(p.grad))

    def _following(self, pos: int) -> list[_Item]:
        """Parameters after position ``pos`` of the last step's order, not updated yet in
        this one, up to one bucket's state bytes (at least one)."""
        opt = self._opt()
        if opt is None or pos < -1:
            return []
        out: list[_Item] = []
        total = 0
        for gi, pi in self._order[pos + 1:]:
            if (gi, pi) in opt.updated_this_step:
                continue
            p = opt.param_groups[gi]["params"][pi]
            total += opt.buckets.state_bytes(gi, pi, p)
            if out and total > max(opt.buckets.limit, 1):
                break
            out.append((gi, pi, p))
        return out

    def _grad_of(self, key: tuple[int, int]) -> Any:
        opt = self._opt()
        return None if opt is None else opt.param_groups[key[0]]["params"][key[1]].grad
