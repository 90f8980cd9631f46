"""Group commit: concurrent durable commits share fdatasyncs, and none is acknowledged
before an fdatasync that covers its record (and its data) has completed."""

import errno
import itertools
import os
import select
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from conftest import in_threads, poll_until
from tierstore.errors import KeyExists, StorageError
from tierstore.groupsync import GroupSync

FLUSH_S = 0.005  # a drive's cache flush: long enough that concurrent commits overlap


def _is_journal(s, fd: int) -> bool:
    """Whether ``fd`` (given to a patched ``os.fdatasync``) is ``s``'s journal."""
    return os.path.realpath(f"/proc/self/fd/{fd}") == os.path.realpath(s.journal.path)


def test_each_caller_returns_after_a_sync_that_began_after_it_was_called():
    clock = itertools.count()
    lock = threading.Lock()
    rounds = []  # (start, end) of each fsync

    def fsync():
        with lock:
            start = next(clock)
        time.sleep(FLUSH_S)
        with lock:
            rounds.append((start, next(clock)))

    g = GroupSync(fsync)
    calls = []

    def caller(k):
        for _ in range(20):
            with lock:
                entered = next(clock)
            g.sync()
            with lock:
                calls.append((entered, next(clock)))

    assert in_threads(caller, 8) == []
    assert len(calls) == 160 and g.rounds == len(rounds) < 160
    for entered, returned in calls:
        assert any(entered < s and e < returned for s, e in rounds), "returned before a sync covered it"


def test_a_failed_sync_fails_every_caller_it_covered_and_the_next_round_retries():
    fail = threading.Event()
    fail.set()
    inside, release = threading.Event(), threading.Event()

    def fsync():
        inside.set()
        release.wait(10)
        if fail.is_set():
            fail.clear()
            raise OSError(errno.EIO, "Input/output error")

    g = GroupSync(fsync)
    results = {}

    def caller(k):
        try:
            g.sync()
            results[k] = "ok"
        except OSError as e:
            results[k] = e.errno

    first = threading.Thread(target=caller, args=(0,))
    first.start()
    assert inside.wait(10)  # round 1 runs (and will fail); the next callers wait for round 2
    inside.clear()
    later = [threading.Thread(target=caller, args=(k,)) for k in (1, 2, 3)]
    for t in later:
        t.start()
    poll_until(lambda: g.callers == 4, "four callers wait for the round")
    release.set()
    for t in [first, *later]:
        t.join(10)
    assert results == {0: errno.EIO, 1: "ok", 2: "ok", 3: "ok"}
    assert g.rounds == 2


def test_concurrent_durable_puts_share_journal_fsyncs(make_store, monkeypatch):
    s = make_store()
    real = os.fdatasync
    synced, data_synced = [], []

    def fdatasync(fd):
        (synced if _is_journal(s, fd) else data_synced).append(fd)
        time.sleep(FLUSH_S)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    n_threads, per = 8, 15

    def putter(k):
        for i in range(per):
            s.put(torch.full((64,), float(k * 100 + i)), key=f"t{k}/{i}", durable=True)

    assert in_threads(putter, n_threads) == []
    puts = n_threads * per
    assert 0 < len(synced) < puts * 3 // 4, f"{len(synced)} journal fsyncs for {puts} concurrent durable puts"
    # the data file's syncs (each put's bytes before its record) are shared the same way
    assert 0 < len(data_synced) < puts * 3 // 4, f"{len(data_synced)} data fsyncs for {puts} durable puts"
    for k in range(n_threads):
        for i in range(per):
            assert torch.equal(s.get(s.lookup(f"t{k}/{i}")), torch.full((64,), float(k * 100 + i)))


def _failing_journal_syncs(s, monkeypatch):
    """From now on every fdatasync of ``s``'s journal fails (EIO); returns the real one."""
    real = os.fdatasync

    def fdatasync(fd):
        if _is_journal(s, fd):
            raise OSError(errno.EIO, "Input/output error")
        real(fd)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    return real


