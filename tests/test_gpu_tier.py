"""The GPU tier's logic on a CPU host: slab bookkeeping, location encoding, lifetimes,
placement and movement between the GPU and host tiers.

The CUDA calls (cudaMalloc, IPC handles, cudaMemcpy, cudaHostRegister) are the only
part replaced here, by host memory (``HostBackend``); everything above them is the
real store. The same paths run against CUDA in tests/test_gpu.py (gpu marker).
"""

import ctypes

import numpy as np
import pytest
from conftest import poll_until

from tierstore import Config, Store
from tierstore.errors import CapacityExceeded, InvalidArgument
from tierstore.gpu import GPU_ALIGN, GpuTier, decode_loc, detect_backend, encode_loc


class HostBackend:
    """Device memory stood in for by host memory; copies are memmove."""

    name = "host-test"

    def __init__(self, devices: int = 1, fail_register: bool = False) -> None:
        self.devices = devices
        self.bufs: dict[int, np.ndarray] = {}
        self.freed: list[int] = []
        self.registered: list[tuple[int, int]] = []
        self.fail_register = fail_register

    def device_count(self) -> int:
        return self.devices

    def device_uuid(self, device: int) -> str:
        return f"{device + 0xA0:032x}"

    def malloc(self, device: int, nbytes: int) -> int:
        buf = np.zeros(nbytes, np.uint8)
        self.bufs[buf.ctypes.data] = buf
        return buf.ctypes.data

    def free(self, device: int, ptr: int) -> None:
        del self.bufs[ptr]
        self.freed.append(ptr)

    def ipc_handle(self, device: int, ptr: int) -> bytes:
        return ptr.to_bytes(8, "little") + bytes(56)  # 64 bytes, like cudaIpcMemHandle_t

    def copy(self, device: int, dst: int, src: int, nbytes: int) -> None:
        ctypes.memmove(dst, src, nbytes)

    def host_register(self, address: int, nbytes: int) -> None:
        if self.fail_register:
            raise RuntimeError("cudaErrorMemoryAllocation")
        self.registered.append((address, nbytes))

    def host_unregister(self, address: int) -> None:
        self.registered = [r for r in self.registered if r[0] != address]


def test_locations_round_trip_and_reject_garbage():
    for d, s, o in [(0, 0, 0), (3, 17, 12345 * 512), (255, 4095, (1 << 40) - 1)]:
        assert decode_loc(encode_loc(d, s, o)) == (d, s, o)
    for bad in [-1, 1 << 60, "3", True, 1.5]:
        with pytest.raises(InvalidArgument):
            decode_loc(bad)
    with pytest.raises(InvalidArgument):
        encode_loc(256, 0, 0)


def test_slabs_split_allocate_export_and_outlive_their_mappers():
    be = HostBackend(devices=2)
    tier = GpuTier(10 << 20, 4 << 20, be)
    assert [len(tier.slabs[d]) for d in (0, 1)] == [3, 3]  # 4 + 4 + 2 MiB on each device
    assert tier.capacity() == 20 << 20 and tier.capacity(1) == 10 << 20
    exported = tier.export()
    assert len(exported) == 6 and all(len(e["handle"]) == 64 for e in exported)
    a = tier.alloc(3 << 20, device=1)
    b = tier.alloc(3 << 20, device=1)
    assert decode_loc(a)[:2] == (1, 0) and decode_loc(b)[:2] == (1, 1)  # the second did not fit slab 0
    assert tier.alloc(5 << 20, device=1) is None  # bigger than any slab
    assert not tier.fits(5 << 20) and tier.fits(4 << 20)
    assert tier.used(1) == 6 << 20 and tier.used(0) == 0
    c = tier.alloc(1)
    assert decode_loc(c)[0] == 0 and tier.used(0) == GPU_ALIGN  # blocks are GPU_ALIGN-rounded
    tier.free(a, 3 << 20)
    assert tier.used(1) == 3 << 20
    with pytest.raises(InvalidArgument):
        tier.alloc(10, device=2)
    assert {e["uuid"] for e in exported} == {be.device_uuid(0), be.device_uuid(1)}  # clients map devices by UUID
    tier.attach("client-a")
    tier.attach("client-b")
    assert tier.mapped_by() == 2
    tier.detach("client-a")
    tier.detach("client-b")  # as at the daemon's stop: their connections closed, the processes may live on
    buf = np.zeros(4 << 20, np.uint8)
    assert tier.pin_host(buf.ctypes.data, buf.nbytes)[0] and be.registered
    assert tier.close() is False
    assert be.freed == [] and len(be.bufs) == 6  # opened by clients once: left to the process exit
    assert be.registered == []  # but the host arena is unregistered before it is unmapped


