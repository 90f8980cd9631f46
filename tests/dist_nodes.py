"""Run under torchrun as one of two simulated nodes (gloo, CPU): data-parallel training
whose ranks keep their optimizer state and fp32 masters, durable, in their own node's
daemon (found by ``TIERSTORE_SOCKET``, which differs per node), resuming from the pool.

    TIERSTORE_SOCKET=NODE_SOCKET torchrun --nnodes=2 --node-rank=N --nproc-per-node=2 \\
        --master-addr=127.0.0.1 --master-port=PORT tests/dist_nodes.py JOB TOTAL [GATE_STEP GATE_FILE]

Every rank takes up its state from its daemon (``resume=True``) and the ranks agree on the
step they continue from (``agree_on_step``: a rank one step ahead goes back). With a gate,
after step GATE_STEP every rank waits (at a barrier, then for GATE_FILE to appear) — rank 0
prints ``gate`` once all are there — then goes on: a node whose daemon was killed at the
gate fails in its next optimizer step, after the other node's ranks completed theirs.
Without a gate the run goes to TOTAL, then trains the same model with plain AdamW from
scratch and checks that the parameters are equal: ``rank R nodes ok from S (found F)``.
"""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from tierstore.client import Client
from tierstore.client.distributed import agree_on_step
from tierstore.client.torch import offload_optimizer


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 12))


def train(model, opt, start, end, on_step=None):
    """Data parallel: each gradient averaged over the ranks one parameter at a time (as DDP does,
    but without its buckets, which are laid out anew in a restarted process and would change
    how the sums round)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(start, end):
        x = torch.randn(4, 12, generator=torch.Generator().manual_seed(step * world + rank))
        nn.functional.mse_loss(model(x), x.flip(1)).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        opt.zero_grad(set_to_none=True)
        if on_step is not None:
            on_step(step + 1)


def wait_for(path, deadline_s=120.0):
    end = time.monotonic() + deadline_s
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise TimeoutError(f"{path} did not appear within {deadline_s:.0f} s")
        time.sleep(0.05)  # a file written by the test, polled with a deadline


def main():
    job, total = sys.argv[1], int(sys.argv[2])
    gate = (int(sys.argv[3]), sys.argv[4]) if len(sys.argv) > 4 else None
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    client = Client.connect(namespace=f"{job}/rank{rank}")  # this node's daemon: TIERSTORE_SOCKET
    model = make_model()
    opt = offload_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), client, tier="nvme",
                            master_weights=True, durable=True, resume=True)  # parameters come back from masters
    found = opt.completed_steps
    start = agree_on_step(opt)  # a rank one step ahead of the others goes back to theirs

    def at_gate(step):
        if gate is None or step != gate[0]:
            return
        dist.barrier()
        if rank == 0:
            print("gate", flush=True)
        wait_for(gate[1])

    train(model, opt, start, total, at_gate)
    plain = make_model()
    train(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2), 0, total)
    for a, b in zip(plain.parameters(), model.parameters()):
        assert torch.equal(a, b), "parameters differ from the plain run"
    print(f"rank {rank} nodes ok from {start} (found {found})", flush=True)
    client.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
