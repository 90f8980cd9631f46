"""The GPU side of the client: a page-locked arena mapping and CUDA tensors through it.
Skipped without a CUDA device (the `gpu` marker)."""

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_arena_mapping_is_pinned_on_first_use(daemon):
    with daemon.client("gpu") as c:
        assert not c.pinned and "not page-locked yet" in c.pinned_reason  # connecting touched no CUDA
        h = c.put(torch.ones(1 << 20, device="cuda"))
        assert c.pinned, c.pinned_reason
        assert c._slabmap is None  # host-tier traffic opens no GPU slabs
        c.free(h)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_cuda_round_trip_through_the_pinned_arena(daemon, dtype):
    with daemon.client("gpu") as c:
        t = (torch.randn(1 << 20, device="cuda") * 10).to(dtype)
        h = c.put(t, key=f"g/{dtype}")
        out = torch.empty_like(t)
        c.get(h, out=out)
        assert torch.equal(out, t)
        assert torch.equal(c.get(h), t.cpu())


# ---------------------------------------------------------------------------- GPU tier
@pytest.fixture
def gpu_daemon(daemon_factory):
    return daemon_factory("--gpu-bytes", "256MiB", "--gpu-slab-bytes", "64MiB")


_OTHER_PROCESS = """
import sys, torch
from tierstore.client import Client
want = torch.load(sys.argv[2])
with Client.connect(socket=sys.argv[1], namespace="gpu") as c:
    h = c.lookup("x")
    out = torch.empty_like(want, device="cuda")
    c.get(h, out=out)  # this process's own mapping of the slab (CUDA IPC)
    assert c.info(h)["residency"] == ["gpu"]
    print(bool(torch.equal(out.cpu(), want)), c.stat()["tiers"]["gpu"]["mapped_by"])
"""


def test_gpu_tier_over_cuda_ipc(gpu_daemon, tmp_path):
    import subprocess
    import sys

    with gpu_daemon.client("gpu") as a:
        st = a.stat()
        assert st["tiers"]["gpu"]["capacity_bytes"] == 256 << 20, st.get("gpu_reason")
        assert st["tiers"]["host"]["pinned"], st["tiers"]["host"]["pinned_reason"]
        x = torch.randn(4 << 20, device="cuda")
        h = a.put(x, key="x", tier="gpu")
        assert a.info(h)["residency"] == ["gpu"]
        # another process opens the slab's handle (in this process CUDA would only count a reference)
        torch.save(x.cpu(), tmp_path / "x.pt")
        r = subprocess.run([sys.executable, "-c", _OTHER_PROCESS, gpu_daemon.socket, str(tmp_path / "x.pt")],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
        same, mapped = r.stdout.split()
        assert same == "True" and int(mapped) == 2
        out = torch.empty_like(x)
        a.get(h, out=out)
        assert torch.equal(out, x)
        assert torch.equal(a.get(h), x.cpu())  # copied out to the host, stays in the GPU tier
        assert a.info(h)["residency"] == ["gpu"]
    with gpu_daemon.client("gpu") as c:
        with c.checkout(c.lookup("x"), "r") as v:  # a host check-out moves it down
            assert torch.equal(v, x.cpu())
        assert c.info(c.lookup("x"))["residency"] == ["host"]
        assert c.stat()["tiers"]["gpu"]["used_bytes"] == 0


def test_gpu_tier_overflow_moves_objects_to_host(gpu_daemon):
    with gpu_daemon.client("gpu") as c:
        xs = [torch.full((8 << 20,), float(i), device="cuda") for i in range(10)]  # 320 MiB into 256 MiB
        hs = [c.put(x, tier="gpu") for x in xs]
        for h, x in zip(hs, xs):
            out = torch.empty_like(x)
            c.get(h, out=out)
            assert torch.equal(out, x)
        assert c.stat()["counters"]["gpu_demotions"] >= 2


def test_gpu_tier_in_process_store(tmp_path):
    from tierstore import Config, Store

    with Store(Config(host_bytes=64 << 20, nvme_dirs=[str(tmp_path)], nvme_bytes=256 << 20,
                      gpu_bytes=64 << 20)) as s:
        x = torch.randn(1 << 20, device="cuda")
        h = s.put(x, tier="gpu")
        assert torch.equal(s.get(h), x.cpu())


# ---------------------------------------------------------------------------- ordering
@pytest.mark.parametrize("tier", ["host", "gpu"])
def test_put_async_and_get_order_with_a_user_stream(gpu_daemon, tier):
    """The caller's stream is still writing the tensor (a long sleep first) when put_async
    is called: the copy must wait for it. A get's copy is held back on the side stream:
    the caller's stream must not read ``out`` before it lands."""
    with gpu_daemon.client("gpu") as c:
        user = torch.cuda.Stream()
        n = 4 << 20  # 16 MiB (a quarter of the test daemon's host tier): a copy long enough to lose a race
        x = torch.zeros(n, device="cuda")
        torch.cuda.synchronize()
        with torch.cuda.stream(user):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the write
            x.fill_(7.0)
            fut = c.put_async(x, tier=tier)
        h = fut.result()
        assert torch.equal(c.get(h), torch.full((n,), 7.0))
        out = torch.zeros(n, device="cuda")
        torch.cuda.synchronize()
        side = c._streams().stream(out.device, "in")
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)  # the copy into out starts late
        with torch.cuda.stream(user):
            c.get(h, out=out)
            total = out.sum()  # queued on the user stream right after the get
        torch.cuda.synchronize()
        assert float(total) == 7.0 * n


