"""An optimizer-offloaded training step on the GPU: plain AdamW (state in GPU memory)
against tierstore with the update on the GPU (``update="gpu"``) and on the host
(``update="cpu"``), and torchao's ``CPUOffloadOptimizer`` when installed. Same model,
same data; parameters compared with the plain run. Needs a CUDA device.

Usage: python bench/gpu_train.py [--layers 16] [--width 2048] [--steps 6] [--tier host]
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit_json, machine, partial, print_table, skipped_without_cuda, start_daemon  # noqa: E402


def model(layers: int, width: int):
    import torch

    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width),
                   torch.nn.LayerNorm(width)]
    return torch.nn.Sequential(*blocks).cuda()


def run(label: str, make_opt, layers: int, width: int, steps: int, batch: int) -> dict:
    import torch

    m = model(layers, width)
    opt = make_opt(m)
    g = torch.Generator(device="cuda").manual_seed(1)
    times = []
    torch.cuda.reset_peak_memory_stats()
    for i in range(steps + 2):
        x = torch.randn(batch, width, device="cuda", generator=g)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        m(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    params = torch.cat([p.detach().flatten().float() for p in m.parameters()])
    out = {"step_s": sorted(times)[len(times) // 2], "peak_gpu_bytes": torch.cuda.max_memory_allocated(),
           "params": params, "opt": opt}
    partial({"bench": "gpu_train", "variant": label, "step_s": out["step_s"], "steps_s": times,
             "peak_gpu_bytes": out["peak_gpu_bytes"]})
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--tier", default="host", choices=["host", "nvme"])
    args = p.parse_args(argv)
    import torch

    skipped = skipped_without_cuda("gpu_train")
    if skipped is not None:
        return skipped
    from tierstore.client import Client
    from tierstore.client.torch import offload_optimizer

    nparams = sum(q.numel() for q in model(args.layers, args.width).parameters())
    state_bytes = 2 * 4 * nparams
    base = tempfile.mkdtemp(prefix="tierstore-gpu-train-")
    host = 2 * state_bytes + (1 << 30) if args.tier == "host" else state_bytes // 2
    d, sock, ns = start_daemon(base, "--host-bytes", str(host), "--nvme-bytes", str(4 * state_bytes + (1 << 30)),
                               "--policy", "trace")
    common = dict(layers=args.layers, width=args.width, steps=args.steps, batch=args.batch)
    results, rows = {}, []
    try:
        plain = run("plain", lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4), **common)
        results["plain"] = plain
        with Client.connect(socket=sock, namespace="bench") as c:
            for mode in ("gpu", "cpu"):
                results[f"tierstore_{mode}"] = run(
                    f"tierstore_{mode}", lambda m, mode=mode: offload_optimizer(torch.optim.AdamW(m.parameters(), lr=1e-4), c,
                                                           tier=args.tier, prefix=f"opt-{mode}", update=mode),
                    **common)
                results[f"tierstore_{mode}"]["opt"].free()
            pinned = c.pinned_reason
        try:
            from torchao.optim import CPUOffloadOptimizer
        except Exception as e:
            results["torchao"] = None
            torchao_why = f"torchao not installed ({type(e).__name__})"
        else:
            torchao_why = "torchao CPUOffloadOptimizer"
            results["torchao"] = run("torchao",
                                     lambda m: CPUOffloadOptimizer(m.parameters(), torch.optim.AdamW, lr=1e-4),
                                     **common)
    finally:
        d.terminate()
        d.wait()
        ns.close()
        shutil.rmtree(base, ignore_errors=True)
    out_rows = {}
    for name, r in results.items():
        if r is None:
            continue
        same = bool(torch.allclose(r["params"], plain["params"], rtol=1e-4, atol=1e-6))
        out_rows[name] = {"step_s": r["step_s"], "vs_plain": r["step_s"] / plain["step_s"],
                          "peak_gpu_bytes": r["peak_gpu_bytes"], "params_match_plain": same}
        rows.append([name, f"{r['step_s']:.3f}", f"{r['step_s'] / plain['step_s']:.2f}",
                     f"{r['peak_gpu_bytes'] / 2**30:.2f}", same])
    print(f"# offloaded training step: {nparams / 1e6:.0f} M params, Adam state {state_bytes / 2**30:.2f} GiB on "
          f"the {args.tier} tier; {torchao_why}; arena: {pinned}; {machine()}")
    print_table(["variant", "step s", "vs plain", "peak GPU GiB", "params = plain"], rows)
    out = {"bench": "gpu_train", "params": nparams, "state_bytes": state_bytes, "tier": args.tier,
           "machine": machine(), "results": out_rows}
    emit_json(out)
    return out


if __name__ == "__main__":
    main()
