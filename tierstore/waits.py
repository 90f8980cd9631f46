"""Waiting for another holder: the rules every wait of the store follows.

A call that must wait for another holder to let go (a lease, host room, an object in
flight) waits on the object index's condition variable through ``wait_for_others``.
The daemon sets how the calls of one request wait (``wait_context``): on its event loop
a call that would wait or touch the disk raises ``WouldBlock`` (``nowait=True``
calls), on an op worker one that would wait for another holder raises ``WouldWait``.
Both are internal: they never reach a client.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

from .errors import Closed

__all__ = ["WouldBlock", "WouldWait", "wait_context", "wait_for_others"]


class WouldBlock(Exception):
    """Internal: a ``nowait=True`` call would have to wait or touch the disk.

    The daemon's event loop calls the store with ``nowait=True`` and, on this,
    hands the request to a worker thread instead; it never reaches a client.
    """


class WouldWait(WouldBlock):
    """Internal: a call made under ``wait_context(park=True)`` would wait for another
    holder to let go (a lease, host room, an object in flight). Nothing was taken or
    changed (but what a batch had taken: its ``progress``); the daemon's op worker hands
    the request to a wait thread and goes on with the next."""


@dataclass(slots=True)
class WaitContext:
    """How the calls of one daemon request wait (``wait_context``)."""

    park: bool
    abandoned: Callable[[], bool] | None


_waiting = threading.local()


@contextmanager
def wait_context(*, park: bool, abandoned: Callable[[], bool] | None = None) -> Iterator[WaitContext]:
    """(the daemon) The store calls this thread makes inside wait this way: ``park``: a
    wait for another holder raises ``WouldWait`` instead (the thread is one other
    requests need; the request runs again on a thread that may wait, its timeouts
    counted from then); ``abandoned``: polled while waiting — once true (the requester
    went away) the wait ends in ``Closed``."""
    prev = getattr(_waiting, "ctx", None)
    ctx = _waiting.ctx = WaitContext(park, abandoned)
    try:
        yield ctx
    finally:
        _waiting.ctx = prev


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
