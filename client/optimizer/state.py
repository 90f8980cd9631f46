"""The offloaded optimizer's state tensors in the pool: their keys, versions and handles.

Each parameter's state (the wrapped optimizer's tensors and python numbers, and an
fp32 master where one is kept) is a few objects, ``PREFIX/GROUP.INDEX/NAME@VERSION``,
two versions each (crash-consistent) or one. ``StateTensors`` owns which names each
parameter has (its layout), each parameter's current version and the handles looked
up so far; it knows nothing of steps, buckets or progress records.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from tierstore.contract import Pool, PoolLease
from tierstore.errors import NotFound, StaleHandle

if TYPE_CHECKING:
    from tierstore.batch import LeaseGroup

__all__ = ["StateTensors", "Key", "Item", "OPT_STREAM"]

log = logging.getLogger(__name__)

OPT_STREAM = "optim"
"""The access sequence the optimizer's gets and check-outs are recorded under."""

Key = tuple[int, int]
"""A parameter: (group, index in the group)."""
Item = tuple[int, int, torch.Tensor]
"""A parameter to update: (group, index, the parameter)."""


def pytag(v: Any) -> tuple[str, torch.Tensor]:
    """Non-tensor optimizer state (python numbers) stored as 0-d tensors, tagged by type."""
    if isinstance(v, bool):
        return "bool", torch.tensor(v)
    if isinstance(v, int):
        return "int", torch.tensor(v, dtype=torch.int64)
    if isinstance(v, float):
        return "float", torch.tensor(v, dtype=torch.float64)
    raise TypeError(f"cannot offload optimizer state of type {type(v).__name__}")


def untag(tag: str, t: torch.Tensor) -> Any:
    return {"bool": bool, "int": int, "float": float}[tag](t.item())


def _dtensor_cls() -> Any:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without distributed
        return None
    return DTensor


def local(v: torch.Tensor) -> tuple[str, torch.Tensor]:
    """(tag, plain tensor): sharded (FSDP2) state is stored as this rank's local shard."""
    dt = _dtensor_cls()
    if dt is not None and isinstance(v, dt):
        return "dtensor", v.to_local()
    if v.layout != torch.strided:
        raise TypeError(f"cannot offload optimizer state held as a {v.layout} tensor (SGD's momentum under sparse "
                        "gradients is one): give the parameter dense gradients, or leave it out of the offloaded "
                        "optimizer")
    return "tensor", v


