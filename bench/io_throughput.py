"""NVMe-tier and host-tier throughput beside the ceilings and the usual alternatives.

Compared in one run, on the same directory and bytes, with the page cache out of
the way (O_DIRECT, or fsync + POSIX_FADV_DONTNEED before each read):

  ceiling   the best non-tierstore variant of the run: raw O_DIRECT sequential
            write/read (one stream, several streams), `dd oflag/iflag=direct`, and the
            alternatives below
  tierstore put(tier="nvme") / get() through the posix (or kvikio) engine, checksums on
  torch     torch.save (+fsync) / torch.load
  numpy     ndarray.tofile (+fsync) / numpy.fromfile
  deepspeed AsyncIOBuilder aio handle with page-locked buffers, when it imports under
            --deepspeed-python (bench/aio_peer.py runs it in a process of its own)
  host      tierstore host tier put/get vs a NumPy memcpy of the same size

Then (``--path-sizes``, 64 MiB - 1 GiB by default) every NVMe path a user takes -
volatile and durable puts, get(out=) and check-outs, in-process and through a daemon -
beside DeepSpeed's aio, interleaved (bench/nvme_paths.py).

Usage: python bench/io_throughput.py [--dir DIR] [--sizes 1MiB,8MiB,...] [--runs N] [--quick]
       [--path-sizes 64MiB,256MiB,1GiB] [--path-rounds N] [--small-pages] [--deepspeed-python PY]
       [--ds-aio B:QD:T,...]
Prints tables, then one JSON line.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from aio_peer import AioPeer  # noqa: E402
from common import (drop_cache, emit_json, gbps, machine, print_table, random_bytes, repeat,  # noqa: E402
                    pyplot, size_label, time_torch_save_load, timed)

from nvme_paths import print_paths, run_paths  # noqa: E402

from tierstore import Config, Store  # noqa: E402
from tierstore.units import parse_size  # noqa: E402


def _aligned(n: int) -> tuple[mmap.mmap, np.ndarray]:
    m = mmap.mmap(-1, max(n, 4096))
    return m, np.frombuffer(m, np.uint8)[:n]


# ----------------------------------------------------------------------------- variants
def raw_direct(path: str, data: np.ndarray, runs: int, streams: int, chunk: int) -> tuple[dict, dict]:
    """O_DIRECT sequential write then read of ``data`` with ``streams`` requests in flight."""
    n = data.nbytes
    m, buf = _aligned(n)
    buf[:] = data
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    pool = ThreadPoolExecutor(streams)
    chunk = min(chunk, n)
    offs = list(range(0, n, chunk))

    def io(write: bool) -> float:
        def one(o: int) -> None:
            mv = memoryview(buf[o:o + chunk])
            (os.pwritev if write else os.preadv)(fd, [mv], o)

        def run() -> None:
            list(pool.map(one, offs))
            if write:
                os.fdatasync(fd)
        return timed(run)

    try:
        w = repeat(lambda: io(True), runs)
        r = repeat(lambda: io(False), runs)
    finally:
        pool.shutdown()
        os.close(fd)
        os.unlink(path)
        buf = None  # drop the buffer export before closing the map
        m.close()
    return w, r


def dd_direct(path: str, data: np.ndarray, runs: int) -> tuple[dict, dict] | None:
    if shutil.which("dd") is None:
        return None
    src = path + ".src"
    data.tofile(src)
    bs = str(min(data.nbytes, 64 << 20))
    count = str(-(-data.nbytes // int(bs)))

    def w() -> float:
        return timed(lambda: subprocess.run(["dd", f"if={src}", f"of={path}", f"bs={bs}", f"count={count}",
                                             "oflag=direct", "conv=fdatasync", "status=none"], check=True))

    def r() -> float:
        return timed(lambda: subprocess.run(["dd", f"if={path}", "of=/dev/null", f"bs={bs}", "iflag=direct",
                                             "status=none"], check=True))
    try:
        return repeat(w, runs), repeat(r, runs)
    finally:
        for p in (src, path):
            if os.path.exists(p):
                os.unlink(p)


def tierstore_nvme(directory: str, data: np.ndarray, runs: int, chunk: int, threads: int) -> tuple[dict, dict, str]:
    import torch

    cfg = Config(host_bytes="64MiB", nvme_dirs=[directory], nvme_bytes=max(4 * data.nbytes, 1 << 30),
                 io_chunk_bytes=chunk, io_threads=threads, promote_on_get=False)
    with Store(cfg) as s:
        t = torch.from_numpy(data)
        out = torch.from_numpy(_aligned(data.nbytes)[1])
        handles: list = []

        def w() -> float:
            # steady state of a training loop: the previous version's space is reused
            if handles:
                s.free(handles.pop())
            return timed(lambda: handles.append(s.put(t, tier="nvme", durable=True)))

        def r() -> float:
            return timed(lambda: s.get(handles[-1], out=out))
        wr = repeat(w, runs)
        rd = repeat(r, runs)
        if not np.array_equal(out.numpy(), data):
            raise SystemExit("tierstore read back wrong bytes")
        engine = f"{s.engine.name}, {'O_DIRECT' if s.nvme.direct else 'buffered: ' + s.nvme.direct_reason}"
    return wr, rd, engine


def torch_save_load(path: str, data: np.ndarray, runs: int) -> tuple[dict, dict]:
    import torch

    try:
        return time_torch_save_load(torch.from_numpy(data), path, runs)
    finally:
        os.unlink(path)


def numpy_file(path: str, data: np.ndarray, runs: int) -> tuple[dict, dict]:
    def w() -> float:
        def run() -> None:
            with open(path, "wb") as f:
                data.tofile(f)
                f.flush()
                os.fsync(f.fileno())
        return timed(run)

    def r() -> float:
        drop_cache(path)
        return timed(lambda: np.fromfile(path, dtype=np.uint8))
    try:
        return repeat(w, runs), repeat(r, runs)
    finally:
        os.unlink(path)


def deepspeed_aio(peer, path: str, data: np.ndarray, runs: int) -> tuple[dict, dict]:
    """The DeepSpeed aio peer (``aio_peer.py``, its own page-locked buffer) on the same size."""
    n = data.nbytes
    try:
        return repeat(lambda: peer.write(n, path), runs), repeat(lambda: peer.read(n, path), runs)
    finally:
        os.unlink(path)


def host_tier(data: np.ndarray, runs: int) -> tuple[dict, dict, dict]:
    import torch

    with tempfile.TemporaryDirectory(dir=".") as d:
        cfg = Config(host_bytes=3 * data.nbytes + (16 << 20), nvme_dirs=[d], nvme_bytes="64MiB")
        with Store(cfg) as s:
            t = torch.from_numpy(data)
            out = torch.empty_like(t)
            out.fill_(0)  # pre-fault
            hs: list = []

            def put() -> float:
                if hs:
                    s.free(hs.pop())
                return timed(lambda: hs.append(s.put(t, tier="host")))
            pw = repeat(put, runs)
            pr = repeat(lambda: timed(lambda: s.get(hs[-1], out=out)), runs)
            assert torch.equal(out, t)
    dst = np.empty_like(data)
    dst.fill(0)
    mc = repeat(lambda: timed(lambda: np.copyto(dst, data)), runs)
    return pw, pr, mc


def snapshot_vs_torch(directory: str, total: int, count: int, runs: int) -> dict:
    """Snapshot/restore of a namespace of ``count`` tensors (``total`` bytes) vs torch.save/load of them."""
    import torch

    per = total // count // 4
    tensors = {f"layer{i}/w": torch.randn(per, generator=torch.Generator().manual_seed(i)) for i in range(count)}
    d = tempfile.mkdtemp(dir=directory)
    cfg = Config(host_bytes=3 * total + (64 << 20), nvme_dirs=[os.path.join(d, "nvme")], nvme_bytes=4 * total)
    snaps: list = []
    try:
        with Store(cfg, namespace="src") as s:
            for k, t in tensors.items():
                s.put(t, key=k)

            def snap() -> float:
                dest = os.path.join(d, f"snap{len(snaps)}.zarr")
                snaps.append(dest)
                dt = timed(lambda: s.snapshot(dest, progress=False))
                return dt

            sw = repeat(snap, runs, warmup=0)

            def rest() -> float:
                for root, _, files in os.walk(snaps[-1]):
                    for f in files:
                        drop_cache(os.path.join(root, f))
                ns = f"dst{len(snaps)}-{os.urandom(4).hex()}"
                return timed(lambda: s.restore(snaps[-1], namespace=ns, progress=False))

            sr = repeat(rest, runs, warmup=0)
        tw, tr = time_torch_save_load(tensors, os.path.join(d, "t.pt"), runs, warmup=0)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    n = per * 4 * count
    return {"bytes": n, "objects": count, "snapshot_gbps": gbps(n, sw["median_s"]),
            "restore_gbps": gbps(n, sr["median_s"]), "torch_save_gbps": gbps(n, tw["median_s"]),
            "torch_load_gbps": gbps(n, tr["median_s"])}


def plot(results: list[dict], path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    xs = [r["size"] / 2**20 for r in results]
    for ax, key, title in ((axes[0], "write_gbps", "write"), (axes[1], "read_gbps", "read")):
        ax.plot(xs, [r["ceiling_" + key] for r in results], "k--", label="ceiling (best non-tierstore)")
        for name in ("tierstore", "torch", "numpy"):
            ax.plot(xs, [r[key][name] for r in results], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("object size, MiB")
        ax.set_ylabel("GB/s")
        ax.set_title(f"NVMe tier {title}")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


# ----------------------------------------------------------------------------- driver
def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", default=None, help="directory on the drive to test (default: ./bench-io-tmp)")
    p.add_argument("--sizes", default="1MiB,8MiB,64MiB,256MiB,1GiB")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--chunk", default="16MiB", help="tierstore io_chunk_bytes")
    p.add_argument("--threads", type=int, default=16, help="tierstore io_threads")
    p.add_argument("--quick", action="store_true", help="tiny sizes, 2 runs (smoke test)")
    p.add_argument("--snapshot-bytes", default="1GiB", help="namespace size for snapshot/restore (0: skip)")
    p.add_argument("--snapshot-objects", type=int, default=500)
    p.add_argument("--png", default=None, help="write a plot here (needs matplotlib)")
    p.add_argument("--path-sizes", default="64MiB,256MiB,1GiB",
                   help="sizes of the per-path comparison with DeepSpeed's aio ('': skip it)")
    p.add_argument("--path-rounds", type=int, default=5, help="interleaved rounds of the per-path comparison")
    p.add_argument("--small-pages", action="store_true",
                   help="the per-path comparison also through a daemon whose arena is in 4 KiB pages "
                        "(--host-huge-pages off), in the same rounds")
    p.add_argument("--deepspeed-python", default=sys.executable,
                   help="an interpreter where deepspeed imports (default: this one; docs/benchmarks.md#deepspeed)")
    p.add_argument("--ds-aio", default="8MiB:32:8,1MiB:8:1",
                   help="DeepSpeed aio configurations, BLOCK:QUEUE_DEPTH:THREADS each, all in the per-path comparison; "
                        "the first also in the size table (default: a deep queue, then ZeRO-Infinity's default aio "
                        "block and depth, as bench/train_offload.py runs it)")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.runs, args.snapshot_bytes, args.snapshot_objects = "1MiB,3MiB", 2, "8MiB", 20
        args.path_sizes, args.path_rounds = "4MiB", 1
    sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    path_sizes = [parse_size(s) for s in args.path_sizes.split(",") if s]
    ds_cfg = [tuple(parse_size(x) if i == 0 else int(x) for i, x in enumerate(c.split(":")))
              for c in args.ds_aio.split(",") if c]
    load = [os.getloadavg()]
    chunk = parse_size(args.chunk)
    base = args.dir or os.path.abspath("bench-io-tmp")
    os.makedirs(base, exist_ok=True)
    work = tempfile.mkdtemp(dir=base)
    results = []
    rows = []
    notes: list[str] = []
    peer = AioPeer.start(args.deepspeed_python, *ds_cfg[0], max(sizes)) if sizes and ds_cfg else ""
    if peer and isinstance(peer, str):
        notes.append(f"deepspeed aio skipped: {peer}")
    paths = None
    try:
        for n in sizes:
            data = random_bytes(n, seed=n)
            r: dict = {"size": n}
            r["raw_1"] = raw_direct(os.path.join(work, "raw1"), data, args.runs, 1, 64 << 20)
            r["raw_qd4"] = raw_direct(os.path.join(work, "rawq4"), data, args.runs, 4, 1 << 20)
            r["raw_qd"] = raw_direct(os.path.join(work, "rawq"), data, args.runs, args.threads, chunk)
            dd = dd_direct(os.path.join(work, "dd"), data, args.runs)
            if dd:
                r["dd"] = dd
            ts_dir = os.path.join(work, f"ts-{n}")
            w, rd, engine = tierstore_nvme(ts_dir, data, args.runs, chunk, args.threads)
            shutil.rmtree(ts_dir, ignore_errors=True)
            r["tierstore"] = (w, rd)
            r["torch"] = torch_save_load(os.path.join(work, "t.pt"), data, args.runs)
            r["numpy"] = numpy_file(os.path.join(work, "n.bin"), data, args.runs)
            if not isinstance(peer, str):
                r["deepspeed_aio"] = deepspeed_aio(peer, os.path.join(work, "ds.bin"), data, args.runs)
            hw, hr, mc = host_tier(data, args.runs)
            res = {"size": n, "engine": engine, "write_gbps": {}, "read_gbps": {}}
            for name in ("raw_1", "raw_qd4", "raw_qd", "dd", "tierstore", "torch", "numpy", "deepspeed_aio"):
                if name in r:
                    res["write_gbps"][name] = gbps(n, r[name][0]["median_s"])
                    res["read_gbps"][name] = gbps(n, r[name][1]["median_s"])
                    res.setdefault("spread", {})[name] = [
                        [gbps(n, r[name][i]["max_s"]), gbps(n, r[name][i]["min_s"])] for i in (0, 1)]
            # the ceiling is the best way of moving these bytes measured in this run, tierstore excluded
            ceil_names = ("raw_1", "raw_qd4", "raw_qd", "dd", "torch", "numpy", "deepspeed_aio")
            res["ceiling_write_gbps"] = max(v for k, v in res["write_gbps"].items() if k in ceil_names)
            res["ceiling_read_gbps"] = max(v for k, v in res["read_gbps"].items() if k in ceil_names)
            res["host_put_gbps"] = gbps(n, hw["median_s"])
            res["host_get_gbps"] = gbps(n, hr["median_s"])
            res["memcpy_gbps"] = gbps(n, mc["median_s"])
            results.append(res)
            tw, tr = res["write_gbps"]["tierstore"], res["read_gbps"]["tierstore"]
            rows.append([size_label(n), f"{res['ceiling_write_gbps']:.2f}", f"{tw:.2f}",
                         f"{tw / res['ceiling_write_gbps']:.2f}", f"{res['write_gbps']['torch']:.2f}",
                         f"{res['write_gbps']['numpy']:.2f}", f"{res['ceiling_read_gbps']:.2f}", f"{tr:.2f}",
                         f"{tr / res['ceiling_read_gbps']:.2f}", f"{res['read_gbps']['torch']:.2f}",
                         f"{res['read_gbps']['numpy']:.2f}", f"{res['memcpy_gbps']:.2f}",
                         f"{res['host_put_gbps'] / res['memcpy_gbps']:.2f}",
                         f"{res['host_get_gbps'] / res['memcpy_gbps']:.2f}"])
        snap = None
        if parse_size(args.snapshot_bytes):
            snap = snapshot_vs_torch(work, parse_size(args.snapshot_bytes), args.snapshot_objects,
                                     min(args.runs, 3))
        if path_sizes:
            load.append(os.getloadavg())
            paths = run_paths(work, path_sizes, args.path_rounds, ds_cfg, args.deepspeed_python,
                              chunk, args.threads, args.small_pages)
    finally:
        if not isinstance(peer, str):
            peer.close()
        shutil.rmtree(work, ignore_errors=True)
    load.append(os.getloadavg())
    print(f"# io_throughput on {machine()}, dir {base}, runs {args.runs} (median), chunk {size_label(chunk)}, "
          f"threads {args.threads}; engine: {results[0]['engine'] if results else '?'}; load average "
          + " / ".join(f"{x[0]:.2f}" for x in load))
    if rows:
        print_table(["size", "ceil W", "ts W", "W/ceil", "torch W", "np W", "ceil R", "ts R", "R/ceil", "torch R",
                     "np R", "memcpy", "host put/mc", "host get/mc"], rows)
    if snap:
        print(f"# snapshot of a namespace of {snap['objects']} tensors, {size_label(snap['bytes'])}: "
              f"snapshot {snap['snapshot_gbps']:.2f} GB/s vs torch.save {snap['torch_save_gbps']:.2f} GB/s "
              f"({snap['snapshot_gbps'] / snap['torch_save_gbps']:.2f}x); restore {snap['restore_gbps']:.2f} GB/s "
              f"vs torch.load {snap['torch_load_gbps']:.2f} GB/s ({snap['restore_gbps'] / snap['torch_load_gbps']:.2f}x)")
    if args.png:
        plot(results, args.png)
        print(f"# plot: {args.png}")
    if paths:
        print_paths(paths)
    for nt in notes:
        print(f"# {nt}")
    print("# GB/s = 1e9 B/s; ceiling = best non-tierstore variant of the run: raw O_DIRECT (1 stream x 64MiB,"
          " 4 x 1MiB, N x chunk), dd direct, torch, numpy, deepspeed aio; page cache dropped before reads")
    out = {"bench": "io_throughput", "machine": machine(), "runs": args.runs, "results": results, "notes": notes,
           "snapshot": snap, "paths": paths, "load_average": load}
    emit_json(out)
    return out


if __name__ == "__main__":
    main()
