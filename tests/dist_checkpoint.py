"""Run under torchrun (gloo, CPU): a distributed checkpoint (DCP) of FSDP2 training with
the offloaded optimizer, saved on one number of ranks and loaded on another, compared
with the plain optimizer saved and resharded the same way.

    torchrun --nproc_per_node=2 tests/dist_checkpoint.py save CKPT_DIR SOCKET JOB
    torchrun --nproc_per_node=4 tests/dist_checkpoint.py load CKPT_DIR SOCKET JOB

``save`` trains three variants ``STEPS`` steps: plain AdamW and the offloaded one, each
saved with ``dcp.save`` of ``get_state_dict(model, opt)``, and the offloaded one saved
with ``dcp_save`` (streamed from the pool); ``load`` builds fresh ones on however many
ranks it runs on, loads them (``dcp.load`` + ``set_state_dict``, or ``dcp_load``) and
trains ``MORE`` steps. The global
batch is the same at every world size (split over the ranks), so the resumed runs continue
the same training. Each rank prints ``rank R <phase> ok`` when its checks pass.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

from tierstore.client import Client
from tierstore.client.torch import dcp_load, dcp_save, offload_optimizer

STEPS, MORE, GLOBAL_BATCH = 3, 3, 8


def make_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 24), nn.ReLU(), nn.Linear(24, 16))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


def batch(step):
    """This rank's rows of the step's global batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.randn(GLOBAL_BATCH, 16, generator=torch.Generator().manual_seed(step))
    x = x.chunk(world)[rank]
    return x, x.flip(1)


def train(model, opt, start, end):
    for step in range(start, end):
        x, y = batch(step)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def build(variant, client):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    if variant != "plain":
        opt = offload_optimizer(opt, client, tier="nvme", prefix=f"dcp-{variant}")
    return model, opt


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def snapshot(model, opt):
    """Parameters and optimizer state, gathered whole (the same on every rank)."""
    params = [full(p).detach().clone() for p in model.parameters()]
    state = opt.state_dict()["state"]
    return params, {(i, k): full(torch.as_tensor(v)).clone() for i, st in state.items() for k, v in st.items()}


def assert_same(a, b, what):
    pa, sa = a
    pb, sb = b
    assert len(pa) == len(pb) and all(torch.equal(x, y) for x, y in zip(pa, pb)), f"{what}: parameters differ"
    assert sa.keys() == sb.keys(), f"{what}: optimizer state names differ"
    for k in sa:
        assert torch.equal(sa[k], sb[k]), f"{what}: optimizer state {k} differs"


def main():
    phase, ckpt, sock, job = sys.argv[1:5]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    client = Client.connect(socket=sock, namespace=f"{job}/rank{rank}")
    seen = {}
    for variant in ("plain", "offloaded", "streamed"):
        model, opt = build(variant, client)
        path = os.path.join(ckpt, variant)
        if phase == "save":
            train(model, opt, 0, STEPS)
            seen[variant] = snapshot(model, opt)
            if variant == "streamed":
                stats = dcp_save(model, opt, path, file_bytes=1024)
                assert stats.total_bytes and stats.live_bytes == 0, vars(stats)
            else:
                msd, osd = get_state_dict(model, opt)
                dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        else:
            if variant == "streamed":
                dcp_load(model, opt, path)
            else:
                msd, osd = get_state_dict(model, opt)
                sd = {"model": msd, "optim": osd}
                dcp.load(sd, checkpoint_id=path)
                set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
            loaded = snapshot(model, opt)
            steps = {float(v) for (_, k), v in loaded[1].items() if k == "step"}
            assert steps == {float(STEPS)}, f"{variant}: loaded state is at step {steps}, not {STEPS}"
            train(model, opt, STEPS, STEPS + MORE)
            seen[variant] = (loaded, snapshot(model, opt))
        if variant != "plain":
            assert client.keys(prefix=f"dcp-{variant}/"), "no optimizer state in this rank's namespace"
    for variant in ("offloaded", "streamed"):
        if phase == "save":
            assert_same(seen["plain"], seen[variant], f"{variant}: after training")
        else:
            assert_same(seen["plain"][0], seen[variant][0], f"{variant}: loaded on {world} ranks")
            assert_same(seen["plain"][1], seen[variant][1], f"{variant}: trained on after loading on {world} ranks")
    print(f"rank {rank} {phase} ok", flush=True)
    client.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