def test_slabs_no_client_opened_are_freed_at_close():
    be = HostBackend()
    tier = GpuTier(4 << 20, 2 << 20, be)
    assert tier.close() is True and len(be.freed) == 2 and not be.bufs


def test_pinning_is_chunked_and_a_refusal_is_reported():
    be = HostBackend()
    tier = GpuTier(1 << 20, 1 << 20, be)
    buf = np.zeros(10 << 20, np.uint8)
    ok, why = tier.pin_host(buf.ctypes.data, buf.nbytes, chunk=4 << 20)
    assert ok and len(be.registered) == 3, why
    tier.close()
    assert be.registered == []
    be2 = HostBackend(fail_register=True)
    ok, why = GpuTier(1 << 20, 1 << 20, be2).pin_host(buf.ctypes.data, buf.nbytes)
    assert not ok and "cudaHostRegister failed" in why and "MEMLOCK" in why


def test_without_cuda_the_tier_is_absent_with_a_reason(tmp_path):
    backend, why = detect_backend()
    if backend is not None:
        pytest.skip("a CUDA device is present")
    assert why
    with Store(Config(host_bytes=8 << 20, nvme_dirs=[str(tmp_path)], nvme_bytes=64 << 20, gpu_bytes=4 << 20)) as s:
        assert "gpu" not in s.stat()["tiers"] and s.stat()["gpu_reason"] == why
        with pytest.raises(InvalidArgument, match="gpu tier is not available"):
            s.put(np.zeros(4), tier="gpu")


@pytest.fixture
def gpu_store(tmp_path):
    be = HostBackend()
    cfg = Config(host_bytes=16 << 20, nvme_dirs=[str(tmp_path)], nvme_bytes=128 << 20, gpu_bytes=4 << 20,
                 gpu_slab_bytes=2 << 20)
    s = Store(cfg, gpu_backend=be)
    yield s, be
    s.close()


def test_gpu_tier_put_get_checkout_free(gpu_store):
    s, be = gpu_store
    st = s.stat()
    assert st["tiers"]["gpu"]["capacity_bytes"] == 4 << 20 and st["tiers"]["host"]["pinned"]
    x = np.random.default_rng(0).standard_normal(100_000).astype(np.float32)
    h = s.put(x, key="w", tier="gpu")
    st = s.stat()
    assert st["tiers"]["gpu"]["objects"] == 1 and st["tiers"]["gpu"]["used_bytes"] >= x.nbytes
    assert st["tiers"]["host"]["used_bytes"] == 0  # the GPU copy is the only one
    assert s.info(h)["residency"] == ["gpu"] and s.info(h)["dirty"]
    np.testing.assert_array_equal(s.get(h), x)  # copied out without leaving the GPU tier
    assert s.counters["gpu_hits"] == 1 and s.stat()["tiers"]["gpu"]["objects"] == 1
    lease = s.daemon.checkout(h, "r", owner="c", device=True)  # a CUDA caller leases it where it is
    assert lease.gpu_loc is not None and s.gpu.used() > 0
    assert s.daemon.try_release(lease.lid, owner="c") is None
    with s.checkout(h, "rw") as v:  # a host check-out moves it down to the host tier
        np.testing.assert_array_equal(v, x)
        v *= 2
    assert s.stat()["tiers"]["gpu"]["used_bytes"] == 0 and s.counters["gpu_demotions"] == 1
    np.testing.assert_array_equal(s.get(h), 2 * x)
    h2 = s.put(x, key="w2", tier="gpu")
    s.free(h2)
    assert s.stat()["tiers"]["gpu"]["used_bytes"] == 0 and s.stat()["tiers"]["gpu"]["objects"] == 0


