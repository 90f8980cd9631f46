"""The fair pool's shares, queues and deadlines, with real threads and stand-in connections."""

import threading
import time
from dataclasses import dataclass, field

from tierstore.daemon.fairpool import FairPool, Job
from tierstore.errors import Busy, Closed


@dataclass(eq=False)
class _Cred:
    uid: int


@dataclass(eq=False)
class _Sess:
    namespace: str
    cred: _Cred = field(default_factory=lambda: _Cred(1000))
    closed: bool = False


class _Harness:
    def __init__(self, **shares):
        self.release = threading.Event()
        self.ran: list[Job] = []
        self.answered: list[tuple[Job, Exception]] = []
        self.lock = threading.Condition(threading.RLock())
        """Guards ``ran`` and ``answered``; notified when either grows."""
        self.threads = FairPool("test", self._run, self._answer, **shares)

    def _run(self, job):
        with self.lock:
            self.ran.append(job)
            self.lock.notify_all()
        self.release.wait(30)

    def _answer(self, job, error):
        with self.lock:
            self.answered.append((job, error))
            self.lock.notify_all()

    def wait_until(self, ok, what):
        """Wait until ``ok()`` holds: woken as each job starts or is answered."""
        with self.lock:
            assert self.lock.wait_for(ok, timeout=30), f"{what}: not within 30 s"

    def job(self, sess, rid, wait_s=3600.0, give_back=None):
        now = time.monotonic()
        return Job(sess, lambda: None, rid, "checkout", time.perf_counter(), now, now + wait_s, give_back)

    def running(self):
        with self.lock:
            return {j.rid for j in self.ran}


def test_a_crowded_namespace_and_uid_leave_threads_to_others():
    h = _Harness(threads=6, per_session=3, per_namespace=4, per_uid=5, queue_per_session=100)
    crowd = [_Sess("a"), _Sess("a"), _Sess("a")]
    for i in range(12):
        h.threads.submit(h.job(crowd[i % 3], i))
    h.wait_until(lambda: len(h.running()) == 4, "the namespace's share running")
    same_uid = _Sess("b")
    for i in range(100, 103):
        h.threads.submit(h.job(same_uid, i))
    h.wait_until(lambda: len(h.running()) == 5, "the uid's share running")
    stranger = _Sess("c", _Cred(2000))
    h.threads.submit(h.job(stranger, 200))
    h.wait_until(lambda: 200 in h.running(), "a stranger's wait runs at once")
    assert h.threads.waiting() == 16 and h.threads.waiting(stranger) == 1 and h.threads.waiting(crowd[0]) == 4
    h.release.set()
    h.wait_until(lambda: len(h.running()) == 16, "every wait ran once threads were free")
    h.threads.close()
    assert not h.answered


def test_a_queued_job_ends_at_its_deadline_with_what_it_took_given_back():
    h = _Harness(threads=1, per_session=1, per_namespace=1, per_uid=1, queue_per_session=2)
    s = _Sess("a")
    undone = []
    h.threads.submit(h.job(s, 1))
    h.wait_until(lambda: h.running() == {1}, "the first job runs")
    h.threads.submit(h.job(s, 2, wait_s=0.2, give_back=lambda: undone.append(2)))
    h.threads.submit(h.job(s, 3))
    h.threads.submit(h.job(s, 4))  # over the connection's queue: refused at once
    assert [(j.rid, type(e)) for j, e in h.answered] == [(4, Busy)]
    h.threads.expire(now=time.monotonic() + 0.3)  # job 2's deadline has passed, job 3's has not
    assert [(j.rid, type(e)) for j, e in h.answered][1:] == [(2, Busy)] and h.threads.waiting(s) == 2
    for job, _ in h.answered:  # (the daemon gives back what the request took when it answers)
        if job.give_back:
            job.give_back()
    assert undone == [2]
    gone = _Sess("a", closed=True)
    h.threads.submit(h.job(gone, 5))  # its connection is gone: ended at once
    assert type(h.answered[-1][1]) is Closed and h.threads.waiting() == 2
    h.threads.submit(h.job(s, 6))
    h.release.set()
    h.wait_until(lambda: h.running() == {1, 3, 6}, "the queue ran in order")
    h.threads.close()


def test_a_closed_connections_queue_ends_and_others_go_on():
    h = _Harness(threads=1, per_session=1, per_namespace=1, per_uid=1)
    a, b = _Sess("a"), _Sess("a")
    h.threads.submit(h.job(a, 1))
    h.wait_until(lambda: h.running() == {1}, "the first job runs")
    for i in range(2, 6):
        h.threads.submit(h.job(a, i))
    h.threads.submit(h.job(b, 10))
    a.closed = True
    assert sorted(j.rid for j in h.threads.drop(a)) == [2, 3, 4, 5]  # (for the caller to give back)
    assert h.threads.drop(a) == [] and not h.answered
    assert h.threads.waiting(a) == 1 and h.threads.waiting(b) == 1
    h.release.set()
    h.wait_until(lambda: h.running() == {1, 10}, "the other connection's job ran")
    h.threads.close()


