"""The discard queue: objects whose space is given up, discarded off the caller's path.

``DiscardQueue`` owns one worker thread and the count of discards handed to it and not
yet done. The thread is its own (not the prefetch pool), so no fetch that waits for the
space a discard gives back can stand in front of it; until a queued discard has run, a
host allocation that finds no room waits for it (``pending``) instead of failing.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from .index import ObjectMeta
from .objectindex import ObjectIndex

__all__ = ["DiscardQueue"]

log = logging.getLogger(__name__)


class DiscardQueue:
    """One thread of discards; see the module docstring."""

    def __init__(self, index: ObjectIndex) -> None:
        self.index = index
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierstore-discard")
        self.pending = 0
        """Discards handed to the thread and not yet done (under the index's cv)."""

    def submit(self, meta: ObjectMeta, discard: Callable[[ObjectMeta], None]) -> None:
        """(under cv) ``discard(meta)`` on the discard thread. The index's waiters are woken
        when it is done (the space is back)."""
        cv = self.index.cv

        def run() -> None:
            try:
                discard(meta)
            finally:
                with cv:
                    self.pending -= 1
                    cv.notify_all()

        try:
            self._pool.submit(run)
        except RuntimeError:  # (the store is closing: a durable object's record is superseded at the next start)
            log.warning("discard of %s not run: the store is closing", meta.handle)
            return
        self.pending += 1

    def close(self) -> None:
        """Run the discards already queued, then stop the thread."""
        self._pool.shutdown(wait=True)