def test_a_failed_journal_sync_fails_the_put_and_every_commit_after_it(make_store, monkeypatch):
    s = make_store()
    s.put(torch.ones(8), key="before", durable=True)
    real = _failing_journal_syncs(s, monkeypatch)
    with pytest.raises(StorageError, match="journal sync .* failed"):
        s.put(torch.ones(8), key="x", durable=True)
    monkeypatch.setattr(os, "fdatasync", real)
    with pytest.raises(StorageError, match="restart"):  # the journal's state on disk is unknown now
        s.put(torch.ones(8), key="y", durable=True)
    s.put(torch.ones(8), key="volatile")  # volatile puts do not touch the journal


def test_a_failed_sync_of_a_journaled_free_fails_every_journal_write_after_it(make_store, monkeypatch):
    """A free syncs its record itself: when that fdatasync fails, the records appended
    before it may be lost as well, so the journal is treated as after a failed commit."""
    s = make_store()
    h = s.put(torch.ones(8), key="gone", durable=True)
    real = _failing_journal_syncs(s, monkeypatch)
    with pytest.raises(StorageError):
        s.free(h)
    monkeypatch.setattr(os, "fdatasync", real)
    assert s.journal.sync_failed
    with pytest.raises(StorageError, match="restart"):
        s.put(torch.ones(8), key="y", durable=True)


WRITER = r"""
import sys, threading, torch
from tierstore import Config, Store
s = Store(Config(host_bytes="16MiB", nvme_dirs=[sys.argv[1]], nvme_bytes="512MiB", io_chunk_bytes="1MiB",
                 nvme_grow_bytes="16MiB"))
out = threading.Lock()
def run(k):
    i = 0
    while True:
        n = 100 + (k * 7919 + i * 31) % 5000
        s.put(torch.arange(n, dtype=torch.int32) + k * 1000003 + i, key=f"w{k}/{i}", durable=True,
              tier="nvme" if i % 3 == 2 else None)
        with out:
            print(f"done {k} {i}", flush=True)
        i += 1
for k in range(8):
    threading.Thread(target=run, args=(k,), daemon=True).start()
threading.Event().wait()
"""


def _expected(k, i):
    n = 100 + (k * 7919 + i * 31) % 5000
    return torch.arange(n, dtype=torch.int32) + k * 1000003 + i


def test_sigkill_of_many_threads_putting_durably_loses_nothing_acknowledged(make_store, nvme_dir):
    p = subprocess.Popen([sys.executable, "-c", WRITER, nvme_dir], stdout=subprocess.PIPE, text=True)
    done = set()
    deadline = time.monotonic() + 120
    while len(done) < 300 and time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            break
        _, k, i = line.split()
        done.add((int(k), int(i)))
    os.kill(p.pid, signal.SIGKILL)  # with puts of every thread in flight
    p.wait()
    assert len(done) >= 300, "writer did not make progress"
    s = make_store(host_bytes="16MiB")
    for k, i in done:
        h = s.lookup(f"w{k}/{i}")
        assert h is not None, f"w{k}/{i} was acknowledged as durable but is missing after SIGKILL"
        assert torch.equal(s.get(h), _expected(k, i))
    for key in s.keys(prefix="w"):  # anything else (a put in flight) is whole
        k, i = key[1:].split("/")
        assert torch.equal(s.get(s.lookup(key)), _expected(int(k), int(i)))


def test_sigkill_of_the_daemon_under_concurrent_durable_puts_loses_nothing_acknowledged(daemon):
    acked = set()
    lock = threading.Lock()
    enough = threading.Event()
    stop = threading.Event()

    def client(k):
        with daemon.client("job") as c:
            i = 0
            while not stop.is_set():
                try:
                    c.put(_expected(k, i), key=f"c{k}/{i}", durable=True)
                except Exception:
                    return  # the daemon was killed under this put
                with lock:
                    acked.add((k, i))
                    if len(acked) >= 200:
                        enough.set()
                i += 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    try:
        assert enough.wait(120), "clients did not make progress"
        daemon.kill()
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    with lock:
        acked_now = set(acked)
    daemon.start()
    with daemon.client("job") as c:
        for k, i in acked_now:
            h = c.lookup(f"c{k}/{i}")
            assert h is not None, f"c{k}/{i} was acknowledged as durable but is missing after SIGKILL"
            assert torch.equal(c.get(h), _expected(k, i))


