"""What a training loop tells the prefetcher: hints (objects it will want) and its
iteration boundaries (``step``).

``Hints`` owns the step lock (one step's comparison at a time, so a trace's steps
apply in order) and turns handles into object ids for the prefetcher's queue. The
prefetcher's own state stays the prefetcher's; this component only calls it, under the
object index's lock, as every caller of the prefetcher does.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any, Callable, Iterable

from .names import Handle
from .objectindex import ObjectIndex
from .prefetch import Prefetcher
from .waits import Later

__all__ = ["Hints", "INLINE_STEP"]

INLINE_STEP = 8192
"""Accesses a step's comparison may cover and still run on the daemon's event loop."""


class Hints:
    """Hints and iteration boundaries for the prefetcher; see the module docstring."""

    def __init__(self, index: ObjectIndex, prefetcher: Prefetcher, later: Callable[..., Future]) -> None:
        self.index, self.prefetcher = index, prefetcher
        self._later = later
        """Runs a function off the caller's path (placement's background pool)."""
        self._step_lock = threading.Lock()

    # ------------------------------------------------------------------ hints
    def hint(self, handles: Iterable[Handle | int | str], namespace: str, owner: Any) -> list[int]:
        """Queue fetches of these objects for ``owner``'s loop; their ids."""
        hs = [Handle.parse(h) for h in handles]
        ix = self.index
        with ix.cv:
            oids = [ix.get_meta(h, namespace).id for h in hs]
            self.prefetcher.hint(owner, oids)
        return oids

    def hint_tracked(self, handles: Iterable[Handle | int | str], namespace: str, owner: Any) -> Future:
        """``hint``, with a future that resolves, once the fetches issued for it are done,
        to how many of the objects are host-resident."""
        return self._later(self._settled, self.hint(handles, namespace, owner))

    def _settled(self, oids: list[int]) -> int:
        ix = self.index
        with ix.cv:
            ix.cv.wait_for(lambda: ix.closed or self.prefetcher.settled(oids))
            return sum(1 for m in map(ix.holder, oids) if m is not None and m.host_valid)

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Block until no prefetch is queued or in flight. False on timeout."""
        ix = self.index
        with ix.cv:
            return ix.cv.wait_for(lambda: self.prefetcher.idle() or ix.closed, timeout=timeout_s)

    # ------------------------------------------------------------------ iteration boundaries
    def step(self, owner: Any) -> None:
        """Iteration boundary of ``owner``'s loop: the prefetcher compares it with the last
        (without the index's lock: a long step's comparison holds up no other call)."""
        ix = self.index
        with self._step_lock:
            with ix.cv:
                ix.counters["steps"] += 1
                works = self.prefetcher.close_step(owner)
            for w in works:
                w.decide()
            with ix.cv:
                self.prefetcher.apply_step(owner, works)

    def try_step(self, owner: Any) -> None | Later:
        """``step`` for a caller that must not wait (the daemon's event loop): done at once
        when the comparison is short (at most ``INLINE_STEP`` accesses) and no other step
        is under way; otherwise ``Later`` of ``step``."""
        ix = self.index
        if self._step_lock.acquire(blocking=False):
            try:
                with ix.cv:
                    if self.prefetcher.step_cost(owner) <= INLINE_STEP:
                        ix.counters["steps"] += 1
                        self.prefetcher.step(owner)
                        return None
            finally:
                self._step_lock.release()
        return Later(lambda: self.step(owner))
