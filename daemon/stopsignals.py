"""The signals that stop the daemon, and what they do while it is still starting."""

from __future__ import annotations

import signal
from typing import Any

__all__ = ["STOP_SIGNALS", "StopDuringStart", "stop_during_start"]

STOP_SIGNALS = tuple(sig for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
                     if signal.getsignal(sig) is not signal.SIG_IGN)
"""What stops a daemon cleanly: systemd's stop, Ctrl-C, and the terminal of a foreground
daemon closing (SIGHUP, which would otherwise kill it without its index checkpoint) —
each unless the process was started with it ignored (``nohup``, which ignores SIGHUP;
a background job of a script, SIGINT): that choice is kept. (Read as this module is
first imported, before anything here installs a handler.)"""


class StopDuringStart(BaseException):
    """A stop signal while the daemon starts (``stop_during_start``): it gives up the start."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"received {signal.Signals(signum).name} while starting: not started")
        self.status = 128 + signum


def stop_during_start() -> None:
    """Until ``run`` installs its own handlers: a stop signal ends the start where it is
    (the unwinding closes what was opened; what was written is as after a crash, which
    the next start recovers) with a line saying so, not a traceback or a silent death."""
    def on_signal(signum: int, _frame: Any) -> None:
        raise StopDuringStart(signum)
    for sig in STOP_SIGNALS:
        signal.signal(sig, on_signal)
