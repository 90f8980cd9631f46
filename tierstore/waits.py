"""Waiting for another holder: the rules every wait of the store follows.

A call that must wait for another holder to let go (a lease, host room, an object in
flight) waits on the object index's condition variable through ``wait_for_others``.

The daemon's event loop never waits and never touches the disk. It calls the store's
``try_*`` methods: each does its work at once when it can (an object already resident,
room already free, the journal lock free), and otherwise, with nothing taken or changed
(but what a batch has taken so far, which the rest goes on from), returns ``Later``:
the rest of the call, for a thread that may wait (an op worker) to run. On an op worker,
``wait_context(park=True)`` makes a wait for another holder raise ``WouldWait``, and
the daemon moves the rest to a wait thread. Both are internal: they never reach a client.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from .errors import Closed

__all__ = ["Later", "WouldWait", "wait_context", "wait_for_others", "waits_since"]


@dataclass(frozen=True, slots=True)
class Later:
    """What a ``try_*`` call returns when it cannot finish without waiting or touching
    the disk: ``run()`` is the rest of the call (it returns what the call returns), for
    a thread that may wait. Nothing the rest needs is lost: what was done is done once."""

    run: Callable[[], Any]
    give_back: Callable[[], None] | None = None
    """Gives back what the call took before it returned (a batch's leases so far), for
    a caller that ends the call without running the rest; None: it took nothing."""


class WouldWait(Exception):
    """Internal: a call made under ``wait_context(park=True)`` would wait for another
    holder to let go (a lease, host room, an object in flight). Nothing was taken or
    changed (but what a batch had taken, which the rest goes on from); the daemon's op
    worker hands the rest of the request to a wait thread and goes on with the next."""


@dataclass(slots=True)
class WaitContext:
    """How the calls of one daemon request wait (``wait_context``)."""

    park: bool
    abandoned: Callable[[], bool] | None
    since: float | None
    """``time.monotonic()`` when the request first had to wait (its timeouts count from
    then, however long it was queued for a thread); None: from each call's start."""


_waiting = threading.local()


@contextmanager
def wait_context(*, park: bool, abandoned: Callable[[], bool] | None = None,
                 since: float | None = None) -> Iterator[WaitContext]:
    """(the daemon) The store calls this thread makes inside wait this way: ``park``: a
    wait for another holder raises ``WouldWait`` instead (the thread is one other
    requests need; the rest of the request runs again on a thread that may wait, its
    timeouts counted from then); ``abandoned``: polled while waiting — once true (the requester
    went away) the wait ends in ``Closed``; ``since``: when the request first had to
    wait (``waits_since``)."""
    prev = getattr(_waiting, "ctx", None)
    ctx = _waiting.ctx = WaitContext(park, abandoned, since)
    try:
        yield ctx
    finally:
        _waiting.ctx = prev


def waits_since() -> float:
    """When a call's timeout starts: now, or, for a daemon request that already had to
    wait (run again on a wait thread, perhaps after a queue), when it first did. A call
    that waits computes its deadline as ``waits_since() + timeout``."""
    ctx = getattr(_waiting, "ctx", None)
    if ctx is not None and ctx.since is not None:
        return ctx.since
    return time.monotonic()


def wait_for_others(cv: threading.Condition, remaining: float, cancelled: bool) -> None:
    """(under ``cv``, ``remaining`` > 0) Wait for another holder to let go. On a daemon op
    worker, ``WouldWait`` instead; once the daemon is stopping (``cancelled``) or the
    requester is gone, ``Closed``."""
    ctx = getattr(_waiting, "ctx", None)
    if ctx is not None:
        if ctx.park:
            raise WouldWait()
        if ctx.abandoned is not None and ctx.abandoned():
            raise Closed("the connection that asked went away")
    if cancelled:
        raise Closed("the daemon is stopping; reconnect once it is back")
    # a notify_all wakes it at any change; the 1 s cap re-checks the requester and the stop flag
    cv.wait(min(remaining, 1.0))
