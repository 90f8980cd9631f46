"""Parameter offload under FSDP2 (``fully_shard``, alone or over a tensor-parallel mesh
dimension): each rank's local shard of every parameter lives in the pool, and its
memory is given back between uses.

FSDP2 keeps each parameter as a sharded DTensor: the rank's local shard
(``_local_tensor``) is a view of one padded flat buffer (``_sharded_param_data``), and a
module's parameters are all-gathered from those buffers into separate unsharded
buffers just before its forward and backward (``FSDPParamGroup.unshard`` /
``wait_for_unshard``), freed after. The shard is read only by that all-gather (and by
an optimizer step, a state dict, a load). So this offload works at FSDP2's own seam,
as ``CPUOffloadPolicy`` does when it keeps shards on the host and copies them to the
device for the all-gather: for each parameter group it

- brings the group's shards back from the pool (a new padded buffer, the shard's bytes
  read into its start, padding zeroed; both attributes set to it, as FSDP2's own
  ``reset_sharded_param`` does) when ``unshard`` is called,
  whether by the pre-forward or pre-backward hook, an implicit or explicit prefetch,
  or a user's ``module.unshard()``;
- gives the memory back once ``wait_for_unshard`` has copied the shards into the
  all-gather (the attributes become placeholders of the same shape over a storage
  resized to 0 bytes, as FSDP2 frees its unsharded buffers); a shard changed in place
  since it came in (the version counter of the parameter or of its local shard moved:
  an optimizer step, a load) is put into the pool first;
- also brings every shard in before an optimizer step over them (a global optimizer
  step pre-hook), ``model.state_dict()`` and ``model.load_state_dict()`` (module
  pre-hooks), and FSDP2's lazy initialisation (which re-pads shards).

The parameter objects and their DTensor metadata stay those FSDP2 made; only the
tensors under them come and go. It relies on the attributes of torch 2.13's FSDP2
named above and checks for them at start (``_check``).
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from tierstore.contract import Pool
from tierstore.errors import NotFound, StaleHandle

__all__ = ["ShardOffload", "fsdp_param_groups"]

log = logging.getLogger(__name__)

_PARAM_STREAM = "params"


def fsdp_param_groups(model: torch.nn.Module) -> list[Any]:
    """FSDP2's parameter groups of ``model`` and its submodules, in module order."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state
    except ImportError:  # torch without distributed, or an FSDP2 laid out differently
        return []
    groups: list[Any] = []
    seen: set[int] = set()
    for m in model.modules():
        state = _get_module_fsdp_state(m)
        if state is None:
            continue
        for g in getattr(state, "_fsdp_param_groups", ()):
            if id(g) not in seen:
                seen.add(id(g))
                groups.append(g)
    return groups


def _weak(method: Any) -> Any:
    """A hook calling ``method`` while its object lives (a global hook must not keep it)."""
    ref = weakref.WeakMethod(method)

    def hook(*args: Any) -> None:
        m = ref()
        if m is not None:
            m(*args)
    return hook


class _Shard:
    """One parameter's local shard: its FSDP2 record, key, handle and residence."""

    __slots__ = ("fp", "key", "handle", "resident", "version")

    def __init__(self, fp: Any, key: str) -> None:
        self.fp = fp
        self.key = key
        self.handle: Any = None
        self.resident = True
        self.version: tuple[int, int] = (-1, -1)  # changes() when it came in (or was put)

    @property
    def local(self) -> torch.Tensor:
        return self.fp.sharded_param._local_tensor

    @property
    def flat(self) -> torch.Tensor:
        return self.fp._sharded_param_data

    def changes(self) -> tuple[int, int]:
        """The version counters of the parameter and of its local shard: an in-place change
        of the DTensor (an optimizer step, ``copy_`` by a load) moves the first, one made
        to the local tensor directly the second."""
        return self.fp.sharded_param._version, self.fp.sharded_param._local_tensor._version


