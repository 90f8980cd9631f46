"""H2D / D2H GB/s through the registered (pinned) host arena of a daemon client, beside
torch pinned tensors and pageable memory. Needs a CUDA device (bench/gpu_check.sh).
Prints a table, then one JSON line."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (emit_json, gbps, machine, partial, print_table, repeat, size_label,  # noqa: E402
                    skipped_without_cuda, start_daemon, timed)

from tierstore.client import Client  # noqa: E402


def _sync_timed(fn) -> float:
    def run() -> None:
        fn()
        torch.cuda.synchronize()
    return timed(run)


def main() -> dict:
    skipped = skipped_without_cuda("gpu_transfer")
    if skipped is not None:
        return skipped
    base = tempfile.mkdtemp(prefix="tierstore-gpu-")
    d, sock, ns = start_daemon(base, "--host-bytes", "4GiB")
    rows, res = [], []
    try:
        with Client.connect(socket=sock, namespace="gpu") as c:
            for n in (1 << 20, 64 << 20, 1 << 30):
                g = torch.randn(n // 4, device="cuda")
                hs: list = []

                def put_one() -> float:
                    while hs:  # the previous run's object goes first (untimed): 4 GiB holds one 1 GiB run
                        c.free(hs.pop())
                    return _sync_timed(lambda: hs.append(c.put(g)))
                put = repeat(put_one, 3)
                out = torch.empty_like(g)
                get = repeat(lambda: _sync_timed(lambda: c.get(hs[-1], out=out)), 3)
                pinned = torch.empty(n // 4, pin_memory=True)
                pageable = torch.empty(n // 4)
                d2h_p = repeat(lambda: _sync_timed(lambda: pinned.copy_(g, non_blocking=True)), 3)
                h2d_p = repeat(lambda: _sync_timed(lambda: out.copy_(pinned, non_blocking=True)), 3)
                d2h_q = repeat(lambda: _sync_timed(lambda: pageable.copy_(g)), 3)
                r = {"size": n, "arena_d2h": gbps(n, put["median_s"]), "arena_h2d": gbps(n, get["median_s"]),
                     "pinned_d2h": gbps(n, d2h_p["median_s"]), "pinned_h2d": gbps(n, h2d_p["median_s"]),
                     "pageable_d2h": gbps(n, d2h_q["median_s"]), "arena_pinned": c.pinned}
                r["arena_vs_pinned_d2h"] = r["arena_d2h"] / r["pinned_d2h"]
                r["arena_vs_pinned_h2d"] = r["arena_h2d"] / r["pinned_h2d"]
                res.append(r)
                partial({"bench": "gpu_transfer", **r})
                rows.append([size_label(n), *(f"{r[k]:.2f}" for k in ("arena_d2h", "arena_h2d", "pinned_d2h",
                                                                        "pinned_h2d", "pageable_d2h"))])
                for h in hs:
                    c.free(h)
            print(f"# GPU transfers via the arena (pinned: {c.pinned}, {c.pinned_reason}); {machine()}")
    finally:
        d.terminate()
        d.wait()
        ns.close()
        shutil.rmtree(base, ignore_errors=True)
    print_table(["size", "arena put D2H", "arena get H2D", "torch pinned D2H", "torch pinned H2D", "pageable D2H"],
                rows)
    out = {"bench": "gpu_transfer", "machine": machine(), "results": res}
    emit_json(out)
    return out


if __name__ == "__main__":
    main()
