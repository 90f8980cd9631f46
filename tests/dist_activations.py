"""Run under torchrun (gloo, CPU): FSDP2 training with activations offloaded to the node
daemon (each rank a client in its own namespace), compared bit for bit with the same
run without offload.

    torchrun --nproc_per_node=2 tests/dist_activations.py SOCKET JOB
"""

import contextlib
import sys

import torch
import torch.distributed as dist
from torch import nn

from tierstore.client import Client
from tierstore.client.torch import offload_activations

from dist_train import batch, make_model  # noqa: E402  (the same model and data as the optimizer test)

STEPS = 4


def fsdp2(acts):
    """FSDP2 training; the forward under ``acts`` (an activation offload) unless None."""
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    for m in [m for m in model if isinstance(m, nn.Linear)] + [model]:  # each layer, then the root
        fully_shard(m)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    losses = []
    for step in range(STEPS):
        x, y = batch(step, dist.get_rank(), dist.get_world_size())
        with acts if acts is not None else contextlib.nullcontext():
            loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        losses.append(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, [p.full_tensor().detach().clone() for p in model.parameters()]


def main():
    sock, job = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    client = Client.connect(socket=sock, namespace=f"{job}/rank{rank}")
    acts = offload_activations(client, min_bytes=256, prefetch_bytes=4096)
    plain_losses, plain = fsdp2(None)
    off_losses, off = fsdp2(acts)
    assert all(torch.equal(a, b) for a, b in zip(plain_losses, off_losses)), "losses differ"
    assert all(torch.equal(a, b) for a, b in zip(plain, off)), "parameters differ"
    assert acts.flush(timeout_s=120), "queued puts/frees did not finish"  # frees run on a worker
    st = acts.snapshot()
    assert st["offloaded"] > 0 and st["bytes_in_flight"] == 0, st
    acts.close()
    print(f"rank {rank} fsdp2 activations ok ({st['offloaded']} objects, {st['offloaded_bytes']} bytes)", flush=True)
    client.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
