"""The prefetcher: turns each recorded access into fetches of what the trace predicts
next, within a byte budget, and serves them on its own worker threads.

Its dependencies are two callables given at construction: ``lookup`` (the object
index's ``holder``: what an object id names now) and ``fetch`` (placement's
promotion of one queued object, whose reads run at prefetch priority so demand reads
overtake them on the I/O engine). State here is guarded by the object index's lock
(every method but the worker loop is called with it held); the rest of the store
asks through the methods below, never through its tables.
"""

from __future__ import annotations

import bisect
import collections
from array import array
import logging
import queue
import threading
import time
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, Container, Iterable

from .trace import HORIZON, StepWork, Trace, TraceBook

if TYPE_CHECKING:
    from .config import StoreConfig
    from .index import ObjectMeta
    from .policy import LearnedOrder

__all__ = ["Prefetcher"]

_DONE, _QUEUED, _AGAIN, _FULL = object(), object(), object(), object()

MAX_HINTED = 65536
"""Hinted objects one client may have waiting for a prefetch slot (the oldest go first)."""

log = logging.getLogger(__name__)


_CHUNK = max(4096, HORIZON)
"""Positions of a learned order whose running byte sums ``reach`` builds at a time (at
least ``HORIZON``: a reach spans at most two chunks)."""
_COUNTER = {"hit": "hits", "late": "late", "miss": "misses"}
"""The counter an access's outcome adds to."""


