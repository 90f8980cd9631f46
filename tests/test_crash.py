"""Crash safety: SIGKILL of a writer process, torn journal tails, corrupt records."""

import os
import signal
import subprocess
import sys
import time

import torch

from tierstore import Config, Store
from tierstore.checkpoint import CHECKPOINT_FILE
from tierstore.journal import JOURNAL_FILE, Journal

WRITER = r"""
import sys, torch
from tierstore import Config, Store
d = sys.argv[1]
s = Store(Config(host_bytes="8MiB", nvme_dirs=[d], nvme_bytes="1GiB", io_chunk_bytes="1MiB"))
i = 0
while True:
    n = 1000 + (i * 7919) % 300_000
    t = torch.arange(n, dtype=torch.int32) * 31 + i
    s.put(t, key=f"obj/{i}", durable=True, tier="nvme" if i % 2 else None)
    if i % 3 == 0 and i:
        s.free(s.lookup(f"obj/{i - 1}"))
        print(f"freed {i - 1}", flush=True)
    print(f"done {i}", flush=True)
    i += 1
"""


def _expected(i):
    n = 1000 + (i * 7919) % 300_000
    return torch.arange(n, dtype=torch.int32) * 31 + i


def test_sigkill_mid_stream_loses_nothing_returned(tmp_path):
    d = str(tmp_path / "nvme")
    for round_ in range(3):
        p = subprocess.Popen([sys.executable, "-c", WRITER, d], stdout=subprocess.PIPE, text=True)
        done, freed = set(), set()
        deadline = time.monotonic() + 60
        target = 20 + 7 * round_
        while len(done) < target and time.monotonic() < deadline:
            line = p.stdout.readline()
            if not line:
                break
            kind, i = line.split()
            (done if kind == "done" else freed).add(int(i))
        os.kill(p.pid, signal.SIGKILL)  # mid-put of the next object, at an arbitrary point
        p.wait()
        assert len(done) >= target, "writer did not make progress"
        with Store(Config(host_bytes="8MiB", nvme_dirs=[d], nvme_bytes="1GiB")) as s:
            keys = set(s.keys(prefix="obj/"))
            for i in done - freed:
                h = s.lookup(f"obj/{i}")
                assert h is not None, f"obj/{i} was put durably but is missing after SIGKILL"
                assert torch.equal(s.get(h), _expected(i))
            for i in freed:
                assert f"obj/{i}" not in keys, f"obj/{i} was freed but came back"
            for k in keys:  # anything else present (the put in flight) must be whole
                i = int(k.split("/")[1])
                assert torch.equal(s.get(s.lookup(k)), _expected(i))
            used = s.stat()["tiers"]["nvme"]["used_bytes"]
            assert used == sum(((s.info(s.lookup(k))["nbytes"] + 4095) // 4096) * 4096 for k in keys)
            for k in keys:  # next round starts from a clean namespace
                s.free(s.lookup(k))


def test_torn_tail_is_dropped(tmp_path):
    d = tmp_path / "nvme"
    with Store(Config(host_bytes="8MiB", nvme_dirs=[str(d)], nvme_bytes="64MiB")) as s:
        for i in range(5):
            s.put(torch.full((100,), float(i)), key=f"k{i}", durable=True)
    path = d / JOURNAL_FILE
    size = path.stat().st_size
    (d / CHECKPOINT_FILE).unlink()  # (a crash before any checkpoint covered the record; see test_checkpoint.py)
    with open(path, "r+b") as f:
        f.truncate(size - 10)  # cut into the last record
    with Store(Config(host_bytes="8MiB", nvme_dirs=[str(d)], nvme_bytes="64MiB")) as s:
        assert s.replay_info["torn_bytes"] > 0
        # the torn record was k4's put: as if the crash hit before that put returned
        assert s.keys() == [f"k{i}" for i in range(4)]
        for i in range(4):
            assert torch.equal(s.get(s.lookup(f"k{i}")), torch.full((100,), float(i)))
        s.put(torch.ones(3), key="after", durable=True)
    with Store(Config(host_bytes="8MiB", nvme_dirs=[str(d)], nvme_bytes="64MiB")) as s:
        assert "after" in s.keys() and s.replay_info["torn_bytes"] == 0


def test_corrupt_record_in_the_middle_is_skipped(tmp_path):
    j = Journal(str(tmp_path))
    j.open_for_append()
    for i in range(10):
        j.append({"op": "x", "i": i, "pad": "y" * 50})
    j.close()
    data = bytearray((tmp_path / JOURNAL_FILE).read_bytes())
    rec = len(data) // 10
    data[rec * 4 + 30] ^= 0xFF
    (tmp_path / JOURNAL_FILE).write_bytes(bytes(data))
    res = Journal(str(tmp_path)).replay()
    assert res.corrupt_records == 1 and res.torn_bytes == 0
    assert [r["i"] for r in res.records] == [0, 1, 2, 3, 5, 6, 7, 8, 9]


def test_journal_compaction_bounds_growth(tmp_path):
    d = str(tmp_path / "nvme")
    cfg = Config(host_bytes="8MiB", nvme_dirs=[d], nvme_bytes="64MiB", journal_compact_bytes="64KiB")
    with Store(cfg) as s:
        for i in range(600):
            s.put(torch.full((10,), float(i)), key="rolling", durable=True, replace=True)
        assert s.journal.size() < 256 * 1024
    with Store(cfg) as s:
        assert torch.equal(s.get(s.lookup("rolling")), torch.full((10,), 599.0))
        assert s.stat()["namespaces"]["default"]["objects"] == 1
