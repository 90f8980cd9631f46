"""Every NVMe path a user takes, beside DeepSpeed's aio, interleaved in one run.

For each size, ``rounds`` rounds (after one warm-up round) of, in a rotating order:

  writes  DeepSpeed aio ``sync_pwrite`` of its page-locked buffer, overwriting its file
          (each configured peer: ``--ds-aio``); ``put(tier="nvme")`` volatile and durable,
          in-process (``Store``) and through a daemon (``Client``), each freeing its
          previous version first (the steady state of a training loop: the space is reused);
          and through the daemon a volatile put copied whole before the daemon writes it
          ("1 copy": as before ``put_part``, the same object's space reused)
  reads   DeepSpeed aio ``sync_pread`` of the file it wrote; ``get(out=)`` of the object
          the volatile put wrote and ``checkout("r")`` of the durable put's (on NVMe only),
          in-process and through the daemon; and through the daemon a ``get(out=)`` read
          whole into the host tier before the copy ("1 read": as before streamed gets)

with the page cache dropped before every read (``/proc/sys/vm/drop_caches`` where
writable, else nothing: every variant reads with O_DIRECT). The tier's source and
destination tensors are ordinary ``torch.empty`` tensors, as a user has them (not
page-aligned); DeepSpeed's are its own page-locked buffer. A check-out is timed until
the lease is granted (the bytes are in the host tier); its release is not timed. Every
read reads bytes written in the same round, a few seconds before (on a virtual disk,
recently written bytes may be cached by the host and read faster than old ones).

With ``small_pages`` (``--small-pages``), a second daemon whose arena is in 4 KiB pages
(``--host-huge-pages off``) runs the same daemon paths in the same rounds ("4k daemon
..."): what the arena's huge pages are worth on this disk.

Ratios are per round (the tier's time over the fastest DeepSpeed peer's in the same
round), median over the rounds: the disk of a shared VM drifts more between minutes
than between neighbouring requests.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time

import numpy as np

from aio_peer import AioPeer
from common import gbps, size_label, start_daemon

WRITES = ("put volatile", "put durable", "daemon put volatile", "daemon put durable", "daemon put volatile 1 copy")
READS = ("get(out=)", "checkout r", "daemon get(out=)", "daemon checkout r", "daemon get(out=) 1 read")


def drop_caches() -> bool:
    """Write back and drop the page cache (root only); False where not allowed."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _nvme_only(pool, h) -> None:
    """Wait until a released home-NVMe object has gone back down (the demoter's spill)."""
    deadline = time.monotonic() + 60
    while pool.info(h)["residency"] != ["nvme"]:
        if time.monotonic() > deadline:
            raise SystemExit(f"{h} did not return to NVMe: {pool.info(h)['residency']}")
        time.sleep(0.005)


def _tier_ops(pool, n: int) -> tuple[dict, dict]:
    """The timed write and read operations of one pool (``Store`` or ``Client``): each
    read reads what a write of the same round wrote (``get(out=)`` the volatile put's
    object, ``checkout r`` the durable one's), as DeepSpeed reads the file it wrote: on a
    virtual disk, bytes written a moment ago can read faster than old ones."""
    import torch

    src = torch.empty(n, dtype=torch.uint8)
    src.numpy()[:] = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    out = torch.empty(n, dtype=torch.uint8)
    out.fill_(0)
    kept: dict[bool, object] = {}

    def put(durable: bool):
        def run() -> float:
            if durable in kept:
                pool.free(kept.pop(durable))
            t0 = time.perf_counter()
            kept[durable] = pool.put(src, tier="nvme", durable=durable)
            return time.perf_counter() - t0
        return run

    def get() -> float:
        h = kept[False]
        _nvme_only(pool, h)
        t0 = time.perf_counter()
        pool.get(h, out=out)
        dt = time.perf_counter() - t0
        if not torch.equal(out[:4096], src[:4096]) or not torch.equal(out[-4096:], src[-4096:]):
            raise SystemExit("get(out=) read back wrong bytes")
        return dt

    def checkout() -> float:
        h = kept[True]
        _nvme_only(pool, h)
        t0 = time.perf_counter()
        lease = pool.checkout(h, "r")
        dt = time.perf_counter() - t0
        lease.release()
        return dt

    writes = {"put volatile": put(False), "put durable": put(True)}
    reads = {"get(out=)": get, "checkout r": checkout}
    if hasattr(pool, "_fill"):  # through a daemon: also as before ``put_part`` and streamed gets
        from tierstore.client import client as client_module

        def one_copy() -> float:
            saved, client_module._PART_MIN = client_module._PART_MIN, 1 << 62
            try:
                return put(False)()
            finally:
                client_module._PART_MIN = saved
        writes["put volatile 1 copy"] = one_copy

        def one_read() -> float:
            saved, pool._parts = pool._parts, {}
            try:
                return get()
            finally:
                pool._parts = saved
        reads["get(out=) 1 read"] = one_read
    return writes, reads


