"""Eviction policies: which host-resident object to demote next, and which GPU-tier
object to move down to the host tier next (``GpuOrder``). Policy only; placement moves
the bytes.

This is the whole surface a policy needs: it hears about inserts, accesses and
removals of host-resident objects and yields candidates, best victim first.
Placement skips candidates it cannot move (leased, in flight). Objects prefetched but
not yet used are offered only after every other candidate (no prefetch thrash).
"""

from __future__ import annotations

import bisect
import heapq
from collections import OrderedDict
from typing import Callable, Container, Iterator, Protocol

import numpy as np

from .trace import HORIZON, Trace

__all__ = ["EvictionPolicy", "GpuOrder", "LearnedOrder", "LRUPolicy", "TracePolicy", "make_policy"]


class LearnedOrder(Protocol):
    """What the trace policy reads of the access orders the prefetcher learns
    (``Prefetcher.learned_order``): never written through."""

    @property
    def version(self) -> int:
        """Changes whenever a learned order does."""
        ...

    def learned_traces(self) -> list[Trace]: ...
    def distance(self, oid: int) -> int | None: ...


class EvictionPolicy(Protocol):
    name: str

    def insert(self, oid: int) -> None: ...
    def touch(self, oid: int) -> None: ...
    def remove(self, oid: int) -> None: ...
    def candidates(self) -> Iterator[int]: ...
    def distance(self, oid: int) -> int | None: ...


class GpuOrder:
    """The GPU tier's eviction order: its objects, least recently used first. Placement
    skips the candidates it cannot move (leased, in flight, on another device)."""

    def __init__(self) -> None:
        self._lru: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def insert(self, oid: int) -> None:
        self._lru[oid] = None

    def touch(self, oid: int) -> None:
        """``oid`` was used: it goes to the back (joining the order if it was not in it)."""
        self._lru.pop(oid, None)
        self._lru[oid] = None

    def remove(self, oid: int) -> None:
        self._lru.pop(oid, None)

    def candidates(self) -> Iterator[int]:
        return iter(self._lru)


