"""Offloaded Adam on CPU: step time and node memory, plain vs host tier vs NVMe tier.

A stack of square Linear layers whose AdamW state (exp_avg + exp_avg_sq, fp32) is
>= 2 GiB by default, trained on CPU. Each variant runs in its own process (so peak
memory is its own), the offloaded ones against a daemon started for it:

  plain              torch.optim.AdamW, state in the training process
  plain+tiles        the same, each large parameter updated a tile at a time as the offloaded
                     optimizer does (its ``tiles`` module): the same bits, no offload; a
                     variant's step over this one's is what offloading itself costs
  host               state on the daemon's host tier, single-version (the host tier's default:
                     arena = 1.1x the state)
  host-2v            the same, crash-consistent (two versions: arena = 2.2x the state)
  host+bwd           host, updating each parameter in backward (update_in_backward=True)
  host+bwd+drop      the same, each gradient dropped once its update used it (drop_grads=True)
  nvme               state on the NVMe tier (two versions, its default), host tier = 25% of
                     the state bytes, no prefetch
  nvme+prefetch      the same with the trace-driven prefetcher
  nvme+prefetch-1v   the same, single-version (crash_consistent=False)
  nvme+prefetch+bwd  nvme+prefetch, updating each parameter in backward
  nvme+prefetch+bwd+drop  the same, each gradient dropped once its update used it
  ...+4k             any tierstore variant with its daemon's host arena in 4 KiB pages
                     (``--host-huge-pages off``; the others ask for transparent huge pages,
                     which the kernel gives only where ``shmem_enabled`` allows: docs/store.md)
  ...+crc32c         any tierstore variant with its checksums computed by the ``crc32c``
                     package (``TIERSTORE_CRC32C=crc32c``) instead of the faster ``fastcrc``
  cache+prefetch     state placed by the store (tier=None): the 25 % host tier keeps what
                     fits resident across steps (trace eviction), the rest on NVMe; prefetch
  deepspeed          the peer: DeepSpeed ZeRO-3 (its CPU accelerator, gloo, world size 1)
                     with the optimizer state on NVMe (offload_optimizer device nvme, its CPU
                     Adam, aio block 1 MiB / queue depth 8); run only where ``deepspeed``
                     imports under ``--deepspeed-python`` (docs/benchmarks.md says how to set
                     that environment up), reported as skipped otherwise

The NVMe variants give the prefetcher 3/4 of the host tier (``--nvme-budget``: nothing
of theirs stays resident between steps), the store-placed one 1/3 (every byte of
budget is one it cannot keep resident); docs/prefetch.md.

Reported: median step time (vs plain, and vs plain+tiles where it ran), the training process's peak unique memory
(private pages, sampled after every backward, when the gradients are all there unless
updates in backward dropped them, and after every step; the sample's time is not part
of the step's), the daemon's peak resident memory, their
sum (the node's memory spent on training), the saving against plain as a fraction
of the optimizer-state bytes, the pool bytes the state takes (1x or 2x), the disk
bytes read and written per step, and the CPU seconds a step takes (the training
process's and its daemon's: over the machine's cores, a floor under the step once
every core is busy, as the disk's time for the step's bytes is another). Every tierstore variant must end with the same
parameters (DeepSpeed's CPU Adam is another kernel: its losses are compared with
plain's within a relative tolerance instead). Each
run fingerprints every parameter after every step (an integer sum of its bits), and
a variant that differs is reported with the first step and parameter where it does;
plain is then run once more, because plain AdamW itself is not always bit-identical
from one process to the next on this CPU (docs/benchmarks.md).
Usage: python bench/train_offload.py [--width 4096] [--layers 16] [--steps 3] [--variants a,b] [--nvme-budget 0.75]
       [--deepspeed-python PY] [--quick] [--png F]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (disk_mixed_gbps, emit_json, machine, print_table, proc_status_bytes, pyplot,  # noqa: E402
                    start_daemon)

_MEASURE = r"""
def uss():
    tot = 0
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith(("Private_Clean:", "Private_Dirty:")):
                tot += int(line.split()[1]) * 1024
    return tot

def after_backward():
    # the memory once backward is done (every gradient there, unless updates dropped them):
    # sampled, and its own time taken out of the step's
    global peak, sampling
    t = time.perf_counter()
    peak = max(peak, uss())
    sampling = time.perf_counter() - t