def test_a_host_write_lease_of_a_gpu_object_given_back_keeps_its_bytes(gpu_store):
    """A ``w`` check-out to the host tier of an object whose only copy is in the GPU
    tier, given back unwritten, leaves the object as it was (the check-out reads the
    GPU copy down rather than dropping it)."""
    s, _ = gpu_store
    x = np.random.default_rng(1).standard_normal(50_000).astype(np.float32)
    a, b = s.put(x, key="a", tier="gpu"), s.put(-x, key="b", tier="gpu")
    assert s.info(a)["residency"] == ["gpu"] == s.info(b)["residency"]
    s.checkout(a, "w").give_back()  # in-process
    info = s.daemon.checkout(b, "w", owner="c")  # a connection's, as the daemon takes and gives it back
    assert s.daemon.try_give_back(info.lid, owner="c") is None
    np.testing.assert_array_equal(s.get(a), x)
    np.testing.assert_array_equal(s.get(b), -x)


def test_gpu_tier_refuses_durable_and_oversized(gpu_store):
    s, _ = gpu_store
    with pytest.raises(InvalidArgument, match="volatile"):
        s.put(np.zeros(10), tier="gpu", durable=True)
    with pytest.raises(CapacityExceeded, match="gpu_slab_bytes"):
        s.put(np.zeros(3 << 20, np.uint8), tier="gpu")


def test_a_full_gpu_tier_moves_least_recently_used_objects_to_host(gpu_store):
    s, _ = gpu_store
    xs = [np.full(1 << 20, i, np.uint8) for i in range(8)]
    hs = [s.put(x, key=f"k{i}", tier="gpu") for i, x in enumerate(xs)]  # 8 MiB through a 4 MiB tier
    st = s.stat()
    assert st["tiers"]["gpu"]["used_bytes"] <= 4 << 20
    assert s.counters["gpu_demotions"] >= 4
    for h, x in zip(hs, xs):
        np.testing.assert_array_equal(s.get(h), x)
    on_gpu = [int(m.id) for m in s.index.objects.values() if m.gpu_loc is not None]
    assert on_gpu and all(h.id in on_gpu for h in hs[-len(on_gpu):])  # the newest stayed up


@pytest.fixture
def full_store(tmp_path):
    """``gpu_store``'s tiers with watermarks at 1.0: the background demoter leaves a full
    tier full, so a test that fills one sees it full whatever the demoter's timing."""
    cfg = Config(host_bytes=16 << 20, nvme_dirs=[str(tmp_path)], nvme_bytes=128 << 20, gpu_bytes=4 << 20,
                 gpu_slab_bytes=2 << 20, high_watermark=1.0, low_watermark=1.0)
    with Store(cfg, gpu_backend=HostBackend()) as s:
        yield s


def test_leased_gpu_objects_never_move(full_store):
    s = full_store
    hs = [s.put(np.full(1 << 20, i, np.uint8), tier="gpu") for i in range(4)]  # the tier is full
    leases = [s.daemon.checkout(h, "r", owner="c", device=True) for h in hs]
    with pytest.raises(CapacityExceeded, match="GPU tier full"):
        s.put(np.zeros(1 << 20, np.uint8), tier="gpu", wait_s=0.1)
    assert all(s.index.objects[h.id].gpu_loc is not None for h in hs)
    for ls in leases:
        assert s.daemon.try_release(ls.lid, owner="c") is None
    s.daemon.drop_owner("c")


def test_background_demoter_brings_the_gpu_tier_under_its_watermark(tmp_path):
    be = HostBackend()
    cfg = Config(host_bytes=16 << 20, nvme_dirs=[str(tmp_path)], nvme_bytes=64 << 20, gpu_bytes=4 << 20,
                 gpu_slab_bytes=4 << 20, high_watermark=0.6, low_watermark=0.3)
    with Store(cfg, gpu_backend=be) as s:
        hs = [s.put(np.full(1 << 20, i, np.uint8), tier="gpu") for i in range(3)]
        poll_until(lambda: s.gpu.used() <= 0.3 * s.gpu.capacity(), "the demoter brings the GPU tier down")
        for i, h in enumerate(hs):
            assert (s.get(h) == i).all()


def test_daemon_without_cuda_says_why_there_is_no_gpu_tier(daemon_factory):
    backend, why = detect_backend()
    if backend is not None:
        pytest.skip("a CUDA device is present")
    d = daemon_factory("--gpu-bytes", "64MiB")
    with d.client("g") as c:
        assert "gpu" not in c.stat()["tiers"] and c.stat()["gpu_reason"] == why
        with pytest.raises(InvalidArgument, match="no GPU tier"):
            c.put(np.zeros(16, np.float32), tier="gpu")
        with pytest.raises(InvalidArgument, match="no GPU tier"):
            c._conn.request("gpu_attach")
        h = c.put(np.arange(16, dtype=np.float32))  # everything else works as before
        assert (c.get(h) == np.arange(16)).all()


