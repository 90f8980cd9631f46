"""Small-operation latency and large-object bandwidth through a real daemon.

In one run:
  floor     a raw round trip of the same msgpack message over a Unix SOCK_SEQPACKET
            socket between two processes (decode + encode on the far side)
  small ops lookup, stat, put and get of a 4 KiB object: p50 / p99 latency, ops/s
  bandwidth put / get through the daemon for 1 MiB .. 1 GiB beside a NumPy memcpy
  checkout  check-out + check-in time against object size (zero copy: flat)
  ray       Ray's object store put/get, when `ray` is importable

Usage: python bench/latency.py [--ops N] [--sizes 1MiB,...] [--quick]
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import msgpack
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (emit_json, gbps, pyplot, machine, print_table, random_bytes, repeat, size_label,  # noqa: E402
                    start_daemon, timed)

from tierstore.client import Client  # noqa: E402
from tierstore.units import parse_size  # noqa: E402

ECHO = r"""
import socket, sys, msgpack
s = socket.socket(fileno=int(sys.argv[1]))
buf = bytearray(1 << 20)  # one buffer, read into (a recv(n) would allocate n bytes each time)
while True:
    n = s.recv_into(buf)
    if not n:
        break
    m = msgpack.unpackb(memoryview(buf)[:n], raw=False)
    s.send(msgpack.packb({"id": m["id"], "ok": None}))
