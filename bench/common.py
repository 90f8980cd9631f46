"""Shared benchmark helpers: timing, page-cache control, tables and the JSON last line."""

from __future__ import annotations

import json
import ctypes
import mmap
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Callable

import numpy as np


def drop_cache(path: str) -> None:
    """Evict ``path`` from the page cache so the next read comes from the device."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def repeat(fn: Callable[[], float], runs: int, warmup: int = 1) -> dict:
    """Run ``fn`` (which returns seconds) warmup + runs times; median and spread of the runs."""
    for _ in range(warmup):
        fn()
    xs = [fn() for _ in range(runs)]
    return {"median_s": statistics.median(xs), "min_s": min(xs), "max_s": max(xs), "runs": runs}


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def random_bytes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def machine() -> dict:
    return {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()}


def print_table(headers: list[str], rows: list[list[object]]) -> None:
    cols = [[str(h)] + [str(r[i]) for r in rows] for i, h in enumerate(headers)]
    widths = [max(len(c) for c in col) for col in cols]
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(str(c).rjust(w) for c, w in zip(r, widths)))


def emit_json(obj: dict) -> None:
    """The last line of stdout: one JSON object for machines (also kept by ``partial``)."""
    print(json.dumps(obj, default=float), flush=True)
    partial(obj)


PARTIAL_ENV = "TIERSTORE_BENCH_PARTIAL"
"""Where ``partial`` appends its JSON lines (unset: nowhere). bench/gpu_check.sh points it
into $OUT, so a run killed at its time limit still leaves what it measured."""


def partial(obj: dict) -> None:
    """Append one measurement, as a JSON line, to the file named by $TIERSTORE_BENCH_PARTIAL."""
    path = os.environ.get(PARTIAL_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(obj, default=float) + "\n")


def pwrite_all(fd: int, buf, offset: int) -> int:
    """Write all of ``buf`` at ``offset``: one ``pwritev`` moves at most 0x7ffff000 bytes on
    Linux (and may move less), so loop on what each call returns."""
    return _all(os.pwritev, fd, buf, offset)


def pread_all(fd: int, buf, offset: int) -> int:
    """Fill all of ``buf`` from ``offset`` (looping as ``pwrite_all`` does); an end of file
    before it is full is an error."""
    return _all(os.preadv, fd, buf, offset)


def _all(io, fd: int, buf, offset: int) -> int:
    mv = memoryview(buf).cast("B")
    done = 0
    while done < len(mv):
        n = io(fd, [mv[done:]], offset + done)
        if n <= 0:
            raise OSError(f"{io.__name__} moved {done} of {len(mv)} bytes at offset {offset}, then {n}")
        done += n
    return done


def size_label(n: int) -> str:
    for unit, s in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= s and n % s == 0:
            return f"{n // s}{unit}"
    return f"{n}B"


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (with a note) when not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("# matplotlib not installed: no plot")
        return None
    return plt


def proc_status_bytes(pid: int, field: str) -> int:
    """A kB field of /proc/PID/status (VmHWM, RssAnon, ...) in bytes; 0 if absent."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def time_torch_save_load(obj, path: str, runs: int, warmup: int = 1) -> tuple[dict, dict]:
    """torch.save (+fsync) and torch.load (page cache dropped first) of ``obj`` at ``path``."""
    import torch

    def save() -> float:
        def run() -> None:
            with open(path, "wb") as f:
                torch.save(obj, f)
                f.flush()
                os.fsync(f.fileno())
        return timed(run)

    def load() -> float:
        drop_cache(path)
        return timed(lambda: torch.load(path, weights_only=True))
    return repeat(save, runs, warmup), repeat(load, runs, warmup)


def start_daemon(base: str, *flags: str, env: dict | None = None,
                 timeout_s: float = 300) -> tuple[subprocess.Popen, str, socket.socket]:
    """A real daemon under ``base`` (socket ``base/run/ts.sock``, NVMe tier ``base/nvme``
    unless ``flags`` name one), started and awaited through systemd's notify protocol:
    READY=1, then the STATUS that the host arena's pages are all there (a benchmark
    measures the daemon at work, not its populating in the background). Returns
    (process, socket path, notify socket); keep the notify socket open until the daemon
    has stopped (it reports STOPPING=1 there)."""
    sock = os.path.join(base, "run", "ts.sock")
    notify = os.path.join(base, "notify")
    ns = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    ns.bind(notify)
    ns.settimeout(0.5)
    args = [sys.executable, "-m", "tierstore.daemon", "--socket", sock, "--log-level", "WARNING"]
    if "--nvme-dir" not in flags:
        args += ["--nvme-dir", os.path.join(base, "nvme")]
    p = subprocess.Popen([*args, *flags], env={**os.environ, **(env or {}), "NOTIFY_SOCKET": notify})
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            msg = ns.recv(4096)
            if b"memfd, populated in" in msg or b"memfd, adopted in" in msg:
                return p, sock, ns
        except socket.timeout:
            pass
        if p.poll() is not None:
            ns.close()
            raise SystemExit(f"the daemon exited with status {p.returncode} before it was ready")
        if time.monotonic() > deadline:
            p.kill()
            p.wait()
            ns.close()
            raise SystemExit(f"the daemon was not ready after {timeout_s:.0f} s")


