"""Run under torchrun (gloo, CPU): a small GPT-style model trained with FSDP2, tensor
parallel x FSDP2 on a 2-D mesh, or as a 2-stage pipeline, with every rank's optimizer
state (and, where asked, parameters: under FSDP2 the rank's local shards) offloaded to its
node's daemon, compared step by step with the same run without tierstore (bit for bit:
the plain loop is deterministic on CPU).

    torchrun --nproc_per_node=2 tests/dist_parallel.py fsdp2 SOCKET JOB [params [STEPS [CKPT_DIR|- [prefetch]]]]
    torchrun --nproc_per_node=4 tests/dist_parallel.py tp SOCKET JOB [params [STEPS [CKPT_DIR|- [prefetch]]]]

With CKPT_DIR, after training the offloaded run saves with ``dcp_save``, loads into a
fresh model and optimizer (parameters offloaded too) with ``dcp_load``, and both runs take
one more step, which must be equal. ``prefetch``: FSDP2's explicit forward and backward
prefetching, and block 1 not resharded after forward.
    torchrun --nproc_per_node=2 tests/dist_parallel.py gpipe|1f1b SOCKET JOB [params]

Each rank prints ``rank R <layout> ok`` when its checks pass.
"""

import copy
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from tierstore.client import Client
from tierstore.client.torch import dcp_load, dcp_save, offload_optimizer, offload_parameters

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import gpt_blocks  # noqa: E402  (the model bench/train_dist.py trains)

STEPS, VOCAB, WIDTH, SEQ, BATCH = 4, 32, 16, 8, 4
CKPT = None  # a directory: the sharded layouts go through dcp_save / dcp_load after training
PREFETCH = False  # the sharded layouts with FSDP2's explicit prefetching and a block kept unsharded after forward


def gpt():
    return gpt_blocks.gpt(VOCAB, WIDTH, 2)


def tokens(i, replica):
    g = torch.Generator().manual_seed(100 * i + replica)
    x = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def loss_fn(logits, y):
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def wrap(model, client, prefix, params):
    """The optimizer over ``model`` (offloaded with a client), and the parameter offload's undo."""
    undo = offload_parameters(model, client, tier="host", prefix=f"{prefix}-params") if client and params else None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    if client is not None:
        opt = offload_optimizer(opt, client, tier="nvme", prefix=f"{prefix}-opt")
    return opt, undo


def opt_step(opt, undo):
    if undo is not None:
        undo.materialize()  # the update needs the parameters' values
    opt.step()
    if undo is not None:
        undo.writeback()  # updated parameters back to the pool, their memory released
    opt.zero_grad(set_to_none=True)


