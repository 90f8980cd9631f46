"""Eviction policies: which host-resident object to demote next. Policy only; the store
moves the bytes.

This is the whole surface a policy needs: it hears about inserts, accesses and
removals of host-resident objects and yields candidates, best victim first. The
store skips candidates it cannot move (leased, in flight). Objects prefetched but
not yet used are offered only after every other candidate (no prefetch thrash).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterator, Protocol

from .trace import Trace, TraceBook

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
    """Belady with a learned trace: evict the object whose next use is furthest away
    (objects no trace will use again first); LRU until some trace is learned."""

    name = "trace"

    def __init__(self, book: TraceBook, protected: dict[int, object] | None = None) -> None:
        super().__init__(protected)
        self.book = book

    def candidates(self) -> Iterator[int]:
        learned = self.book.learned_traces()
        if len(learned) == 1:
            return self._walk(learned[0])
        return super().candidates()

    def _walk(self, trace: Trace) -> Iterator[int]:
        """Candidates under one learned trace, lazily: resident objects the trace never
        uses (LRU order), then the rest by next use, furthest first, found by walking
        the trace backwards from its cursor; protected objects last. The store usually
        takes the first few, so this costs O(victims) instead of a sort per eviction."""
        resident, protected, positions = self._order, self.protected, trace.positions
        held = []
        for oid in list(resident):
            if oid not in positions:
                if oid in protected:
                    held.append(oid)
                else:
                    yield oid
        seq, n, cur = trace.learned, len(trace.learned), trace.cursor
        seen = set()
        for i in range(n):
            p = (cur - i) % n
            oid = seq[p]
            if oid in seen or oid not in resident:
                continue
            # an object used more than once is ranked by its nearest next use
            if trace.distance(oid) != (p - cur - 1) % n:
                continue
            seen.add(oid)
            if oid in protected:
                held.append(oid)
            else:
                yield oid
        yield from (o for o in held if o in resident)

    def _ranked(self) -> list[int]:
        order = list(self._order)
        if not self.book.learned():
            return order
        inf = 1 << 62

        def key(oid: int) -> int:
            d = self.book.distance(oid)
            return -(inf if d is None else d)
        return sorted(order, key=key)  # stable: LRU order breaks ties

    def distance(self, oid: int) -> int | None:
        return self.book.distance(oid)


def make_policy(name: str, book: TraceBook, protected: dict[int, object]) -> EvictionPolicy:
    if name == "lru":
        return LRUPolicy(protected)
    if name == "trace":
        return TracePolicy(book, protected)
    raise ValueError(f"unknown policy {name!r}")
