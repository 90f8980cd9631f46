"""The in-process store against real files with O_DIRECT."""

import os
import threading
import time

import numpy as np
import pytest
import torch
from conftest import poll_until
from tierstore.tensors import TensorSpec

from tierstore.waits import Later
from tierstore import (Busy, CapacityExceeded, ChecksumMismatch, Handle, InvalidArgument, KeyExists, NotFound,
                       StaleHandle)

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64, torch.bool, torch.complex64]


def _rand(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=g).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=g, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tier", [None, "nvme"])
def test_round_trip_every_dtype(make_store, dtype, tier):
    s = make_store()
    for shape in [(), (0,), (1,), (3, 5, 7), (1000, 3)]:
        t = _rand(shape, dtype)
        h = s.put(t, tier=tier)
        got = s.get(h)
        assert got.dtype == t.dtype and got.shape == t.shape
        assert torch.equal(got, t)


def test_numpy_round_trip_and_out(make_store):
    s = make_store()
    a = np.random.default_rng(0).standard_normal((33, 17)).astype(np.float32)
    h = s.put(a, key="np")
    got = s.get(h)
    assert isinstance(got, np.ndarray) and np.array_equal(got, a)
    out = np.empty_like(a)
    assert s.get(h, out=out) is out and np.array_equal(out, a)
    be = a.astype(">f4")  # non-native byte order is stored as native
    assert np.array_equal(s.get(s.put(be)), a)
    for tier in ("host", "nvme"):  # shapes keep their rank: 0-d stays 0-d, empty stays empty
        for x in (np.asarray(np.float32(2.5)), np.zeros((0, 3), np.int8), a[::2, ::3], a.T):
            got = s.get(s.put(x, tier=tier))
            assert got.shape == x.shape and got.dtype == x.dtype and np.array_equal(got, x), (tier, x.shape)


def test_non_contiguous_input_is_copied(make_store):
    s = make_store()
    t = torch.arange(100.0).reshape(10, 10).t()
    assert not t.is_contiguous()
    assert torch.equal(s.get(s.put(t)), t)


@pytest.mark.parametrize("nbytes", [1, 511, 512, 513, 4095, 4096, 4097, (1 << 20) - 1, (1 << 20) + 1,
                                    3 * (1 << 20) + 777])
@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_odd_sizes_are_never_truncated(make_store, nbytes, tier):
    s = make_store()
    t = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    h = s.put(t, tier=tier)
    assert torch.equal(s.get(h), t)
    out = torch.empty_like(t)
    s.get(h, out=out)
    assert torch.equal(out, t)


def test_ephemeral_in_process_is_marked_and_cannot_be_durable(make_store):
    """In-process there is no connection to end: an ephemeral object lives as long as the store."""
    s = make_store()
    for tier in (None, "host", "nvme"):
        h = s.put(torch.arange(10.0), key=f"e{tier}", tier=tier, ephemeral=True)
        assert s.info(h)["ephemeral"] and torch.equal(s.get(h), torch.arange(10.0))
    assert not s.info(s.put(torch.ones(3), key="plain"))["ephemeral"]
    with pytest.raises(InvalidArgument, match="cannot be durable"):
        s.put(torch.ones(3), key="bad", ephemeral=True, durable=True)
    assert s.lookup("bad") is None


def test_spill_when_host_full_then_exact_read_back(make_store):
    s = make_store(host_bytes="8MiB")
    data = [torch.randn(256 * 1024, generator=torch.Generator().manual_seed(i)) for i in range(12)]  # 12 MiB
    hs = [s.put(t) for t in data]
    st = s.stat()["tiers"]
    assert st["nvme"]["objects"] > 0 and st["host"]["used_bytes"] <= 8 << 20
    for h, t in zip(hs, data):
        assert torch.equal(s.get(h), t)
    # tier="host" demotes cold objects to make room
    big = torch.randn(1 << 20)
    h = s.put(big, tier="host")
    assert "host" in s.info(h)["residency"]
    assert s.stat()["counters"]["demotions"] > 0
    for h2, t in zip(hs, data):
        assert torch.equal(s.get(h2), t)


def test_checkout_rw_is_zero_copy_and_persists(make_store):
    s = make_store(host_bytes="4MiB")
    h = s.put(torch.zeros(1024), key="x")
    with s.checkout(h, mode="rw") as v:
        v += 3
    assert torch.equal(s.get(h), torch.full((1024,), 3.0))
    # spill it, change it again after promotion
    for _ in range(6):
        s.put(torch.randn(128 * 1024), tier="host")
    with s.checkout(h, mode="rw") as v:
        assert torch.equal(v, torch.full((1024,), 3.0))
        v *= 2
    assert torch.equal(s.get(h), torch.full((1024,), 6.0))


def test_leases_conflict(make_store):
    s = make_store()
    h = s.put(torch.ones(10))
    r1 = s.checkout(h, "r")
    r2 = s.checkout(h, "r")
    with pytest.raises(Busy, match="conflicting"):
        s.checkout(h, "rw", timeout_s=0.05)
    with pytest.raises(Busy, match="checked out"):
        s.free(h)
    r1.release()
    r2.release()
    with s.checkout(h, "rw", timeout_s=0.05):
        pass
    s.free(h)


def test_keys_lookup_replace_and_stale(make_store):
    s = make_store()
    h1 = s.put(torch.ones(3), key="opt/a/1")
    s.put(torch.ones(3), key="opt/b/1")
    s.put(torch.ones(3), key="param/1")
    assert s.keys(prefix="opt/") == ["opt/a/1", "opt/b/1"]
    assert s.lookup("opt/a/1") == h1
    assert s.lookup("missing") is None
    with pytest.raises(KeyExists, match="replace=True"):
        s.put(torch.zeros(3), key="opt/a/1")
    assert torch.equal(s.get(h1), torch.ones(3))  # a failed put changes nothing
    h2 = s.put(torch.zeros(3), key="opt/a/1", replace=True)
    assert torch.equal(s.get(s.lookup("opt/a/1")), torch.zeros(3))
    with pytest.raises(StaleHandle):
        s.get(h1)
    s.free(h2)
    with pytest.raises(StaleHandle):
        s.free(h2)
    with pytest.raises(NotFound):
        s.get(Handle(10**9, 1))
    assert Handle.parse(int(h1)) == h1 and Handle.parse(str(h1)) == h1
    other = s.put(torch.ones(1), namespace="other-job", key="opt/a/1")
    assert s.keys(namespace="other-job") == ["opt/a/1"]
    with pytest.raises(NotFound):
        s.get(other)  # handles are scoped to their namespace


def test_bad_input_changes_nothing(make_store):
    s = make_store(host_bytes="4MiB", nvme_bytes="16MiB")
    h = s.put(torch.arange(6, dtype=torch.float32))
    with pytest.raises(InvalidArgument, match="dtype"):
        s.get(h, out=torch.empty(6, dtype=torch.float64))
    with pytest.raises(InvalidArgument, match="bytes"):
        s.get(h, out=torch.empty(5))
    with pytest.raises(InvalidArgument, match="contiguous"):
        s.get(h, out=torch.empty(12)[::2])
    with pytest.raises(InvalidArgument, match="torch.Tensor or numpy"):
        s.put([1, 2, 3])
    with pytest.raises(InvalidArgument, match="tier"):
        s.put(torch.ones(1), tier="ssd")
    with pytest.raises(InvalidArgument, match="mode"):
        s.checkout(h, mode="wr")
    with pytest.raises(InvalidArgument, match="NUL"):
        s.put(torch.ones(1), key="a\0b")
    with pytest.raises(CapacityExceeded, match="every tier"):
        s.put(torch.empty(32 << 20, dtype=torch.uint8))
    with pytest.raises(CapacityExceeded, match="host tier"):
        s.put(torch.empty(8 << 20, dtype=torch.uint8), tier="host")
    assert s.stat()["namespaces"]["default"]["objects"] == 1
    assert torch.equal(s.get(h), torch.arange(6, dtype=torch.float32))


