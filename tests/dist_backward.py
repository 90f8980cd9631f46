"""Run under torchrun (gloo, CPU): update-in-backward with ZeRO-1 and FSDP2, each rank's
optimizer state offloaded to the node daemon, compared step by step with the same runs
without tierstore. FSDP2 calls its sharded parameters' post-accumulate-grad hooks after
the reduce-scatter, so the updates happen in backward; under DDP (ZeRO-1) a gradient is
final only after the all-reduce at the end of backward, so they stay in ``step()``.

    torchrun --nproc_per_node=2 tests/dist_backward.py SOCKET JOB
"""

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from tierstore.client import Client
from tierstore.client.torch import offload_optimizer, offloaded

from dist_train import make_model  # the same model as the runs with the updates in step()

STEPS = 6


def batch(step, rank, world, micro):
    g = torch.Generator().manual_seed((step * world + rank) * 2 + micro)
    x = torch.randn(8, 16, generator=g)
    return x, x.flip(1)


def train(model, opt, step):
    """One step: two micro-batches, the first accumulated only (``deferred``)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for micro in range(2):
        x, y = batch(step, rank, world, micro)
        with opt.deferred() if micro == 0 and hasattr(opt, "deferred") else _Nothing():
            (nn.functional.mse_loss(model(x), y) / 2).backward()


class _Nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def zero1(client):
    models, opts = [], []
    for off in (False, True):
        model = make_model()
        ddp = nn.parallel.DistributedDataParallel(model)
        cls = offloaded(torch.optim.AdamW, client, tier="nvme", prefix="zero1-bwd", update_in_backward=True) \
            if off else torch.optim.AdamW
        models.append((model, ddp))
        opts.append(ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=cls, lr=1e-2, weight_decay=0.01))
    inner = opts[1].optim
    assert inner.backward is not None and not inner.backward.enabled, "DDP gradients must not update in backward"
    for step in range(STEPS):
        for (model, ddp), opt in zip(models, opts):
            rank, world = dist.get_rank(), dist.get_world_size()
            for micro in range(2):
                x, y = batch(step, rank, world, micro)
                with inner.deferred() if micro == 0 and opt is opts[1] else _Nothing():
                    (nn.functional.mse_loss(ddp(x), y) / 2).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        assert all(torch.equal(a, b) for a, b in zip(models[0][0].parameters(), models[1][0].parameters())), \
            f"ZeRO-1 differs at step {step}"


def fsdp2(client, drop=False):
    """FSDP2 against plain AdamW step by step, updating in backward (``drop``: dropping each
    sharded gradient once its update used it)."""
    from torch.distributed.fsdp import fully_shard

    models, opts = [], []
    for off in (False, True):
        model = make_model()
        for linear in (m for m in model if isinstance(m, nn.Linear)):  # one FSDP2 unit per layer, then the root
            fully_shard(linear)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        if off:
            opt = offload_optimizer(opt, client, tier="nvme", prefix="fsdp-bwd-drop" if drop else "fsdp-bwd",
                                    update_in_backward=True, drop_grads=drop)
        models.append(model)
        opts.append(opt)
    in_backward = 0
    for step in range(STEPS):
        for model, opt in zip(models, opts):
            train(model, opt, step)
            if opt is opts[1]:
                in_backward += len(opt._in_step.updated)  # updated before step() is called
                if drop:
                    assert all(p.grad is None for p in model.parameters()), "a used gradient was kept"
            opt.step()
            opt.zero_grad(set_to_none=True)
        full = [[p.full_tensor() for p in m.parameters()] for m in models]
        assert all(torch.equal(a, b) for a, b in zip(*full)), f"FSDP2 differs at step {step}"
    n = sum(1 for _ in models[1].parameters())
    assert in_backward == STEPS * n, (in_backward, STEPS * n)


def main():
    sock, job = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    client = Client.connect(socket=sock, namespace=f"{job}/rank{rank}")
    zero1(client)
    print(f"rank {rank} zero1 ok (updates in step)", flush=True)
    fsdp2(client)
    print(f"rank {rank} fsdp2 ok (updates in backward)", flush=True)
    fsdp2(client, drop=True)
    print(f"rank {rank} fsdp2 ok (updates in backward, gradients dropped)", flush=True)
    client.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
