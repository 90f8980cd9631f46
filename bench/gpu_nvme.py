"""NVMe -> GPU and GPU -> NVMe GB/s: KvikIO (``kvikio.CuFile`` into device memory, GPUDirect
Storage when active, its compat mode otherwise) against a host bounce (O_DIRECT
``preadv`` into pinned host memory, then a host-to-device copy), and the posix vs
kvikio engine for NVMe <-> host. Needs a CUDA device (bench/gpu_check.sh).

Usage: python bench/gpu_nvme.py [--dir D] [--size 1GiB] [--threads 1,4,8,16] [--task 1MiB,4MiB,16MiB]
Prints a table, then one JSON line (including the fastest kvikio thread count / task size).
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import drop_cache, emit_json, gbps, machine, print_table, skipped_without_cuda  # noqa: E402

from tierstore.units import parse_size  # noqa: E402


def _bounce_read(path: str, dev, host, chunk: int) -> float:
    """O_DIRECT into pinned host memory, then H2D, chunk by chunk (the copy of chunk i
    overlaps the read of chunk i+1 on the copy engine)."""
    import torch

    n = dev.numel()
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        t0 = time.perf_counter()
        hv = memoryview(host.numpy()).cast("B")
        for off in range(0, n, chunk):
            k = min(chunk, n - off)
            os.preadv(fd, [hv[off:off + k]], off)
            dev[off:off + k].copy_(host[off:off + k], non_blocking=True)
        torch.cuda.synchronize()
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", default=os.path.abspath("bench-io-tmp"))
    p.add_argument("--size", default="1GiB")
    p.add_argument("--threads", default="1,4,8,16")
    p.add_argument("--task", default="1MiB,4MiB,16MiB")
    args = p.parse_args(argv)
    import torch

    skipped = skipped_without_cuda("gpu_nvme")
    if skipped is not None:
        return skipped
    n = parse_size(args.size)
    os.makedirs(args.dir, exist_ok=True)
    path = os.path.join(args.dir, "gpu_nvme.bin")
    src = np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8)
    m = mmap.mmap(-1, n)
    np.frombuffer(m, np.uint8)[:] = src
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    os.pwritev(fd, [m], 0)
    os.fsync(fd)
    os.close(fd)
    del m
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    rows, results = [], {"size": n}
    drop_cache(path)
    t = _bounce_read(path, dev, host, 16 << 20)
    ok = torch.equal(dev[:4096].cpu(), torch.from_numpy(src[:4096]))
    results["bounce_read_gbps"] = gbps(n, t)
    rows.append(["O_DIRECT -> pinned -> H2D", "-", "-", f"{results['bounce_read_gbps']:.2f}", "-"])
    try:
        import cupy
        import kvikio
        import kvikio.defaults
    except Exception as e:
        results["kvikio"] = f"unavailable: {e}"
    else:
        from tierstore.engine.kvikio_engine import detect

        results["kvikio"] = detect()[1]
        buf = cupy.asarray(dev)  # the same device memory, through __cuda_array_interface__
        best = None
        for threads in [int(x) for x in args.threads.split(",")]:
            for task in [parse_size(x) for x in args.task.split(",")]:
                try:
                    kvikio.defaults.set({"num_threads": threads, "task_size": task})
                except Exception:
                    kvikio.defaults.num_threads_reset(threads)
                    kvikio.defaults.task_size_reset(task)
                dev.zero_()
                drop_cache(path)
                with kvikio.CuFile(path, "r") as f:
                    t0 = time.perf_counter()
                    f.read(buf)
                    torch.cuda.synchronize()
                    tr = time.perf_counter() - t0
                ok = ok and torch.equal(dev[-4096:].cpu(), torch.from_numpy(src[-4096:]))
                wpath = path + ".w"
                with kvikio.CuFile(wpath, "w") as f:
                    t0 = time.perf_counter()
                    f.write(buf)
                    os.fsync(f.fileno())
                    tw = time.perf_counter() - t0
                os.unlink(wpath)
                r = {"threads": threads, "task": task, "read_gbps": gbps(n, tr), "write_gbps": gbps(n, tw)}
                results.setdefault("kvikio_runs", []).append(r)
                rows.append(["kvikio CuFile (device buffer)", threads, f"{task >> 20} MiB", f"{r['read_gbps']:.2f}",
                             f"{r['write_gbps']:.2f}"])
                if best is None or r["read_gbps"] > best["read_gbps"]:
                    best = r
        results["kvikio_best"] = best
    results["bytes_ok"] = bool(ok)
    os.unlink(path)
    print(f"# NVMe <-> GPU, {n >> 20} MiB in {args.dir}; {results.get('kvikio')}; {machine()}")
    print_table(["path", "threads", "task", "read GB/s", "write GB/s"], rows)
    out = {"bench": "gpu_nvme", "machine": machine(), **results}
    emit_json(out)
    return out


if __name__ == "__main__":
    main()
