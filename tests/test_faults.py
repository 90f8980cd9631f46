"""Fault injection: the harness's short mode in CI, and disk faults on the store."""

import os

import numpy as np
import pytest
import torch

import faults
from tierstore import ChecksumMismatch, StorageError


def test_fault_rounds_short(tmp_path):
    stats = faults.run(rounds=4, seed=11, workers=3, ops=250, base=tmp_path, verbose=False)
    assert not stats.failures, stats.failures[:10]
    assert stats.rounds == 4 and stats.objects_checked > 0 and stats.ephemeral_checked > 0


def _extent_file(s, h):
    e = s.index.objects[h.id].nvme[0]
    return s.nvme.drives[e.dev].path, e


def test_truncated_extent_is_an_error_for_that_object_only(make_store):
    s = make_store()
    keep = s.put(torch.arange(1000.0), tier="nvme", durable=True)
    last = s.put(torch.randn(300_000), tier="nvme", durable=True)  # the extent at the end of the file
    path, e = _extent_file(s, last)
    with open(path, "r+b") as f:
        f.truncate(e.file_offset + 4096)
    with pytest.raises(ChecksumMismatch):
        s.get(last)
    assert torch.equal(s.get(keep), torch.arange(1000.0))


def test_zero_filled_extent_is_detected(make_store):
    s = make_store()
    h = s.put(torch.randn(200_000), tier="nvme")
    path, e = _extent_file(s, h)
    with open(path, "r+b") as f:
        f.seek(e.file_offset)
        f.write(b"\0" * e.nbytes)
    with pytest.raises(ChecksumMismatch, match="block 0"):
        s.get(h)


def test_unwritable_data_file_fails_writes_cleanly(make_store, nvme_dir):
    """An NVMe file that refuses writes (immutable, as a read-only or failing drive would)."""
    import shutil
    import subprocess

    s = make_store(nvme_bytes="64MiB", nvme_grow_bytes="1MiB", host_bytes="4MiB")
    h = s.put(torch.ones(1000), tier="nvme", durable=True)
    data = os.path.join(nvme_dir, "data.bin")
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", data]).returncode != 0:
        pytest.skip("chattr +i is not available on this filesystem")
    try:
        with pytest.raises(StorageError, match="data.bin"):
            s.put(torch.ones(2_000_000), tier="nvme")
        assert torch.equal(s.get(h), torch.ones(1000))  # reads keep working
        assert s.stat()["namespaces"]["default"]["objects"] == 1  # the failed put left nothing
    finally:
        subprocess.run(["chattr", "-i", data], check=True)
    h2 = s.put(torch.ones(10), tier="nvme")
    assert torch.equal(s.get(h2), torch.ones(10))


def test_failed_durable_check_ins_end_every_lease_of_the_batch_and_leak_no_space(make_store, nvme_dir):
    """A batch check-in whose durable write-backs fail raises, and still ends every lease
    (the first failure must not leave the rest of the batch checked out)."""
    import shutil
    import subprocess

    s = make_store(nvme_bytes="64MiB", nvme_grow_bytes="64MiB", host_bytes="8MiB")
    hs = [s.put(torch.full((1000,), float(i)), durable=True) for i in range(3)]
    group = s.checkout_many(hs, "rw")
    data = os.path.join(nvme_dir, "data.bin")
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", data]).returncode != 0:
        group.release()
        pytest.skip("chattr +i is not available on this filesystem")
    try:
        for t in group.tensors:
            t.add_(1)
        with pytest.raises(StorageError):
            group.release()
        assert s.stat()["leases"] == 0
    finally:
        subprocess.run(["chattr", "-i", data], check=True)
    with s.checkout_many(hs, "rw") as ts:  # nothing is stuck: the objects can be written again
        for t in ts:
            t.add_(1)
    assert [float(s.get(h)[0]) for h in hs] == [2.0, 3.0, 4.0]
    for h in hs:
        s.free(h)
    assert s.stat()["tiers"]["nvme"]["used_bytes"] == 0  # the failed check-ins' old copies went too


@pytest.mark.skipif(os.geteuid() != 0, reason="another uid probes namespace ownership: needs root")
def test_journal_damage_rounds_short(tmp_path):
    import pathlib
    import shutil
    import tempfile

    base = pathlib.Path(tempfile.mkdtemp(prefix="tierstore-journal-", dir="/tmp"))  # reachable by nobody
    try:
        stats = faults.run_journal_damage(rounds=3, seed=5, base=base, ops=40, verbose=False)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    assert not stats.failures, stats.failures[:10]
    assert stats.rounds == 3 and stats.flips + stats.zeroed_pages + stats.cuts == 3
    assert stats.objects_checked and stats.frees_checked and stats.ownership_checked


@pytest.mark.parametrize("dest", ["new", "aligned out", "unaligned out", "checkout"])
def test_flipped_byte_in_a_large_object_is_detected(make_store, dest):
    """An object of many chunks, read by the engine's workers while the caller checks each
    chunk as it lands: a flipped byte in a middle block fails the read, whatever the
    destination (page-aligned, bounced through staging buffers, or the host tier)."""
    from tierstore.tensors import aligned_empty

    s = make_store(io_threads=3)
    n = 12 << 20  # 12 chunks of 1 MiB
    t = torch.from_numpy(np.random.default_rng(5).integers(0, 256, n, dtype=np.uint8))
    h = s.put(t[1:], tier="nvme")  # an unaligned source: written through the staging buffers
    assert torch.equal(s.get(h), t[1:])  # every block's checksum matches what the workers wrote
    path, e = _extent_file(s, h)
    with open(path, "r+b") as f:
        f.seek(e.file_offset + (7 << 20) + 99)
        b = f.read(1)
        f.seek(e.file_offset + (7 << 20) + 99)
        f.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(ChecksumMismatch, match="block 7 "):
        if dest == "new":
            s.get(h)
        elif dest == "aligned out":
            s.get(h, out=torch.from_numpy(aligned_empty(n - 1)))
        elif dest == "unaligned out":
            s.get(h, out=torch.empty(n, dtype=torch.uint8)[1:])
        else:
            s.checkout(h, "r")
    assert s.stat()["namespaces"]["default"]["objects"] == 1  # the object stays; reads keep failing
