"""The offloaded optimizer's state in the wrapped optimizer's own form: ``optimizer.state``
(a mapping read from the pool on access) and the ``state_dict`` format.

State comes out of the pool as copies (sharded state as DTensors like the parameter,
no fp32 master) and goes in as both versions kept, with a fresh fp32 master where one
is kept.
"""

from __future__ import annotations

from collections import defaultdict
from copy import deepcopy
from collections.abc import MutableMapping
from typing import Any, Callable, Iterator

import torch

from .state import Key, StateTensors, local, pytag, untag, wrap_like

__all__ = ["PoolState", "Placeholders", "checked_state", "param_state", "set_param_state", "pack", "placed"]


def param_state(states: StateTensors, gi: int, pi: int, p: torch.Tensor) -> dict[str, Any]:
    """Parameter ``p``'s current state as the wrapped optimizer keeps it (copies out of
    the pool; sharded state as a DTensor like the parameter; no fp32 master)."""
    st: dict[str, Any] = {}
    for name, tag in states.layout.get((gi, pi), {}).items():
        if name == "master":
            continue
        t = states.get_current(gi, pi, name)
        if tag == "dtensor":
            st[name] = wrap_like(t, p)
        else:
            st[name] = t if tag == "tensor" else untag(tag, t)
    return st


def set_param_state(states: StateTensors, gi: int, pi: int, p: torch.Tensor, st: dict[str, Any], *,
                    master: bool) -> None:
    """Put parameter ``p``'s state (the wrapped optimizer's form) into the pool as every
    version kept, with a fresh fp32 master where one is kept (``master``). An empty state (as
    ``optimizer.state[p] = {}`` resets one) frees what the parameter kept: its next update
    is a first one again, as the wrapped optimizer's would be (its master made anew from
    the parameter)."""
    old = states.layout.pop((gi, pi), {})
    if not st:
        for name in old:
            for version in range(states.versions):
                states.free_key(states.key(gi, pi, name, version))
        states.cur.pop((gi, pi), None)
        states.layout[(gi, pi)] = {}  # in optimizer.state, empty, as torch's own would have it
        return
    layout = states.layout[(gi, pi)] = {}
    for name, v in st.items():
        if isinstance(v, torch.Tensor):
            layout[name], v = local(v)
            # as torch does: floating state follows the dtype of what is updated (the fp32
            # master where there is one, else the parameter), except "step"
            if v.is_floating_point() and name != "step":
                v = v.to(torch.float32 if master else p.dtype)
            t = v
        else:
            layout[name], t = pytag(v)
        states.put_both(gi, pi, name, t)
    if master:
        layout["master"] = "tensor"
        states.put_both(gi, pi, "master", p.detach().float())
    states.cur[(gi, pi)] = 0


class Placeholder:
    """Where a placeholder's bytes are: one state tensor's current version in the pool."""

    __slots__ = ("obj", "gi", "pi", "name", "shape", "dtype")

    def __init__(self, obj: torch.Tensor, gi: int, pi: int, name: str, shape: tuple[int, ...],
                 dtype: torch.dtype) -> None:
        self.obj = obj  # kept: the registry is by id
        self.gi, self.pi, self.name, self.shape, self.dtype = gi, pi, name, shape, dtype

    @property
    def nbytes(self) -> int:
        return int(torch.Size(self.shape).numel()) * self.dtype.itemsize