def test_put_async_keeps_small_puts_in_flight_on_one_connection(daemon):
    with daemon.client("job") as c:
        for durable in (False, True):
            futs = [c.put_async(_expected(k, 1)[:500], key=f"p{int(durable)}/{k}", durable=durable)
                    for k in range(100)]
            assert c._executor is None  # no thread per put: they were sent from slots
            handles = [f.result() for f in futs]
            assert len(set(handles)) == 100
            for k, h in enumerate(handles):
                assert c.lookup(f"p{int(durable)}/{k}") == h
                assert torch.equal(c.get(h), _expected(k, 1)[:500])
        with pytest.raises(KeyExists):  # an error comes back through the future
            c.put_async(torch.ones(4), key="p0/0").result()
        big = torch.arange(10_000.0)  # over a slot: a background put, as before
        assert torch.equal(c.get(c.put_async(big, key="big").result()), big)
    daemon.kill()
    daemon.start()
    with daemon.client("job") as c:  # the durable ones were on disk when their futures completed
        assert sorted(c.keys(prefix="p1/")) == sorted(f"p1/{k}" for k in range(100))


def test_a_failed_data_sync_fails_every_put_of_its_batch_and_publishes_none(make_store, monkeypatch):
    """The group committer syncs a batch's bytes once per drive before it appends any
    record: a failed sync fails every put of the batch with a typed error, publishes
    none of them and gives their space back; the next batch syncs again."""
    s = make_store()
    used_nvme, used_host = s.nvme.used_bytes, s.host.used_bytes
    real = os.fdatasync
    entered, release = threading.Event(), threading.Event()
    data_syncs = []

    def fdatasync(fd):
        if _is_journal(s, fd):
            return real(fd)
        data_syncs.append(fd)
        entered.set()
        release.wait(10)  # the first batch's sync waits here while the others queue behind it
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    errors = {}

    def putter(k):
        try:
            s.put(torch.full((64,), float(k)), key=f"k{k}", durable=True)
        except Exception as e:
            errors[k] = e

    first = threading.Thread(target=putter, args=(0,))
    first.start()
    assert entered.wait(10)
    rest = [threading.Thread(target=putter, args=(k,)) for k in range(1, 8)]
    for t in rest:
        t.start()
    # (the committer's queue has no public view: its length read directly)
    poll_until(lambda: len(s.puts.committer._queue) == 7, "seven commits queue behind the failing sync")
    release.set()
    for t in [first, *rest]:
        t.join(10)
    assert len(data_syncs) == 2, "one data sync per batch"
    assert sorted(errors) == list(range(8))
    assert all(isinstance(e, StorageError) and "syncing" in str(e) for e in errors.values()), errors
    assert all(s.lookup(f"k{k}") is None for k in range(8)), "a put whose bytes were not synced was published"
    assert (s.nvme.used_bytes, s.host.used_bytes) == (used_nvme, used_host)
    assert s.stat()["reservations"] == 0
    monkeypatch.setattr(os, "fdatasync", real)
    s.put(torch.ones(4), key="k0", durable=True)  # the next batch syncs again
    assert torch.equal(s.get(s.lookup("k0")), torch.ones(4))


KILLER = r"""
import os, signal, sys, threading, torch
from tierstore import Config, Store
s = Store(Config(host_bytes="16MiB", nvme_dirs=[sys.argv[1]], nvme_bytes="512MiB", io_chunk_bytes="1MiB",
                 nvme_grow_bytes="16MiB"))
owner = s.nvme if sys.argv[2] == "data" else s.durability
name = "sync_drives" if sys.argv[2] == "data" else "commit"
real, calls = getattr(owner, name), []
def killing(*args):
    calls.append(1)
    if len(calls) == 6:  # the sixth batch dies between its writes and their sync
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*args)
setattr(owner, name, killing)
out = threading.Lock()
def run(k):
    for i in range(10 ** 6):
        s.put(torch.arange(100 + 37 * k + i, dtype=torch.int32) + k * 1000003 + i, key=f"w{k}/{i}", durable=True)
        with out:
            print(f"done {k} {i}", flush=True)
for k in range(8):
    threading.Thread(target=run, args=(k,), daemon=True).start()
threading.Event().wait()
"""


