"""Activation offload of CUDA tensors: device-to-host through the pinned arena on a side
stream in forward, back to the device in backward. Skipped without a CUDA device (the
`gpu` marker)."""

import pytest
import torch

from tierstore.client.torch import offload_activations

from test_activations import GPT, Save, _batch, _step

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool, torch.int64])
def test_cuda_saved_tensors_come_back_exactly_through_a_daemon(daemon, dtype):
    with daemon.client("acts-gpu") as c:
        acts = offload_activations(c, min_bytes=1, prefetch_bytes=0)
        base = (torch.randn(300, 500, device="cuda") * 50).to(dtype)
        cases = [base.clone(), base.clone().t(), base.clone()[7:200, 3:401], base.clone()[::2, 1::3]]
        refs = [(v.clone(), v.size(), v.stride(), v.data_ptr() % 512) for v in cases]
        x = torch.randn(3, device="cuda", requires_grad=True)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), acts:  # a forward on a stream of its own: the puts wait for it
            outs = [Save.apply(x, v) for v in cases]
        torch.cuda.current_stream().wait_stream(side)
        assert acts.flush(timeout_s=120)
        Save.seen = []
        sum(o.sum() for o in outs).backward()
        for (ref, size, stride, align), got in zip(refs, reversed(Save.seen)):
            assert got.is_cuda and got.size() == size and got.stride() == stride and got.data_ptr() % 512 == align
            assert torch.equal(got, ref)
        assert acts.stats.offloaded == len(cases) and acts.stats.fetched_bytes > 0
        acts.close()
        assert c.stat()["namespaces"].get("acts-gpu", {}).get("objects", 0) == 0


@pytest.mark.parametrize("through", ["daemon", "store"])
def test_cuda_training_step_matches_plain(daemon, make_store, through):
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        client = daemon.client("acts-gpu") if through == "daemon" else make_store()
        acts = offload_activations(client, min_bytes=4096, inflight_bytes=1 << 20, prefetch_bytes=1 << 20)
        losses, grads = [], []
        for a in (None, acts):
            torch.manual_seed(0)
            model = GPT().cuda()
            losses.append(_step(model, _batch(0, 8).cuda(), a))
            grads.append([p.grad for p in model.parameters()])
        torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)
        for g0, g1 in zip(*grads):
            torch.testing.assert_close(g0, g1)
        assert acts.flush(timeout_s=120) and acts.stats.offloaded > 0 and acts.stats.bytes_in_flight == 0
        acts.close()
        if through == "daemon":
            client.close()
    finally:
        torch.use_deterministic_algorithms(False)
