"""One function run in a forked child: background work on a snapshot of this process.

``fork`` gives the child the parent's memory as of the fork, copy-on-write: what the
parent changes afterwards the child never sees, so a consistent view taken under the
parent's locks stays consistent in the child with no lock held. The child runs on its
own CPU, outside the parent's interpreter lock (a daemon's event loop and workers do
not wait for it), at a lower priority (``nice``), and writes only what the function
writes.

Rules the child keeps, because every other thread of the parent is gone in it and may
have held a lock at the fork: it takes no lock of the parent (the function reads plain
data), logs nothing (a handler's lock or a buffered stream's may be held) and ends with
``os._exit``. It closes every inherited descriptor but its status pipe (a socket or a
directory lock kept open in it would outlive a dead parent), dies with the parent
(``PR_SET_PDEATHSIG``), and takes SIGTERM and SIGINT by their default action. The death
signal follows the *thread* that called ``start``: start a job from a thread that
outlives it (the store forks from its own checkpoint thread).

The parent learns the outcome from ``ForkJob.wait`` (``None``: the function returned;
else why not) and can end it early with ``ForkJob.kill``.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import traceback
from typing import Callable

__all__ = ["ForkJob", "start"]

_PR_SET_PDEATHSIG = 1
_NICE = 10
_ENDING = {signal.SIGTERM, signal.SIGINT}


class ForkJob:
    """A running child (``start``)."""

    def __init__(self, pid: int, status_fd: int) -> None:
        self.pid, self._fd = pid, status_fd
        self._outcome: str | None | bool = False  # False: not reaped yet
        self._lock = threading.Lock()  # one reaper; a second caller waits for its outcome

    def wait(self) -> str | None:
        """Block until the child ends; None when its function returned, else why it did not.
        Any number of threads may wait; the child is reaped once."""
        with self._lock:
            if self._outcome is False:
                self._outcome = self._reap()
            return self._outcome

    def _reap(self) -> str | None:
        chunks = []
        while True:
            b = os.read(self._fd, 4096)
            if not b:
                break
            chunks.append(b)
        os.close(self._fd)
        _, status = os.waitpid(self.pid, 0)
        msg = b"".join(chunks).decode(errors="replace").strip()
        if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
            return None
        if os.WIFSIGNALED(status):
            return f"killed by signal {os.WTERMSIG(status)}"
        return msg or f"exit status {os.waitstatus_to_exitcode(status)}"

    def kill(self) -> None:
        """End the child now (SIGKILL); ``wait`` then reaps it."""
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def start(fn: Callable[[], None]) -> ForkJob:
    """Fork; the child runs ``fn`` and exits (status 0 if it returned). Raises OSError when
    the fork itself fails (no memory, a process limit)."""
    r, w = os.pipe()
    parent = os.getpid()
    # SIGTERM/SIGINT stay blocked across the fork, so one that reaches the child before it
    # has put back their default actions is held, not taken by the parent's handlers
    held = signal.pthread_sigmask(signal.SIG_BLOCK, _ENDING)
    try:
        pid = os.fork()
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        os.close(r)
        os.close(w)
        raise
    if pid == 0:  # the child: nothing below returns
        code = 1
        try:
            os.close(r)
            _child_setup(parent, keep=w, mask=held)
            fn()
            code = 0
        except BaseException:
            try:
                os.write(w, traceback.format_exc(limit=4)[-2000:].encode())
            except BaseException:  # (no way left to tell why: the parent reports the exit status)
                code = 1
        finally:
            os._exit(code)
    signal.pthread_sigmask(signal.SIG_SETMASK, held)
    os.close(w)
    return ForkJob(pid, r)


def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_LIBC = _libc()  # (loaded here: the child calls into it, it does not dlopen)


def _child_setup(parent: int, keep: int, mask: set) -> None:
    try:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except AttributeError:
        pass  # (not Linux) the child still ends when its function does
    if os.getppid() != parent:  # the parent died before the death signal was armed
        os._exit(1)
    for sig in _ENDING:
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask - _ENDING)  # a held one ends the child now
    try:
        signal.set_wakeup_fd(-1)
    except ValueError:
        pass
    os.closerange(3, keep)
    os.closerange(keep + 1, _max_fd())
    os.nice(_NICE)


def _max_fd() -> int:
    try:
        return os.sysconf("SC_OPEN_MAX")
    except (OSError, ValueError):
        return 65536
