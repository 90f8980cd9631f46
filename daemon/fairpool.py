"""A thread pool that no connection, namespace or uid can take whole.

The daemon runs what must leave its event loop on two of these: the op workers
(requests that touch the disk) and the wait threads (requests waiting for another
holder). Each has ``threads`` threads, all connections together, and:

- a connection runs at most ``per_session`` jobs at once, a namespace
  ``per_namespace`` and a uid ``per_uid``; what is over a share queues, per
  connection, and a free thread takes the next queued job its shares allow, the
  namespaces in turn and, within one, its connections in turn;
- a queued job has a deadline: one whose time is up is ended without running
  (``expire``: answered ``Busy``), so a request's ``timeout_s`` holds however crowded
  the pool is;
- queues are bounded: a connection queues at most ``queue_per_session`` jobs, a
  namespace ``queue_per_namespace`` and a uid ``queue_per_uid``; one more is refused
  at once (``Busy``);
- a job that ends without running (refused, out of time, its connection gone, the
  daemon stopping) is handed to ``abandon`` with the error it ends in, which gives
  back what the request had taken so far (``Later.give_back``) and answers it.

Costs: queueing, starting and expiring a job are O(log queued) plus the shares
skipped; a closed connection's queue goes in O(its jobs).
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from tierstore.errors import Busy, Closed, TierstoreError

__all__ = ["FairPool", "Job"]

_QUEUED, _RUNNING, _ENDED = 0, 1, 2


@dataclass(eq=False, slots=True)
class Job:
    """The rest of one request, for a thread: ``rest()`` is it."""

    sess: Any
    """The connection (its ``namespace``, ``cred.uid`` and ``closed`` are read)."""
    rest: Callable[[], Any]
    rid: int
    op: str
    t0: float
    """``time.perf_counter()`` at its arrival (for its latency)."""
    since: float
    """``time.monotonic()`` from which its timeouts count."""
    deadline: float
    """``time.monotonic()`` by which a queued job that has not started ends (``Busy``)."""
    give_back: Callable[[], None] | None = None
    """Gives back what the request took before it was queued (``Later.give_back``)."""
    state: int = field(default=_QUEUED)


class FairPool:
    """Runs ``Job``s on a fair share of ``threads`` threads: ``run(job)`` on one;
    ``abandon(job, error)`` (on the caller's thread) for one that ends without running."""

    def __init__(self, name: str, run: Callable[[Job], None], abandon: Callable[[Job, TierstoreError], None], *,
                 threads: int, per_session: int, per_namespace: int, per_uid: int, queue_per_session: int = 1024,
                 queue_per_namespace: int = 4096, queue_per_uid: int = 16384) -> None:
        self.name = name
        self._run, self._abandon = run, abandon
        self.threads, self.per_session, self.per_namespace, self.per_uid = threads, per_session, per_namespace, per_uid
        self.queue_per_session, self.queue_per_namespace, self.queue_per_uid = \
            queue_per_session, queue_per_namespace, queue_per_uid
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"tierstore-{name}")
        self._lock = threading.Lock()
        self._turns: dict[Any, deque] = {}
        """Namespace -> its connections with queued jobs, in turn (namespaces in turn too:
        the one served last goes to the back)."""
        self._jobs: dict[Any, deque[Job]] = {}
        """Connection -> its queued jobs, oldest first (ended ones are skipped)."""
        self._deadlines: list[tuple[float, int, Job]] = []
        self._seq = itertools.count()
        self._running: Counter = Counter()
        """("s", session) / ("n", namespace) / ("u", uid) / "all" -> jobs on threads now."""
        self._queued: Counter = Counter()
        """The same keys -> jobs queued."""
        self._stale: Counter = Counter()
        """Connection -> ended jobs left in its deque (skipped when reached)."""
        self._closed = False

    # ------------------------------------------------------------ requests
    def submit(self, job: Job) -> None:
        """Run ``job`` on a thread now or queue it within the shares; end it at once
        (``abandon``) if a queue is full, its connection is gone or the pool is closed."""
        error: TierstoreError | None = None
        if not job.since <= job.deadline <= job.since + 86400:  # (a NaN would stop every expiry behind it)
            job.deadline = job.since + 86400
        with self._lock:
            q = self._queued
            s, n, u = _keys(job)
            if self._closed:
                error = Closed("the daemon is stopping; reconnect once it is back")
            elif job.sess.closed:
                error = Closed("the connection that asked went away")
            elif q[s] >= self.queue_per_session or q[n] >= self.queue_per_namespace or q[u] >= self.queue_per_uid:
                error = Busy(f"too many requests of this {_which(q, s, n, self)} are queued for the daemon's "
                             f"{self.name} threads; wait for some of them to finish")
            else:
                jobs = self._jobs.get(job.sess)
                if jobs is None:
                    jobs = self._jobs[job.sess] = deque()
                    self._turns.setdefault(job.sess.namespace, deque()).append(job.sess)
                jobs.append(job)
                for k in (s, n, u, "all"):
                    q[k] += 1
                self._start_queued()
                if job.state == _QUEUED:
                    self._add_deadline(job)
        if error is not None:
            job.state = _ENDED
            self._abandon(job, error)

    @property
    def queued(self) -> bool:
        """Whether any job is queued (read without the lock: a hint)."""
        return bool(self._jobs)

    def expire(self, now: float | None = None) -> None:
        """End every queued job whose deadline has passed (``Busy``)."""
        now = time.monotonic() if now is None else now
        late: list[Job] = []
        with self._lock:
            while self._deadlines and self._deadlines[0][0] <= now:
                job = heapq.heappop(self._deadlines)[2]
                if job.state == _QUEUED:
                    self._unqueue(job)
                    late.append(job)
            if late:
                self._start_queued()
        for job in late:
            self._abandon(job, Closed("the connection that asked went away") if job.sess.closed else
                          Busy(f"'{job.op}' waited its timeout for one of the daemon's {self.name} threads "
                               "(every one it may use was busy meanwhile); try again"))

    def drop(self, sess: Any) -> list[Job]:
        """A closed connection's queued jobs end; returned, not abandoned: the caller gives
        back what they took before the connection's own clean-up (in that order)."""
        with self._lock:
            jobs = self._jobs.pop(sess, None)
            self._stale.pop(sess, None)
            if not jobs:
                return []
            turn = self._turns.get(sess.namespace)
            if turn is not None:
                turn.remove(sess)
                if not turn:
                    del self._turns[sess.namespace]
            ended = [j for j in jobs if j.state == _QUEUED]
            for job in ended:
                self._count_off(job, self._queued)
                job.state = _ENDED
        return ended

    def waiting(self, sess: Any | None = None) -> int:
        """Jobs on threads or queued: ``sess``'s, or everyone's."""
        with self._lock:
            k = ("s", sess) if sess is not None else "all"
            return self._running[k] + self._queued[k]

    def close(self) -> list[Job]:
        """(the daemon stops) Queued jobs end, returned (as ``drop``); running ones finish;
        the threads are joined. Jobs submitted from now on are abandoned (``Closed``)."""
        with self._lock:
            self._closed = True
            ended = [j for jobs in self._jobs.values() for j in jobs if j.state == _QUEUED]
            for job in ended:
                job.state = _ENDED
            self._jobs.clear()
            self._stale.clear()
            self._turns.clear()
            self._deadlines.clear()
            self._queued.clear()
        self._pool.shutdown(wait=True)
        return ended

    # ------------------------------------------------------------ inside (under the lock)
    def _add_deadline(self, job: Job) -> None:
        heapq.heappush(self._deadlines, (job.deadline, next(self._seq), job))
        if len(self._deadlines) > 2 * self._queued["all"] + 1024:  # started and ended ones go, now and then
            self._deadlines = [e for e in self._deadlines if e[2].state == _QUEUED]
            heapq.heapify(self._deadlines)

    def _fits(self, job: Job) -> bool:
        r = self._running
        s, n, u = _keys(job)
        return r[s] < self.per_session and r[n] < self.per_namespace and r[u] < self.per_uid

    def _count_off(self, job: Job, counter: Counter) -> None:
        for k in (*_keys(job), "all"):
            counter[k] -= 1
            if not counter[k]:
                del counter[k]

    def _unqueue(self, job: Job) -> None:
        """Take a queued ``job`` out (it stays in its connection's deque, ended, until the
        ended ones there outnumber the queued: then the deque is rebuilt)."""
        job.state = _ENDED
        self._count_off(job, self._queued)
        sess = job.sess
        jobs = self._jobs.get(sess)
        if jobs is None:
            return
        if jobs[0] is not job:
            self._stale[sess] += 1  # left behind a queued one (an over-count is harmless: a rebuild sooner)
        while jobs and jobs[0].state != _QUEUED:
            jobs.popleft()
        if not jobs:
            self._forget(sess)
        elif self._stale[sess] > 2 * self._queued[("s", sess)] + 64:
            self._jobs[sess] = deque(j for j in jobs if j.state == _QUEUED)
            del self._stale[sess]

    def _forget(self, sess: Any) -> None:
        del self._jobs[sess]
        self._stale.pop(sess, None)
        turn = self._turns[sess.namespace]
        turn.remove(sess)
        if not turn:
            del self._turns[sess.namespace]

    def _start_queued(self) -> None:
        """Put queued jobs on free threads: the namespaces in turn, within one its
        connections in turn, each the oldest job of the first connection its shares allow."""
        while self._running["all"] < self.threads and self._turns:
            started = False
            for ns in list(self._turns):
                if self._running["all"] >= self.threads:
                    break
                if self._running[("n", ns)] >= self.per_namespace:
                    continue
                turn = self._turns[ns]
                for _ in range(len(turn)):
                    sess = turn[0]
                    turn.rotate(-1)  # (this connection goes to the back of its namespace's turn)
                    jobs = self._jobs[sess]
                    if self._fits(jobs[0]):
                        break
                else:
                    continue
                job = jobs.popleft()
                while jobs and jobs[0].state != _QUEUED:
                    jobs.popleft()
                if not jobs:
                    self._forget(sess)
                if ns in self._turns:  # this namespace goes to the back of the turn
                    self._turns[ns] = self._turns.pop(ns)
                self._count_off(job, self._queued)
                for k in (*_keys(job), "all"):
                    self._running[k] += 1
                job.state = _RUNNING
                self._pool.submit(self._thread, job)
                started = True
            if not started:
                return

    def _thread(self, job: Job) -> None:
        try:
            self._run(job)
        finally:
            with self._lock:
                self._count_off(job, self._running)
                if not self._closed:
                    self._start_queued()


def _keys(job: Job) -> tuple:
    return ("s", job.sess), ("n", job.sess.namespace), ("u", job.sess.cred.uid)


def _which(q: Counter, s: Any, n: Any, pool: FairPool) -> str:
    if q[s] >= pool.queue_per_session:
        return f"connection ({pool.queue_per_session})"
    if q[n] >= pool.queue_per_namespace:
        return f"namespace ({pool.queue_per_namespace})"
    return f"uid ({pool.queue_per_uid})"