def _no_memory(shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of this shape and dtype over a storage of 0 bytes: its metadata is right,
    its data is nowhere (nothing may read it)."""
    t = torch.empty(shape, dtype=dtype)
    t.untyped_storage().resize_(0)
    return t


class Placeholders:
    """Cheap stand-ins for state tensors: ``state_dict()`` inside
    ``OffloadedOptimizer.lazy_state_dict()`` puts these in place of the tensors (each with
    the shape and dtype of its object in the pool, over no memory; sharded state as a
    DTensor over such a local tensor), so a checkpoint writer can fetch each from the
    pool when it writes it (``tierstore.client.dcp``). Python scalars are read at once.
    Also keeps each parameter's state dict and the groups as made, for a load that fills
    them in place."""

    def __init__(self, states: StateTensors) -> None:
        self.states = states
        self.by_id: dict[int, Placeholder] = {}
        self.param_states: dict[tuple[int, int], dict[str, Any]] = {}
        self.groups: list[dict[str, Any]] = []
        self._meta: dict[str, tuple[str, list[int]]] | None = None  # key -> (dtype, shape): one listing


    def find(self, obj: Any) -> Placeholder | None:
        return self.by_id.get(id(obj))

    def state(self, gi: int, pi: int, p: torch.Tensor) -> dict[str, Any]:
        """Parameter ``p``'s state as ``param_state`` gives it, tensors as placeholders."""
        from tierstore.tensors import torch_dtype

        states = self.states
        if self._meta is None:  # listed when the state dict is made (get_state_dict may make state first)
            self._meta = {e["key"]: (e["dtype"], e["shape"]) for e in states.store.ls(states.prefix + "/")}
        st: dict[str, Any] = {}
        for name, tag in states.layout.get((gi, pi), {}).items():
            if name == "master":
                continue
            if tag not in ("tensor", "dtensor"):
                st[name] = untag(tag, states.get_current(gi, pi, name))
                continue
            key = states.key(gi, pi, name, states.cur[(gi, pi)])
            if key not in self._meta:
                raise RuntimeError(f"optimizer state {key} is missing from the pool; was it freed?")
            dtype, shape = torch_dtype(self._meta[key][0]), tuple(self._meta[key][1])
            local_t = _no_memory(list(shape), dtype)
            obj = wrap_like(local_t, p) if tag == "dtensor" else local_t
            self.by_id[id(obj)] = Placeholder(obj, gi, pi, name, shape, dtype)
            st[name] = obj
        self.param_states[(gi, pi)] = st
        return st

    def fetch(self, ph: Placeholder) -> torch.Tensor:
        """The placeholder's bytes from the pool, in a new CPU tensor of exactly its size."""
        states = self.states
        out = torch.empty(ph.shape, dtype=ph.dtype)
        return states.store.get(states.lookup(ph.gi, ph.pi, ph.name, states.cur[(ph.gi, ph.pi)]), out=out)


def pack(states: StateTensors, param_groups: list[dict[str, Any]], lazy: Placeholders | None = None) -> dict[str, Any]:
    """``state_dict()``: state keyed by integer ids in parameter-group order (with ``lazy``,
    tensors as its placeholders)."""
    packed: dict[int, dict[str, Any]] = {}
    groups = []
    idx = 0
    for gi, group in enumerate(param_groups):
        ids = []
        for pi, p in enumerate(group["params"]):
            if states.layout.get((gi, pi)):
                packed[idx] = param_state(states, gi, pi, p) if lazy is None else lazy.state(gi, pi, p)
            ids.append(idx)
            idx += 1
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
    if lazy is not None:
        lazy.groups = groups
    return {"state": packed, "param_groups": groups}


def finish_lazy_load(states: StateTensors, param_groups: list[dict[str, Any]], ph: Placeholders,
                     needs_master: Callable[[torch.Tensor], bool]) -> None:
    """After a load that put each placeholder's tensor into the pool as every version kept
    (``tierstore.client.dcp``): the python scalars and the groups' settings it filled in
    place go in too, fp32 masters are made again from the (loaded) parameters, and every
    parameter's current version is 0."""
    for gi, (group, saved) in enumerate(zip(param_groups, ph.groups)):
        for k, v in saved.items():
            if k != "params":
                group[k] = v
    for (gi, pi), st in ph.param_states.items():
        layout = states.layout[(gi, pi)]
        for name, v in st.items():
            if not isinstance(v, torch.Tensor):
                layout[name], t = pytag(v)
                states.put_both(gi, pi, name, t)
        p = param_groups[gi]["params"][pi]
        if "master" in layout and needs_master(p):
            states.put_both(gi, pi, "master", local(p.detach())[1].float())
        states.cur[(gi, pi)] = 0


def in_rule_format(inner: torch.optim.Optimizer, param_groups: list[dict[str, Any]],
                   found: list[tuple[Key, dict[str, Any]]]) -> list[tuple[Key, dict[str, Any]]]:
    """``found`` (``placed``'s) as the wrapped optimizer's own ``load_state_dict`` would
    keep it: torch's rules bring an older format up to date in ``__setstate__`` (Adam's
    python-number ``step`` becomes the tensor its update needs), which is run here on
    the saved states alone (the tensors are not copied), the optimizer's own state and
    groups put back after."""
    params = {key: param_groups[key[0]]["params"][key[1]] for key, _ in found}
    kept = {k: inner.__dict__[k] for k in ("state", "param_groups")}
    trial: defaultdict = defaultdict(dict, {params[key]: dict(st) for key, st in found})
    try:
        inner.__setstate__({"state": trial, "param_groups": param_groups})
        return [(key, dict(inner.state.get(params[key], st))) for key, st in found]
    finally:
        inner.__dict__.update(kept)


def placed(param_groups: list[dict[str, Any]],
           state_dict: dict[str, Any]) -> tuple[list[tuple[Key, dict[str, Any]]], list[dict[str, Any]]]:
    """``load_state_dict``'s check and match: each saved state's parameter (group, index),
    found by position in its group, and each group's saved settings (copies, as torch's
    own load deep-copies them: a tensor ``lr`` is not shared with the source). Nothing
    changes here, in the groups or in the pool."""
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= state_dict.keys():
        raise ValueError("a state dict needs 'state' and 'param_groups' (as Optimizer.state_dict() returns)")
    groups = state_dict["param_groups"]
    if len(groups) != len(param_groups):
        raise ValueError(f"state_dict has {len(groups)} parameter groups, the optimizer {len(param_groups)}")
    idx_of: dict[Any, Key] = {}
    settings = []
    for gi, (g, saved) in enumerate(zip(param_groups, groups)):
        if len(g["params"]) != len(saved["params"]):
            raise ValueError(f"parameter group {gi} has {len(g['params'])} parameters, the state_dict "
                             f"{len(saved['params'])}")
        settings.append(deepcopy({k: v for k, v in saved.items() if k != "params"}))
        for pi, i in enumerate(saved["params"]):
            idx_of[i] = (gi, pi)
    out = []
    for i, st in state_dict["state"].items():
        where = idx_of.get(i)
        if where is None and isinstance(i, str) and i.isdigit():
            where = idx_of.get(int(i))  # integer ids that went through a text format
        if where is None:
            raise ValueError(f"state_dict has state for parameter {i!r}, which none of its parameter "
                             "groups lists; was it saved from a different model or optimizer?")
        if not isinstance(st, dict):
            raise ValueError(f"state_dict's state for parameter {i!r} is a {type(st).__name__}, not a dict")
        out.append((where, st))
    return out, settings


def checked_state(key: Key, st: dict[str, Any]) -> dict[str, Any]:
    """Parameter ``key``'s saved state, checked before anything is put (every value one the
    pool can hold: a dense tensor or a python number), so a state dict refused changes
    nothing. A value of ``None`` (an older torch's SGD kept ``momentum_buffer: None``
    without momentum) is left out: the rule reads it with ``state.get``, as then."""
    out = {}
    for name, v in st.items():
        if v is None:
            continue
        try:
            if isinstance(v, torch.Tensor):
                if v.device.type == "meta":
                    raise TypeError("a meta tensor has no values to offload (materialize the state first)")
                local(v)
            else:
                pytag(v)
        except TypeError as e:
            raise TypeError(f"parameter {key[0]}.{key[1]}'s state {name!r}: {e}") from None
        out[name] = v
    return out


class PoolState(MutableMapping):
    """``optimizer.state`` of an offloaded optimizer: parameter -> its state, read from the
    pool on access (copies), written into the pool on assignment (``set_state``). It is
    non-empty once any parameter has state, so tools that test ``optimizer.state`` (DCP's
    ``get_state_dict`` runs a zero-gradient step on an optimizer whose state looks empty)
    see the pool's."""

    def __init__(self, groups: Callable[[], list[dict[str, Any]]], states: StateTensors,
                 set_state: Callable[[int, int, dict[str, Any]], None]) -> None:
        self._groups = groups
        self._states = states
        self._set_state = set_state
        self._index: dict[int, Key] = {}  # id(parameter) -> (group, index)

    def _where(self, p: Any) -> Key | None:
        groups = self._groups()
        where = self._index.get(id(p))
        if where is None or where[0] >= len(groups) or where[1] >= len(groups[where[0]]["params"]) \
                or groups[where[0]]["params"][where[1]] is not p:  # groups changed since: index them again
            self._index = {id(q): (gi, pi) for gi, g in enumerate(groups) for pi, q in enumerate(g["params"])}
            where = self._index.get(id(p))
        return where

    def __getitem__(self, p: Any) -> dict[str, Any]:
        where = self._where(p)
        if where is None or where not in self._states.layout:
            return {}  # as the defaultdict of torch.optim.Optimizer.state does, without storing it
        return param_state(self._states, *where, p)

    def __setitem__(self, p: Any, st: dict[str, Any]) -> None:
        where = self._where(p)
        if where is None:
            raise KeyError("not a parameter of this optimizer")
        self._set_state(*where, dict(st))

    def __delitem__(self, p: Any) -> None:
        raise TypeError("the state of an offloaded optimizer's parameter cannot be deleted on its own; "
                        "use load_state_dict or free()")

    def __iter__(self) -> Iterator[Any]:
        groups = self._groups()
        for gi, pi in sorted(self._states.layout):
            yield groups[gi]["params"][pi]

    def __len__(self) -> int:
        return len(self._states.layout)
