"""Run under torchrun (gloo, CPU): ZeRO-1 and FSDP2 training with the optimizer state of
each rank offloaded to the node daemon, compared with the same runs without tierstore.

    torchrun --nproc_per_node=2 tests/dist_train.py SOCKET JOB
"""

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from tierstore.client import Client
from tierstore.client.torch import offload_optimizer, offloaded

STEPS = 8


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))


def batch(step, rank, world):
    g = torch.Generator().manual_seed(step * world + rank)
    x = torch.randn(8, 16, generator=g)
    return x, x.flip(1)


def zero1(optimizer_class):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=optimizer_class, lr=1e-2, weight_decay=0.01)
    for step in range(STEPS):
        x, y = batch(step, rank, world)
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()]


def fsdp2(client):
    from torch.distributed.fsdp import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    if client is not None:  # each rank's local shards' state goes to the pool
        opt = offload_optimizer(opt, client, tier="nvme", prefix="fsdp-opt")
    for step in range(STEPS):
        x, y = batch(step, rank, world)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def main():
    sock, job = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    client = Client.connect(socket=sock, namespace=f"{job}/rank{rank}")
    plain = zero1(torch.optim.AdamW)
    off = zero1(offloaded(torch.optim.AdamW, client, tier="nvme", prefix="zero1-opt"))
    assert all(torch.equal(a, b) for a, b in zip(plain, off)), "ZeRO-1 offloaded run differs"
    assert client.keys(prefix="zero1-opt/"), "no state in this rank's namespace"
    print(f"rank {rank} zero1 ok", flush=True)
    plain = fsdp2(None)
    off = fsdp2(client)
    assert all(torch.equal(a, b) for a, b in zip(plain, off)), "FSDP2 offloaded run differs"
    keys = client.keys(prefix="fsdp-opt/")
    assert any("#dtensor" in k for k in keys), f"FSDP2 state was not stored as local shards: {keys[:4]}"
    print(f"rank {rank} fsdp2 ok", flush=True)
    client.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