@pytest.mark.parametrize("window", ["data", "journal"])
def test_sigkill_inside_a_group_commit_loses_nothing_acknowledged_and_leaves_no_half_object(make_store, nvme_dir,
                                                                                          window):
    """SIGKILL in the middle of a batch: after its bytes are written but before their
    sync (``data``), or after its records are appended and its objects published but
    before the journal's sync (``journal``). Every put acknowledged before is there and
    whole; any put of the batch that is there is whole."""
    p = subprocess.run([sys.executable, "-c", KILLER, nvme_dir, window], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    done = {tuple(map(int, line.split()[1:])) for line in p.stdout.splitlines() if line.startswith("done")}
    assert done, "no put was acknowledged before the kill"

    def expected(k, i):
        return torch.arange(100 + 37 * k + i, dtype=torch.int32) + k * 1000003 + i

    s = make_store(host_bytes="16MiB")
    for k, i in done:
        h = s.lookup(f"w{k}/{i}")
        assert h is not None, f"w{k}/{i} was acknowledged as durable but is missing after SIGKILL"
        assert torch.equal(s.get(h), expected(k, i))
    for key in s.keys(prefix="w"):
        k, i = map(int, key[1:].split("/"))
        assert torch.equal(s.get(s.lookup(key)), expected(k, i))


def test_a_wake_up_written_while_the_loop_empties_the_pipe_is_not_lost(tmp_path, monkeypatch):
    """Replies finished off the event loop wake it with one byte per wake-up, not one per
    reply (a group commit finishes hundreds at once). A wake-up that arrives while the loop
    is emptying the pipe must leave the loop able to be woken again: either a byte in the
    pipe or the flag clear, never the flag set over an empty pipe (replies then waited
    for the next half-second select)."""
    from tierstore.config import Config
    from tierstore.daemon.server import Server

    # the wake-up pipe is the server's own: the race is set up through its private parts on purpose
    srv = Server(Config())
    try:
        srv._wake()  # a reply finished: flag set, one byte
        real_read, raced = os.read, []

        def read(fd, n):
            if fd == srv._wake_r and not raced:
                raced.append(1)
                srv._wake()  # another reply finishes while the loop reads the pipe
            return real_read(fd, n)

        monkeypatch.setattr(os, "read", read)
        srv._drain_wake()
        monkeypatch.setattr(os, "read", real_read)
        assert raced
        srv._wake()  # the next reply
        r, _, _ = select.select([srv._wake_r], [], [], 0)
        assert r, "a reply finished after the race does not wake the loop"
    finally:
        srv.discard()


def test_sigterm_under_pipelined_durable_puts_answers_or_fails_each_and_keeps_every_acknowledged(daemon):
    """A daemon stopped (SIGTERM) while pipelined durable puts are in its group committer
    exits cleanly; each put in flight is answered or fails with a typed error, and every
    one answered is there after the restart."""
    from tierstore.errors import TierstoreError

    acked, failed = [], []
    enough = threading.Event()

    def client():
        with daemon.client("job") as c:
            inflight = []
            for i in itertools.count():
                try:
                    if len(inflight) >= 32:
                        k, f = inflight.pop(0)
                        f.result()
                        acked.append(k)
                        if len(acked) >= 300:
                            enough.set()
                    inflight.append((i, c.put_async(_expected(i, 1)[:200], key=f"s/{i}", durable=True)))
                except TierstoreError as e:
                    failed.append(e)
                    return

    t = threading.Thread(target=client)
    t.start()
    try:
        assert enough.wait(120), "the client did not make progress"
        assert daemon.stop() == 0
    finally:
        t.join(60)
    assert not t.is_alive() and failed, "the client was not told the daemon went away"
    daemon.start()
    with daemon.client("job") as c:
        for i in acked:
            h = c.lookup(f"s/{i}")
            assert h is not None, f"s/{i} was acknowledged as durable but is missing after SIGTERM"
            assert torch.equal(c.get(h), _expected(i, 1)[:200])
