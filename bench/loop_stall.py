"""Does one heavy client hold the others up? Another namespace's ping, through a real daemon.

In one run, a second process pings the daemon in a loop (another namespace) while one
client, in turn:
  idle      does nothing (the ceiling: the ping alone)
  steps     checks out N objects per batch of 4 096, PASSES times per step, in an order
            that alternates between steps (each step relearns a two-step cycle of
            2 x N x PASSES accesses), and steps
  hints     sends prefetch hints of 65 536 handles
  batches   pipelines 32 check-outs of 4 096 handles each
For each phase: the pinger's p50 / p99 / max round trip (ms), and the daemon's RSS.

Usage: python bench/loop_stall.py [--objects 32768] [--passes 4] [--steps 4] [--quick]
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit_json, machine, print_table, proc_status_bytes, start_daemon  # noqa: E402

_PINGER = r"""
import sys, time
from tierstore.client import Client
c = Client.connect(socket=sys.argv[1], namespace="pinger")
out = open(sys.argv[2], "w")
while True:
    t0 = time.perf_counter()
    c.ping()
    out.write(f"{time.monotonic():.6f} {time.perf_counter() - t0:.6f}\n")
    out.flush()
    time.sleep(0.002)
"""


def _phase(log: str, t0: float, t1: float) -> dict:
    rts = []
    with open(log) as f:
        for line in f:
            at, rt = line.split()
            if t0 <= float(at) <= t1:
                rts.append(float(rt) * 1000)
    a = np.array(rts or [0.0])
    return {"pings": len(rts), "p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99)),
            "max_ms": float(a.max())}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--objects", type=int, default=32768)
    p.add_argument("--passes", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--quick", action="store_true", help="4 096 objects, 2 passes, 3 steps")
    args = p.parse_args(argv)
    if args.quick:
        args.objects, args.passes, args.steps = 4096, 2, 3
    from tierstore.client import Client

    base = tempfile.mkdtemp(prefix="tierstore-stall-")
    daemon, sock, notify = start_daemon(base, "--host-bytes", "256MiB")
    log = os.path.join(base, "pings")
    pinger = None
    res: dict = {"bench": "loop_stall", "objects": args.objects, "passes": args.passes, "steps": args.steps,
                 "phases": {}}
    try:
        c = Client.connect(socket=sock, namespace="heavy")
        x = np.zeros(4, np.float32)
        hs = [int(f.result()) for f in [c.put_async(x) for _ in range(args.objects)]]
        pinger = subprocess.Popen([sys.executable, "-c", _PINGER, sock, log])
        while not os.path.exists(log) or os.path.getsize(log) < 100:
            time.sleep(0.05)

        def phase(name, fn):
            t0 = time.monotonic()
            fn()
            t1 = time.monotonic()
            res["phases"][name] = {**_phase(log, t0, t1), "seconds": t1 - t0,
                                   "daemon_rss_mib": proc_status_bytes(daemon.pid, "VmRSS") / (1 << 20)}
            print(f"{name}: {res['phases'][name]}", file=sys.stderr, flush=True)

        phase("idle", lambda: time.sleep(2))

        def steps():
            for step in range(args.steps):
                order = hs if step % 2 == 0 else hs[::-1]
                for _ in range(args.passes):
                    for i in range(0, len(order), 4096):
                        c.checkout_many(order[i:i + 4096], "r").release()
                c.step()
        phase("steps", steps)

        def hints():
            wide = (hs * (65536 // len(hs) + 1))[:65536]
            for _ in range(8):
                c.prefetch(wide)
                c.ping()
        phase("hints", hints)

        def batches():
            futs = [c._conn.submit("checkout_many", handles=hs[:4096], modes="r") for _ in range(32)]
            lids = []
            for f in futs:
                lids += [one["lid"] for one in c._conn.wait(f)["leases"]]
            for i in range(0, len(lids), 4096):
                c._conn.request("release_many", lids=lids[i:i + 4096])
        phase("batches", batches)
        c.close()
    finally:
        if pinger is not None:
            pinger.kill()
            pinger.wait()
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=120)
        notify.close()
        shutil.rmtree(base, ignore_errors=True)
    res["machine"] = machine()
    print_table(["phase", "seconds", "pings", "ping p50 ms", "ping p99 ms", "ping max ms", "daemon RSS MiB"],
                [[k, f"{v['seconds']:.1f}", v["pings"], f"{v['p50_ms']:.2f}", f"{v['p99_ms']:.2f}",
                  f"{v['max_ms']:.1f}", f"{v['daemon_rss_mib']:.0f}"] for k, v in res["phases"].items()])
    emit_json(res)
    return res


if __name__ == "__main__":
    main()
