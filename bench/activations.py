"""Activation memory of GPT training: keep everything, checkpoint, or offload to the pool.

A GPT-style decoder (token embedding, pre-LayerNorm blocks with fused QKV, causal
scaled-dot-product attention and a GELU MLP, a vocabulary head) at a sequence length
where the activations saved for backward dominate the training process's memory,
trained with AdamW. Each variant's memory is measured in a process of its own (so its
peak is its own); the step times come from one more process that runs every variant a
step at a time in turn (the first of each round rotating), each on its own copy of the
model and the same batches, so the machine's load moves them all alike. The offloaded
variants are clients of a daemon started for each:

  none                 every activation stays in the process
  checkpoint           torch.utils.checkpoint per block (use_reentrant=False): only
                       each block's input is kept, the block's forward runs again in backward
  offload-host         offload_activations into the daemon's host tier (large enough)
  offload-nvme         the same with a host tier of 1/4 of the activation bytes: the
                       rest goes to NVMe and comes back through the pool's prefetch
  checkpoint+offload   checkpointing, and what it keeps offloaded

Reported per variant: median step time (forward + backward + AdamW) and against
``none``; activation memory: the process's peak private memory during a step over
what it held just before it (sampled every millisecond in a step of its own; on
CUDA, the allocator's peak over the step's start) and against ``none``; the daemon's
peak resident memory (its host arena is pre-faulted: that is the tier's size, a
setting) and the activation bytes in the pool at most; backward stall time per step
(unpacks that waited for bytes) and forward stall (puts behind); bytes moved per step
(put + fetched back, and NVMe bytes read and written); prefetch hits. Every variant
is checked against plain training in the same process on the same batch: loss and
every gradient compared with torch.equal; and its loss at every timed step against
``none``'s ("same": both hold).

Usage: python bench/activations.py [--width 256] [--layers 8] [--heads 4] [--seq 1024] [--batch 2] [--vocab 1024] [--steps 4] [--window-mib 16] [--variants a,b] [--device cpu|cuda] [--quick] [--png F]
Prints a table, then one JSON line.
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
from common import emit_json, machine, print_table, proc_status_bytes, pyplot, start_daemon  # noqa: E402

VARIANTS = ("none", "checkpoint", "offload-host", "offload-nvme", "checkpoint+offload")

MODEL = r"""
import contextlib, json, sys, threading, time
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

cfg = json.loads(sys.argv[1])
dev = torch.device(cfg["device"])
D, H, T, V = cfg["width"], cfg["heads"], cfg["seq"], cfg["vocab"]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc, self.out = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, H, d // H).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, ckpt):
        super().__init__()
        self.emb, self.pos = nn.Embedding(V, D), nn.Embedding(T, D)
        self.blocks = nn.ModuleList(Block() for _ in range(cfg["layers"]))
        self.ln, self.head = nn.LayerNorm(D), nn.Linear(D, V, bias=False)
        self.ckpt = ckpt

    def forward(self, idx):
        x = self.emb(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = checkpoint(blk, x, use_reentrant=False) if self.ckpt else blk(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.flatten(0, 1), idx.roll(-1, 1).flatten())


def make(ckpt):
    torch.manual_seed(0)
    return GPT(ckpt).to(dev)


def batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, V, (cfg["batch"], T), generator=g).to(dev)


def fwd_bwd(model, idx, a):
    with a if a is not None else contextlib.nullcontext():
        loss = model(idx)
    loss.backward()
    return loss.detach()


def sync():
    if dev.type == "cuda":
        torch.cuda.synchronize()


"""

MEMORY = MODEL + r"""
variant = cfg["variant"]
ckpt = variant.startswith("checkpoint")
acts = client = None
if "offload" in variant:
    from tierstore.client import Client
    from tierstore.client.torch import offload_activations
    client = Client.connect(socket=cfg["socket"], namespace="bench-acts")
    window = cfg["window_mib"] << 20
    acts = offload_activations(client, min_bytes=cfg["min_bytes"], inflight_bytes=window, prefetch_bytes=window)


def private_bytes():
    tot = 0
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith(("Private_Clean:", "Private_Dirty:")):
                tot += int(line.split()[1]) * 1024
    return tot