def run_paths(work: str, sizes: list[int], rounds: int, peers_cfg: list[tuple[int, int, int]], ds_python: str,
              chunk: int, threads: int, small_pages: bool = False) -> dict:
    """Measure; returns {"sizes": [...], "peers": [...], "skipped": reason or None}."""
    from tierstore import Config, Store
    from tierstore.client import Client

    top = max(sizes)
    peers: list[AioPeer] = []
    skipped = None
    for block, depth, nthreads in peers_cfg:
        p = AioPeer.start(ds_python, block, depth, nthreads, top)
        if isinstance(p, str):
            skipped = p
            break
        peers.append(p)
    dropped = drop_caches()
    results = []
    try:
        for n in sizes:
            base = os.path.join(work, f"paths-{n}")
            os.makedirs(base)
            host = 2 * n + (64 << 20)
            flags = ["--host-bytes", str(host), "--nvme-bytes", str(6 * n), "--io-threads", str(threads),
                     "--io-chunk-bytes", str(chunk), "--promote-on-get", "false", "--prefetch", "false"]
            os.makedirs(os.path.join(base, "d"))
            daemons = [start_daemon(os.path.join(base, "d"), *flags)]
            if small_pages:
                os.makedirs(os.path.join(base, "d4k"))
                daemons.append(start_daemon(os.path.join(base, "d4k"), *flags, "--host-huge-pages", "off"))
            cfg = Config(host_bytes=host, nvme_dirs=[os.path.join(base, "inproc")], nvme_bytes=6 * n,
                         io_chunk_bytes=chunk, io_threads=threads, promote_on_get=False, prefetch=False)
            clients = []
            try:
                with Store(cfg) as store:
                    clients = [Client.connect(sock) for _, sock, _ in daemons]
                    w_in, r_in = _tier_ops(store, n)
                    writes, reads = dict(w_in), dict(r_in)
                    for prefix, client in zip(("daemon ", "4k daemon "), clients):
                        w_d, r_d = _tier_ops(client, n)
                        keep = (lambda k: True) if prefix == "daemon " else (lambda k: " 1 " not in k)
                        writes.update({prefix + k: v for k, v in w_d.items() if keep(k)})
                        reads.update({prefix + k: v for k, v in r_d.items() if keep(k)})
                    for i, p in enumerate(peers):
                        path = os.path.join(base, f"ds{i}.bin")
                        writes[p.label] = (lambda p=p, path=path: p.write(n, path))
                        reads[p.label] = (lambda p=p, path=path: p.read(n, path))
                    results.append(_rounds(n, writes, reads, rounds, [p.label for p in peers], dropped))
            finally:
                for client in clients:
                    client.close()
                for daemon, _, notify in daemons:
                    daemon.terminate()
                    daemon.wait()
                    notify.close()
                shutil.rmtree(base, ignore_errors=True)
    finally:
        for p in peers:
            p.close()
    return {"sizes": results, "peers": [p.label for p in peers],
            "deepspeed": peers[0].version if peers else None, "skipped": skipped, "cache_dropped": dropped}


def _rounds(n: int, writes: dict, reads: dict, rounds: int, peers: list[str], dropped: bool) -> dict:
    times: dict[str, dict[str, list[float]]] = {"write": {k: [] for k in writes}, "read": {k: [] for k in reads}}
    for r in range(rounds + 1):
        for ops, kind in ((writes, "write"), (reads, "read")):
            names = list(ops)
            names = names[r % len(names):] + names[:r % len(names)]  # rotate: no variant always first
            for name in names:
                if kind == "read" and dropped:
                    drop_caches()
                dt = ops[name]()
                if r:  # round 0 warms up
                    times[kind][name].append(dt)
    res: dict = {"size": n, "times_s": times,
                 "gbps": {kind: {k: gbps(n, statistics.median(v)) for k, v in t.items()} for kind, t in times.items()}}
    if peers:
        res["vs_deepspeed"] = {}
        for kind, names in (("write", _names(times, "write")), ("read", _names(times, "read"))):
            t = times[kind]
            best = [min(t[p][i] for p in peers) for i in range(rounds)]
            res["vs_deepspeed"][kind] = {name: statistics.median(best[i] / t[name][i] for i in range(rounds))
                                         for name in names}
    return res


def _names(times: dict, kind: str) -> list[str]:
    """The tier's variants of ``kind`` measured, in table order (``WRITES``/``READS``, then
    the 4 KiB-page daemon's)."""
    base = WRITES if kind == "write" else READS
    return [*base, *("4k " + k for k in base if k.startswith("daemon ") and "4k " + k in times[kind])]


def print_paths(out: dict) -> None:
    from common import print_table

    peers = out["peers"]
    for kind in ("write", "read"):
        names = _names(out["sizes"][0]["times_s"], kind) if out["sizes"] else []
        headers = ["size", *peers, *names]
        rows = []
        for r in out["sizes"]:
            cells = [size_label(r["size"])] + [f"{r['gbps'][kind][p]:.2f}" for p in peers]
            for name in names:
                v = f"{r['gbps'][kind][name]:.2f}"
                if "vs_deepspeed" in r:
                    v += f" ({r['vs_deepspeed'][kind][name]:.2f}x)"
                cells.append(v)
            rows.append(cells)
        print(f"# NVMe paths, {kind}s: GB/s (x the fastest DeepSpeed peer of the same round, median of rounds)")
        print_table(headers, rows)
    if out["skipped"]:
        print(f"# DeepSpeed aio skipped: {out['skipped']}")
    if not out["cache_dropped"]:
        print("# page cache not dropped (not root): every variant reads with O_DIRECT")