def test_a_revoked_gpu_write_lease_moves_the_object_off_the_holders_block(gpu_store):
    s, _ = gpu_store
    x = np.arange(300_000, dtype=np.float32)  # 1.2 MiB
    h = s.put(x, key="w", tier="gpu")
    lease = s.daemon.checkout(h, "rw", owner="c", device=True)
    old = s.gpu.ptr(lease.gpu_loc)
    ctypes.memset(old, 0, 4000)  # the holder writes part of it, then stops answering
    assert s.daemon.revoke(lease.lid, owner="c") and not s.daemon.revoke(lease.lid, owner="c")
    assert s.counters["leases_revoked"] == 1 and s.stat()["leases"] == 0
    want = x.copy()
    want[:1000] = 0  # what it had written became the object's
    np.testing.assert_array_equal(s.get(h), want)
    fenced = s.stat()["tiers"]["gpu"]["fenced_bytes"]
    assert fenced == s.gpu.rounded(x.nbytes)
    other = s.put(np.full(300_000, 7, np.float32), key="o", tier="gpu")  # room: not the held block
    ctypes.memset(old, 0xFF, x.nbytes)  # it resumes, writing through its old pointer
    np.testing.assert_array_equal(s.get(h), want)
    np.testing.assert_array_equal(s.get(other), np.full(300_000, 7, np.float32))
    s.free(other)
    s.daemon.drop_owner("c")  # its connection ends: the block is reused again
    assert s.stat()["tiers"]["gpu"]["fenced_bytes"] == 0
    on_gpu = s.info(h)["residency"] == ["gpu"]  # (the put above may have moved it down)
    assert s.gpu.used() == (s.gpu.rounded(x.nbytes) if on_gpu else 0)
    np.testing.assert_array_equal(s.get(h), want)


def test_a_revoked_host_read_lease_keeps_its_block_from_reuse(full_store):
    s = full_store  # "full but for the held block" is then a function of the puts alone
    h = s.put(np.full(1 << 20, 5, np.uint8), key="r", tier="host")
    lease = s.daemon.checkout(h, "r", owner="c")
    assert s.daemon.revoke(lease.lid, owner="c")
    assert s.stat()["tiers"]["host"]["fenced_bytes"] == 0  # still the object's block
    s.free(h)
    assert s.stat()["tiers"]["host"]["fenced_bytes"] == 1 << 20
    hs = [s.put(np.full(1 << 20, i, np.uint8), key=f"f{i}", tier="host") for i in range(15)]
    assert s.stat()["tiers"]["host"]["free_bytes"] < 1 << 20  # full but for the held block
    s.arena.view(lease.host_off, 1 << 20)[:] = 99  # a stale view's write
    for i, o in enumerate(hs):
        assert (s.get(o) == i).all()
    s.daemon.drop_owner("c")
    assert s.stat()["tiers"]["host"]["fenced_bytes"] == 0


def test_cupy_backend_copies_are_complete_when_they_return():
    """cudaMemcpy returns before a device-to-device copy finishes; the tier frees the source
    (a caller's temporary) or publishes the block right after, so the backend waits for it."""
    import contextlib

    from tierstore.gpu import CupyBackend

    calls = []

    class Runtime:
        def memcpy(self, dst, src, n, kind):
            calls.append(("memcpy", dst, src, n, kind))

        def streamSynchronize(self, stream):
            calls.append(("sync", stream))

        def getDeviceProperties(self, d):
            return {"uuid": bytes(range(16))}

    class Cupy:
        class cuda:
            Device = staticmethod(lambda d: contextlib.nullcontext())

    be = CupyBackend.__new__(CupyBackend)
    be._cupy, be._rt = Cupy, Runtime()
    be.copy(0, 1000, 2000, 64)
    assert calls == [("memcpy", 1000, 2000, 64, 4), ("sync", 0)]
    assert be.device_uuid(0) == bytes(range(16)).hex()


