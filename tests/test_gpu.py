"""The GPU side of the client: a page-locked arena mapping and CUDA tensors through it.
Skipped without a CUDA device (the `gpu` marker)."""

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_arena_mapping_is_pinned(daemon):
    with daemon.client("gpu") as c:
        assert c.pinned, c.pinned_reason


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


def test_gpu_tier_over_cuda_ipc(gpu_daemon):
    with gpu_daemon.client("gpu") as a, gpu_daemon.client("gpu") as b:
        st = a.stat()
        assert st["tiers"]["gpu"]["capacity_bytes"] == 256 << 20, st.get("gpu_reason")
        assert st["tiers"]["host"]["pinned"], st["tiers"]["host"]["pinned_reason"]
        x = torch.randn(4 << 20, device="cuda")
        h = a.put(x, key="x", tier="gpu")
        assert a.info(h)["residency"] == ["gpu"]
        out = torch.empty_like(x)
        b.get(h, out=out)  # another process's mapping of the same slab
        torch.cuda.synchronize()
        assert torch.equal(out, x)
        assert torch.equal(a.get(h), x.cpu())  # copied out to the host, stays in the GPU tier
        assert a.info(h)["residency"] == ["gpu"]
        assert a.stat()["tiers"]["gpu"]["mapped_by"] == 2
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


# ---------------------------------------------------------------------------- hooks on the GPU
def _sparse_model():
    """Poor arithmetic density: many small parameters and element-wise work, so an update
    that ran before its state arrived (or a state read before the update wrote it) shows."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.LayerNorm(256))
                                 for _ in range(12)]).cuda()


@pytest.mark.parametrize("update", ["gpu", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offloaded_optimizer_on_cuda_matches_plain(daemon, update, dtype):
    from tierstore.client.torch import offload_optimizer

    plain, off = _sparse_model().to(dtype), _sparse_model().to(dtype)
    masters = {}
    if dtype == torch.bfloat16:  # the plain baseline: fp32 masters, as mixed precision trains
        masters = {p: p.detach().float().clone().requires_grad_() for p in plain.parameters()}
        opt_plain = torch.optim.AdamW(list(masters.values()), lr=1e-3, weight_decay=0.1)
    else:
        opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-3, weight_decay=0.1)
    with daemon.client("gpu") as c:
        opt = offload_optimizer(torch.optim.AdamW(off.parameters(), lr=1e-3, weight_decay=0.1), c, tier="host",
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


def test_parameter_offload_on_cuda_matches_plain(daemon):
    from tierstore.client.torch import offload_parameters

    plain, off = _sparse_model(), _sparse_model()
    with daemon.client("gpu") as c:
        undo = offload_parameters(off, c, tier="host")
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