def wrap_like(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A DTensor over the local shard ``t`` sharded like the parameter ``p``."""
    return _dtensor_cls().from_local(t, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                     stride=p.stride())


class StateTensors:
    """The optimizer state's objects under ``prefix``: layout, current versions, handles."""

    def __init__(self, store: Pool, *, prefix: str, tier: str | None, durable: bool, versions: int) -> None:
        self.store = store
        self.prefix = prefix
        self.tier = tier
        self.durable = durable
        self.versions = versions
        """State versions kept per state tensor: 2 (crash-consistent) or 1."""
        # (group, index) -> {name: tag}; tag is "tensor", "dtensor" or the python type of a scalar
        self.layout: dict[Key, dict[str, str]] = {}
        self.cur: dict[Key, int] = {}  # (group, index) -> current state version (0 or 1)
        self._handles: dict[str, Any] = {}  # key -> handle, so a step does not look every key up

    def key(self, gi: int, pi: int, name: str, version: int) -> str:
        tag = self.layout.get((gi, pi), {}).get(name, "tensor")
        suffix = "" if tag == "tensor" else f"#{tag}"  # python scalars keep their type in the key
        return f"{self.prefix}/{gi}.{pi}/{name}{suffix}@{version}"

    def write_version(self, read: int) -> int:
        """The version an update that reads version ``read`` writes: the other one, or (single
        version) the same, in place."""
        return 1 - read if self.versions == 2 else read

    def lookup(self, gi: int, pi: int, name: str, version: int) -> Any:
        """The handle of a state tensor, looked up once (keys keep their objects while we run)."""
        key = self.key(gi, pi, name, version)
        h = self._handles.get(key)
        if h is None:
            h = self.store.lookup(key)
            if h is not None:
                self._handles[key] = h
        return h

    def put(self, key: str, t: torch.Tensor) -> None:
        """Put ``t`` as the object ``key`` (replacing it), in this optimizer's tier and durability."""
        self._handles[key] = self.store.put(t, key=key, tier=self.tier, replace=True, durable=self.durable)

    def put_both(self, gi: int, pi: int, name: str, t: torch.Tensor) -> None:
        """Put ``t`` as every version kept of a state tensor (both, or version 0 alone)."""
        t = t.detach().contiguous()
        for version in range(self.versions):
            self.put(self.key(gi, pi, name, version), t)

    def free_key(self, key: str) -> None:
        """Free the object under ``key``, if there is one."""
        self._handles.pop(key, None)
        h = self.store.lookup(key)
        if h is not None:
            self.store.free(h)

    def keys_in_layout(self) -> set[str]:
        """The keys of every state tensor the layout names, every version kept."""
        return {self.key(gi, pi, name, v) for (gi, pi), names in self.layout.items() for name in names
                for v in range(self.versions)}

    def free_others(self, old: dict[str, str], keep: set[str]) -> None:
        """Free the objects of ``old`` (key -> handle, as listed before) whose key is not in
        ``keep``."""
        for key, h in old.items():
            if key not in keep:
                self._handles.pop(key, None)
                try:
                    self.store.free(h)
                except (NotFound, StaleHandle):  # freed or replaced since the listing
                    pass

    def free_all(self) -> None:
        """Free every object under the prefix (the layout is the caller's to reset)."""
        self._handles.clear()
        for k in self.store.keys(prefix=self.prefix + "/"):
            h = self.store.lookup(k)
            if h is not None:
                self.store.free(h)

    def hint(self, items: list[Item], versions: dict[Key, int]) -> None:
        """Hint the pool to bring up the state ``items`` will read (one message, not waited for)."""
        hs = []
        for gi, pi, _ in items:
            for name in self.layout.get((gi, pi), ()):
                h = self.lookup(gi, pi, name, versions[(gi, pi)])
                if h is not None:
                    hs.append(h)
        if hs:
            try:
                self.store.prefetch(hs, wait=False)  # a hint: not waited for
            except (NotFound, StaleHandle):  # a key re-bound behind our back: found again at its check-out
                log.debug("prefetch hint named a re-bound optimizer state; skipped")

    def get_current(self, gi: int, pi: int, name: str) -> torch.Tensor:
        """A copy of the current version of one state tensor."""
        return self.store.get(self.lookup(gi, pi, name, self.cur[(gi, pi)]))

    def checkout_state(self, gi: int, pi: int, name: str, version: int, mode: str) -> PoolLease:
        """Check out one state tensor's ``version`` (the GPU update path)."""
        key = self.key(gi, pi, name, version)

        def checkout() -> PoolLease:
            h = self.lookup(gi, pi, name, version)
            if h is None:
                raise RuntimeError(f"optimizer state {key} is missing from the pool; "
                                   "was it freed, or is this prefix used by another job?")
            return self.store.checkout(h, mode, stream=OPT_STREAM)

        try:
            return checkout()
        except (NotFound, StaleHandle):
            self._handles.pop(key, None)  # the key was re-bound behind our back: look it up again
            return checkout()

    def checkout_states(self, wanted: list[tuple[int, int, str, int, int]]) -> LeaseGroup:
        """Leases on state tensors to update, ``(group, index, name, version, source)`` each:
        ``w`` on that version starting with the bytes of version ``source``, or ``rw`` on it
        where ``source`` is ``version`` (single-version state, updated in place); sent together
        (through a daemon, one message). Returns them in order, as a ``LeaseGroup``."""

        def requests() -> list[tuple[Any, str, Any]]:
            reqs = []
            for gi, pi, name, version, source in wanted:
                dst, src = self.lookup(gi, pi, name, version), self.lookup(gi, pi, name, source)
                if dst is None or src is None:
                    k = self.key(gi, pi, name, version if dst is None else source)
                    raise RuntimeError(f"optimizer state {k} is missing from the pool; "
                                       "was it freed, or is this prefix used by another job?")
                reqs.append((dst, "rw", None) if source == version else (dst, "w", src))
            return reqs

        try:
            return self.store.checkout_each(requests(), stream=OPT_STREAM)
        except (NotFound, StaleHandle):
            for gi, pi, name, version, source in wanted:  # a key was re-bound behind our back: look them up again
                for v in (version, source):
                    self._handles.pop(self.key(gi, pi, name, v), None)
            return self.store.checkout_each(requests(), stream=OPT_STREAM)

    def masters_into(self, param_groups: list[dict[str, Any]]) -> None:
        """Parameters that have fp32 masters come back from them (after a resume or rewind)."""
        for (gi, pi), layout in self.layout.items():
            if gi >= len(param_groups) or pi >= len(param_groups[gi]["params"]):
                raise ValueError(f"pool state under {self.prefix!r} names parameter {gi}.{pi}, which this "
                                 "optimizer does not have; wrong prefix or a different model?")
            p = param_groups[gi]["params"][pi]
            if "master" in layout:
                with torch.no_grad():
                    p.copy_(self.get_current(gi, pi, "master"))