def skipped_without_cuda(bench: str) -> dict | None:
    """The JSON result of a GPU benchmark on a host without CUDA (printed), else None."""
    import torch

    if torch.cuda.is_available():
        return None
    out = {"bench": bench, "skipped": "no CUDA device"}
    print("# no CUDA device: nothing to measure")
    emit_json(out)
    return out


def disk_gbps(directory: str, nbytes: int = 64 << 20) -> tuple[float, float]:
    """(read, write) GB/s of O_DIRECT 4 MiB requests in ``directory``."""
    path = os.path.join(directory, "calib.bin")
    m = mmap.mmap(-1, nbytes)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    chunk = 4 << 20
    try:
        pwrite_all(fd, m, 0)
        os.fsync(fd)
        t0 = time.perf_counter()
        for off in range(0, nbytes, chunk):
            os.pwritev(fd, [memoryview(m)[off:off + chunk]], off)
        os.fsync(fd)
        write = nbytes / (time.perf_counter() - t0) / 1e9
        t0 = time.perf_counter()
        for off in range(0, nbytes, chunk):
            os.preadv(fd, [memoryview(m)[off:off + chunk]], off)
        return nbytes / (time.perf_counter() - t0) / 1e9, write
    except OSError:
        return 1.0, 1.0
    finally:
        os.close(fd)
        os.unlink(path)
        m.close()


def disk_mixed_gbps(directory: str, nbytes: int = 256 << 20, depth: int = 4) -> float:
    """GB/s (read + written bytes) of O_DIRECT 16 MiB requests, ``depth`` in flight each
    way, when ``directory``'s disk reads ``nbytes`` and writes ``nbytes`` at the same
    time: the rate at which it can move a training step's state in and out. The buffers
    are private memory in transparent huge pages where the kernel gives them (as
    contiguous as memory gets: docs/store.md, "Huge pages"). 0.0 where the directory
    does not take O_DIRECT (not measured)."""
    chunk = 16 << 20
    nbytes = max(chunk, nbytes // chunk * chunk)
    paths = [os.path.join(directory, f"calib-mixed-{k}.bin") for k in range(2)]
    whole = mmap.mmap(-1, 2 * depth * chunk + (2 << 20), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        whole.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):
        pass
    view = memoryview(whole)
    probe = ctypes.c_char.from_buffer(whole)
    first = -ctypes.addressof(probe) % (2 << 20)
    del probe
    bufs = [view[first + i * chunk:first + (i + 1) * chunk] for i in range(2 * depth)]
    for b in bufs:
        b[:] = b"\x5a" * chunk
    fds: list[int] = []
    try:
        for p in paths:
            fds.append(os.open(p, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600))
        # both files written once first: the read finds data, and the timed write overwrites
        # allocated blocks, as the store's write-backs do in steady state (a first write into a
        # new or fallocated range of a file costs ext4 ~1.5x more on this VM)
        for fd in fds:
            for off in range(0, nbytes, chunk):
                os.pwritev(fd, [bufs[0]], off)
            os.fsync(fd)

        def move(k: int, i: int) -> None:
            io = os.preadv if k == 0 else os.pwritev
            for off in range(i * chunk, nbytes, depth * chunk):
                io(fds[k], [bufs[k * depth + i]], off)

        threads = [threading.Thread(target=move, args=(k, i)) for k in range(2) for i in range(depth)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        os.fsync(fds[1])
        return 2 * nbytes / (time.perf_counter() - t0) / 1e9
    except OSError:
        return 0.0
    finally:
        for fd, p in zip(fds, paths):
            os.close(fd)
            os.unlink(p)
        for b in bufs:
            b.release()
        view.release()
        whole.close()
