"""Buckets of the offloaded optimizer: which parameters are updated together.

Small parameters of one group updated on the CPU are updated together, up to
``bucket_bytes`` of state: one check-out message, one call of the wrapped optimizer and
one check-in for the bucket. Their first steps (the wrapped optimizer making their state)
are made together within the same limit. A bucket that does not fit in the host tier at once
lowers the limit for the rest of the run (``shrink``).
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from tierstore.units import align_up, format_size

from .state import Item, StateTensors, local

__all__ = ["Buckets", "DEFAULT_BUCKET_BYTES"]

log = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 16 << 20
"""Default ``bucket_bytes`` of ``offload_optimizer``: small parameters are updated
together, up to this many bytes of state at a time."""
_BUCKET_MAX = 256
"""Most parameters in one bucket (each has a few state tensors: well below one
``checkout_each`` list's 4096)."""


class Buckets:
    """Where the bucket starting at a parameter ends (``end``), within ``limit`` bytes of state."""

    def __init__(self, states: StateTensors, on_gpu: Callable[[torch.Tensor], bool], bucket_bytes: int) -> None:
        self._states = states
        self._on_gpu = on_gpu
        self.limit = bucket_bytes
        """Most bytes of state in one bucket: ``bucket_bytes``, lowered when a bucket does not
        fit in the host tier at once."""

    def state_bytes(self, gi: int, pi: int, p: torch.Tensor) -> int:
        """About how many host-tier bytes a parameter's state takes checked out (fp32 per
        element; every object in whole pages)."""
        layout = self._states.layout.get((gi, pi), {})
        n = sum(1 for tag in layout.values() if tag in ("tensor", "dtensor"))
        return n * align_up(max(4 * local(p)[1].numel(), 1)) + (len(layout) - n) * align_up(8)

    def bucketable(self, gi: int, pi: int, p: torch.Tensor) -> bool:
        return (bool(self._states.layout.get((gi, pi))) and not self._on_gpu(p)
                and self.state_bytes(gi, pi, p) <= self.limit)

    def end(self, work: list[Item], k: int) -> int:
        """End (exclusive) of the bucket starting at ``work[k]``: the parameters after it in
        the same group that are updated on the CPU with state already in the pool, up to
        ``limit`` bytes of state and ``_BUCKET_MAX`` parameters (one alone otherwise)."""
        gi, pi, p = work[k]
        if not self.bucketable(gi, pi, p):
            return k + 1
        total, end = self.state_bytes(gi, pi, p), k + 1
        while end < len(work) and end - k < _BUCKET_MAX:
            g2, p2, q = work[end]
            if g2 != gi or not self.bucketable(g2, p2, q):
                break
            total += self.state_bytes(g2, p2, q)
            if total > self.limit:
                break
            end += 1
        return end

    def first_end(self, work: list[Item], k: int) -> int:
        """End (exclusive) of the first steps made together from ``work[k]`` (a parameter
        without state yet): the parameters after it in the same group updated on the CPU
        and without state either, while their state, made in memory by the wrapped
        optimizer before it moves into the pool, stays within ``limit`` (about three fp32
        tensors each: two moments and a master) and ``_BUCKET_MAX`` parameters."""
        gi, pi, p = work[k]
        end, total = k + 1, self._first_bytes(p)
        if self._on_gpu(p):
            return end
        while end < len(work) and end - k < _BUCKET_MAX:
            g2, p2, q = work[end]
            if g2 != gi or self._states.layout.get((g2, p2)) or self._on_gpu(q):
                break
            total += self._first_bytes(q)
            if total > self.limit:
                break
            end += 1
        return end

    @staticmethod
    def _first_bytes(p: torch.Tensor) -> int:
        return 3 * align_up(max(4 * local(p)[1].numel(), 1))

    def shrink(self, items: list[Item]) -> None:
        """The bucket ``items`` did not fit in the host tier at once (nothing was taken):
        smaller buckets from now on."""
        need = sum(self.state_bytes(g, pi, p) for g, pi, p in items)
        self.limit = min(self.limit, need // 2)
        log.info("a bucket of %d parameters (%s of state) does not fit in the host tier at once: "
                 "updating at most %s together", len(items), format_size(need), format_size(self.limit))