model = make(ckpt)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
for step in range(cfg["warmup"]):  # the memory step below is not a first step
    fwd_bwd(model, batch(step), acts)
    opt.step()
    opt.zero_grad(set_to_none=False)  # the gradients stay allocated: part of the baseline below
    sync()
if acts:
    acts.flush(timeout_s=600)

# one more step, for memory only: its peak over what the process held just before it
idx = batch(99)
if dev.type == "cuda":
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd(model, idx, acts)
    torch.cuda.synchronize()
    act_mem, peak_total = torch.cuda.max_memory_allocated() - base, torch.cuda.max_memory_allocated()
else:
    base = private_bytes()
    peak = [base]
    done = threading.Event()

    def sample():
        while not done.wait(0.001):
            peak[0] = max(peak[0], private_bytes())
    th = threading.Thread(target=sample, daemon=True)
    th.start()
    fwd_bwd(model, idx, acts)
    done.set()
    th.join()
    peak[0] = max(peak[0], private_bytes())
    act_mem, peak_total = peak[0] - base, peak[0]
opt.zero_grad(set_to_none=True)
if acts:
    acts.flush(timeout_s=600)
pool_peak = acts.snapshot()["peak_bytes_in_flight"] if acts else 0

# the check: plain training and this variant, same process, same batch: loss and every gradient
del opt
model = None
idx = batch(7)
plain = make(False)
lp = fwd_bwd(plain, idx, None)
gp = [p.grad for p in plain.parameters()]
del plain
other = make(ckpt)
lo = fwd_bwd(other, idx, acts)
same = torch.equal(lp, lo) and all(torch.equal(a, p.grad) for a, p in zip(gp, other.parameters()))
if acts:
    acts.close()
st = client.stat() if client else None
print(json.dumps({"act_mem": act_mem, "peak_total": peak_total, "pool_peak": pool_peak, "same": same,
                  "loss": float(lp), "daemon_pid": st["pid"] if st else None}))
"""


TIMER = MODEL + r"""
# every variant in this one process, a step of each in turn (the first of each round
# rotating), so the machine's load moves all of them alike; each variant trains its own
# copy of the model on the same batches, and its losses are compared with none's
from tierstore.client import Client
from tierstore.client.torch import offload_activations

window = cfg["window_mib"] << 20
runs = {}
for v in cfg["variants"]:
    r = {"model": make(v.startswith("checkpoint")), "acts": None, "client": None, "times": [], "fb_times": [],
         "losses": []}
    r["opt"] = torch.optim.AdamW(r["model"].parameters(), lr=1e-4)
    if "offload" in v:
        r["client"] = Client.connect(socket=cfg["sockets"][v], namespace="bench-acts")
        r["acts"] = offload_activations(r["client"], min_bytes=cfg["min_bytes"], inflight_bytes=window,
                                        prefetch_bytes=window)
    runs[v] = r


def counters(r):
    if r["acts"] is None:
        return None
    t = r["client"].stat()["tiers"]["nvme"]
    return r["acts"].snapshot(), (t["bytes_read"], t["bytes_written"])


def one_step(r, step, timed):
    idx = batch(step)
    sync()
    t0 = time.perf_counter()
    loss = fwd_bwd(r["model"], idx, r["acts"])
    sync()
    t1 = time.perf_counter()
    r["opt"].step()
    r["opt"].zero_grad(set_to_none=False)
    sync()
    if timed:
        r["times"].append(time.perf_counter() - t0)
        r["fb_times"].append(t1 - t0)
        r["losses"].append(float(loss))


names = list(runs)
for step in range(cfg["warmup"]):
    for v in names:
        one_step(runs[v], step, False)
c0 = {v: counters(r) for v, r in runs.items()}
for i, step in enumerate(range(cfg["warmup"], cfg["warmup"] + cfg["steps"])):
    for v in names[i % len(names):] + names[:i % len(names)]:
        one_step(runs[v], step, True)
out = {}
for v, r in runs.items():
    per, io = {}, [0, 0]
    if r["acts"] is not None:
        (s0, io0), (s1, io1) = c0[v], counters(r)
        n = cfg["steps"]
        per = {k: (s1[k] - s0[k]) / n for k in ("backward_stall_s", "forward_stall_s", "offloaded_bytes",
                                               "fetched_bytes", "hits", "late", "misses", "cancelled")}
        io = [(b - a) / n for a, b in zip(io0, io1)]
        r["acts"].close()
        r["client"].close()
    out[v] = {"times": r["times"], "fb_times": r["fb_times"], "losses": r["losses"], "per_step": per,
              "nvme_read_per_step": io[0], "nvme_written_per_step": io[1]}
