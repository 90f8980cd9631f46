"""Eviction policies: which host-resident object to demote next. Policy only; the store
moves the bytes.

This is the whole surface a policy needs: it hears about inserts, accesses and
removals of host-resident objects and yields candidates, best victim first. The
store skips candidates it cannot move (leased, in flight). Objects prefetched but
not yet used are offered only after every other candidate (no prefetch thrash).
"""

from __future__ import annotations

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

    def _ranked(self) -> list[int]:
        return list(self._order)

    def candidates(self) -> Iterator[int]:
        ranked = self._ranked()
        free = [o for o in ranked if o not in self.protected]
        return iter(free + [o for o in ranked if o in self.protected])

    def distance(self, oid: int) -> int | None:
        return None


class TracePolicy(LRUPolicy):
    """Belady with the learned traces; LRU until some trace is learned.

    Objects no trace will use again go first. With one learned trace: among objects
    needed within the prefetcher's reach (the next accesses whose bytes fit in its
    budget, at most ``HORIZON``) the one needed furthest away goes first (Belady);
    every object needed later than that is fetched back in time anyway, and evicting
    any of them costs the same bytes per step, so among those the one latest in the
    step's order goes first. That keeps the part a too-small tier rotates in one
    place, the end of the step. Plain Belady's rotation drifts into the head of the
    next step (at the wrap the object just used is the one needed furthest away), and
    the head is then read back with no compute before it to hide behind. Several
    learned traces (several clients or streams) follow the same rule, by a sort.
    """

    name = "trace"

    def __init__(self, book: TraceBook, protected: dict[int, object] | None = None,
                 size_of: Callable[[int], int] | None = None, reach_bytes: int = 0) -> None:
        super().__init__(protected)
        self.book = book
        self.size_of = size_of
        """Bytes of an object (None: the reach is ``HORIZON`` accesses)."""
        self.reach_bytes = reach_bytes

    def horizon(self, trace: Trace) -> int:
        """Accesses ahead the prefetcher can reach: within ``HORIZON`` and, with sizes, the
        next accesses whose bytes fit in ``reach_bytes`` (at least the next one)."""
        seq, n = trace.learned, len(trace.learned)
        limit = min(HORIZON, n)
        if self.size_of is None:
            return limit
        total = 0
        for i in range(limit):
            total += self.size_of(seq[(trace.cursor + 1 + i) % n])
            if total > self.reach_bytes:
                return max(i, 1)
        return limit

    def candidates(self) -> Iterator[int]:
        learned = self.book.learned_traces()
        if len(learned) == 1:
            return self._walk(learned[0])
        return super().candidates()

    def _walk(self, trace: Trace) -> Iterator[int]:
        """Candidates under one learned trace, lazily; protected objects last. The store
        usually takes the first few, so this costs O(trace) at most, not a sort."""
        held = []
        for oid in self._traced_order(trace):
            if oid in self.protected:
                held.append(oid)
            else:
                yield oid
        yield from (o for o in held if o in self._order)

    def _traced_order(self, trace: Trace) -> Iterator[int]:
        """Resident objects the trace never uses (LRU order); those needed beyond the
        horizon, latest trace position first; those needed within it, furthest next
        use first (walking the trace back from the horizon)."""
        resident, positions = self._order, trace.positions
        for oid in list(resident):
            if oid not in positions:
                yield oid
        seq, n, cur = trace.learned, len(trace.learned), trace.cursor
        horizon = self.horizon(trace)
        seen = set()
        for p in range(n - 1, -1, -1):
            oid = seq[p]
            if oid not in seen and oid in resident and trace.distance(oid) >= horizon:
                seen.add(oid)
                yield oid
        for i in range(horizon):
            p = (cur + horizon - i) % n
            oid = seq[p]
            # an object used more than once is ranked by its nearest next use
            if oid not in seen and oid in resident and trace.distance(oid) == (p - cur - 1) % n:
                seen.add(oid)
                yield oid

    def _ranked(self) -> list[int]:
        """Every resident object sorted, for several learned traces (several clients or
        streams) the same rule as the walk: needed within some trace's reach ranks by
        its nearest next use; otherwise by its latest position in its trace's step, as a
        fraction of the step. With one trace this is the walk's order (tests compare)."""
        order = list(self._order)
        reach = [(t, self.horizon(t)) for t in self.book.learned_traces()]
        if not reach:
            return order

        def key(oid: int) -> tuple[int, float]:
            near = late = None
            for t, horizon in reach:
                d = t.distance(oid)
                if d is None:
                    continue
                if d < horizon:
                    near = d if near is None else min(near, d)
                else:
                    at = max(t.positions[oid]) / len(t.learned)
                    late = at if late is None else max(late, at)
            if near is not None:
                return (2, -near)
            return (0, 0.0) if late is None else (1, -late)
        return sorted(order, key=key)  # stable: LRU order breaks ties

    def distance(self, oid: int) -> int | None:
        return self.book.distance(oid)


def make_policy(name: str, book: TraceBook, protected: dict[int, object],
                size_of: Callable[[int], int] | None = None, reach_bytes: int = 0) -> EvictionPolicy:
    if name == "lru":
        return LRUPolicy(protected)
    if name == "trace":
        return TracePolicy(book, protected, size_of, reach_bytes)
    raise ValueError(f"unknown policy {name!r}")
