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