def cpu_now():
    # CPU seconds (user + system) of this process and of the daemon serving it, if any
    t = os.times()
    out = t[0] + t[1]
    if DAEMON:
        with open(f"/proc/{DAEMON}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        out += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out

def record(step, t0, t1, loss, c0):
    # after a step that began at t0 (forward + backward done at t1; CPU c0): its times once
    # warmed up (less the sample after backward), its loss, its CPU, and the memory peak
    global peak
    dt = time.perf_counter() - t0 - sampling
    losses.append(float(loss))
    if step >= cfg["warmup"]:
        times.append(dt)
        fb_times.append(t1 - t0)
        cpu_times.append(cpu_now() - c0)
    peak = max(peak, uss())

sampling = 0.0
cpu_times = []
DAEMON = None
"""
"""The workers' measures: unique (private) pages in bytes, and one step's figures."""

WORKER = r"""
import json, os, sys, time, hashlib
import torch
from torch import nn
cfg = json.loads(sys.argv[1])
torch.manual_seed(0)
torch.set_num_threads(2)

""" + _MEASURE + r"""
model = nn.Sequential(*[nn.Linear(cfg["width"], cfg["width"]) for _ in range(cfg["layers"])])
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
client = None
if cfg["variant"] == "plain+tiles":
    # plain AdamW in this process, each large parameter updated a tile at a time as the
    # offloaded optimizer does (tierstore.client.optimizer.tiles): the baseline that leaves
    # only what offloading costs
    from tierstore.client.optimizer.tiles import step_tiled, tileable

    def tiled_step(opt=opt, whole_step=opt.step):
        groups, rest = opt.param_groups, []
        try:
            for g in groups:
                whole = []
                for p in g["params"]:
                    st = opt.state.get(p)
                    if p.grad is not None and st and tileable(opt, g, p, st):
                        opt.state[p] = step_tiled(opt, g, p, st)
                    else:
                        whole.append(p)
                rest.append(dict(g, params=whole))
            opt.param_groups = rest
            whole_step()
        finally:
            opt.param_groups = groups
    opt.step = tiled_step
elif cfg["variant"] != "plain":
    from tierstore.client import Client
    from tierstore.client.torch import offload_optimizer
    client = Client.connect(socket=cfg["socket"], namespace="bench/rank0")
    opt = offload_optimizer(opt, client, tier=cfg["tier"], prefix="adam", crash_consistent=cfg["crash_consistent"],
                            update_in_backward=cfg["in_backward"], drop_grads=cfg["drop_grads"])
times, fb_times, peak, sums, losses = [], [], uss(), [], []
DAEMON = client.stat()["pid"] if client else None
io0 = None
x = torch.randn(cfg["batch"], cfg["width"], generator=torch.Generator().manual_seed(1))

def nvme_io():
    t = client.stat()["tiers"]["nvme"]
    return t["bytes_read"], t["bytes_written"]

for step in range(cfg["warmup"] + cfg["steps"]):
    if step == cfg["warmup"] and client:
        io0 = nvme_io()
    c0, t0 = cpu_now(), time.perf_counter()
    loss = model(x).square().mean()
    loss.backward()
    t1 = time.perf_counter()
    after_backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    record(step, t0, t1, loss, c0)
    # a bit-exact fingerprint of every parameter after every step (outside the timing)
    sums.append([int(p.detach().view(torch.int32).sum(dtype=torch.int64)) for p in model.parameters()])
h = hashlib.sha256()
for p in model.parameters():
    h.update(p.detach().numpy().tobytes())
st = client.stat() if client else None
io = [(b - a) / cfg["steps"] for a, b in zip(io0, nvme_io())] if client else [0, 0]
pool = st["namespaces"].get("bench/rank0", {}).get("bytes", 0) if st else 0
print(json.dumps({"times": times, "fb_times": fb_times, "cpu_times": cpu_times, "peak_uss": peak,
                  "digest": h.hexdigest(), "sums": sums,
                  "losses": losses, "read_per_step": io[0], "written_per_step": io[1], "pool_bytes": pool,
                  "prefetch": st["prefetch"] if st else None, "daemon_pid": st["pid"] if st else None}))
"""

DS_WORKER = r"""
import json, os, sys, time
os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when deepspeed is imported
import torch
from torch import nn
import deepspeed
cfg = json.loads(sys.argv[1])
torch.manual_seed(0)
torch.set_num_threads(2)
for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(cfg["port"]), "RANK": "0", "LOCAL_RANK": "0",
             "WORLD_SIZE": "1"}.items():
    os.environ.setdefault(k, v)