def test_connections_and_namespaces_take_turns():
    """A connection with a long queue and one with a single job in the same namespace,
    and a third in another: each gets a thread within a turn or two, not after the long
    queue."""
    h = _Harness(threads=1, per_session=1, per_namespace=1, per_uid=1)
    hog, one, other = _Sess("a"), _Sess("a"), _Sess("b", _Cred(2000))
    for i in range(100, 110):
        h.threads.submit(h.job(hog, i))
    h.wait_until(lambda: h.running() == {100}, "the hog's first job runs")
    h.threads.submit(h.job(one, 200))
    h.threads.submit(h.job(other, 300))
    h.release.set()
    h.wait_until(lambda: len(h.running()) == 12, "every job ran")
    order = [j.rid for j in h.ran]
    assert order.index(200) <= 3 and order.index(300) <= 3, order
    h.threads.close()


def test_closing_returns_what_is_queued():
    h = _Harness(threads=1, per_session=1, per_namespace=1, per_uid=1, queue_per_session=10)
    s = _Sess("a")
    for i in range(3):
        h.threads.submit(h.job(s, i))
    h.wait_until(lambda: h.running() == {0}, "the first wait runs")
    threading.Timer(0.2, h.release.set).start()
    assert sorted(j.rid for j in h.threads.close()) == [1, 2] and not h.answered
    h.threads.submit(h.job(s, 9))
    assert type(h.answered[-1][1]) is Closed


def test_queues_are_bounded_per_namespace_and_uid():
    """Beyond a namespace's (or a uid's) queue, one more job is refused at once with
    ``Busy`` naming the share; another namespace of another uid still queues."""
    h = _Harness(threads=1, per_session=1, per_namespace=1, per_uid=1, queue_per_session=10,
                 queue_per_namespace=3, queue_per_uid=5)
    h.threads.submit(h.job(_Sess("z", _Cred(3000)), 0))
    h.wait_until(lambda: h.running() == {0}, "the first job runs")
    ns_a = [_Sess("a"), _Sess("a")]
    for i in range(3):
        h.threads.submit(h.job(ns_a[i % 2], i + 1))
    h.threads.submit(h.job(ns_a[0], 9))
    assert [(j.rid, str(e)) for j, e in h.answered] == [(9, str(h.answered[0][1]))]
    assert "namespace (3)" in str(h.answered[0][1]) and type(h.answered[0][1]) is Busy
    h.threads.submit(h.job(_Sess("b"), 10))
    h.threads.submit(h.job(_Sess("c"), 11))
    h.threads.submit(h.job(_Sess("d"), 12))  # uid 1000's sixth queued
    assert "uid (5)" in str(h.answered[-1][1])
    h.threads.submit(h.job(_Sess("e", _Cred(2000)), 13))
    assert len(h.answered) == 2 and h.threads.waiting() == 7
    h.release.set()
    h.wait_until(lambda: len(h.running()) == 7, "the queued ones ran")
    h.threads.close()


def test_a_deadline_that_is_not_a_time_stops_no_one_elses_expiry():
    """A job whose deadline is NaN (or infinite) gets a day instead; a later job with a
    short deadline is still ended at it (a NaN at the root of the deadlines would have
    stopped every expiry behind it)."""
    h = _Harness(threads=1, per_session=1, per_namespace=1, per_uid=1)
    h.threads.submit(h.job(_Sess("z"), 0))
    h.wait_until(lambda: h.running() == {0}, "the first job runs")
    bad = h.job(_Sess("a"), 1)
    bad.deadline = float("nan")
    h.threads.submit(bad)
    assert bad.deadline == bad.since + 86400
    h.threads.submit(h.job(_Sess("b"), 2, wait_s=0.1))
    h.threads.expire(now=time.monotonic() + 0.2)  # past job 2's deadline
    assert [(j.rid, type(e)) for j, e in h.answered] == [(2, Busy)]
    h.release.set()
    h.threads.close()


def test_a_requests_wait_budget_is_a_number_of_seconds_or_the_default():
    from tierstore.config import Config
    from tierstore.daemon.server import Server

    srv = Server(Config())
    try:
        wait = srv.config.store.lease_wait_s
        assert srv._wait_budget({"timeout_s": 2}) == 2.0
        assert srv._wait_budget({"wait_s": 120}) == 120.0 and srv._wait_budget({"wait_s": 1}) == wait
        for bad in (float("nan"), float("inf"), -1, 1e9, "5", True, None):
            assert srv._wait_budget({"timeout_s": bad, "wait_s": bad}) == wait, bad
    finally:
        srv.discard()


def test_jobs_ended_behind_a_queued_one_do_not_pile_up():
    """A connection whose front job waits long while thousands behind it time out at
    once: its queue keeps about as many entries as it has queued jobs, not every one it
    ever queued."""
    h = _Harness(threads=1, per_session=1, per_namespace=1, per_uid=1, queue_per_session=100000)
    s = _Sess("a")
    h.threads.submit(h.job(_Sess("z", _Cred(2)), 0))
    h.wait_until(lambda: h.running() == {0}, "the first job runs")
    h.threads.submit(h.job(s, 1))  # queued, a long deadline
    for i in range(2, 5002):
        h.threads.submit(h.job(s, i, wait_s=0.0))
        h.threads.expire()
    assert h.threads.waiting(s) == 1 and len(h.threads._jobs[s]) < 200
    h.release.set()
    h.wait_until(lambda: 1 in h.running(), "the front job ran")
    h.threads.close()
