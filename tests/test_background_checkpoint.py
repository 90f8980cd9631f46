"""Background index checkpoints: once the journal has grown enough since the last
checkpoint, a forked child writes a new one, so a restart after ``kill -9`` loads it and
replays only the journal's tail, reaching exactly the state a full replay reaches, with
frees and replaces racing the snapshot. The child dies with its parent, a half-written
one never counts, and a checkpoint never brings back an object whose free or replace the
journal it covers holds."""

import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from conftest import in_threads, poll_until
from tierstore import Config, Store, forkjob
from tierstore.checkpoint import BACKGROUND_TMP, CHECKPOINT_FILE


def _cfg(d, **kw):
    return Config(**{"host_bytes": "64MiB", "nvme_dirs": [str(d)], "nvme_bytes": "1GiB",
                     "nvme_grow_bytes": "16MiB", **kw})


def _val(i):
    return torch.arange(8, dtype=torch.float32) + i


def _state(s):
    """What a replay decides, per durable object, and the keys of the default namespace."""
    ix = s.index
    objs = {oid: (m.gen, m.namespace, m.key, tuple(m.nvme or ()), tuple(m.crcs or ()), m.record)
            for oid, m in ix.objects.items() if m.durable}
    return objs, ix.keys.scan("default"), dict(s.durability.owners), ix.next_id


def _open_copy(d, tmp_path, name, drop_checkpoint):
    ref = tmp_path / name
    shutil.rmtree(ref, ignore_errors=True)
    shutil.copytree(d, ref)
    if drop_checkpoint:
        (ref / CHECKPOINT_FILE).unlink(missing_ok=True)
    return Store(_cfg(ref))


def test_a_restart_after_kill_9_loads_the_background_checkpoint_and_replays_only_the_tail(daemon_factory, tmp_path):
    dm = daemon_factory("--checkpoint-tail-bytes", "32KiB")
    with dm.client() as c:
        for i in range(1500):
            c.put(_val(i), key=f"o{i}", durable=True)
            if i % 10 == 9:
                c.free(c.lookup(f"o{i - 5}"))
            if i % 10 == 3:
                c.put(_val(-i), key=f"o{i - 2}", durable=True, replace=True)
        j = poll_until(lambda: (lambda j: j if j["checkpoints_written"] >= 3 else None)(c.stat()["journal"]),
                       "three background checkpoints")
        assert 0 < j["checkpoint_covers_bytes"] <= j["bytes"]
    dm.kill()
    nvme = dm.base / "nvme"
    with _open_copy(nvme, tmp_path, "full", drop_checkpoint=True) as s:
        assert s.replay_info["checkpoint"] == "none"
        want, total = _state(s), s.replay_info["records_replayed"]
    dm.start()
    with dm.client() as c:
        j = c.stat()["journal"]
        assert j["checkpoint"] == "used", j
        assert j["records_replayed"] < total // 3, (j["records_replayed"], total)
        for i in range(1500):
            h = c.lookup(f"o{i}")
            if i % 10 == 4:
                assert h is None, i  # freed
            elif i % 10 == 1 and i + 2 < 1500:
                assert torch.equal(c.get(h), _val(-(i + 2))), i  # replaced
            else:
                assert torch.equal(c.get(h), _val(i)), i
    dm.stop()
    with Store(_cfg(nvme)) as s:
        assert _state(s) == want  # exactly what replaying every record gives


