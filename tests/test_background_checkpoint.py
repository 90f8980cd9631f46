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
print(s.durability.checkpoints_written, flush=True)
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


def test_the_close_ends_a_background_checkpoint_still_being_written(tmp_path):
    d = tmp_path / "nvme"
    s = Store(_cfg(d))
    s.put(_val(1), key="a", durable=True)
    dur = s.durability
    started = threading.Event()

    def slow():
        started.set()
        time.sleep(60)
    with dur.lock:
        dur._background = job = forkjob.start(slow)
        threading.Thread(target=dur._reap, args=(job, s.journal.position, s.journal.rewrites), daemon=True).start()
    t0 = time.monotonic()
    s.close()
    assert time.monotonic() - t0 < 10
    assert job.wait() == "killed by signal 9"
    with Store(_cfg(d)) as s2:
        assert s2.replay_info["checkpoint"] == "used" and s2.replay_info["records_replayed"] == 0
        assert torch.equal(s2.get(s2.lookup("a")), _val(1))


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
