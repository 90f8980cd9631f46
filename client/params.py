"""Parameter offload: module hooks that keep a model's parameters in a tierstore pool
and bring each submodule's in just before its forward and backward (the next one's
prefetched), releasing them after. Knows nothing of optimizers.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings
import weakref
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

from tierstore.contract import Pool
from tierstore.errors import InvalidArgument, NotFound, StaleHandle

from .claims import BACKWARD_UPDATES, PARAM_OFFLOAD, PrefixMark, claim_prefix, held_by

__all__ = ["offload_parameters"]

log = logging.getLogger(__name__)

_PARAM_STREAM = "params"


def _quiet_output_only_backward_hooks() -> None:
    """The first module of a model (an embedding, a layer fed the raw batch) has no input
    that requires grad, so torch warns on every backward that its full backward hook
    fires on the outputs' gradients instead: for these hooks, which only release the
    module's parameters, that is expected. The filter matches that message alone (it is
    process-wide: warnings filters cannot be scoped to one module's hooks)."""
    warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed with "
                            "respect to module outputs since no inputs require gradients", category=UserWarning)


class _ParamOffload:
    """Module hooks that keep parameters in the pool and materialise them per submodule."""

    def __init__(self, model: torch.nn.Module, store: Pool, tier: str | None, prefix: str) -> None:
        self.model = model
        self.store = store
        self.prefix = prefix.rstrip("/")
        self.handles: list[Any] = []
        self.keys: dict[int, str] = {}  # id(param) -> key
        self.params: dict[int, torch.nn.Parameter] = {}
        self.shapes: dict[int, tuple[torch.Size, torch.dtype, torch.device]] = {}
        self.live: dict[int, int] = {}  # id(param) -> how many running modules need it
        self.staged: dict[int, tuple[torch.Tensor, Any, Any]] = {}  # id(param) -> (device buffer, event, lease)
        self.objects: dict[int, Any] = {}  # id(param) -> its object's handle (set by every put)
        self.loaded_as: dict[int, tuple[int, int]] = {}  # id(param) -> (version, data_ptr) when fetched
        self.streams: Any = None
        self._taken_over: str | None = None  # set by a newer offload on the same pool and prefix
        for name, p in model.named_parameters(remove_duplicate=True):
            if held_by(p, PARAM_OFFLOAD) is not None:
                raise ValueError(f"parameter {name!r} is kept in the pool already (offload_parameters was called "
                                 "on this model, or one sharing its parameters); undo() that one first")
            if held_by(p, BACKWARD_UPDATES) is not None:
                raise ValueError(f"parameter {name!r} is updated in backward by an offloaded optimizer "
                                 "(update_in_backward=True): both hook each parameter's gradient, and the offload "
                                 "releases a parameter's bytes when its gradient is in; make that optimizer with "
                                 "update_in_backward=False")
        claim_prefix(store, self.prefix, self, frees_all=False)
        # a mark under the prefix: a newer offload on it in another process or connection puts its own
        self._mark = PrefixMark(store, self.prefix)
        self._mark.put()
        for name, p in model.named_parameters(remove_duplicate=True):  # tied parameters are stored once
            key = f"{self.prefix}/{name}"
            self.objects[id(p)] = store.put(p.detach(), key=key, tier=tier, replace=True)
            self.keys[id(p)] = key
            self.params[id(p)] = p
            self.shapes[id(p)] = (p.shape, p.dtype, p.device)
            p.data = self._empty(p)  # the pool holds the bytes now
            setattr(p, PARAM_OFFLOAD, weakref.ref(self))
        self.modules = [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]
        self.next_of: dict[int, torch.nn.Module] = {}
        self.prev_of: dict[int, torch.nn.Module] = {}
        _quiet_output_only_backward_hooks()
        for m in self.modules:
            self.handles.append(m.register_forward_pre_hook(self._pre))
            self.handles.append(m.register_forward_hook(self._post))
            self.handles.append(m.register_full_backward_pre_hook(self._bwd_pre))
            self.handles.append(m.register_full_backward_hook(self._bwd_post))
        for a, b in zip(self.modules, self.modules[1:]):
            self.next_of[id(a)] = b
            self.prev_of[id(b)] = a  # backward runs the modules in reverse
        for p in self.params.values():
            if p.requires_grad:
                self.handles.append(p.register_post_accumulate_grad_hook(self._after_grad))
        # the model's state_dict() and load_state_dict() see (and set) the parameters' values
        self.handles.append(model.register_state_dict_pre_hook(lambda *a: self.materialize()))
        self.handles.append(model.register_load_state_dict_pre_hook(lambda *a: self.materialize()))
        # a parameter used outside its own module's forward (``h @ self.emb.weight.T`` in a
        # parent, or only its shape asked for) is loaded on demand: a torch-function mode is
        # active while any of the model's modules runs forward, also when backward re-runs a
        # checkpointed region, so code never sees an unloaded parameter's bytes or shape
        self.demanded: dict[int, bool] = {}  # loaded on demand, not yet released -> under autograd?
        self.internal = 0  # > 0 while this class itself touches parameters: the mode looks away
        self._mode = _OnDemand(self)
        self._tls = threading.local()  # per thread: how deep in module forwards (modes are per thread)
        for m in model.modules():
            self.handles.append(m.register_forward_pre_hook(self._enter, prepend=True))
            self.handles.append(m.register_forward_hook(self._exit, always_call=True))

    def _enter(self, m, args):
        depth = getattr(self._tls, "depth", 0)
        if depth == 0:
            self._mode.__enter__()
        self._tls.depth = depth + 1

    def _exit(self, m, args, out=None):
        self._tls.depth -= 1
        if self._tls.depth:
            return
        self._mode.__exit__(None, None, None)
        if not torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
            with self._quiet():  # a forward without autograd: nothing it loaded is needed after it
                self._release_demanded()

    def demand(self, p: torch.Tensor) -> None:
        """Load ``p`` for a use no module hook announced; it stays until its gradient is
        accumulated (trainable) or the next ``writeback()`` / no-grad forward end (frozen)."""
        if self.live.get(id(p), 0) == 0 and p.numel() == 0 and self.shapes[id(p)][0].numel():
            self._bring_in(p)
            self.live[id(p)] = 1
            self.demanded[id(p)] = torch.is_grad_enabled()

    def _release_demanded(self) -> None:
        """Release what was loaded on demand without autograd (what a forward with autograd
        loaded may still be read by its backward: that goes with its gradient or at writeback)."""
        for pid in [pid for pid, grad in self.demanded.items() if not grad]:
            del self.demanded[pid]
            self.live[pid] = 0
            self._drop(self.params[pid])

    def _own(self, m: torch.nn.Module) -> list[torch.nn.Parameter]:
        return [p for p in m.parameters(recurse=False) if id(p) in self.keys]

    def _bring_in(self, p: torch.Tensor) -> None:
        """Give ``p`` its bytes from the pool, unless it still holds them (``materialize()``
        loaded it and no ``writeback()`` has released it yet: those bytes may hold an update)."""
        if p.numel() == 0:
            want = (p.dtype, p.device)  # the placeholder's: model.to(...) moves it too
            buf = self._fetch(p)
            shape, dtype, device = self.shapes[id(p)]
            if (dtype, device) != want:  # the model was cast or moved since: the stored bytes follow it
                buf = buf.to(device=want[1], dtype=want[0])
                self.shapes[id(p)] = (shape, want[0], want[1])
            p.data = buf
            self.loaded_as[id(p)] = (p._version, p.data_ptr()) if (dtype, device) == want else (-1, -1)
        else:
            self._unstage(p)

    def _changed(self, p: torch.Tensor) -> bool:
        """Whether ``p`` changed since its bytes came from the pool (in place, or new ``.data``)."""
        return self.loaded_as.get(id(p)) != (p._version, p.data_ptr())

    def _drop(self, p: torch.Tensor) -> None:
        """Release ``p``'s bytes; first store them if they changed since they came in (an
        optimizer step after ``materialize()`` whose ``writeback()`` a forward came before)."""
        if p.numel() and self.shapes[id(p)][0].numel() and self._changed(p):
            self._check_owner()
            self.objects[id(p)] = self.store.put(p.detach(), key=self.keys[id(p)], replace=True)
            self.shapes[id(p)] = (self.shapes[id(p)][0], p.dtype, p.device)
        self.loaded_as.pop(id(p), None)
        p.data = self._empty(p)

    def _unstage(self, p: torch.Tensor) -> None:
        """Drop ``p``'s staged copy, if any (the pool's bytes, perhaps older than p's own)."""
        staged = self.staged.pop(id(p), None)
        if staged is not None:
            staged[1].synchronize()
            staged[2].release()

    def _empty(self, p: torch.Tensor) -> torch.Tensor:
        return torch.empty(0, dtype=p.dtype, device=self.shapes[id(p)][2] if id(p) in self.shapes else p.device)

    def _check_owner(self, *, in_pool: bool = False) -> None:
        """Raise if a newer offload took the prefix over: in this process (at once), or
        anywhere on the namespace (``in_pool``: its mark replaced ours; looked up by
        ``materialize()`` and ``writeback()``, once a step)."""
        if in_pool and self._taken_over is None and not self._mark.ours():
            self._taken_over = self.prefix
        if self._taken_over is not None:
            raise InvalidArgument(
                f"the parameters this offload kept under prefix {self.prefix!r} were taken over by a newer "
                f"offload_parameters (or offloaded optimizer) on the same pool (prefix {self._taken_over!r}: in "
                "this process, or in another process or connection on the namespace); give each model a prefix "
                "of its own (prefix=...)")

    def _fetch(self, p: torch.Tensor) -> torch.Tensor:
        """The parameter's bytes from the pool, on its device (a staged copy when there is one)."""
        self._check_owner()
        shape, dtype, device = self.shapes[id(p)]
        staged = self.staged.pop(id(p), None)
        if staged is not None:
            buf, ev, lease = staged
            cur = torch.cuda.current_stream(device)
            cur.wait_event(ev)
            buf.record_stream(cur)
            ev.synchronize()  # issued during the previous module: normally long done
            lease.release()
            return buf
        buf = torch.empty(shape, dtype=dtype, device=device)
        self._by_handle(p, lambda h: self.store.get(h, out=buf, stream=_PARAM_STREAM))
        return buf

    def _by_handle(self, p: torch.Tensor, fn: Callable[[Any], Any]) -> Any:
        """``fn(handle of p)``, looking the key up again if the cached handle went stale."""
        h = self.objects.get(id(p))
        if h is not None:
            try:
                return fn(h)
            except (NotFound, StaleHandle):
                pass  # re-bound behind our back
        h = self.objects[id(p)] = self.store.lookup(self.keys[id(p)])
        if h is None:
            raise RuntimeError(f"parameter {self.keys[id(p)]} is missing from the pool; was it freed?")
        return fn(h)

    def _stage(self, m: torch.nn.Module) -> None:
        """Start the host-to-device copies of ``m``'s CUDA parameters on a side stream, so
        they overlap the current module's compute; others get a prefetch hint."""
        hints = []
        for p in self._own(m):
            if self.live.get(id(p), 0) or id(p) in self.staged or p.numel():  # loaded, staged, or materialised
                continue
            shape, dtype, device = self.shapes[id(p)]
            if device.type != "cuda":
                h = self.objects.get(id(p))
                if h is not None:
                    hints.append(h)
                continue
            if self.streams is None:
                from .gpu import SideStreams

                self.streams = SideStreams()
            side = self.streams.stream(device, "in")
            lease = self._by_handle(p, lambda h: self.store.checkout(h, "r", stream=_PARAM_STREAM))
            with torch.cuda.stream(side):
                buf = torch.empty(shape, dtype=dtype, device=device)
                buf.copy_(lease.tensor.reshape(shape), non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(side)
            self.staged[id(p)] = (buf, ev, lease)
        self._hint(hints)

    def _hint(self, hints: list[Any]) -> None:
        if hints:
            try:
                self.store.prefetch(hints, wait=False)  # a hint: not waited for
            except (NotFound, StaleHandle):  # a hint only: a re-bound key is found at its next fetch
                log.debug("prefetch hint named a re-bound parameter; skipped")

    def _drop_staged(self) -> None:
        for p in [self.params[pid] for pid in self.staged]:
            self._unstage(p)

    def _load(self, m: torch.nn.Module, order: dict[int, torch.nn.Module]) -> None:
        """Materialise ``m``'s parameters; stage the module that runs next in ``order``."""
        for p in self._own(m):
            n = self.live.get(id(p), 0)
            if n == 0:
                self._bring_in(p)
            self.live[id(p)] = n + 1
        nxt = order.get(id(m))
        if nxt is not None:  # bring the next module's parameters up while this one computes
            self._stage(nxt)
            after = order.get(id(nxt))
            if after is not None and any(self.shapes[id(p)][2].type == "cuda" for p in self._own(after)):
                # NVMe -> host in the pool meanwhile
                self._hint([self.objects[id(p)] for p in self._own(after) if id(p) in self.objects])

    def _unload(self, m: torch.nn.Module) -> None:
        for p in self._own(m):
            n = self.live.get(id(p), 0) - 1
            self.live[id(p)] = max(n, 0)
            if n <= 0:
                self._drop(p)

    @contextlib.contextmanager
    def _quiet(self):
        """This class's own touching of parameters: not a use for the on-demand mode."""
        self.internal += 1
        try:
            yield
        finally:
            self.internal -= 1

    def _pre(self, m, args):
        with self._quiet():
            self._load(m, self.next_of)

    def _post(self, m, args, out):
        # autograd saved the Parameter objects themselves (leaves), not their bytes:
        # backward re-loads them in _bwd_pre before the module's backward runs
        if torch._C._current_graph_task_id() != -1 and any(
                isinstance(t, torch.Tensor) and t.requires_grad for t in torch.utils._pytree.tree_leaves(out)):
            # a forward re-run inside backward (activation checkpointing) whose backward
            # follows: that reads these bytes, perhaps before _bwd_pre; they go when the
            # gradient is in (trainable) or after the module's backward (frozen)
            return
        with self._quiet():
            self._unload(m)

    def _bwd_pre(self, m, grad_output):
        self._load(m, self.prev_of)

    def _bwd_post(self, m, grad_input, grad_output):
        # frozen parameters can go now; trainable ones once their gradient is accumulated
        self._unload_frozen(m)

    def _unload_frozen(self, m: torch.nn.Module) -> None:
        for p in self._own(m):
            if not p.requires_grad:
                self.live[id(p)] = 0
                self._drop(p)

    def _after_grad(self, p: torch.Tensor) -> None:
        # the engine accumulates a leaf's gradient once, after every use of it in this
        # backward pass: no backward computation needs its bytes after this point
        self.live[id(p)] = 0
        self.demanded.pop(id(p), None)
        self._drop(p)

    def materialize(self) -> None:
        """Load every parameter (for an optimizer step or a checkpoint)."""
        self._check_owner(in_pool=True)
        for m in self.modules:
            for p in self._own(m):
                if self.live.get(id(p), 0) == 0 and p.numel() == 0:
                    self._bring_in(p)
                    # an optimizer step comes next, and one that writes through ``p.data`` leaves
                    # ``p._version`` as it was: what materialize() loaded is stored when it goes
                    self.loaded_as[id(p)] = (-1, -1)
        self._drop_staged()

    def writeback(self) -> None:
        """Store the (updated) materialised parameters and release their memory."""
        self._check_owner(in_pool=True)
        self._drop_staged()  # staged copies hold the old values
        self.demanded.clear()
        for pid, p in self.params.items():
            if p.numel():
                self.objects[pid] = self.store.put(p.detach(), key=self.keys[pid], replace=True)
                self.shapes[pid] = (self.shapes[pid][0], p.dtype, p.device)
                self.loaded_as.pop(pid, None)
                p.data = self._empty(p)
            self.live[pid] = 0  # between steps nothing runs: whatever a pass left loaded goes too

    def undo(self) -> None:
        """Remove the hooks and give every parameter its bytes back."""
        for h in self.handles:
            h.remove()
        self.handles = []
        self.materialize()
        for p in self.params.values():
            if held_by(p, PARAM_OFFLOAD) is self:
                delattr(p, PARAM_OFFLOAD)


class _OnDemand(TorchFunctionMode):
    """While the model's forward runs: any torch function given one of its offloaded
    parameters while that is not loaded loads it first."""

    def __init__(self, po: _ParamOffload) -> None:
        super().__init__()
        self.po = po

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.po.internal:
            return func(*args, **kwargs)
        params = self.po.params
        for a in (*args, *kwargs.values()):
            if isinstance(a, torch.nn.Parameter):
                if id(a) in params and a.numel() == 0:
                    self.po.demand(a)
            elif isinstance(a, (list, tuple)):
                for b in a:
                    if isinstance(b, torch.nn.Parameter) and id(b) in params and b.numel() == 0:
                        self.po.demand(b)
        return func(*args, **kwargs)


def offload_parameters(model: torch.nn.Module, client: Pool, *, tier: str | None = "host",
                       prefix: str = "params") -> Callable[[], None]:
    """Keep ``model``'s parameters in the pool; each submodule's are brought in just
    before its forward and backward, released after, and the next submodule's are
    prefetched. Returns ``undo()``, which restores ordinary parameters.

    Between steps, call ``undo.materialize()`` before an optimizer step that needs
    the values and ``undo.writeback()`` after it.

    A model sharded by FSDP2 (``fully_shard``, also over a tensor-parallel mesh
    dimension) keeps each rank's local shards in the pool instead, brought in for
    FSDP2's all-gathers, an optimizer step over them, ``state_dict`` and
    ``load_state_dict`` (``params_fsdp.ShardOffload``); every parameter must then be
    managed by ``fully_shard``. ``materialize`` / ``writeback`` work the same there.
    """
    from .params_fsdp import ShardOffload, fsdp_param_groups

    managed = {id(fp.sharded_param) for g in fsdp_param_groups(model) for fp in g.fsdp_params}
    po: _ParamOffload | ShardOffload
    if managed or any(type(p).__name__ == "DTensor" for p in model.parameters()):
        loose = next((n for n, p in model.named_parameters() if id(p) not in managed), None)
        if loose is not None:
            raise ValueError(f"offload_parameters of an FSDP2 / tensor-parallel model needs every parameter "
                             f"managed by fully_shard; {loose!r} is not (fully_shard the root module too)")
        po = ShardOffload(model, client, tier, prefix)
    else:
        po = _ParamOffload(model, client, tier, prefix)
    ref = weakref.ref(po)

    def undo() -> None:
        obj = ref()
        if obj is not None:
            obj.undo()
    undo.materialize = po.materialize  # type: ignore[attr-defined]
    undo.writeback = po.writeback  # type: ignore[attr-defined]
    undo._offload = po  # type: ignore[attr-defined]  # keeps the hooks' owner alive
    return undo