def test_flipped_byte_is_detected(make_store, nvme_dir):
    s = make_store()
    t = torch.randn(300_000)
    h = s.put(t, tier="nvme")
    ext = s.index.objects[h.id].nvme[0]
    path = s.nvme.drives[ext.dev].path
    with open(path, "r+b") as f:
        f.seek(ext.file_offset + 123_457)
        b = f.read(1)
        f.seek(ext.file_offset + 123_457)
        f.write(bytes([b[0] ^ 0x01]))
    with pytest.raises(ChecksumMismatch, match="block 0"):
        s.get(h)
    other = s.put(torch.ones(10), tier="nvme")
    assert torch.equal(s.get(other), torch.ones(10))  # the rest keeps working


def test_durable_objects_survive_reopen_and_frees_stick(make_store, nvme_dir):
    s = make_store()
    keep = {f"k{i}": torch.randn(1000 * (i + 1)) for i in range(5)}
    for k, t in keep.items():
        s.put(t, key=k, durable=True)
    gone = s.put(torch.ones(5), key="gone", durable=True)
    s.put(torch.ones(5), key="volatile")
    h = s.lookup("k0")
    with s.checkout(h, "rw") as v:
        v.fill_(7.0)
    keep["k0"] = torch.full((1000,), 7.0)
    s.free(gone)
    s.close()
    s2 = make_store()
    assert sorted(s2.keys()) == sorted(keep)
    for k, t in keep.items():
        assert torch.equal(s2.get(s2.lookup(k)), t)
    assert s2.stat()["tiers"]["nvme"]["used_bytes"] == sum(((t.nbytes + 4095) // 4096) * 4096 for t in keep.values())


@pytest.mark.parametrize("mode", ["r", "rw"])
def test_an_object_replaced_while_checked_out_goes_at_its_last_check_in(make_store, mode):
    s = make_store(lease_wait_s=30.0)
    base = s.stat()["tiers"]["host"]["used_bytes"]
    h1 = s.put(torch.ones(1 << 18), key="k")
    lease = s.checkout(h1, mode)
    h2 = s.put(torch.zeros(1 << 18), key="k", replace=True)  # returns at once, the old one is still out
    assert s.lookup("k") == h2 and s.stat()["tiers"]["host"]["objects"] == 2
    if mode == "rw":
        lease.tensor.fill_(5.0)  # discarded with the object
    lease.release()
    st = s.stat()
    assert st["tiers"]["host"]["objects"] == 1 and st["tiers"]["host"]["used_bytes"] == base + (1 << 20)
    with pytest.raises(StaleHandle):
        s.get(h1)
    assert torch.equal(s.get(s.lookup("k")), torch.zeros(1 << 18))


def test_a_durable_object_replaced_under_a_writer_is_not_resurrected(make_store):
    s = make_store()
    h1 = s.put(torch.ones(1000), key="k", durable=True)
    lease = s.checkout(h1, "rw")
    s.put(torch.zeros(1000), key="k", durable=True, replace=True)
    lease.tensor.fill_(9.0)
    lease.release()  # the replaced object's bytes are not written back over the new one's record
    s.close()
    s2 = make_store()
    assert s2.keys() == ["k"] and torch.equal(s2.get(s2.lookup("k")), torch.zeros(1000))
    assert s2.stat()["tiers"]["nvme"]["objects"] == 1


def test_unanswered_check_ins_never_leave_the_event_loop(make_store):
    """The client sends these check-ins without waiting: the daemon must handle them on
    arrival (on its event loop), or a later request of the same connection could overtake them."""
    s = make_store()
    for tier, durable, mode in [(None, False, "r"), (None, False, "rw"), ("nvme", False, "w"), (None, True, "r")]:
        h = s.put(torch.ones(1 << 16), tier=tier, durable=durable)
        info = s.daemon.checkout(h, mode, owner="conn")
        assert s.daemon.try_release(info.lid, owner="conn") is None  # done now, not Later
        assert s.stat()["leases"] == 0
    h = s.put(torch.ones(10), durable=True)
    info = s.daemon.checkout(h, "w", owner="conn")
    rest = s.daemon.try_release(info.lid, owner="conn")  # a durable write-back syncs: the client waits for it
    assert isinstance(rest, Later) and s.stat()["leases"] == 1
    rest.run()
    assert s.stat()["leases"] == 0


def test_the_rest_of_a_staged_transfer_looks_up_its_staging_area_again(make_store):
    """A staged get or put the event loop cannot finish now is finished on an op worker
    (``Later``). If the connection went away meanwhile its staging area is no longer its
    own (here another connection's): the rest copies nothing into or out of it and
    publishes nothing."""
    from tierstore.errors import Closed

    s = make_store(host_bytes="1MiB", high_watermark=1.0, low_watermark=1.0)
    owner, other = object(), object()
    s.daemon.staging_area(owner, 64 << 10)
    h = s.put(np.full(1000, 5, np.uint8), tier="nvme")
    rest = s.daemon.try_get_staged(owner, h)  # on NVMe: read through a pin, off the loop
    assert isinstance(rest, Later)
    s.daemon.drop_owner(owner)
    off, _ = s.daemon.staging_area(other, 64 << 10)
    s.arena.view(off, 1000)[:] = 9
    with pytest.raises(Closed):
        rest.run()
    assert (s.arena.view(off, 1000) == 9).all()
    s.daemon.drop_owner(other)

    s.daemon.staging_area(owner, 64 << 10)
    full = s.put(np.zeros(s.host.free_bytes, np.uint8), tier="host")  # the rest of the tier, checked out
    held = s.checkout(full, "r")
    spec = TensorSpec("numpy", "uint8", (1000,), 1000)
    rest = s.daemon.try_put_staged(owner, 0, spec, key="k", tier=None, durable=False, replace=False,
                                   namespace="default")
    assert isinstance(rest, Later)  # no room now
    s.daemon.drop_owner(owner)  # its staging area goes: room for the put, but no bytes of its own
    with pytest.raises(InvalidArgument, match="staging area"):
        rest.run()
    assert s.lookup("k") is None and s.stat()["reservations"] == 0
    held.release()


def test_second_store_on_same_dir_is_refused(make_store):
    make_store()
    with pytest.raises(InvalidArgument, match="in use by pid"):
        make_store()


def test_a_second_store_is_refused_also_after_the_lock_file_was_removed(make_store):
    """The directory itself is locked, not only its lock file: a removed lock file, made
    anew by the next store, does not let two stores share the data file (the second
    would reuse the first's extents, and lose what either acknowledged)."""
    first = make_store()
    d = first.config.nvme_dirs[0]
    os.remove(os.path.join(d, "lock"))
    with pytest.raises(InvalidArgument, match="in use by pid"):
        make_store()
    h = first.put(torch.arange(4.0), durable=True, tier="nvme")
    assert torch.equal(first.get(h), torch.arange(4.0))


def test_full_filesystem_fails_only_that_request(make_store, tmpfs):
    s = make_store(nvme_dirs=[tmpfs], nvme_bytes="256MiB", nvme_grow_bytes="1MiB", host_bytes="4MiB")
    kept = [s.put(torch.full((256 * 1024,), float(i)), tier="nvme", durable=True) for i in range(4)]  # 4 MiB
    from tierstore import NoSpace

    with pytest.raises(NoSpace, match="no space"):
        s.put(torch.empty(40 << 20, dtype=torch.uint8), tier="nvme")
    for i, h in enumerate(kept):
        assert torch.equal(s.get(h), torch.full((256 * 1024,), float(i)))
    small = s.put(torch.ones(1000), tier="nvme")
    assert torch.equal(s.get(small), torch.ones(1000))


def test_threads_put_get_concurrently(make_store):
    from conftest import in_threads

    s = make_store(host_bytes="8MiB")

    def worker(seed):
        g = torch.Generator().manual_seed(seed)
        mine = []
        for i in range(40):
            t = torch.randn(int(torch.randint(1, 80_000, (1,), generator=g)), generator=g)
            mine.append((s.put(t, key=f"w{seed}/{i}", durable=i % 5 == 0), t))
            h, ref = mine[int(torch.randint(0, len(mine), (1,), generator=g))]
            assert torch.equal(s.get(h), ref)
            if i % 7 == 0:
                with s.checkout(h, "r") as v:
                    assert torch.equal(v, ref)
        for h, ref in mine:
            assert torch.equal(s.get(h), ref)

    errors = in_threads(worker, 4)
    assert not errors, errors
    st = s.stat()
    assert st["leases"] == 0 and st["namespaces"]["default"]["objects"] == 160


def test_prefetch_promotes(make_store):
    s = make_store(host_bytes="4MiB")
    hs = [s.put(torch.full((100_000,), float(i)), tier="nvme") for i in range(3)]
    assert all(s.info(h)["residency"] == ["nvme"] for h in hs)
    assert s.prefetch_tracked(hs).result(timeout=30) == 3
    assert all("host" in s.info(h)["residency"] for h in hs)


@pytest.mark.slow
def test_object_larger_than_1gib(make_store):
    s = make_store(host_bytes="64MiB", nvme_bytes="3GiB", io_chunk_bytes="8MiB")
    n = (1 << 30) + 12345
    t = torch.randint(0, 256, (n,), dtype=torch.uint8)
    h = s.put(t, durable=True)
    assert torch.equal(s.get(h), t)


def test_the_demoter_moves_many_small_objects_down_in_batches_intact(make_store, nvme_dir):
    """Past the high watermark the demoter takes small objects down a batch at a time:
    every one keeps its bytes; a durable object whose host copy is newer than its NVMe
    copy (an rw check-in) is written and journaled on the way, so it survives a reopen."""
    s = make_store(host_bytes="8MiB", high_watermark=0.6, low_watermark=0.3)
    dur = s.put(torch.zeros(256), key="dur", durable=True)
    with s.checkout(dur, "rw") as v:  # the host copy is now the newer one
        v.fill_(7.0)
    hs = [s.put(torch.full((1024,), float(i)), key=f"k{i}", tier="host") for i in range(1500)]  # past 60 %

    def worked_down():
        st = s.stat()
        return st["counters"]["demotions"] >= 256 and st["tiers"]["host"]["used_bytes"] <= 0.6 * (8 << 20)
    poll_until(worked_down, "the demoter works down")  # more than one batch's worth
    moved = s.stat()["counters"]["demotions"]
    assert sum(_resident(s, h) == ["nvme"] for h in hs) >= moved - 1
    for i, h in enumerate(hs):
        assert torch.equal(s.get(h), torch.full((1024,), float(i)))
    assert torch.equal(s.get(dur), torch.full((256,), 7.0))
    s.close()
    s2 = make_store(host_bytes="8MiB")
    assert torch.equal(s2.get(s2.lookup("dur")), torch.full((256,), 7.0))


def test_nvme_homed_objects_go_back_down_after_use(make_store):
    s = make_store(host_bytes="16MiB")
    h = s.put(torch.ones(100_000), tier="nvme")
    cached = s.put(torch.ones(100_000))
    assert s.info(h)["residency"] == ["nvme"]
    with s.checkout(h, "rw") as v:
        assert "host" in s.info(h)["residency"]
        v.add_(1)
    poll_until(lambda: s.info(h)["residency"] == ["nvme"], "the background demoter writes it back")
    assert torch.equal(s.get(h), torch.full((100_000,), 2.0))
    assert s.info(h)["residency"] == ["nvme"]  # a get does not pull it up either
    assert "host" in s.info(cached)["residency"]  # tier=None objects stay cached


def test_a_store_placed_object_put_on_nvme_for_want_of_room_is_cached_later(make_store):
    """put(tier=None) finding the host tier full writes to NVMe, but the object does not
    *live* there as a tier="nvme" one does: once checked out it stays in the host tier
    while there is room (the eviction policy decides when it goes)."""
    import time

    s = make_store(host_bytes="4MiB", high_watermark=1.0, low_watermark=0.9)
    first = s.put(torch.ones(3 << 18))  # 3 MiB: fits
    second = s.put(torch.full((3 << 18,), 2.0))  # does not fit beside it: NVMe
    assert s.info(second)["residency"] == ["nvme"]
    s.free(first)
    with s.checkout(second, "rw") as v:
        v.add_(1)
    # a witness: a tier="nvme" object used after it goes back down in the same or a later
    # pass of the demoter, so once it has, the demoter has looked at everything released before it
    witness = s.put(torch.zeros(1024), tier="nvme")
    with s.checkout(witness, "rw") as w:
        w.add_(1)
    poll_until(lambda: s.info(witness)["residency"] == ["nvme"], "the witness goes back to NVMe")
    assert "host" in s.info(second)["residency"]
    assert torch.equal(s.get(second), torch.full((3 << 18,), 3.0))


def test_an_object_larger_than_the_host_tier_is_read_directly_and_its_checkout_refused_at_once(make_store):
    s = make_store(host_bytes="1MiB")
    t = torch.randn(1 << 19)  # 2 MiB, on NVMe
    h = s.put(t, tier="nvme")
    assert torch.equal(s.get(h), t)  # straight from NVMe into the result
    t0 = time.monotonic()
    with pytest.raises(CapacityExceeded, match="do not fit in the host tier at all"):
        s.checkout(h, "r")  # no waiting for room that can never come
    assert time.monotonic() - t0 < 5


def test_write_only_checkout_skips_the_read(make_store):
    s = make_store()
    h = s.put(torch.ones(300_000), tier="nvme")
    reads = s.stat()["tiers"]["nvme"]["bytes_read"]
    with s.checkout(h, "w") as v:
        v.fill_(5.0)
    assert s.stat()["tiers"]["nvme"]["bytes_read"] == reads  # nothing was read to hand out the lease
    assert torch.equal(s.get(h), torch.full((300_000,), 5.0))
    with pytest.raises(InvalidArgument, match="'r', 'rw' or 'w'"):
        s.checkout(h, "x")


@pytest.mark.parametrize("tier,durable", [("nvme", False), (None, True)])
def test_a_client_dying_mid_commit_leaves_a_whole_object(make_store, tier, durable):
    """A connection that goes away while its put is being committed (the daemon then
    aborts what the client left open) must not pull the host block and the NVMe copy
    from under the commit: the object is published whole, never without its bytes."""
    import threading

    from tierstore.tensors import to_bytes

    s = make_store(host_bytes="16MiB")
    t = torch.arange(1 << 18, dtype=torch.float32)
    u8, spec = to_bytes(t)
    res = s.daemon.reserve_put(spec, key="k", tier=tier, durable=durable, replace=False, namespace="default", owner="c1")
    s.arena.view(res.host_off, spec.nbytes)[:] = u8
    written, go = threading.Event(), threading.Event()
    # a durable commit is written down by the group committer (``land_many``), any other by ``write_down``
    name = "land_many" if durable else "write_down"
    real = getattr(s.placement, name)

    def slow_write_down(*args, **kw):
        r = real(*args, **kw)
        written.set()
        go.wait(10)
        return r
    setattr(s.placement, name, slow_write_down)
    out = {}
    committer = threading.Thread(target=lambda: out.setdefault("h", s.daemon.commit_put(res.rid, owner="c1")))
    committer.start()
    assert written.wait(10)
    s.daemon.drop_owner("c1")  # the client's connection closed while its commit was under way
    go.set()
    committer.join(10)
    assert torch.equal(s.get(out["h"]), t) and torch.equal(s.get(s.lookup("k")), t)
    assert s.stat()["reservations"] == 0


def test_a_get_racing_a_checkout_keeps_one_host_copy(make_store):
    """A get that found the object on NVMe, while a check-out brings it up before the get
    promotes it too, reads the copy now there instead of leaking a second host block."""
    import threading

    s = make_store(host_bytes="16MiB", promote_on_get=True)
    t = torch.arange(1 << 18, dtype=torch.float32)
    h = s.put(t, tier="nvme")
    s.index.objects[h.id].home = None  # an object the host tier may keep after use
    real = s.placement.host_has_room
    leases = []

    def checkout_first(n):  # runs between the get's two looks at the object
        th = threading.Thread(target=lambda: leases.append(s.checkout(h, "r")))
        th.start()
        th.join(10)
        return real(n)
    s.placement.host_has_room = checkout_first
    assert torch.equal(s.get(h), t)
    s.placement.host_has_room = real
    assert len(leases) == 1 and torch.equal(leases[0].tensor, t)
    assert s.host.used_bytes == s.host.rounded(t.numel() * 4)  # one host copy, not two
    leases[0].release()


def test_checkout_many_takes_all_or_nothing(make_store):
    """A batch check-out leases every object in order, or none: a failure part-way gives
    back what it took unchanged (no object dirtied, a blank write lease's host block
    dropped, so the object still reads as before)."""
    s = make_store(host_bytes="8MiB", lease_wait_s=5)
    mib = 1 << 18  # float32 elements in 1 MiB
    hs = [s.put(torch.full((mib,), float(i)), key=f"k{i}", tier="nvme" if i >= 3 else None) for i in range(6)]
    with s.checkout_many(hs[:4], ["r", "rw", "w", "r"]) as ts:
        assert [float(t[0]) for t in (ts[0], ts[1], ts[3])] == [0.0, 1.0, 3.0]
        assert s.stat()["leases"] == 4
        ts[1].add_(10)
        ts[2].fill_(20)
    assert s.stat()["leases"] == 0
    assert float(s.get(hs[1])[0]) == 11.0 and float(s.get(hs[2])[0]) == 20.0

    # a freed block of another object's bytes, so a blank lease's host block holds them
    junk = s.put(torch.full((mib,), -7.0))
    s.free(junk)
    held = s.checkout(hs[5], "rw")
    before = s.info(hs[0])
    t0 = time.monotonic()
    with pytest.raises(Busy, match="object #2 of the batch.*no object was checked out"):
        s.checkout_many([hs[4], hs[0], hs[5]], ["w", "rw", "r"], timeout_s=0.3)
    assert time.monotonic() - t0 < 3
    assert s.stat()["leases"] == 1  # only the one held before
    held.release()
    assert torch.equal(s.get(hs[4]), torch.full((mib,), 4.0))  # not the blank block's bytes
    assert torch.equal(s.get(hs[0]), torch.full((mib,), 0.0))
    assert s.info(hs[0]) == before  # the rw lease given back wrote nothing: not made dirty, not moved

    # one lease released on its own, then the group: each checked in once
    g = s.checkout_many(hs, "r")
    assert [lease.handle for lease in g] == hs and len(g) == 6
    g[2].release()
    g.release()
    g.release()
    assert s.stat()["leases"] == 0

    # refused before anything is leased
    with pytest.raises(InvalidArgument, match="twice"):
        s.checkout_many([hs[0], hs[0]], "rw")
    s.checkout_many([hs[0], hs[0]], "r").release()  # two readers of one object are fine
    with pytest.raises(InvalidArgument, match="modes"):
        s.checkout_many(hs[:2], ["r"])
    with pytest.raises(InvalidArgument, match="mode"):
        s.checkout_many(hs[:2], "x")
    with pytest.raises(InvalidArgument, match="1 to"):
        s.checkout_many([], "r")
    big = [s.put(torch.zeros(mib), tier="nvme") for _ in range(9)]
    t0 = time.monotonic()
    with pytest.raises(CapacityExceeded, match="cannot all be checked out at once"):
        s.checkout_many(big, "r")  # 9 MiB of objects in an 8 MiB host tier: would wait forever
    assert time.monotonic() - t0 < 1
    assert s.stat()["leases"] == 0


def _resident(s, h) -> list[str]:
    return s.info(h)["residency"]


def _wait_down(s, *hs) -> None:
    """Until the demoter has taken these tier="nvme" objects back to NVMe only."""
    poll_until(lambda: all(_resident(s, h) == ["nvme"] for h in hs), "the demoter takes them back to NVMe")


def test_checkout_from_a_source_hands_its_block_over_or_copies(make_store):
    """``checkout(dst, "w", source=src)``: the lease starts with src's bytes and src keeps
    its own. A clean, unshared host copy of src changes owner (no copy, no second block);
    anything else is copied; errors leave nothing leased."""
    s = make_store(host_bytes="8MiB", lease_wait_s=0.3)
    mib = 1 << 18  # float32 elements in 1 MiB
    src = s.put(torch.arange(mib, dtype=torch.float32), key="src", tier="nvme")
    dst = s.put(torch.full((mib,), -1.0), key="dst", tier="nvme")
    _wait_down(s, src, dst)  # both on NVMe only
    misses = s.stat()["prefetch"]["misses"]

    # src read up from NVMe into a block that becomes dst's: one block in use, not two
    with s.checkout(dst, "w", source=src) as t:
        assert torch.equal(t, torch.arange(mib, dtype=torch.float32))
        assert s.host.used_bytes == s.host.rounded(4 * mib)
        assert _resident(s, src) == ["nvme"]  # its NVMe copy is still its bytes
        t.mul_(2)
    c = s.stat()["counters"]
    assert (c["source_handovers"], c["source_copies"]) == (1, 0)
    assert s.stat()["prefetch"]["misses"] == misses + 1  # the read of src was recorded as an access
    assert torch.equal(s.get(src), torch.arange(mib, dtype=torch.float32))
    assert torch.equal(s.get(dst), 2 * torch.arange(mib, dtype=torch.float32))

    # src prefetched (clean in host), dst resident and dirty: dst's block goes, src's is handed over
    _wait_down(s, src, dst)
    cache = s.put(torch.full((mib,), 5.0), tier=None)  # host only
    assert s.prefetch_tracked([src]).result(timeout=10) == 1
    assert "host" in _resident(s, src) and _resident(s, cache) == ["host"]
    used = s.host.used_bytes
    with s.checkout(cache, "w", source=src) as t:
        assert torch.equal(t, torch.arange(mib, dtype=torch.float32))
        assert s.host.used_bytes == used - s.host.rounded(4 * mib)
    assert s.stat()["counters"]["source_handovers"] == 2
    assert torch.equal(s.get(cache), torch.arange(mib, dtype=torch.float32))
    assert torch.equal(s.get(src), torch.arange(mib, dtype=torch.float32))
    s.free(cache)

    # src read by someone else, or only in host (dirty): copied, src untouched and resident
    other = s.checkout(src, "r")
    with s.checkout(dst, "w", source=src) as t:
        assert torch.equal(t, torch.arange(mib, dtype=torch.float32))
        t.zero_()
    other.release()
    hot = s.put(torch.full((mib,), 3.0), tier="host")
    with s.checkout(dst, "w", source=hot) as t:
        assert torch.equal(t, torch.full((mib,), 3.0))
        t.add_(1)
    assert s.stat()["counters"]["source_copies"] == 2
    assert torch.equal(s.get(hot), torch.full((mib,), 3.0)) and "host" in _resident(s, hot)
    assert torch.equal(s.get(src), torch.arange(mib, dtype=torch.float32))
    assert torch.equal(s.get(dst), torch.full((mib,), 4.0))

    # dst leased elsewhere: Busy after the wait, and the read lease on src is given back
    held = s.checkout(dst, "r")
    with pytest.raises(Busy):
        s.checkout(dst, "w", source=src, timeout_s=0.2)
    held.release()
    assert s.stat()["leases"] == 0

    # refused up front
    small = s.put(torch.zeros(16))
    with pytest.raises(InvalidArgument, match="same size"):
        s.checkout(dst, "w", source=small)
    with pytest.raises(InvalidArgument, match="its own source"):
        s.checkout(dst, "w", source=dst)
    with pytest.raises(InvalidArgument, match="'w' check-out"):
        s.checkout(dst, "rw", source=src)
    with pytest.raises(NotFound):
        s.checkout(dst, "w", source=Handle(10**6, 1))
    assert s.stat()["leases"] == 0

    # nothing leaked: once everything is freed the host tier is empty
    for h in (src, dst, hot, small):
        s.free(h)
    poll_until(lambda: s.stat()["tiers"]["host"]["used_bytes"] == 0, "the host tier empties")


def test_a_put_waits_for_the_space_a_replace_gave_up_instead_of_failing(make_store):
    """A replaced durable object is discarded off the put's path (its free is journaled,
    which syncs). A put that finds the host tier full meanwhile (the rest checked out)
    waits for that discard instead of failing with CapacityExceeded, however late it runs."""
    s = make_store(host_bytes="1MiB", high_watermark=1.0, low_watermark=1.0)
    blk = 448 << 10  # two fit, with the tier's read reserve
    s.put(torch.zeros(blk, dtype=torch.uint8), key="a", tier="host", durable=True)
    gate, started = threading.Event(), threading.Event()
    discard = s.placement.discard

    def slow_discard(meta):  # the replaced object's discard runs late
        started.set()
        gate.wait(10)
        discard(meta)

    s.placement.discard = slow_discard
    owner = object()
    spec = TensorSpec("torch", "uint8", (blk,), blk)
    res = s.daemon.reserve_put(spec, key="a", tier="host", durable=False, replace=True, namespace="default",
                               owner=owner)
    s.arena.view(res.host_off, blk)[:] = 1
    a2 = s.daemon.commit_put(res.rid, owner=owner)
    held = s.checkout(a2, "r")  # nothing in the tier can be demoted now
    assert started.wait(10)
    result = []

    def put_b():
        try:
            result.append(s.put(torch.full((blk,), 7, dtype=torch.uint8), key="b", tier="host"))
        except Exception as e:  # (the assertion below shows it)
            result.append(e)

    t = threading.Thread(target=put_b)
    waiting = threading.Event()
    cv_wait = s.index.cv.wait

    def watched_wait(timeout=None):  # the put's thread parks on the index's lock: it waits for the space
        if threading.current_thread() is t:
            waiting.set()
        return cv_wait(timeout)

    s.index.cv.wait = watched_wait
    t.start()
    assert waiting.wait(10) and not result, result  # waiting for the space, not failed
    gate.set()
    t.join(10)
    assert not t.is_alive() and isinstance(result[0], Handle), result
    assert torch.equal(s.get(result[0]), torch.full((blk,), 7, dtype=torch.uint8))
    assert torch.equal(held.tensor, torch.ones(blk, dtype=torch.uint8))
    held.release()


def test_a_lease_given_back_leaves_its_object_clean_with_its_nvme_copy(make_store):
    """``give_back()`` of an ``rw`` check-out (a holder that only read, as the activation
    offload's in-place reads): the object is not dirty and keeps its NVMe copy, so a
    demotion writes nothing; ``release()`` after ``rw`` leaves it dirty."""
    s = make_store()
    t = torch.arange(100_000, dtype=torch.float32)
    kept, dirtied = s.put(t, tier="nvme"), s.put(t, tier="nvme")
    for h in (kept, dirtied):
        assert s.info(h)["residency"] == ["nvme"]
    lease = s.checkout(kept, "rw")
    assert torch.equal(lease.tensor, t) and "host" in s.info(kept)["residency"]
    lease.give_back()
    lease.give_back()  # a second call does nothing
    assert lease.tensor is None
    info = s.info(kept)
    assert not info["dirty"] and "nvme" in info["residency"] and not info["writer"]
    s.checkout(dirtied, "rw").release()
    assert s.info(dirtied)["dirty"]
    # what the NVMe copy holds is the object's bytes: dropped from host and read back, exact
    written = s.nvme.bytes_written
    meta = s.index.objects[kept.id]
    with s.index.cv:
        meta.moving = True  # (as the demoter flags what it moves)
    s.placement.demote(meta)
    assert s.nvme.bytes_written == written and s.info(kept)["residency"] == ["nvme"]
    assert torch.equal(s.get(kept), t)


def test_a_sourced_durable_lease_given_back_on_the_event_loop_path_writes_back_later(make_store):
    """``try_give_back`` (the daemon's ``release`` with ``unused``) never syncs on the
    caller: a lease from a source is checked in, and for a durable object that writes it
    back, so that part is ``Later``; a plain lease is given back at once."""
    from tierstore.waits import Later

    s = make_store()
    src = s.put(torch.full((4096,), 3.0), durable=True)
    dst = s.put(torch.zeros(4096), durable=True)
    info = s.daemon.checkout_from(dst, src, owner="c")
    rest = s.daemon.try_give_back(info.lid, owner="c")
    assert isinstance(rest, Later)
    assert s.info(dst)["writer"]  # not checked in yet: the write-back is the rest's
    rest.run()
    assert not s.info(dst)["writer"] and not s.info(dst)["dirty"]
    assert torch.equal(s.get(dst), torch.full((4096,), 3.0))
    plain = s.daemon.checkout(dst, "rw", owner="c")
    assert s.daemon.try_give_back(plain.lid, owner="c") is None and not s.info(dst)["writer"]
    s.daemon.drop_owner("c")


def test_a_large_batch_is_taken_off_the_event_loop_whole(make_store):
    """The daemon's loop takes a batch of up to ``INLINE_BATCH`` resident objects itself;
    a larger one, and a larger check-in, are ``Later`` whole (an op worker takes them, so
    thousands of leases hold no other client up), with the same leases in the end."""
    from tierstore.leasebatches import INLINE_BATCH
    from tierstore.waits import Later

    s = make_store(host_bytes="64MiB")
    hs = [s.put(np.zeros(4, np.float32)) for _ in range(INLINE_BATCH + 1)]
    owner = object()
    small = s.daemon.try_checkout_many(hs[:INLINE_BATCH], ["r"] * INLINE_BATCH, owner=owner)
    assert len(small) == INLINE_BATCH and s.daemon.try_release_many([i.lid for i in small], owner=owner) is None
    big = s.daemon.try_checkout_many(hs, ["r"] * len(hs), owner=owner)
    assert isinstance(big, Later)
    leases = big.run()
    assert [i.oid for i in leases] == [h.id for h in hs]
    each = s.daemon.try_checkout_each([(h, "r", None) for h in hs], owner=owner)
    assert isinstance(each, Later) and len(each.run()) == len(hs)
    back = s.daemon.try_release_many([i.lid for i in leases], owner=owner)
    assert isinstance(back, Later)
    back.run()
    assert s.stat()["leases"] == len(hs)  # the check_each ones are still out


def test_a_connection_holds_a_bounded_number_of_leases(make_store, monkeypatch):
    """One owner (a connection) holds at most ``MAX_LEASES_PER_OWNER`` leases: one more is
    ``CapacityExceeded``, nothing taken; others are unaffected; its leases are found by
    owner when it goes away (no scan over everyone's)."""
    from tierstore import leases as lmod
    from tierstore.errors import CapacityExceeded

    monkeypatch.setattr(lmod, "MAX_LEASES_PER_OWNER", 5)
    s = make_store(host_bytes="64MiB")
    h = s.put(np.zeros(4, np.float32))
    a, b = object(), object()
    got = [s.leases.checkout(h, "r", owner=a) for _ in range(5)]
    with pytest.raises(CapacityExceeded, match="holds 5 leases"):
        s.leases.checkout(h, "r", owner=a)
    other = s.leases.checkout(h, "r", owner=b)
    assert s.index.holder(h.id).readers == 6 and s.leases.leases.count(a) == 5
    assert s.leases.drop_owner(a) == 5 and s.index.holder(h.id).readers == 1
    s.leases.release(other.lid, owner=b)
    assert not s.leases.leases and not s.leases.leases.by_owner and len(got) == 5


@pytest.mark.parametrize("each", [False, True])
def test_a_large_batch_that_must_wait_goes_on_from_what_it_took_or_gives_it_back(make_store, each):
    """A batch too large for the event loop that parks half-way (another holder writes
    object #100) runs again from the leases it took, not from the start (no lease
    taken twice), and ``give_back`` gives back what it took when it ends without running on."""
    from tierstore.leasebatches import INLINE_BATCH
    from tierstore.waits import Later, WouldWait, wait_context

    s = make_store(host_bytes="64MiB")
    hs = [s.put(np.zeros(4, np.float32)) for _ in range(INLINE_BATCH + 44)]
    a, b = object(), object()

    def start():
        if each:
            return s.daemon.try_checkout_each([(h, "r", None) for h in hs], owner=a)
        return s.daemon.try_checkout_many(hs, ["r"] * len(hs), owner=a)

    for end in ("go on", "give back"):
        held = s.leases.checkout(hs[100], "w", owner=b)
        later = start()
        assert isinstance(later, Later) and later.give_back is not None
        with pytest.raises(WouldWait), wait_context(park=True):
            later.run()
        assert s.leases.leases.count(a) == 100
        s.leases.release(held.lid, owner=b)
        if end == "give back":
            later.give_back()
            assert s.leases.leases.count(a) == 0
            continue
        with wait_context(park=False):
            got = later.run()
        assert [i.oid for i in got] == [h.id for h in hs] and s.leases.leases.count(a) == len(hs)
        s.leases.drop_owner(a)
    assert not s.leases.leases


def test_a_volatile_commit_handed_on_and_ended_unrun_gives_its_reservation_up(make_store):
    """A volatile commit that must write to NVMe (or finds the journal lock held) answers
    ``Later``; a daemon that ends it without running it (its connection gone, its queue
    timeout) calls its ``give_back``: the reservation and its host block go, nothing is left
    committing forever."""
    from tierstore.tensors import to_bytes
    from tierstore.waits import Later

    s = make_store()
    used0 = s.stat()["tiers"]["host"]["used_bytes"]
    u8, spec = to_bytes(torch.ones(1 << 16))
    r = s.daemon.reserve_put(spec, key="k", tier="nvme", durable=False, replace=False, namespace="default",
                             owner="conn")
    later = s.daemon.try_commit_put(r.rid, owner="conn")
    assert isinstance(later, Later) and later.give_back is not None
    later.give_back()
    assert s.stat()["tiers"]["host"]["used_bytes"] == used0
    assert s.lookup("k") is None
    s.daemon.drop_owner("conn")  # (nothing left to end)
    s.put(torch.zeros(4), key="k")  # the key was never bound


def test_objects_of_no_bytes_are_bounded_by_count_like_objects_of_one_byte(make_store):
    """An object of no bytes takes no block: a flood of them would grow the store's
    memory without bound. They are refused once the store holds as many objects as its
    tiers have pages (what objects of one byte, a page each, could reach)."""
    from tierstore.errors import CapacityExceeded

    s = make_store(host_bytes="1MiB", nvme_bytes="1MiB", nvme_grow_bytes="1MiB")
    pages = (s.host.capacity + s.nvme.capacity_bytes) // 4096
    hs = []
    with pytest.raises(CapacityExceeded, match="object of no bytes"):
        for _ in range(pages + 1):
            hs.append(s.put(torch.empty(0)))
    assert len(hs) == pages
    s.free(hs.pop())
    hs.append(s.put(torch.empty(0), key="again"))  # room again once one goes
    assert s.get(hs[-1]).numel() == 0


@pytest.mark.parametrize("name", ["lock", "data.bin", "journal.log", "index.ckpt"])
def test_a_link_planted_in_the_nvme_directory_is_refused_at_start_and_its_target_untouched(tmp_path, name):
    from tierstore import Store
    from tierstore.errors import InvalidArgument

    victim = tmp_path / "victim"
    victim.write_bytes(b"precious" * 10)
    nvme = tmp_path / "nvme"
    nvme.mkdir(mode=0o700)
    os.symlink(victim, nvme / name)
    with pytest.raises(InvalidArgument, match=f"symbolic link, {name}"):
        Store(host_bytes="16MiB", nvme_bytes="64MiB", nvme_dirs=[str(nvme)])
    assert victim.read_bytes() == b"precious" * 10


@pytest.mark.parametrize("name", ["lock", "data.bin", "journal.log", "index.ckpt"])
@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_fifo_or_directory_planted_at_a_tier_files_name_is_refused_at_start(tmp_path, name, kind):
    """A FIFO at the journal's or the checkpoint's name would hang the start's read of it
    (nothing ever writes to it); a directory would fail it obscurely: both are refused in
    one line, at once, and left alone."""
    import subprocess
    import sys

    nvme = tmp_path / "nvme"
    nvme.mkdir(mode=0o700)
    (os.mkfifo if kind == "fifo" else os.mkdir)(nvme / name)
    code = ("from tierstore import Store\n"
            f"Store(host_bytes='16MiB', nvme_bytes='64MiB', nvme_dirs=[{str(nvme)!r}])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and f"holds {name}, which is not a regular file" in r.stderr, r.stderr[-2000:]
    assert (nvme / name).exists() and not (nvme / name).is_file()


def test_a_link_planted_at_a_temporary_name_while_the_store_runs_is_not_followed(tmp_path, caplog):
    """The journal's compaction file and the index checkpoint's temporary file are made
    anew: a link planted at their names is removed, never written through."""
    import logging

    from tierstore import Store

    victim = tmp_path / "victim"
    victim.write_bytes(b"precious" * 10)
    nvme = tmp_path / "nvme"
    nvme.mkdir(mode=0o777)
    nvme.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="tierstore.preflight"):
        s = Store(host_bytes="16MiB", nvme_bytes="64MiB", nvme_dirs=[str(nvme)])
    assert "writable by other users" in caplog.text
    h = s.put(torch.arange(8.0), key="k", durable=True)
    for name in ("journal.log.compact", "index.ckpt.tmp", "index.ckpt.bg.tmp"):
        os.symlink(victim, nvme / name)
    s.durability.maybe_compact(force=True)
    s.close()  # writes the index checkpoint through its temporary file
    assert victim.read_bytes() == b"precious" * 10
    assert not (nvme / "journal.log").is_symlink() and (nvme / "index.ckpt").is_file()
    s = Store(host_bytes="16MiB", nvme_bytes="64MiB", nvme_dirs=[str(nvme)])
    try:
        assert torch.equal(s.get(s.lookup("k")), torch.arange(8.0)) and s.lookup("k") == h
    finally:
        s.close()


def test_leases_are_bounded_per_group_of_owners_and_in_all(make_store, monkeypatch):
    """The daemon counts a connection's leases against its uid's share as well: many
    connections of one uid cannot each hold a connection's most. Owners here are
    ("uid", n) pairs grouped by uid, the bounds lowered to a few leases."""
    from tierstore import leases as lmod

    monkeypatch.setattr(lmod, "MAX_LEASES_PER_GROUP", 4)
    monkeypatch.setattr(lmod, "MAX_LEASES", 6)
    s = make_store()
    s.daemon.group_lease_owners(lambda owner: owner[0])
    hs = [s.put(torch.ones(2)) for _ in range(8)]
    held = [s.daemon.checkout(hs[i], "r", owner=("a", i % 3)) for i in range(4)]  # uid a, 3 connections
    with pytest.raises(CapacityExceeded, match="uid's connections hold 4"):
        s.daemon.checkout(hs[4], "r", owner=("a", 3))  # a 4th connection of uid a
    held += [s.daemon.checkout(hs[i], "r", owner=("b", 0)) for i in (5, 6)]  # uid b has its own share
    with pytest.raises(CapacityExceeded, match="daemon holds 6"):
        s.daemon.checkout(hs[7], "r", owner=("c", 0))
    s.daemon.leases.release(held.pop(0).lid, owner=("a", 0))
    s.daemon.checkout(hs[4], "r", owner=("a", 3))  # room again once one is checked in
    assert len(s.daemon.leases) == 6


@pytest.mark.parametrize("shift", [64, 512, 1024])
def test_memory_at_the_drives_dma_alignment_goes_to_the_kernel_without_a_staging_copy(make_store, shift):
    """A put from, and a ``get(out=)`` into, memory ``shift`` bytes past a page: direct
    O_DIRECT I/O where the drive's DMA alignment (``statx``) allows that address, through
    a staging buffer where it does not; the bytes round-trip either way."""
    from tierstore.tensors import aligned_empty

    s = make_store()
    drive = s.stat()["tiers"]["nvme"]["drives"][0]
    if not drive["direct"]:
        pytest.skip(f"the test directory refuses O_DIRECT: {drive['reason']}")
    n = 4 << 20
    src = aligned_empty(n + 4096)[shift:shift + n]
    src[:] = np.random.default_rng(shift).integers(0, 256, n, dtype=np.uint8)
    out = aligned_empty(n + 4096)[shift:shift + n]
    before = s.stat()["tiers"]["nvme"]["staged_bytes"]
    h = s.put(src, tier="nvme")
    s.get(h, out=out)
    staged = s.stat()["tiers"]["nvme"]["staged_bytes"] - before
    assert np.array_equal(out, src)
    assert staged == (0 if shift % drive["dio_mem_align"] == 0 else 2 * n), (shift, drive["dio_mem_align"], staged)


def test_staging_buffers_are_private_huge_page_aligned_memory(make_store):
    """The staging buffers of unaligned transfers lie side by side from a 2 MiB boundary of
    a private mapping advised into transparent huge pages: where the kernel gives private memory
    any (``enabled`` is ``madvise`` or ``always``), each buffer is a few physically
    contiguous pieces once it has been used, so a request is not cut at the drive's
    limit of segments per request."""
    import re

    s = make_store()
    drive = s.stat()["tiers"]["nvme"]["drives"][0]
    if not drive["direct"] or drive["dio_mem_align"] <= 64:
        pytest.skip("this drive takes ordinary tensors as they are: no staging")
    def fallbacks() -> int:  # huge-page faults the kernel could not serve, for want of contiguous memory
        stat = dict(line.split() for line in open("/proc/vmstat"))
        return int(stat.get("thp_fault_fallback", 0))

    before = fallbacks()
    n = 8 << 20
    src = np.random.default_rng(3).integers(0, 256, n + 64, dtype=np.uint8)[64:]  # (not page-aligned)
    s.get(s.put(src, tier="nvme"), out=np.empty(n + 64, np.uint8)[64:])
    pool = s.nvme._bounce
    bufs = [pool.get() for _ in range(pool.count)]
    for b in bufs:
        pool.put(b)
    start = min(b.ctypes.data for b in bufs)
    assert start % (2 << 20) == 0 and all(b.nbytes == pool.size for b in bufs)
    assert sorted(b.ctypes.data for b in bufs) == [start + i * pool.size for i in range(pool.count)]
    thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    smaps = open("/proc/self/smaps").read()
    entry = next(e for e in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", smaps)
                 if int(e.split("-", 1)[0], 16) <= start < int(e.split("-", 1)[1].split()[0], 16))
    huge = int(re.search(r"AnonHugePages:\s+(\d+)", entry).group(1)) << 10
    if "[never]" in thp:
        assert huge == 0
    else:
        assert huge >= 2 << 20 or fallbacks() > before, entry


def test_a_host_tier_split_by_a_staging_area_says_it_is_fragmented_not_full(make_store):
    """Free bytes that lie on both sides of a block nothing can move (a connection's
    staging area) cannot hold an object larger than either side: the error says the tier
    is fragmented and what to do, instead of calling a mostly free tier full."""
    s = make_store(host_bytes="4MiB")
    small = [s.put(np.zeros(256 << 10, np.uint8), tier="host") for _ in range(8)]  # the top half
    off, n = s.daemon.staging_area("conn", 320 << 10)  # below them
    for h in small:
        s.free(h)
    assert s.stat()["tiers"]["host"]["free_bytes"] == (4 << 20) - n and 0 < off < 3 << 20
    with pytest.raises(CapacityExceeded, match="host tier too fragmented: .* raise host_bytes"):
        s.put(np.zeros(5 << 19, np.uint8), tier="host")
    s.daemon.drop_owner("conn")
    s.put(np.zeros(5 << 19, np.uint8), tier="host")  # whole again once the area is gone


def test_an_early_write_that_comes_after_its_object_went_down_begins_nothing(make_store):
    """A ``put_part`` whose turn on a worker comes after the commit, when the committed
    object has already gone down to NVMe and given its host block back, begins nothing
    and fails nothing (it read the block's offset, gone by then, and raised TypeError)."""
    from tierstore.tensors import TensorSpec

    s = make_store(host_bytes="64MiB")
    n = 6 << 20
    spec = TensorSpec("numpy", "uint8", (n,), n)
    owner = object()
    res = s.daemon.reserve_put(spec, key="late", tier="nvme", durable=False, replace=False, namespace="default",
                               owner=owner)
    data = np.random.default_rng(3).integers(0, 256, n, dtype=np.uint8)
    s.placement.host_view(res.host_off, n)[:] = data
    late = s.daemon.fill_put(res.rid, n // 2, owner=owner)  # (its worker has not run it yet)
    h = s.daemon.commit_put(res.rid, owner=owner)
    poll_until(lambda: s.info(h)["residency"] == ["nvme"], "the committed object to go down to NVMe")
    used = s.stat()["tiers"]["nvme"]["used_bytes"]
    assert late.run() == 0
    assert s.stat()["tiers"]["nvme"]["used_bytes"] == used and np.array_equal(s.get(h), data)


@pytest.mark.parametrize("durable", [False, True])
def test_early_writes_racing_their_commit_and_each_other_keep_the_bytes_and_no_space(make_store, durable):
    """``fill`` (``put_part``) from several threads at once while the reservation commits
    or aborts: whichever begins the early write, whichever comes after the commit or
    abort took the reservation, every committed object reads back its bytes (checksummed)
    and the NVMe tier holds exactly the committed objects' bytes, nothing more."""
    from tierstore.tensors import TensorSpec

    s = make_store(host_bytes="64MiB")
    n = 6 << 20
    spec = TensorSpec("numpy", "uint8", (n,), n)
    owner, kept = object(), {}
    used0 = s.stat()["tiers"]["nvme"]["used_bytes"]
    for i in range(12):
        res = s.daemon.reserve_put(spec, key=f"k{i}", tier="nvme", durable=durable, replace=False,
                                   namespace="default", owner=owner)
        data = np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8)
        s.placement.host_view(res.host_off, n)[:] = data
        parts = [s.daemon.fill_put(res.rid, upto, owner=owner) for upto in (n // 3, n // 2, n)]

        errors = []

        def run(later):
            try:
                later.run()  # (one after the commit or abort took the reservation begins nothing)
            except Exception as e:
                errors.append(e)

        threads = [threading.Thread(target=run, args=(p,)) for p in parts]
        for t in threads:
            t.start()
        if i % 4 == 3:
            s.daemon.abort_put(res.rid, owner=owner).run()
        else:
            kept[f"k{i}"] = (s.daemon.commit_put(res.rid, owner=owner), data)
        for t in threads:
            t.join()
        assert not errors, errors
    for key, (h, data) in kept.items():
        assert np.array_equal(s.get(h), data), key
    assert s.stat()["tiers"]["nvme"]["used_bytes"] - used0 == len(kept) * n
    assert s.stat()["counters"]["put_early_bytes"] > 0 and s.stat()["reservations"] == 0
    for h, _ in kept.values():
        s.free(h)
    poll_until(lambda: s.stat()["tiers"]["nvme"]["used_bytes"] == used0, "the NVMe space to come back")


def test_an_early_write_begins_with_the_first_filled_blocks_not_the_first_whole_chunk(make_store):
    """``put_part`` of a prefix shorter than a chunk sends its whole checksum blocks at once
    (the drive starts on the client's first piece), the rest of the chunk later; every
    byte lands once, checksummed, whatever the order of the prefixes."""
    s = make_store(host_bytes="160MiB", nvme_bytes="512MiB", io_chunk_bytes="16MiB")
    n = (64 << 20) + 12345  # chunks of 16 MiB; a last block and page in part
    spec = TensorSpec("numpy", "uint8", (n,), n)
    owner = object()
    for durable in (False, True):
        res = s.daemon.reserve_put(spec, key=f"k{durable}", tier="nvme", durable=durable, replace=False,
                                   namespace="default", owner=owner)
        data = np.random.default_rng(int(durable)).integers(0, 256, n, dtype=np.uint8)
        s.placement.host_view(res.host_off, n)[:] = data
        sent = [s.daemon.fill_put(res.rid, upto, owner=owner).run()
                for upto in ((1 << 20) + 5, 3 << 20, 2 << 20, (16 << 20) + 7, 40 << 20, n - 1)]
        assert sent[:5] == [1 << 20, 2 << 20, 0, 13 << 20, 24 << 20], sent
        assert sum(sent) == n // (1 << 20) * (1 << 20)  # the last part-block waits for the commit
        h = s.daemon.commit_put(res.rid, owner=owner)
        poll_until(lambda: s.info(h)["residency"] == ["nvme"], "the object to be on NVMe only")
        assert np.array_equal(s.get(h), data)  # (read from NVMe, every block checked)
    assert s.stat()["counters"]["put_early_bytes"] == 2 * (n // (1 << 20) * (1 << 20))


def test_an_abort_ends_the_early_writes_still_queued_without_waiting_for_them(make_store):
    """``put_abort`` of a reservation whose early writes (``put_part``) are queued behind
    other I/O: the daemon runs the abort's rest on a worker (a ``Later``: never on its
    event loop), the queued writes are cancelled, not waited for, so the abort ends while
    the I/O ahead of them still runs; the reservation and its NVMe space come back, and
    nothing of it was written. A reservation of another owner's, or none, is NotFound."""
    from tierstore.errors import NotFound
    from tierstore.tensors import TensorSpec
    from tierstore.waits import Later

    s = make_store(host_bytes="64MiB", io_threads=2)
    engine = s.placement.nvme.engine
    n = 8 << 20
    owner = object()
    used0 = s.stat()["tiers"]["nvme"]["used_bytes"]
    gate = threading.Event()
    ahead = [engine.submit(gate.wait) for _ in range(2)]  # every worker busy until the gate opens
    try:
        poll_until(lambda: engine.queued() == 0, "the workers to take the blocking jobs")
        res = s.daemon.reserve_put(TensorSpec("numpy", "uint8", (n,), n), key="k", tier="nvme", durable=False,
                                   replace=False, namespace="default", owner=owner)
        s.placement.host_view(res.host_off, n)[:] = 7
        written0 = s.placement.nvme.bytes_written
        assert s.daemon.fill_put(res.rid, n, owner=owner).run() == n  # every chunk sent, all queued
        assert engine.queued() > 0
        with pytest.raises(NotFound):
            s.daemon.abort_put(res.rid, owner=object())
        with pytest.raises(NotFound):
            s.daemon.abort_put(res.rid + 1000, owner=owner)
        later = s.daemon.abort_put(res.rid, owner=owner)
        assert isinstance(later, Later)
        t = threading.Thread(target=later.run, daemon=True)
        t.start()
        t.join(60)
        assert not t.is_alive(), "the abort waited for writes queued behind the blocked workers"
        assert s.stat()["reservations"] == 0  # (the cancelled writes stay queued, to be skipped)
        assert s.stat()["tiers"]["nvme"]["used_bytes"] == used0
    finally:
        gate.set()
    for f in ahead:
        f.result()
    assert s.placement.nvme.bytes_written == written0