"""


def percentiles(xs: list[float]) -> dict:
    a = np.sort(np.asarray(xs))
    return {"p50_us": float(np.percentile(a, 50) * 1e6), "p99_us": float(np.percentile(a, 99) * 1e6),
            "mean_us": float(a.mean() * 1e6), "n": len(xs)}


def raw_floor(n: int) -> dict:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    p = subprocess.Popen([sys.executable, "-c", ECHO, str(b.fileno())], pass_fds=[b.fileno()])
    b.close()
    xs = []
    buf = bytearray(1 << 20)
    for i in range(n + 100):
        t0 = time.perf_counter()
        a.send(msgpack.packb({"id": i, "op": "lookup", "key": "opt/exp_avg/17"}))
        msgpack.unpackb(memoryview(buf)[:a.recv_into(buf)], raw=False)
        if i >= 100:
            xs.append(time.perf_counter() - t0)
    a.close()
    p.wait()
    return percentiles(xs)


def timed_ops(fn, n: int) -> list[float]:
    xs = []
    for _ in range(min(100, n)):
        fn()
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        xs.append(time.perf_counter() - t0)
    return xs


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ops", type=int, default=20000)
    p.add_argument("--sizes", default="1MiB,8MiB,64MiB,256MiB,1GiB")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--png", default=None, help="write a plot here (needs matplotlib)")
    args = p.parse_args(argv)
    if args.quick:
        args.ops, args.sizes, args.runs = 300, "1MiB,4MiB", 2
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    base = tempfile.mkdtemp(prefix="tierstore-latency-")
    host_bytes = max(3 * max(sizes) + (64 << 20), 256 << 20)
    daemon, sock_path, notify = start_daemon(base, "--host-bytes", str(host_bytes), "--nvme-bytes", "4GiB",
                                              timeout_s=120)
    out: dict = {"bench": "latency", "machine": machine()}
    try:
        floor = raw_floor(args.ops)
        out["floor"] = floor
        with Client.connect(socket=sock_path, namespace="bench") as c:
            small = random_bytes(4096)
            h = c.put(small, key="small")
            dst = np.empty_like(small)
            ops = {
                "lookup": lambda: c.lookup("small"),
                "stat": c.stat,
                "get_4KiB": lambda: c.get(h, out=dst),
                "put_4KiB": lambda: c.put(small),  # a new object each time
                "put_4KiB_replace": lambda: c.put(small, key="p", replace=True),  # overwrite a key
            }
            out["ops"] = {}
            for name, fn in ops.items():
                xs = timed_ops(fn, args.ops if name != "stat" else max(args.ops // 10, 100))
                r = percentiles(xs)
                r["ops_per_s"] = len(xs) / sum(xs)
                r["p50_vs_floor"] = r["p50_us"] / floor["p50_us"]
                r["p99_vs_floor"] = r["p99_us"] / floor["p99_us"]
                out["ops"][name] = r
            assert np.array_equal(dst, small)
            # pipelined: 64 requests in flight from one client (what a training loop's hooks do)
            n_pipe = max(args.ops // 64, 10) * 64
            conn = c._conn

            def burst() -> None:
                futs = [conn.submit("lookup", key="small") for _ in range(64)]
                for f in futs:
                    conn.wait(f)
            t0 = time.perf_counter()
            for _ in range(n_pipe // 64):
                burst()
            out["lookup_pipelined_ops_per_s"] = n_pipe / (time.perf_counter() - t0)
            out["bandwidth"] = []
            out["checkout"] = []
            for n in sizes:
                data = random_bytes(n, seed=n)
                buf = np.empty_like(data)
                buf.fill(0)
                hs: list = []

                def put() -> float:
                    if hs:
                        c.free(hs.pop())
                    return timed(lambda: hs.append(c.put(data, tier="host")))
                pw = repeat(put, args.runs)
                gr = repeat(lambda: timed(lambda: c.get(hs[-1], out=buf)), args.runs)
                if not np.array_equal(buf, data):
                    raise SystemExit("daemon get returned wrong bytes")
                mc = repeat(lambda: timed(lambda: np.copyto(buf, data)), args.runs)

                def co() -> float:
                    t0 = time.perf_counter()
                    with c.checkout(hs[-1], "r") as v:
                        v[0]
                    return time.perf_counter() - t0
                ck = repeat(co, args.runs)
                c.free(hs.pop())
                out["bandwidth"].append({"size": n, "put_gbps": gbps(n, pw["median_s"]),
                                         "get_gbps": gbps(n, gr["median_s"]), "memcpy_gbps": gbps(n, mc["median_s"])})
                out["checkout"].append({"size": n, "checkout_us": ck["median_s"] * 1e6})
            for n in (4096, 1 << 16):  # small sizes for the checkout curve too
                hh = c.put(random_bytes(n), tier="host")
                ck = repeat(lambda: timed(lambda: c.checkout(hh, "r").release()), args.runs * 20)
                out["checkout"].insert(0 if n == 4096 else 1, {"size": n, "checkout_us": ck["median_s"] * 1e6})
                c.free(hh)
        out["ray"] = ray_bench(sizes[:2], args.runs)
    finally:
        daemon.terminate()
        daemon.wait()
        notify.close()
        shutil.rmtree(base, ignore_errors=True)

    print(f"# latency through the daemon on {machine()}; raw SEQPACKET msgpack round trip (floor): "
          f"p50 {floor['p50_us']:.1f} us, p99 {floor['p99_us']:.1f} us")
    print_table(["op", "p50 us", "p99 us", "ops/s", "p50/floor", "p99/floor"],
                [[k, f"{v['p50_us']:.1f}", f"{v['p99_us']:.1f}", f"{v['ops_per_s']:.0f}", f"{v['p50_vs_floor']:.2f}",
                  f"{v['p99_vs_floor']:.2f}"] for k, v in out["ops"].items()])
    print(f"# lookup with 64 in flight from one client: {out['lookup_pipelined_ops_per_s']:.0f} ops/s")
    print()
    print_table(["size", "put GB/s", "get GB/s", "memcpy GB/s", "put/mc", "get/mc"],
                [[size_label(b["size"]), f"{b['put_gbps']:.2f}", f"{b['get_gbps']:.2f}", f"{b['memcpy_gbps']:.2f}",
                  f"{b['put_gbps'] / b['memcpy_gbps']:.2f}", f"{b['get_gbps'] / b['memcpy_gbps']:.2f}"]
                 for b in out["bandwidth"]])
    print()
    print_table(["size", "checkout+checkin us"], [[size_label(r["size"]), f"{r['checkout_us']:.1f}"]
                                                   for r in out["checkout"]])
    print(f"# ray: {out['ray'] if isinstance(out['ray'], str) else 'measured, see JSON'}")
    if args.png:
        plot(out, args.png)
        print(f"# plot: {args.png}")
    emit_json(out)
    return out


def plot(out: dict, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    names = ["floor"] + list(out["ops"])
    p50 = [out["floor"]["p50_us"]] + [v["p50_us"] for v in out["ops"].values()]
    p99 = [out["floor"]["p99_us"]] + [v["p99_us"] for v in out["ops"].values()]
    xs = range(len(names))
    a1.bar([x - 0.2 for x in xs], p50, width=0.4, label="p50")
    a1.bar([x + 0.2 for x in xs], p99, width=0.4, label="p99")
    a1.set_xticks(list(xs), names)
    a1.set_ylabel("latency, us")
    a1.set_title("small operations through the daemon vs raw round trip")
    a1.legend()
    sizes = [b["size"] / 2**20 for b in out["bandwidth"]]
    a2.plot(sizes, [b["put_gbps"] for b in out["bandwidth"]], marker="o", label="put")
    a2.plot(sizes, [b["get_gbps"] for b in out["bandwidth"]], marker="o", label="get")
    a2.plot(sizes, [b["memcpy_gbps"] for b in out["bandwidth"]], "k--", label="memcpy")
    a2.set_xscale("log", base=2)
    a2.set_xlabel("object size, MiB")
    a2.set_ylabel("GB/s")
    a2.legend()
    for a in (a1, a2):
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def ray_bench(sizes: list[int], runs: int) -> dict | str:
    try:
        import ray
    except ImportError:
        return "skipped: ray is not installed"
    ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR")
    try:
        res = []
        for n in sizes:
            data = random_bytes(n)
            refs: list = []
            pw = repeat(lambda: timed(lambda: refs.append(ray.put(data))), runs)
            gr = repeat(lambda: timed(lambda: ray.get(refs[-1])), runs)
            res.append({"size": n, "put_gbps": gbps(n, pw["median_s"]), "get_gbps": gbps(n, gr["median_s"])})
        return {"results": res}
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