def sharded(client, params, tp):
    """FSDP2 over every rank, or (``tp``) TP over the attention and MLP on the mesh's "tp"
    dimension and FSDP2 over "dp". With offloaded parameters, odd steps call
    ``materialize`` / ``writeback`` around the optimizer step and check that no shard is
    resident after it (the last step is one: the pool then holds the final shards); even
    steps leave it to the offload (the step brings the shards in,
    the next all-gathers put them back); every forward checks that no shard is resident
    inside it once its all-gather is done."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // 2, 2) if tp else (world,), mesh_dim_names=("dp", "tp") if tp else ("dp",))
    if tp and client is not None and params:  # tensor-parallel DTensors that FSDP2 does not manage: refused
        loose = gpt()
        parallelize_module(loose[1], mesh["tp"], gpt_blocks.tp_plan())
        try:
            offload_parameters(loose, client)
        except ValueError as e:
            assert "managed by fully_shard" in str(e), e
        else:
            raise AssertionError("offload_parameters accepted DTensors outside FSDP2")
    def build(name):
        model = gpt()
        for block in (model[1], model[2]):
            if tp:
                parallelize_module(block, mesh["tp"], gpt_blocks.tp_plan())
            # PREFETCH: block 1 keeps its gathered parameters from forward to backward
            fully_shard(block, mesh=mesh["dp"], reshard_after_forward=not (PREFETCH and block is model[1]))
        fully_shard(model, mesh=mesh["dp"])
        if PREFETCH:  # explicit prefetching: each block's all-gather is issued by the block before it runs
            model[1].set_modules_to_forward_prefetch([model[2]])
            model[2].set_modules_to_backward_prefetch([model[1]])
        return (model, *wrap(model, client, name, params))

    name = "tp" if tp else "fsdp2"
    model, opt, undo = build(name)
    checked = []
    if undo is not None:  # inside the forward of block 2, after its all-gather: no shard is resident
        shards = dict(model.named_parameters())  # the sharded parameters (forward swaps in unsharded ones)

        def no_shard_resident(module, args):
            held = [n for n, p in shards.items() if p._local_tensor.untyped_storage().nbytes()]
            assert not held, f"shards resident during the forward: {held[:3]}"
            checked.append(1)
        model[2].register_forward_pre_hook(no_shard_resident)
    replica = mesh["dp"].get_local_rank()  # the ranks of a TP group see the same batch
    losses = []
    for i in range(STEPS):
        x, y = tokens(i, replica)
        loss = loss_fn(model(x), y)
        loss.backward()
        if undo is not None and i % 2 == 0:  # the step brings its shards in; the next forward puts them back
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
            continue
        opt_step(opt, undo)
        losses.append(loss.detach())
        if undo is not None:
            held = [n for n, p in model.named_parameters() if p._local_tensor.untyped_storage().nbytes()]
            assert not held, f"step {i}: shards still resident between steps: {held[:3]}"
    if undo is not None:
        assert len(checked) == STEPS
    if CKPT is not None:  # offloaded: through dcp_save into a fresh model and optimizer, then one more step
        if client is not None:
            stats = dcp_save(model, opt, os.path.join(CKPT, name), file_bytes=2048)
            assert stats.total_bytes and stats.peak_bytes < stats.total_bytes, vars(stats)
            undo()
            name += "2"
            model, opt, undo = build(name)
            dcp_load(model, opt, os.path.join(CKPT, name[:-1]))
        x, y = tokens(STEPS, replica)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    if undo is not None:
        undo.writeback()
        undo()
    return losses, [p.full_tensor().detach().clone() for p in model.parameters()], model, f"{name}-params"


def pipeline(client, params, schedule):
    """Two stages (embedding + block | block + head), 4 microbatches."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank = dist.get_rank()
    full = gpt()
    stage_mod = copy.deepcopy(full[:2] if rank == 0 else full[2:])
    opt, undo = wrap(stage_mod, client, f"pp{rank}", params)
    stage = PipelineStage(stage_mod, rank, 2, torch.device("cpu"))
    sched = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule](stage, n_microbatches=4, loss_fn=loss_fn)
    losses = []
    for i in range(STEPS):
        x, y = tokens(i, 0)
        x, y = torch.cat([x, x.flip(0)]), torch.cat([y, y.flip(0)])  # 8 rows: 4 microbatches of 2
        if rank == 0:
            sched.step(x)
        else:
            mb = []
            sched.step(target=y, losses=mb)
            losses.append(torch.stack(mb).detach())
        opt_step(opt, undo)
    if undo is not None:
        undo()
    return losses, [p.detach().clone() for p in stage_mod.parameters()], stage_mod, None


def main():
    layout, sock, job = sys.argv[1:4]
    params = sys.argv[4:5] == ["params"]
    global STEPS, CKPT, PREFETCH
    if sys.argv[5:]:
        STEPS = int(sys.argv[5])
    CKPT = sys.argv[6] if sys.argv[6:] and sys.argv[6] != "-" else None
    PREFETCH = sys.argv[7:] == ["prefetch"]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    client = Client.connect(socket=sock, namespace=f"{job}/rank{rank}")
    if layout in ("tp", "fsdp2"):
        run = lambda c, p: sharded(c, p, layout == "tp")  # noqa: E731
    else:
        run = lambda c, p: pipeline(c, p, layout)  # noqa: E731
    plain_losses, plain, _, _ = run(None, False)
    off_losses, off, off_model, params_prefix = run(client, params)
    for step, (a, b) in enumerate(zip(plain_losses, off_losses)):
        assert torch.equal(a, b), f"{layout}: step {step} loss {b.tolist()} differs from plain {a.tolist()}"
    assert all(torch.equal(a, b) for a, b in zip(plain, off)), f"{layout}: parameters differ from plain"
    keys = client.keys(prefix="")
    assert any("-opt/" in k for k in keys), f"no optimizer state in this rank's namespace: {keys[:4]}"
    if layout in ("tp", "fsdp2"):
        assert any("#dtensor" in k for k in keys), f"sharded state was not stored as local shards: {keys[:4]}"
    if params and layout in ("tp", "fsdp2"):  # each local shard, as the rank holds it, is in the pool
        local = {f"{params_prefix}/{n}": p._local_tensor for n, p in off_model.named_parameters()}
        for k, t in local.items():
            if t.numel():
                assert torch.equal(client.get(client.lookup(k)), t), f"{k}: pool copy differs from the shard"
    print(f"rank {rank} {layout} ok", flush=True)
    client.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
