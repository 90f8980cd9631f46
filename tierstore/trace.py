"""Access traces: learn a training loop's access order and predict what comes next.

Policy only (no I/O, no locks of its own; the store calls it under its lock). One
``Trace`` per (client, stream) records the object ids accessed between ``step()``
marks. A step whose order matches the previous one (most accesses in the same
relative order) makes the trace *learned*; small changes (an extra or missing
access, a skipped layer) keep it learned and update it; a step that mostly differs
drops back to *learning*, and the new order is learned once it repeats.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Iterator

__all__ = ["HORIZON", "MAX_LEARNED", "MAX_STEP_ACCESSES", "MAX_STREAMS", "OVERFLOW_STREAM", "StepWork", "Trace",
           "TraceBook", "similarity"]

_SIMILAR = 0.8
"""Fraction of accesses that must keep their relative order for a step to 'repeat'."""
MAX_STEP_ACCESSES = 1 << 17
"""Accesses one owner's traces record per step, all its streams together; the rest of
a longer step is not learned (its first part still is)."""
MAX_LEARNED = 1 << 21
"""Positions every learned order holds, all owners together: an order that would take
the total past it is not learned (that trace predicts nothing; ``over_budget`` counts it)."""
HORIZON = 64
"""Accesses ahead the prefetcher looks (its byte budget usually stops it earlier)."""
MAX_STREAMS = 64
"""Traces one owner (a connection, an in-process owner) may have; later stream names share one."""
OVERFLOW_STREAM = "(more streams)"
"""The trace an owner's accesses on stream names beyond ``MAX_STREAMS`` are recorded in."""
MAX_STREAM_CHARS = 128
"""Longest stream name a request may give."""


def similarity(a: list[int], b: list[int]) -> float:
    """Length of the longest common subsequence of ``a`` and ``b`` over the longer one.

    Computed on the unique-first-occurrence projection with patience sorting
    (O(n log n)), which is exact when ids repeat at most once per step and a close
    lower bound otherwise.
    """
    if not a or not b:
        return 1.0 if not a and not b else 0.0
    pos = {}
    for i, x in enumerate(b):
        pos.setdefault(x, i)
    seq = [pos[x] for x in dict.fromkeys(a) if x in pos]
    tails: list[int] = []
    for v in seq:
        k = bisect.bisect_left(tails, v)
        if k == len(tails):
            tails.append(v)
        else:
            tails[k] = v
    return len(tails) / max(len(dict.fromkeys(a)), len(dict.fromkeys(b)))


@dataclass(eq=False)
class StepWork:
    """One trace's closed step, to be decided without the store's lock (``decide``: the
    comparisons and the index of a new order, O(n log n) in the step's length) and then
    applied under it (``Trace.apply``)."""

    trace: "Trace"
    cur: list[int]
    previous: list[int]
    before: list[int]
    learned: list[int]
    outcome: str = ""
    """``empty`` (no access), ``same`` (the learned order repeats), ``learn`` (a new
    order: ``seq``, indexed in ``positions``) or ``forget`` (no order repeats)."""
    seq: list[int] | None = None
    positions: dict[int, list[int]] | None = None

    def decide(self) -> "StepWork":
        cur, previous, before = self.cur, self.previous, self.before
        seq = None
        if not cur:
            self.outcome = "empty"
            return self
        if previous and similarity(cur, previous) >= _SIMILAR:
            seq = cur
        elif before and previous and similarity(cur, before) >= _SIMILAR:
            seq = previous + cur
        if seq is None:
            self.outcome = "forget"
        elif seq == self.learned:
            self.outcome = "same"  # the usual case in a training loop: nothing to rebuild
        else:
            self.outcome, self.seq, self.positions = "learn", seq, {}
            for i, x in enumerate(seq):
                self.positions.setdefault(x, []).append(i)
        return self