print(json.dumps(out))
"""

_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
"""For the memory runs only: large allocations straight from mmap and back on free, so
the private memory sampled follows what the process holds, not what malloc's free lists
keep. The timing run keeps malloc's defaults, as a training job would."""


def _worker(code: str, cfg: dict, env: dict) -> dict:
    r = subprocess.run([sys.executable, "-c", code, json.dumps(cfg)], capture_output=True, text=True,
                       env={**os.environ, **env})
    if r.returncode != 0:
        raise SystemExit(f"{cfg.get('variant', 'timing run')} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _daemon(base: str, host_bytes: int):
    d = tempfile.mkdtemp(dir=base)
    return start_daemon(d, "--host-bytes", str(host_bytes), "--nvme-bytes", str(max(4 * host_bytes, 1 << 30)))


def _stop(daemon, ns) -> None:
    daemon.terminate()
    daemon.wait()
    ns.close()


def run_memory(variant: str, cfg: dict, base: str, host_bytes: int) -> dict:
    """One variant's memory and check, in its own process (against a daemon of its own when
    it offloads)."""
    daemon = ns = None
    try:
        wcfg = dict(cfg, variant=variant)
        if "offload" in variant:
            daemon, wcfg["socket"], ns = _daemon(base, host_bytes)
        out = _worker(MEMORY, wcfg, _MALLOC_ENV)
        out["daemon_peak_rss"] = proc_status_bytes(daemon.pid, "VmHWM") if daemon else 0
        out["host_bytes"] = host_bytes if daemon else 0
        return out
    finally:
        if daemon is not None:
            _stop(daemon, ns)


def run_timing(variants: list[str], cfg: dict, base: str, hosts: dict[str, int]) -> dict:
    """Every variant's steps, alternated in one process, each offloading one against a
    daemon of its own (host tier as in its memory run)."""
    daemons = {}
    try:
        sockets = {}
        for v in variants:
            if "offload" in v:
                daemon, sockets[v], ns = _daemon(base, hosts[v])
                daemons[v] = (daemon, ns)
        return _worker(TIMER, dict(cfg, variants=variants, sockets=sockets), {})
    finally:
        for daemon, ns in daemons.values():
            _stop(daemon, ns)


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def plot(rows: list[dict], path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    names = [r["variant"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
    a.barh(names, [r["act_mem"] / 2**20 for r in rows], color="tab:blue")
    a.set_xlabel("activation memory of the process (MiB)")
    a.invert_yaxis()
    b.barh(names, [r["step_s"] for r in rows], color="tab:orange")
    b.barh(names, [r["backward_stall_s"] for r in rows], color="tab:red", label="backward stall")
    b.set_xlabel("step time (s)")
    b.invert_yaxis()
    b.legend(loc="lower right")
    fig.suptitle("activations: keep, checkpoint, offload to the pool")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--window-mib", type=int, default=16,
                   help="offload_activations' inflight_bytes and prefetch_bytes, in MiB (default 16)")
    p.add_argument("--min-bytes", type=int, default=1 << 20, help="offload_activations' min_bytes (default 1 MiB)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"a subset of {','.join(VARIANTS)} (none is always run: the others are compared with it)")
    p.add_argument("--dir", default=None)
    p.add_argument("--png", default=None)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    variants = ["none"] + [v for v in args.variants.split(",") if v != "none"]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    if args.width % args.heads:
        p.error("--width must be a multiple of --heads")
    if args.quick:
        args.width, args.layers, args.heads, args.seq, args.batch, args.vocab = 64, 2, 2, 128, 2, 256
        args.steps, args.window_mib, args.min_bytes = 1, 1, 16 << 10
    base = args.dir or os.path.abspath("bench-io-tmp")
    os.makedirs(base, exist_ok=True)
    cfg = {k: getattr(args, k) for k in ("width", "layers", "heads", "seq", "batch", "vocab", "steps", "warmup",
                                         "window_mib", "min_bytes", "device")}
    results: dict[str, dict] = {}
    host = 64 << 20
    for v in variants:
        if v == "offload-nvme":  # a quarter of what the host-tier run had in the pool at most
            peak = results.get("offload-host", {}).get("pool_peak") or results["none"]["act_mem"]
            host = max(peak // 4, 16 << 20)
        elif "offload" in v:  # room for every activation of a step, and more
            host = max(2 * results["none"]["act_mem"], 64 << 20)
        results[v] = run_memory(v, cfg, base, host)
        results[v]["host_tier"] = host
    timing = run_timing(variants, cfg, base, {v: r["host_tier"] for v, r in results.items()})
    for v, r in results.items():
        r.update(timing[v])
        r["same"] = r["same"] and r["losses"] == timing["none"]["losses"]
    none = results["none"]
    none_step, none_mem = _median(none["times"]), max(none["act_mem"], 1)
    rows, table = [], []
    for v, r in results.items():
        per = r["per_step"]
        step = _median(r["times"])
        row = {"variant": v, "step_s": step, "step_vs_none": step / none_step, "act_mem": r["act_mem"],
               "act_mem_vs_none": r["act_mem"] / none_mem, "peak_private": r["peak_total"],
               "daemon_peak_rss": r["daemon_peak_rss"], "host_tier_bytes": r["host_bytes"],
               "pool_peak": r["pool_peak"], "backward_stall_s": per.get("backward_stall_s", 0.0),
               "forward_stall_s": per.get("forward_stall_s", 0.0),
               "moved_per_step": per.get("offloaded_bytes", 0) + per.get("fetched_bytes", 0),
               "nvme_read_per_step": r["nvme_read_per_step"], "nvme_written_per_step": r["nvme_written_per_step"],
               "hits": per.get("hits", 0), "late": per.get("late", 0), "misses": per.get("misses", 0),
               "same": r["same"], "loss": r["loss"]}
        rows.append(row)
        table.append([v, f"{step:.2f}", f"{row['step_vs_none']:.2f}", f"{r['act_mem'] / 2**20:.0f}",
                      f"{row['act_mem_vs_none'] * 100:.0f}%", f"{r['daemon_peak_rss'] / 2**20:.0f}",
                      f"{r['pool_peak'] / 2**20:.0f}", f"{row['backward_stall_s']:.3f}",
                      f"{row['forward_stall_s']:.3f}", f"{row['moved_per_step'] / 2**20:.0f}",
                      f"{(r['nvme_read_per_step'] + r['nvme_written_per_step']) / 2**20:.0f}",
                      f"{row['hits']:.0f}/{row['late']:.0f}/{row['misses']:.0f}", "yes" if r["same"] else "NO"])
    print(f"# activations: GPT {args.layers} x {args.width} wide, {args.heads} heads, sequence {args.seq}, batch "
          f"{args.batch}, vocabulary {args.vocab}, on {args.device}; {args.steps} steps after {args.warmup} warm-up; "
          f"offload window {args.window_mib} MiB, min_bytes {args.min_bytes}; {machine()}")
    print(f"# none: forward+backward {_median(none['fb_times']):.2f} s of a {none_step:.2f} s step")
    print_table(["variant", "step s", "vs none", "act MiB", "vs none", "daemon MiB", "pool MiB", "bwd stall s",
                 "fwd stall s", "moved MiB", "nvme MiB", "hit/late/miss", "same"], table)
    by = {r["variant"]: r for r in rows}
    targets = {}
    for v in ("offload-host", "offload-nvme"):
        r, ck = by.get(v), by.get("checkpoint")
        if r is not None:
            targets[v] = {"memory_le_25pct": r["act_mem_vs_none"] <= 0.25, "step_le_1_15x": r["step_vs_none"] <= 1.15,
                          "beats_checkpoint": None if ck is None else
                          r["step_s"] < ck["step_s"] and r["act_mem"] <= max(ck["act_mem"], 1)}
    for v, t in targets.items():
        print(f"# {v}: activation memory <= 25% of none: {t['memory_le_25pct']}; step <= 1.15x none: "
              f"{t['step_le_1_15x']}; faster than checkpoint at equal or lower memory: {t['beats_checkpoint']}")
    if args.png:
        plot(rows, args.png)
    out = {"bench": "activations", "config": cfg, "machine": machine(), "results": rows, "targets": targets}
    emit_json(out)
    return out


if __name__ == "__main__":
    main()
