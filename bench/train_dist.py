"""Distributed training on CPU ranks (torchrun, gloo): plain vs offloaded optimizer per layout.

Layouts (a GPT-style stack of attention + MLP blocks, ``--ranks`` ranks, 4 by default):

  fsdp2       FSDP2 over all ranks
  tp+fsdp2    a 2-D mesh: tensor parallel 2 (q/k/v/fc1 column-, o/fc2 row-parallel) x FSDP2
  pipeline    one pipeline stage per rank, GPipe, 4 microbatches

Each layout runs twice, each run its own torchrun: ``plain`` (torch.optim.AdamW) and
``offloaded`` (``offload_optimizer(tier="host")`` into a daemon started for the run).
Reported per run: median step time (after warm-up) and its ratio to plain; node memory
= the ranks' peak private memory (sampled after every step) + the daemon's peak resident
memory; the optimizer state's bytes on all ranks; DCP save time (``get_state_dict`` +
``dcp.save``) and load time (``get_state_dict`` + ``dcp.load`` + ``set_state_dict`` into a
fresh model and optimizer); for the offloaded run also ``dcp_save`` / ``dcp_load`` (the
state streamed between the pool and the files) and the most state bytes a rank held at
once during ``dcp_save``. Results check: the offloaded run's parameters after every step
and after the DCP load must equal plain's (a digest of every rank's parameters), and a
step after ``dcp_load`` must land on the same parameters as after ``dcp.load``.

Usage: python bench/train_dist.py [--layouts fsdp2,tp+fsdp2,pipeline] [--width 256] [--layers 4]
                                  [--steps 4] [--warmup 1] [--ranks 4] [--quick] [--dir D]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit_json, machine, print_table, proc_status_bytes, start_daemon  # noqa: E402

LAYOUTS = ("fsdp2", "tp+fsdp2", "pipeline")

WORKER = r'''
import hashlib, json, os, statistics, sys, time
import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

cfg = json.loads(sys.argv[1])
W, L, VOCAB, SEQ, BATCH = cfg["width"], cfg["layers"], 256, 32, 8

def uss():
    with open("/proc/self/smaps_rollup") as f:
        return sum(int(l.split()[1]) * 1024 for l in f if l.startswith(("Private_Clean:", "Private_Dirty:")))

sys.path.insert(0, cfg["bench_dir"])
from gpt_blocks import gpt as _gpt, tp_plan

def gpt():
    return _gpt(VOCAB, W, L)

def loss_fn(logits, y):
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))

def tokens(step, replica):
    x = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(100 * step + replica))
    return x[:, :-1], x[:, 1:]

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
client = None
if cfg["variant"] == "offloaded":
    from tierstore.client import Client
    client = Client.connect(socket=cfg["socket"], namespace=f"bench-dist/rank{rank}")

def build():
    """(module this rank trains, optimizer, step function, replica id, DCP key)"""
    layout = cfg["layout"]
    if layout == "pipeline":
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
        full = gpt()
        mods = list(full)
        per = len(mods) // world
        mine = nn.Sequential(*mods[rank * per:(rank + 1) * per if rank < world - 1 else len(mods)])
        model = mine
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        model = gpt()
        if layout == "tp+fsdp2":
            from torch.distributed.tensor.parallel import parallelize_module
            mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
            dp = mesh["dp"]
            for blk in model[1:-1]:
                parallelize_module(blk, mesh["tp"], tp_plan())
        else:
            dp = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))["dp"]
        for blk in model[1:-1]:
            fully_shard(blk, mesh=dp)
        fully_shard(model, mesh=dp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    if client is not None:
        from tierstore.client.torch import offload_optimizer
        opt = offload_optimizer(opt, client, tier="host", prefix="opt")
    if layout == "pipeline":
        stage = PipelineStage(model, rank, world, torch.device("cpu"))
        sched = ScheduleGPipe(stage, n_microbatches=4, loss_fn=loss_fn)
        def fwd_bwd(step):
            x, y = tokens(step, 0)
            if rank == 0:
                sched.step(x)
            elif rank == world - 1:
                sched.step(target=y)
            else:
                sched.step()
        return model, opt, fwd_bwd, f"stage{rank}"
    replica = dp.get_local_rank()
    def fwd_bwd(step):
        x, y = tokens(step, replica)
        loss_fn(model(x), y).backward()
    return model, opt, fwd_bwd, "model"

def digest(model):
    h = hashlib.sha256()
    for p in model.parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()

model, opt, fwd_bwd, key = build()
times, peak, digests = [], uss(), []
for step in range(cfg["warmup"] + cfg["steps"]):
    dist.barrier()
    t0 = time.perf_counter()
    fwd_bwd(step)
    opt.step()
    opt.zero_grad(set_to_none=True)
    if step >= cfg["warmup"]:
        times.append(time.perf_counter() - t0)
    peak = max(peak, uss())
    digests.append(digest(model))
state_bytes = 0
for st in opt.state_dict()["state"].values():
    for v in st.values():
        if isinstance(v, torch.Tensor):
            state_bytes += (v.to_local() if hasattr(v, "to_local") else v).nbytes
ckpt = os.path.join(cfg["dir"], "ckpt")
dist.barrier()
t0 = time.perf_counter()
msd, osd = get_state_dict(model, opt)
dcp.save({key: {"model": msd, "optim": osd}}, checkpoint_id=ckpt)
dist.barrier()
save_s = time.perf_counter() - t0
peak = max(peak, uss())
stream_save_s = stream_load_s = stream_peak = None
if client is not None:  # the same state saved again, streamed from the pool (dcp_save)
    from tierstore.client.torch import dcp_load, dcp_save
    dist.barrier()
    t0 = time.perf_counter()
    stream_peak = dcp_save(model, opt, ckpt + "-stream", key=key).peak_bytes
    dist.barrier()
    stream_save_s = time.perf_counter() - t0
    opt.free()
del model, opt, msd, osd
model, opt, fwd_bwd, key = build()
dist.barrier()
t0 = time.perf_counter()
msd, osd = get_state_dict(model, opt)
sd = {key: {"model": msd, "optim": osd}}
dcp.load(sd, checkpoint_id=ckpt)
set_state_dict(model, opt, model_state_dict=sd[key]["model"], optim_state_dict=sd[key]["optim"])
dist.barrier()
load_s = time.perf_counter() - t0
fwd_bwd(cfg["warmup"] + cfg["steps"])
opt.step()
digests.append(digest(model))  # one step after the load: the loaded state was used
peak = max(peak, uss())
if client is not None:  # and back with dcp_load: the step after it must land on the same parameters
    opt.free()
    del model, opt, msd, osd, sd
    model, opt, fwd_bwd, key = build()
    dist.barrier()
    t0 = time.perf_counter()
    dcp_load(model, opt, ckpt + "-stream", key=key)
    dist.barrier()
    stream_load_s = time.perf_counter() - t0
    fwd_bwd(cfg["warmup"] + cfg["steps"])
    opt.step()
    if digest(model) != digests[-1]:
        raise SystemExit("the step after dcp_load differs from the one after dcp.load + set_state_dict")
st = client.stat() if client is not None else None
mine = {"times": times, "peak_uss": peak, "digests": digests, "state_bytes": state_bytes,
        "save_s": save_s, "load_s": load_s, "stream_save_s": stream_save_s, "stream_load_s": stream_load_s,
        "stream_peak": stream_peak, "daemon_pid": st["pid"] if st else None}
out = [None] * world
dist.all_gather_object(out, mine)
if rank == 0:
    print("RESULT " + json.dumps(out))
dist.barrier()
dist.destroy_process_group()
# (the interpreter's own teardown is skipped: a gloo thread still joinable when static
# destructors run aborts the process, "terminate called without an active exception",
# about one run in three on 2 cores, after every result is in)
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
'''


def run(layout: str, variant: str, args: argparse.Namespace, base: str) -> dict:
    d = tempfile.mkdtemp(dir=base)
    cfg = {"layout": layout, "variant": variant, "width": args.width, "layers": args.layers, "steps": args.steps,
           "warmup": args.warmup, "dir": d, "bench_dir": os.path.dirname(os.path.abspath(__file__))}
    daemon = None
    if variant == "offloaded":
        daemon, cfg["socket"], notify = start_daemon(d, "--host-bytes", args.host_bytes, "--nvme-bytes", "256MiB")
    worker = os.path.join(d, "worker.py")
    with open(worker, "w") as f:
        f.write(WORKER)
    try:
        r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            f"--nproc-per-node={args.ranks}", worker, json.dumps(cfg)],
                           capture_output=True, text=True, timeout=args.timeout_s)
        if r.returncode != 0:
            raise SystemExit(f"{layout}/{variant} failed:\n{r.stderr[-3000:]}")
        ranks = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("RESULT "))[7:])
        daemon_bytes = proc_status_bytes(daemon.pid, "VmHWM") if daemon else 0
    finally:
        if daemon is not None:
            daemon.terminate()
            daemon.wait(timeout=60)
            notify.close()
        shutil.rmtree(d, ignore_errors=True)
    step = sorted(max(xs) for xs in zip(*(rk["times"] for rk in ranks)))  # a step ends when its last rank does
    return {"layout": layout, "variant": variant, "step_s": step[len(step) // 2],
            "ranks_bytes": sum(rk["peak_uss"] for rk in ranks), "daemon_bytes": daemon_bytes,
            "state_bytes": sum(rk["state_bytes"] for rk in ranks),
            "save_s": max(rk["save_s"] for rk in ranks), "load_s": max(rk["load_s"] for rk in ranks),
            "stream_save_s": _most(rk["stream_save_s"] for rk in ranks),
            "stream_load_s": _most(rk["stream_load_s"] for rk in ranks),
            "stream_peak_bytes": _most(rk["stream_peak"] for rk in ranks),
            "digests": [rk["digests"] for rk in ranks]}


def _most(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return max(xs) if xs else None


def _fmt(x: float | None, unit: float = 1.0, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x / unit)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--host-bytes", default="256MiB", help="the daemon's host tier (holds both state versions)")
    ap.add_argument("--timeout-s", type=int, default=900)
    ap.add_argument("--quick", action="store_true", help="tiny: width 32, 4 layers, 2 steps")
    ap.add_argument("--dir", default=None, help="where checkpoints and daemon directories go")
    args = ap.parse_args(argv)
    if args.quick:
        args.width, args.layers, args.steps, args.host_bytes = 32, 4, 2, "32MiB"
    layouts = args.layouts.split(",")
    for lay in layouts:
        if lay not in LAYOUTS:
            raise SystemExit(f"unknown layout {lay!r}; choose from {', '.join(LAYOUTS)}")
    if "tp+fsdp2" in layouts and args.ranks % 2:
        raise SystemExit("tp+fsdp2 needs an even --ranks (tensor parallel 2)")
    base = tempfile.mkdtemp(prefix="train-dist-", dir=args.dir)
    print(f"# {args.ranks} CPU ranks (gloo), width {args.width}, {args.layers} blocks, {args.steps} timed steps "
          f"after {args.warmup}; {machine()}")
    results = []
    try:
        for lay in layouts:
            plain = run(lay, "plain", args, base)
            off = run(lay, "offloaded", args, base)
            off["same_as_plain"] = off["digests"] == plain["digests"]
            plain["same_as_plain"] = True
            results += [plain, off]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    rows = []
    by = {(r["layout"], r["variant"]): r for r in results}
    for r in results:
        p = by[(r["layout"], "plain")]
        node = r["ranks_bytes"] + r["daemon_bytes"]
        rows.append([r["layout"], r["variant"], f"{r['step_s'] * 1e3:.1f}", f"{r['step_s'] / p['step_s']:.2f}",
                     f"{node / 2**20:.0f}", f"{r['state_bytes'] / 2**20:.1f}", f"{r['save_s']:.2f}",
                     f"{r['load_s']:.2f}", _fmt(r["stream_save_s"]), _fmt(r["stream_load_s"]),
                     _fmt(r["stream_peak_bytes"], 2**10, "{:.0f}"), "yes" if r["same_as_plain"] else "NO"])
    print_table(["layout", "variant", "step ms", "x plain", "node MiB", "state MiB", "dcp save s", "dcp load s",
                 "dcp_save s", "dcp_load s", "dcp_save peak KiB", "= plain"], rows)
    out = {"bench": "train_dist", "ranks": args.ranks, "width": args.width, "layers": args.layers,
           "results": [{k: v for k, v in r.items() if k != "digests"} for r in results],
           "all_equal": all(r["same_as_plain"] for r in results)}
    emit_json(out)
    if not out["all_equal"]:
        raise SystemExit("an offloaded run's parameters differ from plain's")
    return out


if __name__ == "__main__":
    main()
