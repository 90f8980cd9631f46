"""The group committer: durable commits made durable together, a batch at a time.

A durable put costs two syncs (its bytes on the NVMe tier, then its journal record)
and, done one by one, a thread that waits through both. ``GroupCommit`` takes durable
commits from any thread (``submit``: a future of the commit) and one thread of its own
commits whatever has queued since its last batch, in the order the promise needs:

1. every object's bytes written (adjacent small ones in one request,
   ``NvmeTier.write_many``), then one sync per drive written to
   (``Placement.land_many``); a failed write fails its object, a failed sync every
   object of the batch, before anything is published;
2. every record appended and every object published in one hold of the journal lock,
   then one journal fdatasync for the batch (``Durability.record_puts``);
3. every future completed: a put is answered only now, with its bytes and its record
   on stable storage. A crash at any point before loses only unanswered puts, and
   never leaves a record naming bytes that were not synced.

So N durable puts in flight cost two syncs and a few writes, not 2N syncs and N
threads. The committer knows nothing of reservations or replies: ``Puts`` hands it
the object and its publish step, and finishes the put from the future.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

from .durability import Durability
from .errors import Closed, StorageError
from .index import ObjectMeta
from .placement import Landing, Placement

__all__ = ["GroupCommit", "MAX_BATCH", "then"]

log = logging.getLogger(__name__)

MAX_BATCH = 512
"""Most commits in one batch (each small one is one buffer of a ``pwritev``)."""


@dataclass(slots=True)
class _Commit:
    meta: ObjectMeta
    tier: str | None
    gpu_loc: int | None
    replace: bool
    publish: Callable[[Landing], ObjectMeta | None]
    """(under the index's cv) Make the object visible; what it replaced."""
    future: Future = field(default_factory=Future)
    """Its result: ``(landing, replaced object or None)``."""
    landing: Landing | None = None


class GroupCommit:
    """One thread committing queued durable commits a batch at a time; see the module docstring."""

    def __init__(self, placement: Placement, durability: Durability) -> None:
        self.placement, self.durability = placement, durability
        self._queue: deque[_Commit] = deque()
        # guards the queue and ``_closing``; the committer waits on it for work
        self._cv = threading.Condition(threading.Lock())
        self._closing = False
        self.batches = 0
        """Batches committed (each: one sync per drive written to, one journal sync)."""
        self.commits = 0
        self._thread = threading.Thread(target=self._run, name="tierstore-commit", daemon=True)
        self._thread.start()

    def submit(self, meta: ObjectMeta, *, tier: str | None, gpu_loc: int | None, replace: bool,
               publish: Callable[[Landing], ObjectMeta | None]) -> Future:
        """Queue the durable commit of ``meta`` (reserved, filled, flagged ``moving``); the
        future's result is ``(landing, replaced object or None)`` once it is durable, or
        the error that failed it (then nothing was published, unless the journal sync
        failed after the publish, as with ``Durability.record_put``)."""
        c = _Commit(meta, tier, gpu_loc, replace, publish)
        with self._cv:
            if self._closing:
                raise Closed("the store is closing; no more durable puts are taken")
            self._queue.append(c)
            self._cv.notify()
        return c.future

    def close(self) -> None:
        """Commit what is queued, then stop the thread."""
        with self._cv:
            self._closing = True
            self._cv.notify()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closing:
                    self._cv.wait()
                if not self._queue:
                    break
                batch = [self._queue.popleft() for _ in range(min(len(self._queue), MAX_BATCH))]
            try:
                self._commit(batch)
            except Exception as e:  # a bug fails this batch's puts, not the committer
                log.exception("group commit of %d puts failed", len(batch))
                for c in batch:
                    if not c.future.done():
                        c.future.set_exception(StorageError(f"durable commit failed: {type(e).__name__}: {e}"))
        log.info("group committer stopped after %d batches of %d commits", self.batches, self.commits)

    def _commit(self, batch: list[_Commit]) -> None:
        landed = self.placement.land_many([(c.meta, c.tier, c.gpu_loc) for c in batch])
        live = []
        for c, landing in zip(batch, landed):
            if isinstance(landing, Exception):
                c.future.set_exception(landing)
            else:
                c.landing = landing
                live.append(c)
        olds = self.durability.record_puts(
            [(c.meta, c.replace, (lambda c=c: c.publish(c.landing))) for c in live]) if live else []
        self.batches += 1
        self.commits += len(batch)
        for c, old in zip(live, olds):
            if isinstance(old, Exception):
                c.future.set_exception(old)
            else:
                c.future.set_result((c.landing, old))


def then(done: Future, ok: Callable[[Any], Any], failed: Callable[[], None] = lambda: None) -> Future:
    """A future of ``ok(result of done)``; if ``done`` (or ``ok``) fails, ``failed()`` runs
    and the error passes on. Both run on the thread that completes ``done``."""
    out: Future = Future()

    def finish(f: Future) -> None:
        try:
            out.set_result(ok(f.result()))
        except BaseException as e:
            try:
                failed()
            finally:
                out.set_exception(e)

    done.add_done_callback(finish)
    return out
