"""DCP checkpoints of an offloaded optimizer: memory and time of a save and a load,
``get_state_dict`` + ``dcp.save`` / ``dcp.load`` + ``set_state_dict`` against the streamed
``dcp_save`` / ``dcp_load`` (tierstore.client.dcp).

One process (no process group), a stack of ``--layers`` bias-free Linear(width, width)
layers whose AdamW state (two fp32 moments, ``--layers`` × width² × 8 bytes) is offloaded
to the NVMe tier of a daemon started for the run. Each variant runs in a process of its
own (so its peak resident set is its own), ``--rounds`` times, alternating. Reported per
variant: how much the process's resident set grew over what it was before the save
(and the load) at its peak (``VmHWM`` after the kernel's high-water mark was reset),
the time, and for the streamed variant the most state bytes it held at once
(``StreamStats.peak_bytes``). Results check: a load of either checkpoint gives the
optimizer state that was saved.

Usage: python bench/dcp_stream.py [--layers 32] [--width 1024] [--file-mib 16] [--rounds 3] [--dir D]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit_json, machine, print_table, start_daemon  # noqa: E402

WORKER = r'''
import json, sys, time, warnings, torch
warnings.filterwarnings("ignore", message="torch.distributed is disabled")
from torch import nn
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from tierstore.client import Client
from tierstore.client.torch import dcp_load, dcp_save, offload_optimizer

cfg = json.loads(sys.argv[1])
client = Client.connect(socket=cfg["socket"], namespace="dcp-stream")

def status(field):
    with open("/proc/self/status") as f:
        return int(f.read().split(field + ":")[1].split()[0]) * 1024

def build(prefix):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(cfg["width"], cfg["width"], bias=False) for _ in range(cfg["layers"])])
    opt = offload_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), client, tier="nvme", prefix=prefix,
                            crash_consistent=False)
    return model, opt

def measured(fn):
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark starts again from the resident set now
    before = status("VmRSS")
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, status("VmHWM") - before, out

model, opt = build("a")
model(torch.randn(2, cfg["width"])).sum().backward()
opt.step()
opt.zero_grad(set_to_none=True)
saved = opt.state[model[-1].weight]["exp_avg"].clone()
path = cfg["path"]
if cfg["variant"] == "streamed":
    save_s, save_grow, st = measured(lambda: dcp_save(model, opt, path, file_bytes=cfg["file_bytes"]))
    peak = st.peak_bytes
else:
    def save():
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    save_s, save_grow, _ = measured(save)
    peak = None
opt.free()
del model, opt
model, opt = build("b")
if cfg["variant"] == "streamed":
    load_s, load_grow, _ = measured(lambda: dcp_load(model, opt, path))
else:
    def load():
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    load_s, load_grow, _ = measured(load)
ok = torch.equal(opt.state[model[-1].weight]["exp_avg"], saved)
opt.free()
print("RESULT " + json.dumps({"save_s": save_s, "save_grow": save_grow, "load_s": load_s, "load_grow": load_grow,
                              "peak": peak, "ok": ok}))
'''

VARIANTS = ("get_state_dict", "streamed")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--file-mib", type=int, default=16, help="dcp_save's file_bytes, in MiB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the checkpoints and the daemon's directories go")
    args = ap.parse_args(argv)
    state = args.layers * args.width * args.width * 8
    base = tempfile.mkdtemp(prefix="dcp-stream-", dir=args.dir)
    daemon, sock, notify = start_daemon(base, "--host-bytes", "256MiB", "--nvme-bytes", f"{max(4 * state, 1 << 30)}")
    print(f"# {args.layers} x Linear({args.width}, {args.width}), AdamW state {state / 2**20:.0f} MiB on NVMe, "
          f"dcp_save files of {args.file_mib} MiB; {machine()}")
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    try:
        for r in range(args.rounds):
            for v in VARIANTS:
                path = os.path.join(base, f"ckpt-{v}-{r}")
                cfg = {"variant": v, "socket": sock, "path": path, "layers": args.layers, "width": args.width,
                       "file_bytes": args.file_mib << 20}
                p = subprocess.run([sys.executable, "-c", WORKER, json.dumps(cfg)], capture_output=True, text=True,
                                   timeout=900)
                if p.returncode != 0:
                    raise SystemExit(f"{v} failed:\n{p.stderr[-3000:]}")
                runs[v].append(json.loads(next(x for x in p.stdout.splitlines() if x.startswith("RESULT "))[7:]))
                shutil.rmtree(path, ignore_errors=True)
    finally:
        daemon.terminate()
        daemon.wait(timeout=60)
        notify.close()
        shutil.rmtree(base, ignore_errors=True)
    rows, results = [], []
    for v in VARIANTS:
        med = {k: statistics.median(x[k] for x in runs[v]) for k in ("save_s", "save_grow", "load_s", "load_grow")}
        peak = max((x["peak"] for x in runs[v] if x["peak"] is not None), default=None)
        ok = all(x["ok"] for x in runs[v])
        results.append({"variant": v, **med, "peak_bytes": peak, "state_bytes": state, "ok": ok})
        rows.append([v, f"{med['save_s']:.2f}", f"{med['save_grow'] / 2**20:.0f}", "-" if peak is None else
                     f"{peak / 2**20:.0f}", f"{med['load_s']:.2f}", f"{med['load_grow'] / 2**20:.0f}",
                     "yes" if ok else "NO"])
    print_table(["variant", "save s", "save RSS growth MiB", "state held MiB", "load s", "load RSS growth MiB",
                 "state loaded ok"], rows)
    out = {"bench": "dcp_stream", "layers": args.layers, "width": args.width, "file_bytes": args.file_mib << 20,
           "results": results, "all_ok": all(r["ok"] for r in results)}
    emit_json(out)
    if not out["all_ok"]:
        raise SystemExit("a loaded state differs from the saved one")
    return out


if __name__ == "__main__":
    main()
