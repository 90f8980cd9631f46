"""Eviction policies: which host-resident object to demote next. Policy only; the store
moves the bytes.

This is the whole surface a policy needs: it hears about inserts, accesses and
removals of host-resident objects and yields candidates, best victim first. The
store skips candidates it cannot move (leased, in flight). Objects prefetched but
not yet used are offered only after every other candidate (no prefetch thrash).
"""

from __future__ import annotations

import bisect
import heapq
from collections import OrderedDict
from typing import Callable, Iterator, Protocol

from .trace import HORIZON, Trace, TraceBook

__all__ = ["EvictionPolicy", "LRUPolicy", "TracePolicy", "make_policy"]


class EvictionPolicy(Protocol):
    name: str

    def insert(self, oid: int) -> None: ...
    def touch(self, oid: int) -> None: ...
    def remove(self, oid: int) -> None: ...
    def candidates(self) -> Iterator[int]: ...
    def distance(self, oid: int) -> int | None: ...


class LRUPolicy:
    """Least recently used first. Cheap, and right until an access trace exists."""

    name = "lru"

    def __init__(self, protected: dict[int, object] | None = None) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()
        self.protected = protected if protected is not None else {}

    def insert(self, oid: int) -> None:
        self._order[oid] = None
        self._order.move_to_end(oid)

    def touch(self, oid: int) -> None:
        if oid in self._order:
            self._order.move_to_end(oid)

    def remove(self, oid: int) -> None:
        self._order.pop(oid, None)

    def candidates(self) -> Iterator[int]:
        """Lazily (the store usually takes the first): unprotected objects, least recently
        used first, then protected ones. Valid until the policy next changes."""
        protected = self.protected
        held = []
        for oid in self._order:
            if oid in protected:
                held.append(oid)
            else:
                yield oid
        yield from held

    def distance(self, oid: int) -> int | None:
        return None