@dataclass(eq=False)
class Trace:
    """The learned order of one client's (stream's) accesses."""

    learned: list[int] = field(default_factory=list)
    current: list[int] = field(default_factory=list)
    previous: list[int] = field(default_factory=list)
    before: list[int] = field(default_factory=list)
    state: str = "learning"
    """``learning`` (no prediction yet) or ``learned``."""
    cursor: int = 0
    """Position in ``learned`` of the latest access."""
    positions: dict[int, list[int]] = field(default_factory=dict)
    steps: int = 0
    relearned: int = 0
    version: int = 0
    """Bumped whenever ``learned`` (and so ``positions``) changes."""
    ticks: int = 0
    """Positions the cursor has moved forward in total (a clock along the repeating order)."""

    def record(self, oid: int, keep: bool = True) -> None:
        """An access; ``keep``: it is recorded for learning (within its owner's
        ``MAX_STEP_ACCESSES``), else it only moves the cursor."""
        if keep:
            self.current.append(oid)
        if self.state == "learned":
            self._move(self._locate(oid))

    def step(self) -> None:
        """Close the current step and decide whether the order repeats.

        A step like the previous one gives a one-step cycle. A step like the one
        before the previous gives a two-step cycle (previous + current): loops that
        alternate between two sets of objects, such as double-buffered optimizer
        state, are predicted too.
        """
        self.apply(self.close().decide())

    def close(self) -> StepWork:
        """(under the lock) The step ends here: its accesses, for ``StepWork.decide``;
        those from now on belong to the next step."""
        cur, self.current = self.current, []
        self.steps += 1
        return StepWork(self, cur, self.previous, self.before, self.learned)

    def apply(self, work: StepWork, room: bool = True) -> None:
        """(under the lock) What ``work`` decided; ``room``: a new order fits in the
        learned positions' budget (else it is not learned)."""
        if work.outcome == "empty":
            return
        was = self.state
        if work.outcome == "same" or (work.outcome == "learn" and room):
            self.state = "learned"
            if work.outcome == "learn":
                self.learned, self.positions = work.seq, work.positions
                self.version += 1
        else:
            self.state = "learning"
            if self.learned:
                self.learned, self.positions = [], {}
                self.version += 1
            if was == "learned":
                self.relearned += 1
        self.before, self.previous = self.previous, work.cur
        self._move(len(self.learned) - 1 if self.learned else 0)

    def _move(self, cursor: int) -> None:
        if self.learned:
            self.ticks += (cursor - self.cursor) % len(self.learned)
        self.cursor = cursor

    def _locate(self, oid: int) -> int:
        """The position of ``oid`` at or after the cursor (wrapping); cursor if unknown."""
        ps = self.positions.get(oid)
        if not ps:
            return self.cursor
        k = bisect.bisect_left(ps, self.cursor)
        return ps[k] if k < len(ps) else ps[0]

    def distance(self, oid: int) -> int | None:
        """Accesses until ``oid`` is next used (0 = the next one), or None if not in the trace."""
        ps = self.positions.get(oid)
        if self.state != "learned" or not ps:
            return None
        n = len(self.learned)
        k = bisect.bisect_right(ps, self.cursor)
        nxt = ps[k] if k < len(ps) else ps[0] + n
        return nxt - self.cursor - 1