class Prefetcher:
    def __init__(self, config: "StoreConfig", lookup: Callable[[int], "ObjectMeta | None"],
                 fetch: Callable[[int], None]) -> None:
        self._lookup, self._fetch = lookup, fetch
        self.enabled = config.prefetch
        self.budget_bytes = config.prefetch_budget_bytes
        self.max_inflight = config.prefetch_max_inflight
        self.book = TraceBook()
        self.protected: dict[int, tuple[Any, int]] = {}
        """Prefetched and not yet used: oid -> (owner, nbytes). Not evicted before use."""
        self.protected_ids: Container[int] = MappingProxyType(self.protected)
        """A live, read-only view of ``protected``'s ids, for the eviction policy."""
        self.learned_order: LearnedOrder = self.book
        """The learned access orders, read-only, for the eviction policy."""
        self.protected_bytes = 0
        self.queued: dict[int, tuple[Any, int]] = {}
        """Queued or in flight: oid -> (owner, nbytes)."""
        self.queued_bytes = 0
        self.counters: dict[str, float] = dict.fromkeys(
            ("hits", "late", "misses", "stall_s", "late_wait_s", "prefetched_bytes", "wasted_bytes", "issued",
             "dropped"), 0)
        self.counters["stall_s"] = self.counters["late_wait_s"] = 0.0
        self._q: queue.Queue = queue.Queue()
        self._hints: dict[Any, collections.deque[int]] = {}
        """Per owner: hinted objects not yet offered (the in-flight limit or the budget held
        them back); offered as fetches finish and prefetched objects are used."""
        self._scanned: dict[int, tuple[Trace, int, int]] = {}
        """Per trace: (trace, version, ticks of the last access the scan has passed)."""
        self._sums: dict[int, tuple[Trace, int, dict[int, array]]] = {}
        """Per trace: (trace, version, chunk -> running byte sums over that chunk of two
        rounds of its order)."""
        self._workers = [threading.Thread(target=self._run, name=f"tierstore-prefetch-{i}", daemon=True)
                         for i in range(self.max_inflight)]
        for w in self._workers:
            w.start()

    # ------------------------------------------------------------------ under the store lock
    def record(self, owner: Any, stream: str, oid: int, outcome: str, stall_s: float) -> None:
        """An access by ``owner``: count it, learn from it, schedule what comes next."""
        c = self.counters
        c[_COUNTER[outcome]] += 1
        c["stall_s"] += stall_s
        if outcome == "late":
            c["late_wait_s"] += stall_s
        used = self.protected.pop(oid, None)
        if used is not None:
            self.protected_bytes -= used[1]
            if owner in self._hints:  # budget came free
                self._drain_hints(owner)
        trace = self.book.record(owner, stream, oid)
        if self.enabled and trace.state == "learned":
            self._advance(owner, trace)

    def access(self, owner: Any, stream: str, meta: "ObjectMeta", hit: bool, late: bool, t0: float) -> None:
        """A read of ``meta`` that began at ``t0`` (``time.monotonic()``): from a memory tier
        (``hit``), after waiting for a prefetch in flight (``late``), or neither (a miss)."""
        if hit and not late:
            self.record(owner, stream, meta.id, "hit", 0.0)
        else:
            self.record(owner, stream, meta.id, "late" if hit else "miss", time.monotonic() - t0)

    def hint(self, owner: Any, oids: list[int]) -> int:
        """Explicit prefetch() hints: the same queue and budget as predictions. What the
        in-flight limit or the budget holds back waits, in order, for a slot (at most
        ``MAX_HINTED`` per owner); returns how many were queued now."""
        q = self._hints.setdefault(owner, collections.deque())
        q.extend(oids)
        while len(q) > MAX_HINTED:
            q.popleft()
        return self._drain_hints(owner)

    def _drain_hints(self, owner: Any) -> int:
        q = self._hints.get(owner)
        n = 0
        while q:
            got = self._offer(owner, q[0])
            if got is _FULL:
                if self.queued or self.protected_bytes:
                    break  # a slot or budget comes free later
                self.counters["dropped"] += 1  # larger than the whole budget: it can never be fetched ahead
            q.popleft()
            n += got is _QUEUED
        if not q:
            self._hints.pop(owner, None)
        return n

    def pending(self, oids: Iterable[int]) -> bool:
        """Whether any of ``oids`` is hinted and not yet offered."""
        if not self._hints:
            return False
        waiting = set().union(*self._hints.values())
        return any(o in waiting for o in oids)

    def step(self, owner: Any) -> None:
        self.book.step(owner)

    def close_step(self, owner: Any) -> list[StepWork]:
        """``owner``'s step ends (``TraceBook.close``): decide the work without the lock,
        then ``apply_step`` it."""
        return self.book.close(owner)

    def apply_step(self, owner: Any, works: list[StepWork]) -> None:
        self.book.apply(owner, works)

    def step_cost(self, owner: Any) -> int:
        """Accesses a step of ``owner``'s compares (``TraceBook.pending``)."""
        return self.book.pending(owner)

    def drop_owner(self, owner: Any) -> None:
        """A client went away: forget its traces, queued fetches and protections."""
        self.book.drop(owner)
        self._hints.pop(owner, None)
        live = {id(t) for t in self.book.all_traces()}
        for cache in (self._scanned, self._sums):
            for k in [k for k in cache if k not in live]:
                del cache[k]
        for oid, (o, n) in list(self.queued.items()):
            if o is owner:
                del self.queued[oid]  # the worker sees it gone and skips it
                self.queued_bytes -= n
        for oid, (o, n) in list(self.protected.items()):
            if o is owner:
                del self.protected[oid]
                self.protected_bytes -= n

    def forget(self, oid: int) -> None:
        """The object was freed or evicted; a prefetch it never served was wasted."""
        p = self.protected.pop(oid, None)
        if p is not None:
            self.protected_bytes -= p[1]
            self.counters["wasted_bytes"] += p[1]

    def reach(self, trace: Trace) -> int:
        """How many accesses ahead of ``trace``'s cursor the prefetcher fetches: the next
        ones whose bytes, resident or not, fit in the budget (at least one, at most
        ``HORIZON``). Fetching further ahead would only make room by evicting objects
        needed sooner than the ones fetched; the eviction policy uses the same reach.
        O(log n) amortized: a binary search in running byte sums over the trace's order,
        built a chunk at a time as the cursor reaches it (never the whole order at once,
        so a long order costs the lock no long pause)."""
        n = len(trace.learned)
        if n == 0:
            return 0
        budget = self.budget_bytes if self.enabled else 0
        limit = min(HORIZON, n)
        s = trace.cursor + 1  # positions s .. s + limit - 1 (mod n) are the candidates
        c, j = divmod(s, _CHUNK)
        run = self._chunk(trace, c)
        k = bisect.bisect_right(run, run[j] + budget, j, min(len(run), j + limit + 1)) - 1 - j
        if k == len(run) - 1 - j and k < limit:  # it fits to the end of the chunk: go on in the next
            left = budget - (run[-1] - run[j])
            nxt = self._chunk(trace, c + 1)
            k += bisect.bisect_right(nxt, left, 0, min(len(nxt), limit - k + 1)) - 1
        return max(1, k)

    def _chunk(self, trace: Trace, c: int) -> array:
        """Running byte sums over positions ``c * _CHUNK`` .. of the order read twice round
        (the first 0): built once per learned order, a chunk at a time."""
        n = len(trace.learned)
        got = self._sums.get(id(trace))
        if got is None or got[0] is not trace or got[1] != trace.version:
            got = self._sums[id(trace)] = (trace, trace.version, {})
        chunks = got[2]
        run = chunks.get(c)
        if run is None:
            lookup, seq, acc = self._lookup, trace.learned, 0
            run = array("q", [0])
            for p in range(c * _CHUNK, min((c + 1) * _CHUNK, 2 * n)):
                meta = lookup(seq[p % n])
                acc += meta.nbytes if meta is not None else 0
                run.append(acc)
            chunks[c] = run
        return run

    def _advance(self, owner: Any, trace: Trace) -> None:
        """Queue what the trace predicts within reach, looking only at accesses not seen by
        an earlier call (amortized O(1) per access): an access is passed once its object
        is resident or queued; the scan stops at the first one the budget or the in-flight
        limit holds back, and restarts at an object being moved down."""
        seq, n = trace.learned, len(trace.learned)
        end = trace.ticks + self.reach(trace)
        start = trace.ticks + 1
        st = self._scanned.get(id(trace))
        if st is not None and st[0] is trace and st[1] == trace.version and st[2] >= start:
            start = st[2] + 1
        pending = None
        a = start
        while a <= end:
            got = self._offer(owner, seq[a % n])
            if got is _FULL:
                break
            if got is _AGAIN and pending is None:
                pending = a
            a += 1
        self._scanned[id(trace)] = (trace, trace.version, a - 1 if pending is None else pending - 1)

    def demoted(self, oid: int) -> None:
        """``oid`` left the host tier: a scan that passed it as resident must see it again."""
        for trace, version, done in list(self._scanned.values()):
            d = trace.distance(oid) if trace.version == version else None
            if d is not None and trace.ticks + 1 + d <= done:
                self._scanned[id(trace)] = (trace, version, trace.ticks + d)

    def _offer(self, owner: Any, oid: int) -> object:
        """Queue ``oid`` if it needs fetching: _QUEUED, _DONE (nothing to do), _AGAIN (being
        moved down: look again later) or _FULL (budget or in-flight limit reached)."""
        meta = self._lookup(oid)
        if meta is None or meta.freeing or oid in self.queued or meta.gpu_loc is not None:
            return _DONE
        if meta.moving:
            return _AGAIN if meta.host_valid else _DONE  # a demotion, or someone else's promotion
        if meta.host_valid:
            return _DONE
        if len(self.queued) >= self.max_inflight or \
                self.queued_bytes + self.protected_bytes + meta.nbytes > self.budget_bytes:
            return _FULL
        self._queue(owner, oid, meta.nbytes)
        return _QUEUED

    def _queue(self, owner: Any, oid: int, nbytes: int) -> None:
        self.queued[oid] = (owner, nbytes)
        self.queued_bytes += nbytes
        self.counters["issued"] += 1
        self._q.put(oid)

    def wanted(self, oid: int) -> bool:
        """Whether a fetch of ``oid`` is queued and still wanted (its client did not go away)."""
        return oid in self.queued

    def is_protected(self, oid: int) -> bool:
        """Whether ``oid`` was prefetched and not yet used (eviction and demotion leave it be)."""
        return oid in self.protected

    def idle(self) -> bool:
        """Nothing queued or in flight."""
        return not self.queued

    def settled(self, oids: list[int]) -> bool:
        """Whether the fetches issued for a hint of ``oids`` are done: none of them in flight,
        and none still waiting for a slot (hinted ones are issued as fetches in flight
        finish; with none in flight the budget holds them back until prefetched objects
        are used)."""
        if any(o in self.queued for o in oids):
            return False
        return not self.queued or not self.pending(oids)

    def done(self, oid: int, nbytes: int, fetched: bool) -> None:
        """The worker's fetch of ``oid`` ended (``fetched``: it is host-resident now)."""
        q = self.queued.pop(oid, None)
        if q is None:  # its client went away meanwhile: nothing of it is kept
            if not fetched:
                self.counters["dropped"] += 1
            else:
                self.counters["prefetched_bytes"] += nbytes
            return
        self.queued_bytes -= q[1]
        owner = q[0]
        if fetched:
            self.counters["prefetched_bytes"] += nbytes
            self.protected[oid] = (owner, nbytes)
            self.protected_bytes += nbytes
        else:
            self.counters["dropped"] += 1
        if owner in self._hints:  # a slot came free: the next hinted object
            self._drain_hints(owner)
        if self.enabled:
            # a slot and budget came free: go on down the owner's traces now, not at its next
            # access (a loop that checks a layer out in one batch accesses in bursts)
            for trace in self.book.of(owner):
                if trace.state == "learned":
                    self._advance(owner, trace)

    def stat(self) -> dict[str, Any]:
        c = self.counters
        return {"hits": int(c["hits"]), "late": int(c["late"]), "misses": int(c["misses"]),
                "stall_s": c["stall_s"], "late_wait_s": c["late_wait_s"], "prefetched_bytes": int(c["prefetched_bytes"]),
                "wasted_bytes": int(c["wasted_bytes"]), "issued": int(c["issued"]), "dropped": int(c["dropped"]),
                "queued": len(self.queued), "hinted": sum(len(q) for q in self._hints.values()),
                "protected_bytes": self.protected_bytes,
                "budget_bytes": self.budget_bytes, "enabled": self.enabled, "traces": self.book.describe(),
                "learned_positions": self.book.learned_total, "over_budget": self.book.over_budget}

    # ------------------------------------------------------------------ worker threads
    def _run(self) -> None:
        while True:
            oid = self._q.get()
            if oid is None:
                return
            try:
                self._fetch(oid)
            except Exception:  # one failed fetch must not stop the worker
                log.exception("prefetch of object %d failed", oid)

    def close(self) -> None:
        for _ in self._workers:
            self._q.put(None)
        for w in self._workers:
            w.join()
        log.info("prefetcher stopped")