deepspeed.init_distributed(dist_backend="gloo")

""" + _MEASURE + r"""
def disk_io():  # this process's bytes to and from the block layer (its swap files)
    with open("/proc/self/io") as f:
        d = dict(line.split(": ") for line in f.read().splitlines())
    return int(d["read_bytes"]), int(d["write_bytes"])

model = nn.Sequential(*[nn.Linear(cfg["width"], cfg["width"]) for _ in range(cfg["layers"])])
config = {
    "train_micro_batch_size_per_gpu": cfg["batch"],
    "gradient_accumulation_steps": 1,
    # AdamW as torch's defaults in the other variants: lr 1e-4, betas (0.9, 0.999), eps 1e-8, weight decay 0.01
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8,
                                              "weight_decay": 0.01}},
    "zero_optimization": {
        "stage": 3,  # NVMe optimizer offload needs stage 3 (1 and 2 with device nvme act as CPU offload)
        "offload_optimizer": {"device": "nvme", "nvme_path": cfg["nvme_path"], "pin_memory": True,
                              "buffer_count": 4, "fast_init": False},
        "sub_group_size": 1e9,
    },
    "aio": {"block_size": 1 << 20, "queue_depth": 8, "thread_count": 1, "single_submit": False,
            "overlap_events": True},
    "steps_per_print": 1 << 30,
    "wall_clock_breakdown": False,
}
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
x = torch.randn(cfg["batch"], cfg["width"], generator=torch.Generator().manual_seed(1))
times, fb_times, losses, peak = [], [], [], uss()
io0 = None
for step in range(cfg["warmup"] + cfg["steps"]):
    if step == cfg["warmup"]:
        io0 = disk_io()
    c0, t0 = cpu_now(), time.perf_counter()
    loss = engine(x).square().mean()
    engine.backward(loss)
    t1 = time.perf_counter()
    after_backward()
    engine.step()
    record(step, t0, t1, loss, c0)
io = [(b - a) / cfg["steps"] for a, b in zip(io0, disk_io())]
print(json.dumps({"times": times, "fb_times": fb_times, "cpu_times": cpu_times, "peak_uss": peak, "digest": None,
                  "sums": None,
                  "losses": losses, "read_per_step": io[0], "written_per_step": io[1], "pool_bytes": 0,
                  "prefetch": None, "daemon_pid": None, "deepspeed": deepspeed.__version__}))
