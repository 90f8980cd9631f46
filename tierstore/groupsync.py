"""Group commit: one fsync for every caller waiting on the same file.

``GroupSync(fn).sync()`` returns once a call of ``fn`` (an fsync/fdatasync of one
file) that *began after* ``sync`` was entered has completed, so whatever the caller
wrote to that file before calling it is on stable storage. Callers that arrive while
an fsync is running wait for the next one, which a single thread (the first of them
to get the turn) runs for all of them: N concurrent commits cost far fewer than N
fsyncs, and none returns before an fsync covering its write.

A failed fsync fails every caller it would have covered (each gets the error); the
next round tries again.
"""

from __future__ import annotations

import errno
import threading
from typing import Callable

__all__ = ["GroupSync"]


class _Round:
    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = False
        self.error: OSError | None = None


class GroupSync:
    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn = fn
        self._cv = threading.Condition(threading.Lock())
        self._next = _Round()  # the round that callers arriving now join; it has not started
        self._running = False
        self.rounds = 0
        """fsyncs run (each covering every caller of its round)."""
        self.callers = 0

    def sync(self) -> None:
        with self._cv:
            r = self._next
            self.callers += 1
            while not r.done:
                if not self._running:  # our round's turn: lead it
                    self._running = True
                    self._next = _Round()
                    break
                self._cv.wait()
            else:
                if r.error is not None:
                    raise OSError(r.error.errno, r.error.strerror)
                return
        try:
            self._fn()
        except OSError as e:
            r.error = e
        except BaseException as e:  # never let the followers take a failure for a sync
            r.error = OSError(errno.EIO, f"sync failed: {e}")
            raise
        finally:
            with self._cv:
                r.done = True
                self._running = False
                self.rounds += 1
                self._cv.notify_all()
        if r.error is not None:
            raise OSError(r.error.errno, r.error.strerror)
