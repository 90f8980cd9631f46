"""The group committer: durable commits made durable together, a batch at a time.

A durable put costs two syncs (its bytes on the NVMe tier, then its journal record)
and, done one by one, a thread that waits through both. ``GroupCommit`` takes durable
commits from any thread (``submit``: a future of the commit) and threads of its own
commit whatever has queued since its last batch, in the order the promise needs:

1. every object's bytes written (adjacent small ones in one request,
   ``NvmeTier.write_many``), then one sync per drive written to
   (``Placement.land_many``); a failed write fails its object, a failed sync every
   object of the batch, before anything is published;
2. every record appended and every object published in one hold of the journal lock,
   then one journal fdatasync for the batch (``Durability.record_puts``);
3. every future completed: a put is answered only now, with its bytes and its record
   on stable storage. A crash at any point before loses only unanswered puts, and
   never leaves a record naming bytes that were not synced.

Steps 1 and 2 run on two threads, a batch apart: one batch's bytes are written and
synced while the batch before it is journaled. So N durable puts in flight cost two
syncs and a few writes, not 2N syncs and N threads. The committer knows nothing of reservations or replies: ``Puts`` hands it
the object, its publish step and its last steps, and gets a future of the put.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from .durability import Durability
from .errors import Closed, StorageError
from .index import ObjectMeta
from .placement import Landing, Placement

__all__ = ["GroupCommit", "MAX_BATCH", "Pending"]

log = logging.getLogger(__name__)

MAX_BATCH = 512
"""Most commits in one batch (each small one is one buffer of a ``pwritev``)."""


_HANDOFF = threading.Lock()
"""Orders a ``Pending``'s settling against a callback being added to it (held for a few
instructions: one lock for all of them is cheaper than one each)."""


class Pending:
    """The outcome of one queued commit, settled once by the committer: ``result()`` waits
    for it (a caller that waits), ``add_done_callback`` runs a function on it once it is
    there (the daemon, which never waits). A ``concurrent.futures.Future`` does as much,
    at several times the cost per put."""

    __slots__ = ("_value", "_error", "_done", "_callback", "_settled")

    def __init__(self) -> None:
        self._value: Any = None
        self._error: BaseException | None = None
        self._done = False
        self._callback: Callable[["Pending"], None] | None = None
        self._settled = threading.Lock()
        self._settled.acquire()  # released once settled: ``result`` waits on it

    def done(self) -> bool:
        return self._done

    def settle(self, value: Any, error: BaseException | None) -> None:
        self._value, self._error = value, error
        with _HANDOFF:
            self._done = True
            callback, self._callback = self._callback, None
        self._settled.release()
        if callback is not None:
            callback(self)

    def add_done_callback(self, fn: Callable[["Pending"], None]) -> None:
        """``fn(self)`` once settled: at once if it is, else on the settling thread. One callback."""
        with _HANDOFF:
            if not self._done:
                self._callback = fn
                return
        fn(self)

    def result(self) -> Any:
        if not self._done:
            with self._settled:  # until ``settle`` releases it
                pass
        if self._error is not None:
            raise self._error
        return self._value


@dataclass(slots=True)
class _Commit:
    meta: ObjectMeta
    tier: str | None
    replace: bool
    publish: Callable[[Landing], None]
    """(under the index's cv) Make the object visible (and hand what it replaced to its discard)."""
    finish: Callable[[], Any]
    """(once durable) The put's last step; what it returns is the future's result."""
    failed: Callable[[], None]
    """(once failed) Give up the put, before the future gets the error."""
    future: "Pending" = field(default_factory=lambda: Pending())
    landing: Landing | None = None

    def succeed(self) -> None:
        try:
            result = self.finish()
        except Exception as e:
            self.fail(e)
            return
        self.future.settle(result, None)

    def fail(self, e: Exception) -> None:
        if self.future.done():
            return
        try:
            self.failed()
        finally:
            self.future.settle(None, e)


class GroupCommit:
    """One thread committing queued durable commits a batch at a time; see the module docstring."""

    def __init__(self, placement: Placement, durability: Durability) -> None:
        self.placement, self.durability = placement, durability
        self._queue: deque[_Commit] = deque()
        # guards the queue and ``_closing``; the writer waits on it for work
        self._cv = threading.Condition(threading.Lock())
        self._closing = False
        # batches written and synced, waiting for the journal stage (None: no more); bounded,
        # so the writer runs at most two batches ahead of the journal
        self._landed: queue.Queue[list[_Commit] | None] = queue.Queue(maxsize=2)
        self.batches = 0
        """Batches committed (each: one sync per drive written to, one journal sync)."""
        self.commits = 0
        self._writer = threading.Thread(target=self._write_loop, name="tierstore-commit-data", daemon=True)
        self._journaler = threading.Thread(target=self._journal_loop, name="tierstore-commit-journal", daemon=True)
        self._writer.start()
        self._journaler.start()

    def submit(self, meta: ObjectMeta, *, tier: str | None, replace: bool,
               publish: Callable[[Landing], None], finish: Callable[[], Any],
               failed: Callable[[], None]) -> "Pending":
        """Queue the durable commit of ``meta`` (reserved, filled, flagged ``moving``). Once
        it is durable, ``finish()`` runs on the committer
        and the future's result is what it returns; if it fails, ``failed()`` runs and the
        future gets the error (nothing was published then, unless the journal sync failed
        after the publish, as with ``Durability.record_put``)."""
        c = _Commit(meta, tier, replace, publish, finish, failed)
        with self._cv:
            if self._closing:
                raise Closed("the store is closing; no more durable puts are taken")
            self._queue.append(c)
            self._cv.notify()
        return c.future

    def close(self) -> None:
        """Commit what is queued, then stop both threads."""
        with self._cv:
            self._closing = True
            self._cv.notify()
        self._writer.join()
        self._journaler.join()

    # The two stages run on their own threads, so one batch's bytes are written and synced
    # while the batch before it is journaled and synced: the drive and the journal work at
    # once. The journal stage takes batches in the order they were written.
    def _write_loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closing:
                    self._cv.wait()
                if not self._queue:
                    break
                batch = [self._queue.popleft() for _ in range(min(len(self._queue), MAX_BATCH))]
            try:
                live = self._land(batch)
            except Exception as e:  # a bug fails this batch's puts, not the committer
                self._fail(batch, e)
                continue
            if live:
                self._landed.put(live)
        self._landed.put(None)
        log.info("group committer: writer stopped")

    def _journal_loop(self) -> None:
        while (batch := self._landed.get()) is not None:
            try:
                self._record(batch)
            except Exception as e:  # a bug fails this batch's puts, not the committer
                self._fail(batch, e)
        log.info("group committer stopped after %d batches of %d commits", self.batches, self.commits)

    def _land(self, batch: list[_Commit]) -> list[_Commit]:
        """Stage 1: every object's bytes written and synced; the commits that got there."""
        landed = self.placement.land_many([(c.meta, c.tier) for c in batch])
        live = []
        for c, landing in zip(batch, landed):
            if isinstance(landing, Exception):
                c.fail(landing)
            else:
                c.landing = landing
                live.append(c)
        return live

    def _record(self, batch: list[_Commit]) -> None:
        """Stage 2: every record appended and object published, one journal sync, answers."""
        outs = self.durability.record_puts([(c.meta, c.replace, (lambda c=c: c.publish(c.landing))) for c in batch])
        self.batches += 1
        self.commits += len(batch)
        for c, out in zip(batch, outs):
            if isinstance(out, Exception):
                c.fail(out)
            else:
                c.succeed()

    @staticmethod
    def _fail(batch: list[_Commit], e: Exception) -> None:
        log.exception("group commit of %d puts failed", len(batch))
        for c in batch:
            c.fail(StorageError(f"durable commit failed: {type(e).__name__}: {e}"))
