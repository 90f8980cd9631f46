"""Load: many client processes doing mixed operations against one daemon for a bounded time.

Every get and check-out is verified byte for byte. Reported: operations and errors by
kind (only CapacityExceeded is expected), p50/p99 latency per op, aggregate ops/s and
GB/s, and the daemon's resident memory sampled during the run (it must stay flat).

Usage: python bench/load.py [--clients 64] [--seconds 60] [--quick]
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
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit_json, machine, print_table, proc_status_bytes, pyplot, start_daemon  # noqa: E402

WORKER = r"""
import json, sys, time, zlib
import numpy as np
from tierstore.client import Client
from tierstore import TierstoreError
sock, idx, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
rng = np.random.default_rng(idx)
lat = {k: [] for k in ("put", "get", "checkout", "free", "lookup")}
errors, nbytes, wrong = {}, 0, 0
def data(key, n):
    return np.random.default_rng(zlib.crc32(key.encode())).integers(0, 256, n, dtype=np.uint8)
c = Client.connect(socket=sock, namespace=f"load/rank{idx}")
live = {}
deadline = time.monotonic() + seconds
i = 0
while time.monotonic() < deadline:
    i += 1
    r = rng.random()
    t0 = time.perf_counter()
    try:
        if len(live) >= 40:  # a steady live set, so the daemon's memory must stay flat
            r = 0.95
        if r < 0.3 or not live:
            key, n = f"k{i}", int(rng.choice([4096, 65536, 1 << 20]))
            live[key] = (c.put(data(key, n), key=key), n)
            op, nbytes = "put", nbytes + n
        elif r < 0.6:
            key = list(live)[int(rng.integers(len(live)))]
            h, n = live[key]
            got = c.get(h)
            wrong += not np.array_equal(got, data(key, n))
            op, nbytes = "get", nbytes + n
        elif r < 0.75:
            key = list(live)[int(rng.integers(len(live)))]
            h, n = live[key]
            with c.checkout(h, "r") as v:
                wrong += not np.array_equal(v, data(key, n))
            op = "checkout"
        elif r < 0.9:
            key = list(live)[int(rng.integers(len(live)))]
            c.lookup(key)
            op = "lookup"
        else:
            key = list(live)[int(rng.integers(len(live)))]
            c.free(live.pop(key)[0])
            op = "free"
        lat[op].append(time.perf_counter() - t0)
    except TierstoreError as e:
        errors[e.code] = errors.get(e.code, 0) + 1
print(json.dumps({"lat": {k: v for k, v in lat.items()}, "errors": errors, "bytes": nbytes, "wrong": wrong}))
"""


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--host-bytes", default="1GiB")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--png", default=None, help="write a plot here (needs matplotlib)")
    args = p.parse_args(argv)
    if args.quick:
        args.clients, args.seconds, args.host_bytes = 4, 3.0, "128MiB"
    base = tempfile.mkdtemp(prefix="tierstore-load-")
    daemon, sock, ns = start_daemon(base, "--host-bytes", args.host_bytes, "--nvme-bytes", "8GiB", timeout_s=120)
    try:
        mem = [(0.0, proc_status_bytes(daemon.pid, "RssAnon"))]
        t0 = time.monotonic()
        # each client's output goes to a file: its JSON (every latency) outgrows a pipe's
        # buffer, and a client blocked writing to a pipe nobody reads never exits
        files = [(open(os.path.join(base, f"client{i}.out"), "w+"), open(os.path.join(base, f"client{i}.err"), "w+"))
                 for i in range(args.clients)]
        procs = [subprocess.Popen([sys.executable, "-c", WORKER, sock, str(i), str(args.seconds)],
                                  stdout=fo, stderr=fe, text=True) for i, (fo, fe) in enumerate(files)]
        while any(pr.poll() is None for pr in procs):
            time.sleep(min(1.0, args.seconds / 10))
            mem.append((time.monotonic() - t0, proc_status_bytes(daemon.pid, "RssAnon")))
        outs = []
        for pr, (fo, fe) in zip(procs, files):
            fo.seek(0)
            fe.seek(0)
            out, err = fo.read(), fe.read()
            fo.close()
            fe.close()
            if pr.returncode != 0:
                raise SystemExit(f"a load client failed:\n{err[-2000:]}")
            outs.append(json.loads(out.strip().splitlines()[-1]))
        wall = time.monotonic() - t0
    finally:
        daemon.terminate()
        daemon.wait()
        ns.close()
        shutil.rmtree(base, ignore_errors=True)
    lat: dict[str, list[float]] = {}
    errors: dict[str, int] = {}
    for o in outs:
        for k, v in o["lat"].items():
            lat.setdefault(k, []).extend(v)
        for k, v in o["errors"].items():
            errors[k] = errors.get(k, 0) + v
    wrong = sum(o["wrong"] for o in outs)
    total_ops = sum(len(v) for v in lat.values())
    rows, res = [], {}
    for k, v in lat.items():
        a = np.asarray(v) * 1e6 if v else np.zeros(1)
        res[k] = {"count": len(v), "p50_us": float(np.percentile(a, 50)), "p99_us": float(np.percentile(a, 99))}
        rows.append([k, len(v), f"{res[k]['p50_us']:.0f}", f"{res[k]['p99_us']:.0f}"])
    mem_mb = [m / 2**20 for _, m in mem]
    third = max(1, len(mem_mb) // 3)
    print(f"# load: {args.clients} client processes x {args.seconds:.0f} s against one daemon; {machine()}")
    print_table(["op", "count", "p50 us", "p99 us"], rows)
    print(f"# {total_ops / wall:.0f} ops/s, {sum(o['bytes'] for o in outs) / wall / 1e9:.2f} GB/s put+get, "
          f"wrong bytes: {wrong}, errors: {errors or 'none'}")
    print(f"# daemon heap (RssAnon) MiB: start {mem_mb[0]:.0f}, first third max {max(mem_mb[:third]):.0f}, "
          f"last third max {max(mem_mb[-third:]):.0f}")
    if args.png:
        plt = pyplot()
        if plt is not None:
            fig, ax = plt.subplots(figsize=(6, 4))
            ax.plot([t for t, _ in mem], mem_mb, marker=".")
            ax.set_xlabel("seconds")
            ax.set_ylabel("daemon heap (RssAnon), MiB")
            ax.set_title(f"{args.clients} clients, {total_ops / wall:.0f} ops/s")
            ax.set_ylim(bottom=0)
            fig.tight_layout()
            fig.savefig(args.png, dpi=100)
    out = {"bench": "load", "clients": args.clients, "seconds": args.seconds, "ops": res,
           "ops_per_s": total_ops / wall, "errors": errors, "wrong": wrong, "daemon_heap_mib": mem_mb,
           "machine": machine()}
    emit_json(out)
    return out


if __name__ == "__main__":
    main()
