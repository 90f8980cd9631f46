"""The offloaded optimizer's fixed cost per parameter tensor, through a daemon.

A model of many small tensors (the demo's TinyGPT: 12 tensors per block) is where a
per-tensor cost shows: the state is tiny, so the step is all bookkeeping and round
trips. For each tier, ``opt.step()`` of AdamW is timed plain (state in the process)
and offloaded to a daemon started for the run (median over the steps after warm-up),
and the difference is divided by the number of parameter tensors.

By default small parameters are updated in buckets (``bucket_bytes``). With
``--compare-sequential`` the offloaded step is also timed one parameter at a time
(``bucket_bytes=0``: one ``checkout_each`` per parameter) and one state tensor at a
time with the prefetch hints waited for (as the optimizer did before
``checkout_each``), the three rotated from round to round, so they are measured under
the same load.

Usage: python bench/optimizer_overhead.py [--layers 8] [--steps 12] [--tiers host,nvme] [--compare-sequential] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from common import emit_json, machine, print_table, start_daemon  # noqa: E402
from tierstore.client import Client  # noqa: E402
from tierstore.client.cli.demo import TinyGPT  # noqa: E402
from tierstore.client.torch import offload_optimizer  # noqa: E402


def _model(layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return TinyGPT(64, d=128, layers=layers)


class _OneByOne(list):
    """Leases taken one check-out each, checked in one message each."""

    def release(self) -> None:
        for lease in self:
            lease.release()


@contextlib.contextmanager
def _sequential(client: Client):
    """The optimizer as it was before ``checkout_each``: one check-out per state tensor,
    prefetch hints waited for (instance attributes shadow the client's methods)."""
    real = client.prefetch

    def one_by_one(requests, *, timeout_s=None, stream="default"):
        leases = _OneByOne()
        try:
            for h, mode, source in requests:
                leases.append(client.checkout(h, mode, timeout_s=timeout_s, stream=stream, source=source))
        except BaseException:
            leases.release()
            raise
        return leases

    client.checkout_each = one_by_one  # a round trip per state tensor, as before the one-message list
    client.prefetch = lambda hs, wait=True: real(hs, wait=True)
    try:
        yield
    finally:
        del client.checkout_each, client.prefetch


def step_ms(layers: int, steps: int, client: Client | None, tier: str, sequential: bool = False,
            bucket_bytes: int | None = None) -> float:
    model = _model(layers)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    kw = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
    opt = offload_optimizer(inner, client, tier=tier, prefix=f"o{time.monotonic_ns()}", **kw) if client else inner
    x = torch.randint(0, 64, (8, 64))
    times = []
    ctx = _sequential(client) if sequential and client else contextlib.nullcontext()
    with ctx:
        for _ in range(steps):
            model(x).sum().backward()
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
            opt.zero_grad(set_to_none=True)
    if client:
        opt.free()
    warm = min(2, steps - 1)
    return statistics.median(times[warm:]) * 1e3


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--tiers", default="host,nvme")
    p.add_argument("--compare-sequential", action="store_true")
    p.add_argument("--rounds", type=int, default=3, help="alternated rounds with --compare-sequential")
    p.add_argument("--quick", action="store_true", help="2 layers, 4 steps, 1 round (smoke test)")
    p.add_argument("--dir", default=None, help="where the daemon's NVMe tier goes (default: a temporary dir)")
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.steps, args.rounds = 2, 4, 1
    tiers = [t for t in args.tiers.split(",") if t]
    for t in tiers:
        if t not in ("host", "nvme"):
            p.error(f"unknown tier {t!r}: host or nvme")
    n_tensors = sum(1 for _ in _model(args.layers).parameters())
    base = tempfile.mkdtemp(prefix="tierstore-optov-", dir=args.dir)
    proc, sock, ns = start_daemon(base, "--host-bytes", "256MiB", "--nvme-bytes", "2GiB")
    rows, results = [], []
    try:
        with Client.connect(socket=sock, namespace="bench") as c:
            for tier in tiers:
                for r in range(args.rounds if args.compare_sequential else 1):
                    plain = step_ms(args.layers, args.steps, None, tier)
                    variants = [("buckets", False, None)] + (
                        [("per parameter", False, 0), ("per tensor", True, 0)] if args.compare_sequential else [])
                    variants = variants[r % len(variants):] + variants[:r % len(variants)]
                    for name, seq, bucket in variants:
                        off = step_ms(args.layers, args.steps, c, tier, seq, bucket)
                        per = (off - plain) / n_tensors * 1e3
                        rows.append([tier, r, name, f"{plain:.1f}", f"{off:.1f}", f"{per:.0f}"])
                        results.append({"tier": tier, "round": r, "variant": name, "plain_step_ms": plain,
                                        "offloaded_step_ms": off, "per_tensor_us": per})
    finally:
        proc.terminate()
        proc.wait()
        ns.close()
        shutil.rmtree(base, ignore_errors=True)
    print(f"# optimizer_overhead: TinyGPT, {args.layers} layers = {n_tensors} parameter tensors, AdamW, "
          f"opt.step() median of {args.steps} steps after warm-up; offloaded through a daemon")
    print_table(["tier", "round", "offloaded as", "plain ms", "offloaded ms", "us per tensor"], rows)
    out = {"bench": "optimizer_overhead", "machine": machine(), "layers": args.layers, "tensors": n_tensors,
           "results": results}
    emit_json(out)
    return out


if __name__ == "__main__":
    main()