def test_checkpoints_taken_while_frees_and_replaces_race_them_match_a_full_replay(tmp_path):
    """Tiny tail: a checkpoint forks every few records while four threads put, replace
    and free; after a crash (no clean close) the checkpoint's start equals a full replay."""
    d = tmp_path / "nvme"
    code = r"""
import sys, threading, torch
from tierstore import Config, Store
s = Store(Config(host_bytes="64MiB", nvme_dirs=[sys.argv[1]], nvme_bytes="1GiB", nvme_grow_bytes="16MiB",
                 checkpoint_tail_bytes="2KiB"))
def work(k):
    for i in range(300):
        s.put(torch.full((4,), float(i)), key=f"t{k}/{i % 40}", durable=True, replace=True)
        if i % 7 == 0:
            h = s.lookup(f"t{k}/{(i + 3) % 40}")
            if h is not None:
                try:
                    s.free(h)
                except Exception:
                    pass
ts = [threading.Thread(target=work, args=(k,)) for k in range(4)]
[t.start() for t in ts]; [t.join() for t in ts]
print(s.stat()["journal"]["checkpoints_written"], flush=True)
sys.stdin.readline()
"""
    p = subprocess.Popen([sys.executable, "-c", code, str(d)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    try:
        written = int(p.stdout.readline())
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
    assert written >= 5
    with _open_copy(d, tmp_path, "full", drop_checkpoint=True) as s:
        want = _state(s)
    with _open_copy(d, tmp_path, "ckpt", drop_checkpoint=False) as s:
        assert s.replay_info["checkpoint"] == "used", s.replay_info
        assert _state(s) == want


def test_an_object_whose_free_is_journaled_is_not_in_a_checkpoint_taken_before_it_leaves_the_index(tmp_path):
    with Store(_cfg(tmp_path / "nvme")) as s:
        keep, gone = s.put(_val(1), key="keep", durable=True), s.put(_val(2), key="gone", durable=True)
        old = s.put(_val(3), key="swap", durable=True)
        s.durability.journal_free(gone.id)  # journaled, still in the index (the moment a free is at)
        ix = s.index
        new = s.put(_val(4), key="swap2", durable=True)
        with s.durability.lock, ix.cv:
            # the moment a replace is at: the new object holds the key, the old one waits for its discard
            ix.keys[("default", "swap")] = new.id
            ix.objects[old.id].freeing = True
            assert ix.objects[gone.id] is not None
            ids = {m["id"] for m in map(_unpack, s.durability._collect()) if isinstance(m, dict)
                   and m.get("op") == "put"}
            ix.keys[("default", "swap")] = old.id
            ix.objects[old.id].freeing = False
        assert keep.id in ids and new.id in ids
        assert gone.id not in ids and old.id not in ids


def _unpack(r):
    import msgpack

    return msgpack.unpackb(r, raw=False, strict_map_key=False) if isinstance(r, bytes) else r


def test_a_left_over_background_temp_file_is_removed_at_start(tmp_path):
    d = tmp_path / "nvme"
    with Store(_cfg(d)) as s:
        s.put(_val(1), key="a", durable=True)
    (d / BACKGROUND_TMP).write_bytes(b"half a checkpoint")
    with Store(_cfg(d)) as s:
        assert s.replay_info["checkpoint"] == "used"
        assert not (d / BACKGROUND_TMP).exists()


def _slow_background_writes(monkeypatch, seconds):
    """Background checkpoints (written with a ``tmp``) take ``seconds`` longer: the child
    sleeps before it writes (the patch is inherited through the fork)."""
    from tierstore import checkpoint

    real = checkpoint.write

    def write(directory, identity, records, *, tmp=None):
        if tmp is not None:
            time.sleep(seconds)
        return real(directory, identity, records, tmp=tmp)
    monkeypatch.setattr(checkpoint, "write", write)


def _put_until_background(s, first=0):
    i = first
    while s.durability._background is None:
        s.put(_val(i), key=f"k{i}", durable=True)
        i += 1
    return i


def test_the_close_ends_a_background_checkpoint_still_being_written(tmp_path, monkeypatch):
    d = tmp_path / "nvme"
    _slow_background_writes(monkeypatch, 60)
    s = Store(_cfg(d, checkpoint_tail_bytes=4096))
    n = _put_until_background(s)
    job = s.durability._background
    t0 = time.monotonic()
    s.close()
    assert time.monotonic() - t0 < 10
    assert job.wait() == "killed by signal 9"
    assert not (d / BACKGROUND_TMP).exists()
    with Store(_cfg(d)) as s2:
        assert s2.replay_info["checkpoint"] == "used" and s2.replay_info["records_replayed"] == 0
        assert [torch.equal(s2.get(s2.lookup(f"k{i}")), _val(i)) for i in range(n)] == [True] * n


def test_a_background_checkpoint_outlives_the_thread_whose_put_started_it(tmp_path, monkeypatch):
    """The child is forked by the store's own checkpoint thread: the short-lived thread
    whose append crossed the threshold may end while the child writes."""
    _slow_background_writes(monkeypatch, 1)
    forked_by = []
    real_start = forkjob.start

    def start(fn):
        forked_by.append(threading.current_thread().name)
        return real_start(fn)
    monkeypatch.setattr(forkjob, "start", start)
    with Store(_cfg(tmp_path / "nvme", checkpoint_tail_bytes=0)) as s:
        hs = [s.put(_val(i), durable=True) for i in range(200)]
        s.durability.checkpoint_tail_bytes = 4096  # (the journal is past it: the next append starts one)

        def frees():  # (a free is journaled on the caller's thread)
            while s.durability._background is None:
                s.free(hs.pop())
        t = threading.Thread(target=frees)
        t.start()
        t.join()  # (ended long before the child, which sleeps a second, has written)
        poll_until(lambda: s.stat()["journal"]["checkpoints_written"] >= 1, "the checkpoint is written",
                   timeout_s=30)
    assert set(forked_by) == {"tierstore-checkpoint"}


def test_a_forked_job_dies_with_the_thread_that_started_it(tmp_path):
    """Why the store forks from a thread of its own (``PR_SET_PDEATHSIG`` is per thread)."""
    armed = tmp_path / "armed"  # (the child's function runs once the death signal is armed)
    jobs = []

    def child():
        armed.write_text("")
        time.sleep(60)

    def thread():
        jobs.append(forkjob.start(child))
        poll_until(armed.exists, "the child runs")
    t = threading.Thread(target=thread)
    t.start()
    t.join()
    assert jobs[0].wait() == "killed by signal 9"


def test_a_compaction_during_a_background_checkpoint_leaves_the_coverage_true_and_checkpoints_going_on(
        tmp_path, monkeypatch):
    _slow_background_writes(monkeypatch, 1)
    with Store(_cfg(tmp_path / "nvme", checkpoint_tail_bytes=4096)) as s:
        n = _put_until_background(s)
        for i in range(n):  # (most of the journal garbage: the compaction shrinks it)
            s.free(s.lookup(f"k{i}"))
        s.durability.maybe_compact(force=True)  # the journal is rewritten while the child writes
        poll_until(lambda: s.durability._background is None, "the stale background checkpoint is let go of",
                   timeout_s=30)
        j = s.stat()["journal"]
        assert 0 < j["checkpoint_covers_bytes"] <= j["bytes"]  # the compaction's own checkpoint
        written = j["checkpoints_written"]
        _put_until_background(s, n)  # the new journal's growth starts the next one
        poll_until(lambda: s.stat()["journal"]["checkpoints_written"] > written, "a checkpoint of the new journal",
                   timeout_s=30)
    with Store(_cfg(tmp_path / "nvme")) as s2:
        assert s2.replay_info["checkpoint"] == "used"


# ------------------------------------------------------------------ the child itself
def test_a_forked_job_reports_success_failure_and_a_kill():
    assert forkjob.start(lambda: None).wait() is None
    err = forkjob.start(lambda: 1 / 0).wait()
    assert "ZeroDivisionError" in err
    job = forkjob.start(lambda: time.sleep(60))
    job.kill()
    assert job.wait() == "killed by signal 9"


def test_a_job_forked_from_a_worker_thread_runs_and_keeps_no_inherited_descriptor(tmp_path):
    r, w = os.pipe()
    out = tmp_path / "fds"
    res = []

    def fn():
        out.write_text(" ".join(sorted(os.listdir("/proc/self/fd"))))

    errors = in_threads(lambda k: res.append(forkjob.start(fn).wait()), 1)
    assert not errors and res == [None]
    fds = {int(x) for x in out.read_text().split()}
    assert r not in fds and w not in fds  # (0-2, the status pipe and the listing's own)
    assert len(fds) <= 5, fds
    os.close(r)
    os.close(w)


def test_a_forked_job_dies_with_its_parent(tmp_path):
    code = r"""
import sys, time
from tierstore import forkjob
job = forkjob.start(lambda: time.sleep(120))
print(job.pid, flush=True)
time.sleep(120)
"""
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = int(p.stdout.readline())
    p.kill()
    p.wait()

    def gone():
        try:
            with open(f"/proc/{child}/stat") as f:
                return f.read().split()[2] == "Z"  # (a zombie until init reaps it)
        except FileNotFoundError:
            return True
    poll_until(gone, "the child ended with its parent", timeout_s=10)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_forked_job_ends_on_sigterm_or_sigint_like_a_plain_process(sig):
    job = forkjob.start(lambda: time.sleep(60))
    os.kill(job.pid, sig)
    assert job.wait() == f"killed by signal {int(sig)}"