def test_kvikio_engine_moves_host_buffers_with_o_direct_and_whole(tmp_path, monkeypatch):
    """The kvikio engine's host path is the posix engine's: O_DIRECT where the directory
    takes it (KvikIO's POSIX path reads through the page cache), and every short
    transfer continued. KvikIO itself is only loaded for device buffers."""
    import fcntl
    import mmap
    import os

    from tierstore.engine import probe_direct_io
    from tierstore.engine.kvikio_engine import KvikioFile

    direct = probe_direct_io(str(tmp_path))[0]
    f = KvikioFile(str(tmp_path / "data.bin"), direct=direct)
    try:
        assert bool(fcntl.fcntl(f.fileno(), fcntl.F_GETFL) & os.O_DIRECT) == direct
        real_w, real_r = os.pwritev, os.preadv
        monkeypatch.setattr(os, "pwritev", lambda fd, bufs, off: real_w(fd, [memoryview(bufs[0])[:8192]], off))
        monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: real_r(fd, [memoryview(bufs[0])[:4096]], off))
        buf, out = (np.frombuffer(mmap.mmap(-1, 1 << 20), np.uint8) for _ in range(2))  # page-aligned
        buf[:] = np.arange(1 << 20) % 251
        assert f.pwrite_from(buf, 0) == 1 << 20
        assert f.pread_into(out, 0) == 1 << 20 and (out == buf).all()
        assert f._cu is None  # no CuFile opened for host I/O
    finally:
        f.close()


def test_a_device_get_of_an_nvme_object_reads_through_device_io_and_checks_every_block(make_store, monkeypatch):
    """Where the engine does GPUDirect Storage, ``get`` into a CUDA tensor reads an NVMe-only
    object straight into it and verifies each block's CRC32C on the host after the
    transfer. Device memory is stood in for by a CPU tensor, ``pread_device`` by the host
    read it replaces."""
    import torch

    from tierstore.errors import ChecksumMismatch

    s = make_store(io_chunk_bytes="1MiB")
    x = np.random.default_rng(5).standard_normal(3 << 18).astype(np.float32)  # 3 MiB: three chunks
    h = s.put(x, key="w", tier="nvme")
    reads = []
    for drv in s.nvme.drives:
        f = drv.file

        def pread_device(buf, pos, f=f):
            reads.append((pos, buf.numel()))
            return f.pread_into(buf.numpy(), pos)  # (a CPU view: the O_DIRECT path takes aligned buffers)
        monkeypatch.setattr(f, "pread_device", pread_device, raising=False)
    monkeypatch.setattr(s.engine, "gds", True, raising=False)
    meta = s.index.objects[h.id]
    out = torch.from_numpy(np.frombuffer(__import__("mmap").mmap(-1, x.nbytes), np.float32))  # page-aligned
    assert s.placement.read_to_device(meta, out) is False
    assert (out.numpy() == x).all() and len(reads) == 3 and s.counters["nvme_reads"] == 1
    ext = meta.nvme[0]
    with open(s.nvme.drives[ext.dev].path, "r+b") as f:  # one block damaged on the drive
        f.seek(ext.file_offset + (1 << 20) + 4096)
        f.write(b"\xff" * 64)
    with pytest.raises(ChecksumMismatch, match="block 1 "):
        s.placement.read_to_device(meta, out)


@pytest.mark.parametrize("call", ["try_put_staged", "put_staged"])
def test_a_staged_put_to_the_gpu_tier_is_refused_and_writes_no_host_block(full_store, call):
    """A staged put copies from the staging area into a host block; a hostile request
    naming the GPU tier once had its bytes land at offset 0 of the arena — another
    object's block — while the GPU block stayed unfilled. It is refused; nothing moves."""
    from tierstore.tensors import to_bytes

    s = full_store
    victim = s.put(np.full(1 << 20, 7, np.uint8), tier="host")  # large: its block is at the arena's bottom
    off, _ = s.daemon.staging_area("c", 64 << 10)
    u8, spec = to_bytes(np.full(4096, 0xEE, np.uint8))
    s.arena.view(off, 4096)[:] = u8
    with pytest.raises(InvalidArgument, match="staged put cannot go to the gpu tier"):
        getattr(s.daemon, call)("c", 0, spec, key=None, tier="gpu", durable=False, replace=False,
                                namespace="default")
    np.testing.assert_array_equal(s.get(victim), np.full(1 << 20, 7, np.uint8))
    assert not s.puts.reservations
    s.daemon.drop_owner("c")
