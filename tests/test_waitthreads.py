"""The wait threads' shares, queue and deadlines, with real threads and stand-in connections."""

import threading
import time
from dataclasses import dataclass, field

from conftest import poll_until

from tierstore.daemon.waitthreads import WaitJob, WaitThreads
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
        self.ran: list[WaitJob] = []
        self.answered: list[tuple[WaitJob, Exception]] = []
        self.lock = threading.Lock()
        self.threads = WaitThreads(self._run, self._answer, **shares)

    def _run(self, job):
        with self.lock:
            self.ran.append(job)
        self.release.wait(30)

    def _answer(self, job, error):
        with self.lock:
            self.answered.append((job, error))

    def job(self, sess, rid, wait_s=3600.0):
        now = time.monotonic()
        return WaitJob(sess, lambda: None, rid, "checkout", time.perf_counter(), now, now + wait_s)

    def running(self):
        with self.lock:
            return {j.rid for j in self.ran}


def test_a_crowded_namespace_and_uid_leave_threads_to_others():
    h = _Harness(threads=6, per_session=3, per_namespace=4, per_uid=5, backlog=100)
    crowd = [_Sess("a"), _Sess("a"), _Sess("a")]
    for i in range(12):
        h.threads.submit(h.job(crowd[i % 3], i))
    poll_until(lambda: len(h.running()) == 4, "the namespace's share running")
    same_uid = _Sess("b")
    for i in range(100, 103):
        h.threads.submit(h.job(same_uid, i))
    poll_until(lambda: len(h.running()) == 5, "the uid's share running")
    stranger = _Sess("c", _Cred(2000))
    h.threads.submit(h.job(stranger, 200))
    poll_until(lambda: 200 in h.running(), "a stranger's wait runs at once")
    assert h.threads.waiting() == 16 and h.threads.waiting(stranger) == 1 and h.threads.waiting(crowd[0]) == 4
    h.release.set()
    poll_until(lambda: len(h.running()) == 16, "every wait ran once threads were free")
    h.threads.close()
    assert not h.answered


def test_a_queued_wait_ends_at_its_deadline_and_a_closed_connections_queue_goes():
    h = _Harness(threads=1, per_session=1, per_namespace=1, per_uid=1, backlog=2)
    s = _Sess("a")
    h.threads.submit(h.job(s, 1))
    poll_until(lambda: h.running() == {1}, "the first wait runs")
    h.threads.submit(h.job(s, 2, wait_s=0.2))
    h.threads.submit(h.job(s, 3))
    h.threads.submit(h.job(s, 4))  # over the backlog: refused at once
    assert [(j.rid, type(e)) for j, e in h.answered] == [(4, Busy)]
    time.sleep(0.3)
    h.threads.expire()
    assert [(j.rid, type(e)) for j, e in h.answered][1:] == [(2, Busy)] and h.threads.waiting(s) == 2
    gone = _Sess("a", closed=True)
    h.threads.submit(h.job(gone, 5))
    h.threads.drop(gone)
    assert h.threads.waiting() == 2
    h.threads.submit(h.job(s, 6))
    h.release.set()
    poll_until(lambda: h.running() == {1, 3, 6}, "the queue ran in order")
    h.threads.close()


def test_closing_answers_what_is_queued():
    h = _Harness(threads=1, per_session=1, per_namespace=1, per_uid=1, backlog=10)
    s = _Sess("a")
    for i in range(3):
        h.threads.submit(h.job(s, i))
    poll_until(lambda: h.running() == {0}, "the first wait runs")
    threading.Timer(0.2, h.release.set).start()
    h.threads.close()
    assert sorted((j.rid, type(e)) for j, e in h.answered) == [(1, Closed), (2, Closed)]
    h.threads.submit(h.job(s, 9))
    assert type(h.answered[-1][1]) is Closed