class LRUPolicy:
    """Least recently used first. Cheap, and right until an access trace exists."""

    name = "lru"

    def __init__(self, protected: Container[int] = ()) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()
        self.protected = protected
        """Objects prefetched and not yet used (``Prefetcher.protected_ids``, read-only):
        offered last."""

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
    those go last. Every object needed later than that is fetched back in time anyway;
    what matters is how many bytes that costs and *where* in the step they are read
    back. Each traced position has a fixed rotation key, so the same objects rotate
    step after step, and among objects beyond every reach:

    1. objects that may rotate and were already used in this step (next needed in the
       next one), highest rotation key first;
    2. then those still ahead in this step (evicting one costs a read in this step),
       highest key first;
    3. then the held ones, latest in the step first: the head of the step (the accesses
       from its start whose bytes fit in the budget) and objects larger than half the
       budget. Nothing runs before the head to hide its reads behind (plain Belady's
       rotation drifts into it: at the wrap the object just used is the one needed
       furthest away), and an object that fills most of the reach cannot be read
       within the compute in front of it.

    The rotation keys are the positions' bit-reversed ranks (a van der Corput order):
    whatever fraction of the step a too-small tier must rotate is spread evenly over
    it, so the disk reads and writes back at about the step's average rate everywhere
    instead of all at once in one stretch.

    Cost per eviction: O(traces x HORIZON) plus the candidates skipped, not a pass
    over every resident object: the policy keeps, per learned trace, its resident
    objects in three lists sorted by rotation key (used in this step, ahead, held),
    moving entries from the second to the first as the trace's cursor passes them
    (both are split again when a step wraps), and the resident objects no trace uses,
    in LRU order; all are rebuilt only when a learned order changes.
    """

    name = "trace"

    def __init__(self, book: LearnedOrder, protected: Container[int] = (),
                 reach: Callable[[Trace], int] | None = None, size: Callable[[int], int] | None = None,
                 budget_bytes: int = 0) -> None:
        super().__init__(protected)
        self.book = book
        self.reach = reach
        """Accesses ahead of a trace's cursor the prefetcher fetches (None: ``HORIZON``)."""
        self.size = size
        """Bytes of an object (None: every object counts as one, and the budget is the
        reach when the order is learned, in accesses)."""
        self.budget_bytes = budget_bytes
        self._version = -1
        self._traces: list[Trace] = []
        self._where: dict[int, list[int]] = {}
        """Traced oid -> indexes in ``_traces`` of the traces that use it."""
        self._rotation: list[list[float]] = []
        """Per trace: the rotation key of each position (higher: evicted first)."""
        self._parts: list[tuple[list, list, list]] = []
        """Per trace: (used in this step, ahead, held) resident objects as sorted
        (rotation key, latest position) lists, split at ``_split``'s cursor."""
        self._split: list[int] = []
        """Per trace: the cursor at which its lists were last split."""
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
        self._rotation = [self._rotation_keys(t) for t in self._traces]
        self._split = [t.cursor for t in self._traces]
        self._parts = [([], [], []) for _ in self._traces]
        self._untraced = OrderedDict()
        for oid in self._order:
            self._add(oid)
        for lists in self._parts:
            for lst in lists:
                lst.sort()

    def _rotation_keys(self, t: Trace) -> list[float]:
        """Each position's rotation key: its bit-reversed rank, in [0, 1), where it may
        rotate; position / length - 1, in [-1, 0), in the head of the step and for an
        object larger than half the budget."""
        n = len(t.learned)
        sizes = [self.size(o) for o in t.learned] if self.size is not None else [1] * n
        budget = self.budget_bytes if self.size is not None else self.horizon(t)
        head, acc = 0, 0
        while head < n and (head == 0 or acc + sizes[head] <= budget):
            acc += sizes[head]
            head += 1
        keys = [p / n - 1.0 for p in range(n)]
        spread = [p for p in range(head, n) if 2 * sizes[p] <= budget]
        bits = max(1, (len(spread) - 1).bit_length())
        ranks = np.arange(len(spread), dtype=np.int64)
        rev = np.zeros_like(ranks)
        for b in range(bits):  # each rank's bits reversed, all ranks at once
            rev |= ((ranks >> b) & 1) << (bits - 1 - b)
        for p, key in zip(spread, (rev / (1 << bits)).tolist()):
            keys[p] = key
        return keys

    def _entry(self, i: int, oid: int) -> tuple[float, int]:
        """(rotation key, latest position) of ``oid`` in trace ``i``."""
        p = self._traces[i].positions[oid][-1]
        return self._rotation[i][p], p

    def _list(self, i: int, entry: tuple[float, int]) -> list:
        """The list of trace ``i`` that ``entry`` belongs in, at its last split."""
        key, p = entry
        return self._parts[i][2 if key < 0 else 0 if p <= self._split[i] else 1]

    def _add(self, oid: int, keep_sorted: bool = False) -> None:
        where = self._where.get(oid)
        if where is None:
            self._untraced[oid] = None
            return
        for i in where:
            e = self._entry(i, oid)
            if keep_sorted:
                bisect.insort(self._list(i, e), e)
            else:
                self._list(i, e).append(e)

    def _catch_up(self, i: int) -> None:
        """Split trace ``i``'s lists at its cursor now: move the entries the cursor passed
        since the last split from ahead to used (O(accesses passed)); after a wrap, split
        them all again (once a step)."""
        t = self._traces[i]
        c0 = self._split[i]
        if t.cursor == c0:
            return
        used, ahead, _ = self._parts[i]
        self._split[i] = t.cursor
        if t.cursor < c0:
            both = used + ahead
            used[:] = sorted(e for e in both if e[1] <= t.cursor)
            ahead[:] = sorted(e for e in both if e[1] > t.cursor)
            return
        for p in range(c0 + 1, t.cursor + 1):
            oid = t.learned[p]
            if oid not in self._order or t.positions[oid][-1] != p or self._rotation[i][p] < 0:
                continue
            e = (self._rotation[i][p], p)
            k = bisect.bisect_left(ahead, e)
            if k < len(ahead) and ahead[k] == e:
                del ahead[k]
                bisect.insort(used, e)

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
                    e = self._entry(i, oid)
                    lst = self._list(i, e)
                    k = bisect.bisect_left(lst, e)
                    if k < len(lst) and lst[k] == e:
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
        for i in range(len(traces)):
            self._catch_up(i)
        # beyond every reach: the objects that may rotate, those used in this step before
        # those ahead in it, each highest rotation key first; then the held ones, latest
        # first (a k-way merge of the per-trace lists; entries within a trace's reach, at
        # most its horizon, are skipped)
        for part in range(3):
            heap = [(-parts[part][-1][0], i, len(parts[part]) - 1)
                    for i, parts in enumerate(self._parts) if parts[part]]
            heapq.heapify(heap)
            while heap:
                _, i, k = heapq.heappop(heap)
                lst, t = self._parts[i][part], traces[i]
                if k >= len(lst):
                    continue
                if k:
                    heapq.heappush(heap, (-lst[k - 1][0], i, k - 1))
                p = lst[k][1]
                if (p - t.cursor - 1) % len(t.learned) < horizons[i]:
                    continue  # within this trace's reach
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

    def keys(self) -> dict[int, tuple]:
        """The key the walk orders candidates by, for every resident object (for tests):
        (0, LRU rank) untraced; (1, part, -rotation key) beyond every reach, part 0 for an
        object that may rotate and is already used in this step, 1 for one still ahead in
        it, 2 for a held one (the lowest over the traces using it); (2, -distance) within
        one."""
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
                keys[oid] = (1, *min(self._part(i, oid) for i in self._where[oid]))
        return keys

    def _part(self, i: int, oid: int) -> tuple[int, float]:
        key, p = self._entry(i, oid)
        return (2 if key < 0 else 0 if p <= self._traces[i].cursor else 1), -key

    def distance(self, oid: int) -> int | None:
        return self.book.distance(oid)


def make_policy(name: str, book: LearnedOrder, protected: Container[int],
                reach: Callable[[Trace], int] | None = None, size: Callable[[int], int] | None = None,
                budget_bytes: int = 0) -> EvictionPolicy:
    if name == "lru":
        return LRUPolicy(protected)
    if name == "trace":
        return TracePolicy(book, protected, reach, size, budget_bytes)
    raise ValueError(f"unknown policy {name!r}")
