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

__all__ = ["HORIZON", "MAX_STREAMS", "OVERFLOW_STREAM", "Trace", "TraceBook", "similarity"]

_SIMILAR = 0.8
"""Fraction of accesses that must keep their relative order for a step to 'repeat'."""
_MAX_STEP_ACCESSES = 1 << 20
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


@dataclass
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

    def record(self, oid: int) -> None:
        if len(self.current) < _MAX_STEP_ACCESSES:
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
        cur, self.current = self.current, []
        self.steps += 1
        if not cur:
            return
        was = self.state
        if self.previous and similarity(cur, self.previous) >= _SIMILAR:
            self._learn(cur)
        elif self.before and self.previous and similarity(cur, self.before) >= _SIMILAR:
            self._learn(self.previous + cur)
        else:
            self.state = "learning"
            if self.learned:
                self.learned, self.positions = [], {}
                self.version += 1
            if was == "learned":
                self.relearned += 1
        self.before, self.previous = self.previous, cur
        self._move(len(self.learned) - 1 if self.learned else 0)

    def _move(self, cursor: int) -> None:
        if self.learned:
            self.ticks += (cursor - self.cursor) % len(self.learned)
        self.cursor = cursor

    def _learn(self, seq: list[int]) -> None:
        self.state = "learned"
        if seq == self.learned:
            return  # the usual case in a training loop: nothing to rebuild
        self.learned = list(seq)
        self.positions = {}
        for i, x in enumerate(seq):
            self.positions.setdefault(x, []).append(i)
        self.version += 1

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
    owner's own traces, not everyone's."""

    def __init__(self) -> None:
        self._owners: dict[object, dict[str, Trace]] = {}
        self.version = 0
        """Bumped whenever some trace's learned order changes or a trace goes away."""

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
        for t in self._owners.get(owner, {}).values():
            before = t.version
            t.step()
            self.version += t.version != before

    def drop(self, owner: object) -> None:
        if self._owners.pop(owner, None) is not None:
            self.version += 1

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