def test_a_refused_registration_falls_back_to_pageable_without_a_stale_cuda_error(daemon, monkeypatch):
    """cudaHostRegister refused (RLIMIT_MEMLOCK, say): copies stay pageable, and the error it
    left does not surface as the next kernel's failure."""
    real = torch.cuda.cudart()

    class Refusing:
        def __getattr__(self, name):
            return getattr(real, name)

        def cudaHostRegister(self, ptr, size, flags):
            return real.cudaHostRegister(0, 4096, flags)  # a real refusal: cudaErrorInvalidValue, left set

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Refusing())
    with daemon.client("gpu") as c:
        x = torch.randn(1 << 20, device="cuda")
        h = c.put(x)
        assert not c.pinned and "cudaHostRegister failed" in c.pinned_reason
        y = x * 2 + 1  # a kernel launch: PyTorch checks cudaGetLastError after it
        torch.cuda.synchronize()
        out = torch.empty_like(x)
        c.get(h, out=out)
        assert torch.equal(out, x) and torch.equal(y, x * 2 + 1)


def test_a_forked_dataloader_worker_of_a_cuda_process_connects(daemon):
    """This process has a CUDA context; its fork-based DataLoader worker cannot make one,
    and connecting there must not try."""
    from test_cuda_fallback import _Connects

    torch.ones(1, device="cuda")
    assert torch.cuda.is_initialized()
    loader = torch.utils.data.DataLoader(_Connects(daemon.socket), batch_size=None, num_workers=1,
                                         multiprocessing_context="fork")
    assert [r.tolist() for r in loader] == [[0.0, 0.0, 0.0], [1000.0, 1.0, 0.0]]


