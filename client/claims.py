"""Who holds what in a process: the prefixes of a pool that an offloaded optimizer or a
parameter offload writes under, and the parameters under their hooks.

Two holders on one prefix (or one nested in the other) of one pool would overwrite each
other's objects: the newer takes the prefix over, and the older is told (its
``_taken_over`` is set) so that its next use raises instead of touching objects that are
no longer its own. A parameter offload and an optimizer updating in backward both hook
each parameter's gradient and cannot share one: each marks the parameters it hooks.
"""

from __future__ import annotations

import secrets
import weakref
from typing import Any

import torch

__all__ = ["BACKWARD_UPDATES", "PARAM_OFFLOAD", "PrefixMark", "claim_prefix", "held_by"]

BACKWARD_UPDATES = "_tierstore_backward_updates"
"""The attribute of a parameter an optimizer updates in backward: a weak reference to its hooks."""
PARAM_OFFLOAD = "_tierstore_param_offload"
"""The attribute of a parameter kept in the pool by ``offload_parameters``: a weak reference to it."""

_prefixes: "weakref.WeakKeyDictionary[Any, dict[str, tuple[weakref.ref, bool]]]" = weakref.WeakKeyDictionary()
"""Per pool (a ``Store`` or ``Client``), the prefixes held on it: their holders, and
whether each frees every key under its prefix."""


def claim_prefix(pool: Any, prefix: str, holder: Any, *, frees_all: bool) -> None:
    """Record ``holder`` as the owner of ``prefix`` on ``pool``: a live holder of the same
    prefix is taken over (its ``_taken_over`` is set), and so is one nested with it where
    the enclosing one frees every key under its prefix (an optimizer's ``free()`` and
    ``load_state_dict``: ``frees_all``); a parameter offload's keys are only its own."""
    try:
        mine = _prefixes.setdefault(pool, {})
    except TypeError:  # a pool that cannot be weakly referenced: nothing to check against
        return
    for other, (ref, other_frees) in list(mine.items()):
        old = ref()
        clash = (other == prefix or (other_frees and prefix.startswith(other + "/"))
                 or (frees_all and other.startswith(prefix + "/")))
        if old is None or clash:
            del mine[other]
            if old is not None and old is not holder:
                old._taken_over = prefix
    mine[prefix] = (weakref.ref(holder), frees_all)


class PrefixMark:
    """A holder's mark under its prefix in the pool (``PREFIX/_owner``, 8 random bytes): a
    newer holder in another process or connection on the namespace puts its own over it,
    which the older one sees as a different handle when it looks."""

    def __init__(self, pool: Any, prefix: str) -> None:
        self.pool = pool
        self.key = f"{prefix}/_owner"
        self.handle: Any = None

    def put(self) -> None:
        """Put this holder's mark, over any other's."""
        mark = torch.tensor([secrets.randbits(62)], dtype=torch.int64)
        self.handle = self.pool.put(mark, key=self.key, replace=True)

    def ours(self) -> bool:
        """Whether the mark under the prefix is still this holder's (true before ``put``)."""
        return self.handle is None or self.pool.lookup(self.key) == self.handle


def held_by(p: Any, attribute: str) -> Any:
    """The live, active holder a parameter's ``attribute`` names (its ``active`` true), or None."""
    ref = getattr(p, attribute, None)
    holder = ref() if ref is not None else None
    return holder if holder is not None and getattr(holder, "active", True) else None
