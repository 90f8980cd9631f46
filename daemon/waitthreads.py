"""The threads requests wait for other holders on, shared fairly.

A request that must wait for another holder (a lease, host room, an object in
flight) runs on one of these threads until it is satisfied, its ``timeout_s`` ends,
its connection goes or the daemon stops. There are ``threads`` of them, all
connections together, and no one can take them all:

- a connection runs at most ``per_session`` waits at once, a namespace
  ``per_namespace`` and a uid ``per_uid``; what is over a share queues, and a free
  thread takes the oldest queued request whose shares allow it, namespaces in turn;
- a request's ``timeout_s`` counts from when it first had to wait, queued or not: a
  queued request whose time is up is answered ``Busy`` without running (``expire``),
  and one that starts late waits only what is left of it;
- a connection queues at most ``backlog`` requests; one more is refused (``Busy``).
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from tierstore.errors import Busy, Closed, TierstoreError

__all__ = ["WaitJob", "WaitThreads"]


@dataclass(eq=False, slots=True)
class WaitJob:
    """The rest of one request that must wait: ``rest()`` is it."""

    sess: Any
    """The connection (its ``namespace``, ``cred.uid`` and ``closed`` are read)."""
    rest: Callable[[], Any]
    rid: int
    op: str
    t0: float
    """``time.perf_counter()`` at its arrival (for its latency)."""
    since: float
    """``time.monotonic()`` when it first had to wait (its timeouts count from then)."""
    deadline: float
    """... and by when a queued request that has not started is answered ``Busy``."""


class WaitThreads:
    """Runs ``WaitJob``s on a fair share of ``threads`` threads: ``run(job)`` on one;
    ``answer(job, error)`` for one that ends without running."""

    def __init__(self, run: Callable[[WaitJob], None], answer: Callable[[WaitJob, TierstoreError], None], *,
                 threads: int = 128, per_session: int = 16, per_namespace: int = 32, per_uid: int = 64,
                 backlog: int = 1024) -> None:
        self._run, self._answer = run, answer
        self.threads, self.per_session, self.per_namespace, self.per_uid = threads, per_session, per_namespace, per_uid
        self.backlog = backlog
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tierstore-wait")
        self._lock = threading.Lock()
        self._queued: dict[Any, deque[WaitJob]] = {}
        """Namespace -> its requests not yet on a thread, oldest first (namespaces in turn)."""
        self._running: Counter = Counter()
        """("s", session) / ("n", namespace) / ("u", uid) / "all" -> requests on threads now."""
        self._queued_by: Counter = Counter()
        """session -> its requests queued."""
        self._closed = False

    # ------------------------------------------------------------ requests
    def submit(self, job: WaitJob) -> None:
        """Run ``job`` on a thread now, or queue it within the shares; refuse it (answered
        at once) once its connection has ``backlog`` queued or the threads are closed."""
        refusal: TierstoreError | None = None
        with self._lock:
            if self._closed:
                refusal = Closed("the daemon is stopping; reconnect once it is back")
            elif self._queued_by[job.sess] >= self.backlog:
                refusal = Busy(f"this connection already has {self.per_session + self.backlog} requests waiting "
                               "for other holders; wait for some of them to finish")
            else:
                self._queued.setdefault(job.sess.namespace, deque()).append(job)
                self._queued_by[job.sess] += 1
                self._start_queued()
        if refusal is not None:
            self._answer(job, refusal)

    def expire(self, now: float | None = None) -> None:
        """Answer every queued request whose time is up (``Busy``); drop the queued
        requests of connections that went away (nobody to answer)."""
        now = time.monotonic() if now is None else now
        late: list[WaitJob] = []
        with self._lock:
            for ns, jobs in list(self._queued.items()):
                keep = deque()
                for job in jobs:
                    if job.sess.closed or job.deadline <= now:
                        self._queued_by[job.sess] -= 1
                        if not job.sess.closed:
                            late.append(job)
                    else:
                        keep.append(job)
                self._set_queue(ns, keep)
            self._start_queued()  # a dropped request may have been what held a share's queue up
        for job in late:
            self._answer(job, Busy(f"'{job.op}' waited its timeout for another holder to let go (every wait "
                                   "thread it may use was taken meanwhile); try again"))

    def drop(self, sess: Any) -> None:
        """A closed connection's queued requests go (nobody to answer; what they hold is
        released with the rest of the connection's)."""
        with self._lock:
            jobs = self._queued.get(sess.namespace)
            if jobs is not None and self._queued_by[sess]:
                self._set_queue(sess.namespace, deque(j for j in jobs if j.sess is not sess))
            self._queued_by.pop(sess, None)

    @property
    def queued(self) -> bool:
        """Whether any request is queued (read without the lock: a hint)."""
        return bool(self._queued)

    def waiting(self, sess: Any | None = None) -> int:
        """Requests waiting, on threads or queued: ``sess``'s, or everyone's."""
        with self._lock:
            if sess is not None:
                return self._running[("s", sess)] + self._queued_by[sess]
            return self._running["all"] + sum(len(q) for q in self._queued.values())

    def close(self) -> None:
        """(the daemon stops; waits already cancelled) Queued requests are answered
        ``Closed``; running ones end; the threads are joined."""
        with self._lock:
            self._closed = True
            queued = [job for jobs in self._queued.values() for job in jobs]
            self._queued.clear()
            self._queued_by.clear()
        for job in queued:
            if not job.sess.closed:
                self._answer(job, Closed("the daemon is stopping; reconnect once it is back"))
        self._pool.shutdown(wait=True)

    # ------------------------------------------------------------ inside
    def _shares(self, job: WaitJob) -> tuple:
        return ("s", job.sess), ("n", job.sess.namespace), ("u", job.sess.cred.uid), "all"

    def _fits(self, job: WaitJob) -> bool:
        r = self._running
        return (r[("s", job.sess)] < self.per_session and r[("n", job.sess.namespace)] < self.per_namespace
                and r[("u", job.sess.cred.uid)] < self.per_uid)

    def _set_queue(self, ns: Any, jobs: deque) -> None:
        if jobs:
            self._queued[ns] = jobs
        else:
            self._queued.pop(ns, None)

    def _start_queued(self) -> None:
        """(under the lock) Put queued requests on free threads: the oldest one each
        namespace's shares allow, namespaces in turn."""
        while self._running["all"] < self.threads and self._queued:
            started = False
            for ns in list(self._queued):
                if self._running["all"] >= self.threads:
                    break
                jobs = self._queued[ns]
                if self._running[("n", ns)] >= self.per_namespace:
                    continue
                for i, job in enumerate(jobs):
                    if self._fits(job):
                        del jobs[i]
                        break
                else:
                    continue
                # this namespace goes to the back of the turn
                del self._queued[ns]
                if jobs:
                    self._queued[ns] = jobs
                self._queued_by[job.sess] -= 1
                for share in self._shares(job):
                    self._running[share] += 1
                self._pool.submit(self._thread, job)
                started = True
            if not started:
                return

    def _thread(self, job: WaitJob) -> None:
        try:
            self._run(job)
        finally:
            with self._lock:
                for share in self._shares(job):
                    self._running[share] -= 1
                    if not self._running[share]:
                        del self._running[share]
                if not self._closed:
                    self._start_queued()