class TracePolicy(LRUPolicy):
    """Belady with the learned traces; LRU until some trace is learned.

    Objects no trace will use again go first (LRU order). Among objects needed within
    the prefetcher's reach in their trace (the next accesses whose bytes fit in its
    budget, at most ``HORIZON``) the one needed furthest away goes first (Belady), and
    those go last; every object needed later than that is fetched back in time anyway,
    and evicting any of them costs the same bytes per step, so among those the one
    latest in its step (by position over the step's length) goes first. That keeps
    the part a too-small tier rotates in one place, the end of the step. Plain
    Belady's rotation drifts into the head of the next step (at the wrap the object
    just used is the one needed furthest away), and the head is then read back with
    no compute before it to hide behind.

    Cost per eviction: O(traces x HORIZON) plus the candidates skipped, not a pass
    over every resident object: the policy keeps, per learned trace, the sorted
    positions of its resident objects, and the resident objects no trace uses, in
    LRU order; both are rebuilt only when a learned order changes.
    """

    name = "trace"

    def __init__(self, book: TraceBook, protected: dict[int, object] | None = None,
                 reach: Callable[[Trace], int] | None = None) -> None:
        super().__init__(protected)
        self.book = book
        self.reach = reach
        """Accesses ahead of a trace's cursor the prefetcher fetches (None: ``HORIZON``)."""
        self._version = -1
        self._traces: list[Trace] = []
        self._where: dict[int, list[int]] = {}
        """Traced oid -> indexes in ``_traces`` of the traces that use it."""
        self._resident_at: list[list[int]] = []
        """Per trace: the latest positions of its resident objects, sorted."""
        self._untraced: OrderedDict[int, None] = OrderedDict()

    # ------------------------------------------------------------------ bookkeeping
    def _sync(self) -> None:
        if self._version == self.book.version:
            return
        self._version = self.book.version
        self._traces = self.book.learned_traces()
        self._where = {}
        for i, t in enumerate(self._traces):
            for oid in t.positions:
                self._where.setdefault(oid, []).append(i)
        self._resident_at = [[] for _ in self._traces]
        self._untraced = OrderedDict()
        for oid in self._order:
            self._add(oid)
        for lst in self._resident_at:
            lst.sort()

    def _add(self, oid: int, keep_sorted: bool = False) -> None:
        where = self._where.get(oid)
        if where is None:
            self._untraced[oid] = None
            return
        for i in where:
            p = self._traces[i].positions[oid][-1]
            if keep_sorted:
                bisect.insort(self._resident_at[i], p)
            else:
                self._resident_at[i].append(p)

    def insert(self, oid: int) -> None:
        fresh = oid not in self._order
        super().insert(oid)
        if self._version == self.book.version:
            if fresh:
                self._add(oid, keep_sorted=True)
            elif oid in self._untraced:
                self._untraced.move_to_end(oid)

    def touch(self, oid: int) -> None:
        super().touch(oid)
        if oid in self._untraced:
            self._untraced.move_to_end(oid)

    def remove(self, oid: int) -> None:
        if oid in self._order and self._version == self.book.version:
            if oid in self._untraced:
                del self._untraced[oid]
            else:
                for i in self._where.get(oid, ()):
                    lst, p = self._resident_at[i], self._traces[i].positions[oid][-1]
                    k = bisect.bisect_left(lst, p)
                    if k < len(lst) and lst[k] == p:
                        del lst[k]
        super().remove(oid)

    # ------------------------------------------------------------------ ranking
    def horizon(self, trace: Trace) -> int:
        """Accesses ahead that the prefetcher reaches (``Prefetcher.reach``)."""
        return self.reach(trace) if self.reach is not None else min(HORIZON, len(trace.learned))

    def candidates(self) -> Iterator[int]:
        self._sync()
        if not self._traces:
            return super().candidates()
        return self._walk()

    def _walk(self) -> Iterator[int]:
        """Candidates under the learned traces, lazily; protected objects last."""
        held = []
        for oid in self._traced_order():
            if oid in self.protected:
                held.append(oid)
            else:
                yield oid
        yield from (o for o in held if o in self._order)

    def _traced_order(self) -> Iterator[int]:
        yield from list(self._untraced)
        traces, where = self._traces, self._where
        horizons = [self.horizon(t) for t in traces]

        def nearest(oid: int) -> int | None:
            """The smallest next-use distance within a trace's reach, or None."""
            best = None
            for i in where[oid]:
                d = traces[i].distance(oid)
                if d is not None and d < horizons[i] and (best is None or d < best):
                    best = d
            return best

        seen: set[int] = set()
        # beyond every reach: latest in its step first (a k-way merge of the per-trace lists)
        heap = [(-lst[-1] / len(traces[i].learned), i, len(lst) - 1) for i, lst in enumerate(self._resident_at) if lst]
        heapq.heapify(heap)
        while heap:
            _, i, k = heapq.heappop(heap)
            lst, t = self._resident_at[i], traces[i]
            if k >= len(lst):
                continue
            n, cur, p = len(t.learned), t.cursor, lst[k]
            if (p - cur - 1) % n < horizons[i]:
                # inside this trace's reach, and so is every position from there down to the
                # cursor (or to 0, where the reach wraps): skip them all at once
                if p > cur:
                    k = bisect.bisect_right(lst, cur, 0, k)
                    if k:
                        heapq.heappush(heap, (-lst[k - 1] / n, i, k - 1))
                continue
            if k:
                heapq.heappush(heap, (-lst[k - 1] / n, i, k - 1))
            oid = t.learned[p]
            if oid in seen or oid not in self._order:
                continue
            if (len(where[oid]) > 1 or len(t.positions[oid]) > 1) and nearest(oid) is not None:
                continue  # used elsewhere too, within some reach
            seen.add(oid)
            yield oid
        # within some reach: furthest next use first
        near: dict[int, int] = {}
        for i, t in enumerate(traces):
            n, cur = len(t.learned), t.cursor
            for j in range(horizons[i]):
                oid = t.learned[(cur + 1 + j) % n]
                if oid not in seen and oid not in near and oid in self._order:
                    near[oid] = nearest(oid)
        yield from sorted(near, key=lambda o: -near[o])

    def keys(self) -> dict[int, tuple[int, float]]:
        """The key the walk orders candidates by, for every resident object (for tests):
        (0, LRU rank) untraced, (1, -position / length) beyond every reach, (2, -distance)
        within one."""
        self._sync()
        traces = self._traces
        horizons = [self.horizon(t) for t in traces]
        keys = {}
        for rank, oid in enumerate(self._order):
            if oid not in self._where:
                keys[oid] = (0, float(rank))
                continue
            ds = [traces[i].distance(oid) for i in self._where[oid]]
            near = [d for d, i in zip(ds, self._where[oid]) if d is not None and d < horizons[i]]
            if near:
                keys[oid] = (2, -float(min(near)))
            else:
                keys[oid] = (1, -max(traces[i].positions[oid][-1] / len(traces[i].learned)
                                     for i in self._where[oid]))
        return keys

    def distance(self, oid: int) -> int | None:
        return self.book.distance(oid)


def make_policy(name: str, book: TraceBook, protected: dict[int, object],
                reach: Callable[[Trace], int] | None = None) -> EvictionPolicy:
    if name == "lru":
        return LRUPolicy(protected)
    if name == "trace":
        return TracePolicy(book, protected, reach)
    raise ValueError(f"unknown policy {name!r}")