"""

LOSS_RTOL = 1e-4
"""How close DeepSpeed's losses must be to plain's (another Adam kernel: not bit-identical)."""


def divergence(a: dict, b: dict) -> tuple[int, int] | None:
    """(step, parameter) where run ``b``'s parameters first differ from run ``a``'s, or None
    (a run without fingerprints, DeepSpeed's, is compared by its losses instead)."""
    if a["sums"] is None or b["sums"] is None:
        return None
    for step, (sa, sb) in enumerate(zip(a["sums"], b["sums"])):
        for i, (x, y) in enumerate(zip(sa, sb)):
            if x != y:
                return step, i
    return None if a["digest"] == b["digest"] else (len(a["sums"]), -1)


VARIANTS = ("plain", "plain+tiles", "host", "host-2v", "host+bwd", "host+bwd+drop", "nvme", "nvme+prefetch", "nvme+prefetch-1v",
            "nvme+prefetch+bwd", "nvme+prefetch+bwd+drop", "cache+prefetch", "deepspeed")


def deepspeed_missing(python: str) -> str | None:
    """Why the DeepSpeed peer cannot run under ``python`` (None: it can)."""
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    try:
        r = subprocess.run([python, "-c", "import deepspeed, sys; sys.stdout.write(deepspeed.__version__)"],
                           capture_output=True, text=True, env=env, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{python}: {e}"
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        return f"deepspeed does not import under {python} ({last}); docs/benchmarks.md says how to set it up"
    return None


def loss_gap(a: dict, b: dict) -> float:
    """The largest relative difference between two runs' losses, step by step."""
    return max((abs(x - y) / max(abs(x), 1e-30) for x, y in zip(a["losses"], b["losses"])), default=0.0)


def _daemon(base: str, host_bytes: int, nvme_bytes: int, prefetch: bool, policy: str, budget_bytes: int,
            huge: bool = True, env: dict | None = None):
    return start_daemon(base, "--host-bytes", str(host_bytes), "--nvme-bytes", str(nvme_bytes),
                        "--prefetch", "1" if prefetch else "0", "--policy", policy,
                        "--prefetch-budget-bytes", str(max(budget_bytes, 1 << 20)),
                        "--host-huge-pages", "auto" if huge else "off", env=env)


def run(variant: str, cfg: dict, state_bytes: int, base: str) -> dict:
    crc_env = {"TIERSTORE_CRC32C": "crc32c"} if variant.endswith("+crc32c") else None
    variant = variant.removesuffix("+crc32c")
    huge = not variant.endswith("+4k")
    variant = variant.removesuffix("+4k")
    d = tempfile.mkdtemp(dir=base)
    daemon = ns = None
    host = 0
    try:
        wcfg = dict(cfg, variant=variant, in_backward="+bwd" in variant, drop_grads=variant.endswith("+drop"),
                    crash_consistent={"-1v": False, "-2v": True}.get(variant[-3:]))
        python, worker = sys.executable, WORKER
        env = dict(os.environ, **crc_env) if crc_env else None
        if variant == "deepspeed":
            python, worker = cfg["deepspeed_python"], DS_WORKER
            env = dict(os.environ, DS_ACCELERATOR="cpu")
            with socket.socket() as probe:  # a free port for its one-rank gloo group
                probe.bind(("127.0.0.1", 0))
                wcfg.update(nvme_path=d, port=probe.getsockname()[1])
        elif not variant.startswith("plain"):
            if variant.startswith("host"):
                versions = 2 if wcfg["crash_consistent"] else 1
                host, tier, prefetch = int(1.1 * versions * state_bytes) + (64 << 20), "host", False
            else:
                host, prefetch = max(state_bytes // 4, 8 << 20), "+prefetch" in variant
                tier = None if variant.startswith("cache") else "nvme"
            # tier="nvme" keeps nothing resident between steps: the prefetcher may use most of the
            # host tier (the rest holds the parameter being updated and the write-behind), so the
            # next step's first reads overlap the forward and backward passes. A cache keeps what
            # fits resident, and every byte of budget is a byte it cannot keep (docs/prefetch.md).
            budget = int(host * cfg["nvme_budget"]) if tier == "nvme" else host // 3
            daemon, sock, ns = _daemon(d, host, 3 * state_bytes + (256 << 20), prefetch, "trace", budget, huge,
                                       crc_env)
            wcfg.update(socket=sock, tier=tier)
        r = subprocess.run([python, "-c", worker, json.dumps(wcfg)], capture_output=True, text=True, env=env)
        if r.returncode != 0:
            raise SystemExit(f"{variant} failed:\n{r.stderr[-3000:]}")
        out = json.loads(r.stdout.strip().splitlines()[-1])
        out["daemon_peak_rss"] = proc_status_bytes(daemon.pid, "VmHWM") if daemon else 0
        out["host_bytes"] = host
        return out
    finally:
        if daemon is not None:
            daemon.terminate()
            daemon.wait()
            ns.close()
        shutil.rmtree(d, ignore_errors=True)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=4,
                   help="untimed steps first (default 4: the prefetcher has learned a double-buffered "
                        "optimizer's two-step cycle by the end of its 4th step, docs/prefetch.md)")
    p.add_argument("--dir", default=None)
    p.add_argument("--png", default=None)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"a subset of {','.join(VARIANTS)} (plain is "
                   "always run: the others are compared with it)")
    p.add_argument("--nvme-budget", type=float, default=0.75,
                   help="prefetch budget of the nvme variants as a fraction of the host tier (default 0.75; "
                        "the cache variant uses 1/3)")
    p.add_argument("--deepspeed-python", default=sys.executable,
                   help="the interpreter of an environment with deepspeed, for the deepspeed variant (default: "
                        "this one; docs/benchmarks.md#deepspeed)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every variant this many times, in a rotated order each round; step time, ratio "
                        "to plain (per round) and CPU are medians over the rounds (default 1)")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if not 0 < args.nvme_budget <= 1:
        p.error("--nvme-budget must be in (0, 1]")
    variants = ["plain"] + [v for v in args.variants.split(",") if v != "plain"]
    unknown = {v for v in variants if v.removesuffix("+crc32c").removesuffix("+4k") not in VARIANTS
               or v.split("+")[0] in ("plain", "deepspeed") and v not in ("plain", "plain+tiles", "deepspeed")}
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    if args.quick:
        # a state (14 MB) larger than the nvme variants' host tier (its 8 MiB floor), so that
        # every step moves at least the difference through NVMe whatever the demoter's timing
        args.width, args.layers, args.steps, args.warmup = 768, 3, 1, 2
    base = args.dir or os.path.abspath("bench-io-tmp")
    os.makedirs(base, exist_ok=True)
    n_params = args.layers * (args.width * args.width + args.width)
    state_bytes = 2 * 4 * n_params
    cfg = {"width": args.width, "layers": args.layers, "batch": args.batch, "steps": args.steps,
           "warmup": args.warmup, "nvme_budget": args.nvme_budget, "deepspeed_python": args.deepspeed_python}
    skipped = {}
    if "deepspeed" in variants:
        why = deepspeed_missing(args.deepspeed_python)
        if why is not None:
            skipped["deepspeed"] = why
            variants.remove("deepspeed")
    # the ceiling for moving state: this disk reading and writing at once
    mixed_gbps = disk_mixed_gbps(base, 64 << 20 if args.quick else 256 << 20)
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for k in range(args.rounds):
        # rotated each round: on a machine whose speed drifts, no variant always runs first
        for v in variants[k % len(variants):] + variants[:k % len(variants)]:
            runs[v].append(run(v, cfg, state_bytes, base))
    results = {v: r[0] for v, r in runs.items()}
    plain = results["plain"]
    # every run of every variant against the first plain run
    diverged = {v: next((d for d in (divergence(plain, x) for x in r) if d is not None), None)
                for v, r in runs.items()}
    again = None
    if any(d is not None for d in diverged.values()):
        # plain AdamW on CPU is not always bit-reproducible from one process to the next
        # (docs/benchmarks.md): a second plain run tells a store fault from that
        print("# a variant differs from plain: running plain again to see whether plain reproduces itself",
              flush=True)
        again = run("plain", cfg, state_bytes, base)
    def median(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2]

    per_round = {v: [median(x["times"]) for x in r] for v, r in runs.items()}
    med = {v: median(t) for v, t in per_round.items()}
    ratio = {v: median([t / p for t, p in zip(per_round[v], per_round["plain"])]) for v in runs}
    tiled = {v: median([t / p for t, p in zip(per_round[v], per_round["plain+tiles"])]) for v in runs} \
        if "plain+tiles" in runs else None
    cpu = {v: median([median(x["cpu_times"]) for x in r]) for v, r in runs.items()}
    cores = os.cpu_count() or 1
    fwd_bwd = sorted(plain["fb_times"])[len(plain["fb_times"]) // 2]
    rows, out_rows = [], []
    for v, r in results.items():
        node = r["peak_uss"] + r["daemon_peak_rss"]
        plain_node = plain["peak_uss"]
        saving = (plain_node - node) / state_bytes
        moved = r["read_per_step"] + r["written_per_step"]
        disk_s = moved / (mixed_gbps * 1e9) if mixed_gbps else None
        gap = loss_gap(plain, r)
        row = {"variant": v, "step_s": med[v], "step_vs_plain": ratio[v], "step_s_rounds": per_round[v],
               "step_vs_plain_tiles": tiled[v] if tiled else None,
               "peak_uss": r["peak_uss"],
               "daemon_peak_rss": r["daemon_peak_rss"], "host_bytes": r["host_bytes"], "node_bytes": node,
               "saving_of_state": saving,
               "read_per_step": r["read_per_step"], "written_per_step": r["written_per_step"],
               "disk_s_per_step": disk_s, "disk_vs_plain": None if disk_s is None else disk_s / med["plain"],
               "cpu_s_per_step": cpu[v], "cpu_floor_vs_plain": cpu[v] / cores / med["plain"],
               "pool_bytes": r["pool_bytes"], "pool_vs_state": r["pool_bytes"] / state_bytes,
               "loss_rel_gap": gap, "losses_close": gap <= LOSS_RTOL,
               "identical": None if r["sums"] is None else diverged[v] is None, "diverged_at": diverged[v],
               "identical_to_plain_again": None if again is None else divergence(again, r) is None,
               "hit_rate": (r["prefetch"]["hits"] / max(1, r["prefetch"]["hits"] + r["prefetch"]["late"]
                                                       + r["prefetch"]["misses"])) if r["prefetch"] else None}
        out_rows.append(row)
        rows.append([v, f"{med[v]:.2f}", f"{row['step_vs_plain']:.2f}", *([f"{tiled[v]:.2f}"] if tiled else []),
                     f"{r['peak_uss'] / 2**30:.2f}",
                     f"{r['daemon_peak_rss'] / 2**30:.2f}", f"{node / 2**30:.2f}", f"{saving * 100:.0f}%",
                     f"{r['pool_bytes'] / state_bytes:.2f}", f"{moved / 2**30:.2f}", *(["-", "-"] if disk_s is None else [f"{disk_s:.2f}", f"{disk_s / med['plain']:.2f}"]),
                     f"{cpu[v]:.2f}", f"{row['cpu_floor_vs_plain']:.2f}",
                     _same(row),
                     "-" if row["hit_rate"] is None else f"{row['hit_rate'] * 100:.1f}%"])
    print(f"# train_offload: {args.layers} x Linear({args.width}) = {n_params / 1e6:.0f}M params, AdamW state "
          f"{state_bytes / 2**30:.2f} GiB, batch {args.batch}, {args.steps} steps after {args.warmup} warm-up; "
          f"prefetch budget {args.nvme_budget:.0%} of the host tier (nvme variants); {args.rounds} round(s), "
          f"variants rotated each round (step s: median over rounds; vs plain: the median of each round's ratio); "
          f"OMP_WAIT_POLICY {os.environ.get('OMP_WAIT_POLICY', 'unset')} (every variant's process inherits it); "
          f"{machine()}")
    if args.rounds > 1:
        print("# step s per round: " + "; ".join(f"{v} " + " ".join(f"{t:.2f}" for t in per_round[v])
                                                   for v in runs))
    disk = (f"disk {mixed_gbps:.2f} GB/s reading and writing at once (O_DIRECT): 'disk s' is the time it needs "
            "for a step's NVMe bytes, a floor under that variant's step however well they overlap the compute"
            if mixed_gbps else f"{base} does not take O_DIRECT: disk time not measured")
    print(f"# plain: forward+backward {fwd_bwd:.2f} s, optimizer {med['plain'] - fwd_bwd:.2f} s per step; {disk}")
    print(f"# 'cpu s': CPU seconds a step takes, the training process's and its daemon's together; 'cpu/plain':"
          f" that over {cores} cores, in plain steps: a floor under the step where the cores are all busy")
    print_table(["variant", "step s", "vs plain", *(["vs plain+tiles"] if tiled else []), "proc GiB", "daemon GiB", "node GiB", "saved/state",
                 "pool/state", "moved GiB/step", "disk s", "disk/plain", "cpu s", "cpu/plain", "same", "hit rate"],
                rows)
    for v, why in skipped.items():
        print(f"# {v}: skipped: {why}")
    if again is not None:
        d = divergence(plain, again)
        print("# plain run again: " + ("bit-identical to the first plain run" if d is None else
                                        f"DIFFERS from the first plain run from step {d[0]}, parameter {d[1]} "
                                        "(torch itself is not reproducible here)"))
    if args.png:
        plot(out_rows, args.png)
    out = {"bench": "train_offload", "rounds": args.rounds, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
           "params": n_params, "state_bytes": state_bytes, "machine": machine(),
           "disk_mixed_gbps": mixed_gbps, "plain_fwd_bwd_s": fwd_bwd, "nvme_budget": args.nvme_budget,
           "results": out_rows, "skipped": skipped,
           "plain_reproduced": None if again is None else divergence(plain, again) is None}
    emit_json(out)
    return out


def _same(row: dict) -> str:
    if row["identical"] is None:  # another optimizer kernel: its losses against plain's
        return f"losses {'within' if row['losses_close'] else 'NOT within'} {LOSS_RTOL:g}"
    if row["identical"]:
        return "yes"
    step, param = row["diverged_at"]
    where = f"NO (step {step}, param {param})"
    return where + (" = plain again" if row["identical_to_plain_again"] else "")


def plot(rows: list[dict], path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    names = [r["variant"] for r in rows]
    a1.bar(names, [r["step_vs_plain"] for r in rows], label="step")
    disk = [(r["variant"], r["disk_vs_plain"]) for r in rows if r.get("disk_vs_plain") is not None]
    if disk:
        a1.scatter(*zip(*disk), color="black", marker="_", s=400, zorder=3, label="disk time of its NVMe bytes")
    a1.axhline(1.25, color="gray", linestyle=":", label="1.25x target")
    a1.set_ylabel("time / plain step")
    a1.legend(fontsize="small")
    a2.bar(names, [r["node_bytes"] / 2**30 for r in rows])
    a2.set_ylabel("node memory for training, GiB (peak)")
    for a in (a1, a2):
        a.tick_params(axis="x", labelrotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