# ---------------------------------------------------------------------------- hooks on the GPU
def _sparse_model():
    """Poor arithmetic density: many small parameters and element-wise work, so an update
    that ran before its state arrived (or a state read before the update wrote it) shows."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.LayerNorm(256))
                                 for _ in range(12)]).cuda()


@pytest.mark.parametrize("tier", ["host", "gpu"])
@pytest.mark.parametrize("update", ["gpu", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offloaded_optimizer_on_cuda_matches_plain(gpu_daemon, update, dtype, tier):
    daemon = gpu_daemon
    from tierstore.client.torch import offload_optimizer

    plain, off = _sparse_model().to(dtype), _sparse_model().to(dtype)
    masters = {}
    if dtype == torch.bfloat16:  # the plain baseline: fp32 masters, as mixed precision trains
        masters = {p: p.detach().float().clone().requires_grad_() for p in plain.parameters()}
        opt_plain = torch.optim.AdamW(list(masters.values()), lr=1e-3, weight_decay=0.1)
    else:
        opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-3, weight_decay=0.1)
    with daemon.client("gpu") as c:
        opt = offload_optimizer(torch.optim.AdamW(off.parameters(), lr=1e-3, weight_decay=0.1), c, tier=tier,
                                update=update)
        for step in range(8):
            x = torch.randn(64, 256, device="cuda", dtype=dtype)
            for model in (plain, off):
                model(x).square().mean().backward()
            for p, m in masters.items():
                m.grad = p.grad.float()
            opt_plain.step()
            for p, m in masters.items():
                p.data.copy_(m)
            opt.step()
            opt_plain.zero_grad(set_to_none=True)
            off.zero_grad(set_to_none=True)
            plain.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        # fp32: the same kernels, or the host's AdamW against the GPU's (rounding-level
        # differences); bf16: assert_close's bf16 tolerance (one ulp after rounding a master)
        tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else {}
        for a, b in zip(plain.parameters(), off.parameters()):
            torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("tier", ["host", "gpu"])
def test_parameter_offload_on_cuda_matches_plain(gpu_daemon, tier):
    from tierstore.client.torch import offload_parameters

    plain, off = _sparse_model(), _sparse_model()
    with gpu_daemon.client("gpu") as c:
        undo = offload_parameters(off, c, tier=tier)
        x = torch.randn(64, 256, device="cuda")
        ya, yb = plain(x), off(x)
        torch.testing.assert_close(ya, yb)
        ya.square().mean().backward()
        yb.square().mean().backward()
        for a, b in zip(plain.parameters(), off.parameters()):
            torch.testing.assert_close(a.grad, b.grad)
        undo()
        for a, b in zip(plain.parameters(), off.parameters()):
            assert b.is_cuda and torch.equal(a, b)


# ---------------------------------------------------------------------------- KvikIO device I/O
def test_kvikio_device_reads_and_writes_are_whole_and_verified(tmp_path):
    """Device buffers through the kvikio engine (GPUDirect Storage where active): whole
    transfers, and the per-block CRC32C checked on the host after the read catches a
    damaged block."""
    import numpy as np

    from tierstore.checksum import BLOCK_BYTES, block_checksums, crc32c
    from tierstore.engine.kvikio_engine import KvikioFile, detect, device_io

    ok, why = detect()
    if not ok:
        pytest.skip(why)
    n = 8 * BLOCK_BYTES
    src = np.random.default_rng(3).integers(0, 255, n, dtype=np.uint8)
    crcs = block_checksums(src, n)
    f = KvikioFile(str(tmp_path / "d.bin"), direct=False)
    try:
        dev = torch.from_numpy(src).cuda()
        assert f.pwrite_device(dev, 0) == n
        back = torch.empty(n, dtype=torch.uint8, device="cuda").fill_(1)
        assert f.pread_device(back, 0) == n
        host = back.cpu().numpy()
        assert (host == src).all()
        assert [crc32c(host[o:o + BLOCK_BYTES]) for o in range(0, n, BLOCK_BYTES)] == crcs
        f.pwrite_from(np.zeros(4096, np.uint8), 3 * BLOCK_BYTES)  # damage block 3 through the host path
        f.pread_device(back[:n], 0)
        host = back[:n].cpu().numpy()
        bad = [i for i, o in enumerate(range(0, n, BLOCK_BYTES)) if crc32c(host[o:o + BLOCK_BYTES]) != crcs[i]]
        assert bad == [3]
    finally:
        f.close()
    print("device I/O:", device_io()[1])


def test_in_process_get_into_a_cuda_tensor_from_nvme(tmp_path):
    """``Store.get(h, out=cuda_tensor)`` of an NVMe-only object: NVMe -> GPU through KvikIO
    where GPUDirect Storage is on (CRC32C checked after the transfer), through host memory
    otherwise; the same bytes either way."""
    from tierstore import Config, Store

    with Store(Config(host_bytes=64 << 20, nvme_dirs=[str(tmp_path)], nvme_bytes=256 << 20)) as s:
        x = torch.randn(3 << 20)
        h = s.put(x, tier="nvme")
        out = torch.empty(3 << 20, device="cuda")
        s.get(h, out=out)
        assert torch.equal(out.cpu(), x)
        nv = s.stat()["tiers"]["nvme"]
        print("engine:", nv["engine"], "|", nv["device_io"])