class TraceBook:
    """Every live trace, by owner and stream.

    An owner has at most ``MAX_STREAMS`` traces: accesses on further stream names are
    recorded in one shared trace of that owner (``OVERFLOW_STREAM``), so a client that
    invents a name per access cannot grow the book without bound; ``step`` costs the
    owner's own traces, not everyone's. An owner's traces record at most
    ``MAX_STEP_ACCESSES`` accesses a step, and the learned orders of all owners hold at
    most ``MAX_LEARNED`` positions."""

    def __init__(self, max_learned: int = MAX_LEARNED) -> None:
        self._owners: dict[object, dict[str, Trace]] = {}
        self._recorded: dict[object, int] = {}
        """Owner -> accesses its traces recorded in this step."""
        self.max_learned = max_learned
        self.learned_total = 0
        """Positions in every learned order together."""
        self.over_budget = 0
        """Orders not learned for want of room in ``max_learned``."""
        self.version = 0
        """Bumped whenever some trace's learned order changes or a trace goes away."""

    def record(self, owner: object, stream: str, oid: int) -> Trace:
        """An access by ``owner`` on ``stream``: recorded in its trace (within the owner's
        ``MAX_STEP_ACCESSES``), which it returns."""
        t = self.get(owner, stream)
        n = self._recorded.get(owner, 0)
        if n < MAX_STEP_ACCESSES:
            self._recorded[owner] = n + 1
            t.record(oid)
        else:
            t.record(oid, keep=False)
        return t

    def pending(self, owner: object) -> int:
        """What a step of ``owner``'s would compare: its traces' accesses this step and
        the two before."""
        return sum(len(t.current) + len(t.previous) + len(t.before) for t in self._owners.get(owner, {}).values())

    @property
    def traces(self) -> dict[tuple[object, str], Trace]:
        return {(o, s): t for o, streams in self._owners.items() for s, t in streams.items()}

    def get(self, owner: object, stream: str) -> Trace:
        streams = self._owners.get(owner)
        if streams is None:
            streams = self._owners[owner] = {}
        t = streams.get(stream)
        if t is None:
            if len(streams) >= MAX_STREAMS:
                stream = OVERFLOW_STREAM
                t = streams.get(stream)
            if t is None:
                t = streams[stream] = Trace()
        return t

    def step(self, owner: object) -> None:
        self.apply(owner, [w.decide() for w in self.close(owner)])

    def close(self, owner: object) -> list[StepWork]:
        """(under the lock) ``owner``'s step ends: its traces' work, to ``decide`` without
        the lock and ``apply`` under it (one step of an owner at a time)."""
        self._recorded.pop(owner, None)
        return [t.close() for t in self._owners.get(owner, {}).values()]

    def apply(self, owner: object, works: list[StepWork]) -> None:
        """(under the lock) What ``owner``'s decided ``works`` say (none, if it went away
        meanwhile)."""
        streams = self._owners.get(owner)
        live = {id(t) for t in streams.values()} if streams else set()
        for w in works:
            t = w.trace
            if id(t) not in live:
                continue
            before, old = t.version, len(t.learned)
            room = w.outcome != "learn" or self.learned_total - old + len(w.seq) <= self.max_learned
            self.over_budget += not room
            t.apply(w, room)
            self.learned_total += len(t.learned) - old
            self.version += t.version != before

    def drop(self, owner: object) -> None:
        self._recorded.pop(owner, None)
        streams = self._owners.pop(owner, None)
        if streams is not None:
            gone = sum(len(t.learned) for t in streams.values())
            self.learned_total -= gone
            self.version += gone > 0  # (an owner that had learned nothing changes no learned order)

    def of(self, owner: object) -> list[Trace]:
        """The owner's traces."""
        return list(self._owners.get(owner, {}).values())

    def all_traces(self) -> Iterator[Trace]:
        for streams in self._owners.values():
            yield from streams.values()

    def learned(self) -> bool:
        return any(t.state == "learned" for t in self.all_traces())

    def learned_traces(self) -> list[Trace]:
        return [t for t in self.all_traces() if t.state == "learned" and t.learned]

    def distance(self, oid: int) -> int | None:
        """Smallest predicted distance to the next use of ``oid`` over all traces."""
        best = None
        for t in self.all_traces():
            d = t.distance(oid)
            if d is not None and (best is None or d < best):
                best = d
        return best

    def describe(self) -> list[dict]:
        return [{"client": str(getattr(o, "cid", o)), "stream": s, "state": t.state, "length": len(t.learned),
                 "steps": t.steps, "relearned": t.relearned} for (o, s), t in self.traces.items()]