def _check(fp: Any, name: str) -> None:
    """Refuse an FSDP2 parameter this offload cannot free and restore safely."""
    for attr in ("sharded_param", "_sharded_param_data"):
        if not hasattr(fp, attr):
            raise ValueError(f"offload_parameters: this torch's FSDP2 keeps parameter {name!r} differently "
                             f"(no FSDPParam.{attr}); use offload_optimizer alone")
    local, flat = fp.sharded_param._local_tensor, fp._sharded_param_data
    if type(local) is not torch.Tensor or type(flat) is not torch.Tensor:
        raise ValueError(f"offload_parameters: parameter {name!r} has a tensor subclass as its local shard "
                         f"({type(local).__name__}); such shards are not offloaded")
    if local.numel() and (local.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()
                          or local.storage_offset() != flat.storage_offset() or not local.is_contiguous()):
        raise ValueError(f"offload_parameters: the local shard of {name!r} is not the start of FSDP2's padded "
                         "buffer (a custom shard placement?); such parameters are not offloaded")


class ShardOffload:
    """Keeps the local shards of an FSDP2 model's parameters in the pool (see the module
    docstring); ``materialize``, ``writeback`` and ``undo`` as ``offload_parameters``'s."""

    def __init__(self, model: torch.nn.Module, store: Pool, tier: str | None, prefix: str) -> None:
        self.store = store
        self.tier = tier
        self.prefix = prefix.rstrip("/")
        names = {id(p): n for n, p in model.named_parameters(remove_duplicate=True)}
        self.groups = fsdp_param_groups(model)
        self.shards: dict[int, list[_Shard]] = {}  # id(group) -> its shards
        self.by_param: dict[int, _Shard] = {}  # id(sharded parameter) -> its shard
        for g in self.groups:
            mine = []
            for fp in g.fsdp_params:
                name = names.get(id(fp.sharded_param), getattr(fp, "_param_fqn", None) or f"{id(fp):x}")
                _check(fp, name)
                s = _Shard(fp, f"{self.prefix}/{name}")
                mine.append(s)
                self.by_param[id(fp.sharded_param)] = s
            self.shards[id(g)] = mine
        self.next_of: dict[int, Any] = {}  # id(group) -> the group restored after it last time
        self._last: Any = None
        for g in self.groups:
            self._release(g)  # into the pool: every shard is put, its memory given back
        self._originals: list[tuple[Any, str]] = []
        for g in self.groups:
            self._wrap(g)
        self.handles = [
            register_optimizer_step_pre_hook(_weak(self._before_step)),
            model.register_state_dict_pre_hook(lambda *a: self.materialize()),
            model.register_load_state_dict_pre_hook(lambda *a: self.materialize()),
        ]

    # ------------------------------------------------------------------ FSDP2's seam
    def _wrap(self, g: Any) -> None:
        """Shadow the group's ``unshard``, ``wait_for_unshard`` and ``lazy_init`` with
        versions that bring its shards in first and (the last two) release them after."""
        unshard, wait, lazy = g.unshard, g.wait_for_unshard, g.lazy_init

        def unshard_in(async_op: bool = False) -> Any:
            self._restore(g)
            return unshard(async_op)

        def wait_then_release() -> Any:
            if getattr(g, "_all_gather_result", None) is not None:
                self._restore(g)  # on one rank of the shard group the copy is made here
            try:
                return wait()
            finally:
                self._release(g)

        def lazy_in() -> Any:
            self._restore(g)  # lazy init re-pads shards: it must see their bytes
            try:
                return lazy()
            finally:
                self._release(g)

        for attr, fn in (("unshard", unshard_in), ("wait_for_unshard", wait_then_release), ("lazy_init", lazy_in)):
            self._originals.append((g, attr))
            setattr(g, attr, fn)

    def _before_step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Global optimizer step pre-hook: an optimizer over our parameters gets them in."""
        for group in opt.param_groups:
            for p in group["params"]:
                s = self.by_param.get(id(p))
                if s is not None and not s.resident:
                    self._restore_one(s)

    # ------------------------------------------------------------------ moves
    def _restore(self, g: Any) -> None:
        shards = self.shards.get(id(g), ())
        if all(s.resident for s in shards):
            return
        for s in shards:
            if not s.resident:
                self._restore_one(s)
        if self._last is not None and self._last is not g:
            self.next_of[id(self._last)] = g
        self._last = g
        nxt = self.next_of.get(id(g))
        if nxt is not None:  # the group that came next last time: NVMe -> host in the pool meanwhile
            self._hint([s.handle for s in self.shards[id(nxt)] if s.handle is not None and not s.resident])

    def _restore_one(self, s: _Shard) -> None:
        """The shard's bytes into a new padded buffer, which becomes FSDP2's (the placeholder
        goes): as ``reset_sharded_param`` does, both attributes are set, the local shard a
        view at the buffer's start."""
        flat, local = s.flat, s.local
        new = torch.empty(flat.shape, dtype=flat.dtype, device=flat.device)
        new_local = new[:local.numel()].view(local.shape)
        if local.numel():
            self._by_handle(s, lambda h: self.store.get(h, out=new_local, stream=_PARAM_STREAM))
        if new.numel() > local.numel():
            new[local.numel():].zero_()  # FSDP2's padding, zero as it made it
        self._set(s, new, new_local)
        s.resident = True
        s.version = s.changes()

    def _release(self, g: Any) -> None:
        for s in self.shards.get(id(g), ()):
            if not s.resident:
                continue
            local = s.local
            if s.changes() != s.version:  # changed in place since it came in (or never put)
                self._put(s)
            if local.is_cuda:  # the all-gather's copy-in ran on FSDP2's streams
                torch.cuda.current_stream(local.device).synchronize()
            # placeholders of the same shape over no memory (as FSDP2 frees its unsharded
            # buffers): a fresh storage, since one the pool's copies went through is not resizable
            flat = s.flat
            empty = torch.empty(flat.shape, dtype=flat.dtype, device=flat.device)
            empty_local = empty[:local.numel()].view(local.shape)
            empty.untyped_storage().resize_(0)
            self._set(s, empty, empty_local)
            s.resident = False

    @staticmethod
    def _set(s: _Shard, flat: torch.Tensor, local: torch.Tensor) -> None:
        s.fp._sharded_param_data = flat
        s.fp.sharded_param._local_tensor = local

    def _put(self, s: _Shard) -> None:
        local = s.local
        if local.numel():
            s.handle = self.store.put(local.detach(), key=s.key, tier=self.tier, replace=True)
        s.version = s.changes()

    def _by_handle(self, s: _Shard, fn: Any) -> Any:
        if s.handle is not None:
            try:
                return fn(s.handle)
            except (NotFound, StaleHandle):
                pass  # re-bound behind our back
        s.handle = self.store.lookup(s.key)
        if s.handle is None:
            raise RuntimeError(f"parameter shard {s.key} is missing from the pool; was it freed?")
        return fn(s.handle)

    def _hint(self, handles: list[Any]) -> None:
        if handles:
            try:
                self.store.prefetch(handles, wait=False)
            except (NotFound, StaleHandle):
                log.debug("prefetch hint named a re-bound parameter shard; skipped")

    # ------------------------------------------------------------------ the user's calls
    def materialize(self) -> None:
        """Bring every shard in (an optimizer step, a checkpoint do it themselves)."""
        for shards in self.shards.values():
            for s in shards:
                if not s.resident:
                    self._restore_one(s)

    def writeback(self) -> None:
        """Put the shards changed since they came in into the pool and give every shard's
        memory back."""
        for g in self.groups:
            self._release(g)

    def undo(self) -> None:
        """Give every shard its memory and bytes back and stop offloading."""
        for h in self.handles:
            h.remove()
        self.handles = []
        for g, attr in self._originals:
            if attr in vars(g):
                delattr(g, attr)  # the class's method again
        self._originals = []
        self.materialize()
