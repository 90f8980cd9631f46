"""A growing NVMe data file gives its free tail back to the filesystem once no object
reached into it for ``nvme_trim_after_s``; what the file still holds stays readable,
and a restart after a cut finds every durable object."""

import contextlib
import os
import subprocess
import sys

import numpy as np
import torch

from conftest import poll_until
from tierstore.allocator import ExtentAllocator
from tierstore.engine.posix import PosixEngine
from tierstore.nvme import DATA_FILE, NvmeTier

MiB = 1 << 20


def test_the_allocator_reports_its_high_water_and_the_peak_since_it_was_last_asked():
    a = ExtentAllocator(64 * MiB)
    assert a.high_water() == 0
    lo = a.alloc(4 * MiB)
    hi = a.alloc(8 * MiB)
    assert (lo, hi) == (0, 4 * MiB) and a.high_water() == 12 * MiB
    assert a.take_peak() == 12 * MiB
    a.free(hi, 8 * MiB)
    assert a.high_water() == 4 * MiB
    assert a.take_peak() == 12 * MiB  # it was 12 MiB until the free, since the last call
    assert a.take_peak() == 4 * MiB
    tmp = a.alloc(20 * MiB)  # taken and given back between two calls: still seen
    a.free(tmp, 20 * MiB)
    assert a.take_peak() == 24 * MiB and a.take_peak() == 4 * MiB
    full = a.alloc(60 * MiB)
    assert a.high_water() == 64 * MiB
    a.free(full, 60 * MiB)
    a.free(lo, 4 * MiB)
    assert a.high_water() == 0


@contextlib.contextmanager
def _tier(d, *, grow=4 * MiB, after=10.0):
    """An NVMe tier over real files in ``d``: 4 MiB growth steps, a 10 s trim window."""
    eng = PosixEngine(4, "test")
    tier = NvmeTier([d], 256 * MiB, eng, chunk_bytes=MiB, grow_bytes=grow, trim_after_s=after)
    try:
        yield tier
    finally:
        tier.close()
        eng.close()


def _put(tier, nbytes, seed):
    data = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    ext = tier.alloc(nbytes)
    return ext, data, tier.write(ext, data)


def _same(tier, obj) -> bool:
    ext, data, crcs = obj
    out = np.empty_like(data)
    tier.read(ext, out, crcs)
    return np.array_equal(out, data)


def _file_bytes(d) -> int:
    return os.stat(os.path.join(d, DATA_FILE)).st_size


def test_a_data_file_gives_back_its_tail_only_once_it_was_free_for_the_whole_window(tmp_path):
    d = str(tmp_path / "nvme")
    with _tier(d) as tier:
        a, b = _put(tier, 8 * MiB, 1), _put(tier, 3 * MiB + 5, 2)
        big = _put(tier, 20 * MiB, 3)
        assert _file_bytes(d) == 32 * MiB
        assert tier.trim(0.0) == 0  # the window is not covered yet
        tier.free(big[0])
        assert tier.trim(5.0) == 0
        assert tier.trim(10.5) == 0  # the big object was there at 5 s, within the last 10 s
        assert _file_bytes(d) == 32 * MiB
        assert tier.trim(15.5) == 20 * MiB
        assert _file_bytes(d) == 12 * MiB == tier.describe()[0]["file_bytes"]
        assert tier.trimmed_bytes == 20 * MiB and tier.describe()[0]["high_water_bytes"] == 11 * MiB + 4096
        assert _same(tier, a) and _same(tier, b)
        assert tier.trim(30.0) == 0  # nothing more above the high water
        again = _put(tier, 20 * MiB, 4)  # the file grows back for new objects
        assert _file_bytes(d) == 32 * MiB
        assert _same(tier, again) and _same(tier, a) and _same(tier, b)


def test_an_object_taken_and_freed_between_two_samples_keeps_the_file(tmp_path):
    d = str(tmp_path / "nvme")
    with _tier(d) as tier:
        keep = _put(tier, 4 * MiB, 1)
        big = _put(tier, 28 * MiB, 2)
        tier.free(big[0])
        for t in (0.0, 11.0):
            tier.trim(t)  # the window covered; the big object was there at the first sample
        brief = _put(tier, 28 * MiB, 3)  # taken again and freed before the next sample
        tier.free(brief[0])
        assert tier.trim(22.0) == 0 and _file_bytes(d) == 32 * MiB
        assert tier.trim(33.0) == 28 * MiB and _file_bytes(d) == 4 * MiB
        assert _same(tier, keep)


def test_only_the_free_tail_is_given_back_and_a_reserved_file_never(tmp_path):
    d = str(tmp_path / "nvme")
    with _tier(d) as tier:
        low = _put(tier, 16 * MiB, 1)
        top = _put(tier, 2 * MiB, 2)
        tier.free(low[0])  # free space below an object in use stays in the file
        assert [tier.trim(t) for t in (0.0, 20.0, 40.0)] == [0, 0, 0]
        assert _file_bytes(d) == 20 * MiB and _same(tier, top)
    r = str(tmp_path / "reserved")
    with _tier(r, grow=0) as tier:
        obj = _put(tier, 4 * MiB, 3)
        tier.free(obj[0])
        assert [tier.trim(t) for t in (0.0, 20.0, 40.0)] == [0, 0, 0]
        assert _file_bytes(r) == 256 * MiB


def test_a_daemon_gives_back_a_freed_tail_and_a_killed_one_restarts_with_every_durable_object(daemon_factory):
    d = daemon_factory("--nvme-trim-after-s", "1", env={"TIERSTORE_NVME_GROW_BYTES": "4MiB"})
    keep = torch.arange(512 * 1024, dtype=torch.float32)  # 2 MiB, first in the file
    big = torch.randn(12 * MiB // 4)
    with d.client(namespace="trim") as c:
        c.put(keep, "keep", tier="nvme", durable=True)
        c.put(big, "big", tier="nvme", durable=True)
        drive = c.stat()["tiers"]["nvme"]["drives"][0]
        assert drive["file_bytes"] >= 14 * MiB
        c.free(c.lookup("big"))
        poll_until(lambda: c.stat()["tiers"]["nvme"]["drives"][0]["file_bytes"] == 4 * MiB,
                   "the data file cut back to the 4 MiB step above its remaining object")
        assert c.stat()["tiers"]["nvme"]["trimmed_bytes"] >= 10 * MiB
        assert torch.equal(c.get(c.lookup("keep")), keep)
    out = subprocess.run([sys.executable, "-m", "tierstore.client.cli", "stat", "--socket", d.socket],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "data files: 4.0 MiB on disk in 1 file" in out.stdout and "of free tail given back" in out.stdout
    assert os.path.getsize(os.path.join(d.nvme, DATA_FILE)) == 4 * MiB
    d.kill()
    d.start()
    with d.client(namespace="trim") as c:
        assert torch.equal(c.get(c.lookup("keep")), keep)
        assert c.lookup("big") is None
        c.put(big, "big", tier="nvme", durable=True)  # the file grows again
        assert torch.equal(c.get(c.lookup("big")), big)
