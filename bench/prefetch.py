"""Training-like replay: does the prefetcher keep every tensor resident before it is asked for?

The parameter and optimizer-state tensors of a real model shape list (GPT-2 small at
its real widths by default, or a ~1B-parameter decoder; ``--scale`` narrows every
width, which keeps the number of tensors and shrinks each: a stress of the store's
per-object cost rather than a real model) are accessed layer by
layer: each layer's fp32 parameters are checked out read-only and its Adam states
(exp_avg, exp_avg_sq) read-write — in batches (``checkout_many``) of at most the
prefetch budget's bytes, or with ``--access object`` one by one — then a matmul runs
whose duration matches the time the disk needs to read that layer's bytes. The host tier holds 25%, 50% and
75% of the working set; the rest lives on NVMe. Compared in one run:

  floor          everything in memory (host tier larger than the working set)
  lru            LRU eviction, no prefetch
  lru+prefetch   LRU eviction, trace-driven prefetch
  trace+prefetch Belady eviction on the learned trace, trace-driven prefetch
  floor+raw I/O  the floor again while a thread moves the bytes trace+prefetch moved per
                 step with plain O_DIRECT reads and writes (no tierstore; a CRC32C per
                 1 MiB block, as the store computes and checks), spread evenly
                 over the step (``--raw-io-at access``: each layer's share when the
                 replay reaches that layer, when a prefetcher would move it): what
                 that much disk traffic alone costs the compute on this machine, the
                 best any store could do at that host fraction

Reported per variant: steady-state hit rate, stall fraction, NVMe bytes read and
written per step and the disk time they take over the step's compute time (the
step-time target applies where that is below 1), step time / floor; and, for the
floor and trace+prefetch, where a step's time goes (check-outs, check-ins, state
updates, compute, the rest). This
machine's speed drifts over minutes, so each variant is compared with floor runs made
just before and just after it (the floor row shows their median and range).
``--mode daemon`` runs the same replay as a client of a real daemon (the deployment:
the prefetcher's I/O runs in another process), ``embedded`` (default) in-process.

Usage: python bench/prefetch.py [--model gpt2-small|decoder-1b] [--scale 1.0] [--steps 5] [--mode M] [--budget F] [--compute matmul|sleep] [--no-raw-io] [--raw-io-at even|access] [--access layer|object] [--variants a,b] [--repeat N] [--probe] [--quick] [--png F]
Prints a line per measured run on stderr as it goes, then a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import mmap
import os
import shutil
import sys
import tempfile
import threading
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import disk_gbps, emit_json, machine, print_table, pyplot, start_daemon  # noqa: E402

from tierstore import Config, Store  # noqa: E402
from tierstore.checksum import block_checksums  # noqa: E402
from tierstore.units import format_size  # noqa: E402

MODELS = {
    # name: (layers, d_model, d_ff, vocab)
    "gpt2-small": (12, 768, 3072, 50257),
    "decoder-1b": (24, 2048, 5632, 32000),
    "tiny": (4, 128, 512, 1000),
}


def layer_shapes(model: str, scale: float) -> list[list[tuple[str, tuple[int, ...]]]]:
    n_layers, d, ff, vocab = MODELS[model]
    d, ff, vocab = max(8, int(d * scale)), max(8, int(ff * scale)), max(8, int(vocab * scale))
    layers = [[("wte", (vocab, d))]]
    for i in range(n_layers):
        layers.append([(f"h{i}.ln1", (d,)), (f"h{i}.qkv", (d, 3 * d)), (f"h{i}.proj", (d, d)),
                       (f"h{i}.ln2", (d,)), (f"h{i}.fc", (d, ff)), (f"h{i}.fc_out", (ff, d))])
    layers.append([("ln_f", (d,))])
    return layers


class RawIO(threading.Thread):
    """O_DIRECT reads and writes of 4 MiB at ``read_bps`` / ``write_bps`` bytes per second,
    evenly paced, over a 128 MiB file in ``directory``, until ``stop()``; with a CRC32C
    of every 1 MiB block written and read, as the store keeps and checks them."""

    CHUNK = 4 << 20
    FILE = 128 << 20

    def __init__(self, directory: str, read_bps: float, write_bps: float, at_access: bool = False) -> None:
        super().__init__(daemon=True)
        self.read_bps, self.write_bps = read_bps, write_bps
        self.at_access = at_access
        """Move each layer's share when the replay reaches it (``kick``), as a prefetcher
        does, instead of evenly over the step."""
        self._owed = [0.0, 0.0]
        self._kicked = threading.Condition()
        self.path = os.path.join(directory, "rawio.bin")
        self.buf = mmap.mmap(-1, self.CHUNK)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        for off in range(0, self.FILE, self.CHUNK):  # written, so reads reach the disk
            os.pwritev(self.fd, [self.buf], off)
        os.fsync(self.fd)
        self._halt = threading.Event()
        self.moved = 0

    def kick(self, read_bytes: float, write_bytes: float) -> None:
        with self._kicked:
            self._owed[0] += read_bytes
            self._owed[1] += write_bytes
            self._kicked.notify()

    def run(self) -> None:
        t0, done_r, done_w, pos = time.perf_counter(), 0, 0, 0
        while not self._halt.is_set():
            if self.at_access:
                with self._kicked:
                    if max(self._owed[0] - done_r, self._owed[1] - done_w) < self.CHUNK and not self._halt.is_set():
                        self._kicked.wait(0.05)
                    behind_r, behind_w = self._owed[0] - done_r, self._owed[1] - done_w
            else:
                el = time.perf_counter() - t0
                behind_r, behind_w = self.read_bps * el - done_r, self.write_bps * el - done_w
            if max(behind_r, behind_w) < self.CHUNK:
                if not self.at_access:
                    time.sleep(0.001)
                continue
            if behind_r >= behind_w:
                os.preadv(self.fd, [self.buf], pos)
                block_checksums(self.buf, self.CHUNK)
                done_r += self.CHUNK
            else:
                block_checksums(self.buf, self.CHUNK)
                os.pwritev(self.fd, [self.buf], pos)
                done_w += self.CHUNK
            pos = (pos + self.CHUNK) % self.FILE
        self.moved = done_r + done_w

    def stop(self) -> None:
        self._halt.set()
        with self._kicked:
            self._kicked.notify()
        self.join()
        os.close(self.fd)
        os.unlink(self.path)
        self.buf.close()


class Compute:
    """A matmul loop calibrated to take ``seconds`` per call; ``sleep=True``: a sleep of
    that long instead (compute on an accelerator: the CPU stays free for the I/O)."""

    def __init__(self, sleep: bool = False) -> None:
        self.sleep = sleep
        self.a = torch.randn(256, 256)
        self.b = torch.randn(256, 256)
        for _ in range(5):
            self.a @ self.b
        t0 = time.perf_counter()
        for _ in range(50):
            self.a @ self.b
        self.per_mm = (time.perf_counter() - t0) / 50

    def run(self, seconds: float) -> None:
        if self.sleep:
            time.sleep(seconds)
            return
        for _ in range(max(1, math.ceil(seconds / self.per_mm))):
            self.a @ self.b


@contextlib.contextmanager
def open_pool(mode: str, d: str, host_bytes: int, nvme_bytes: int, policy: str, prefetch: bool, budget: int):
    """The pool under test: an in-process Store, or a real daemon and a Client of it."""
    # no background demoter: every eviction is the policy's
    if mode == "embedded":
        s = Store(Config(host_bytes=host_bytes, nvme_dirs=[os.path.join(d, "nvme")], nvme_bytes=nvme_bytes,
                         policy=policy, prefetch=prefetch, prefetch_budget_bytes=budget, high_watermark=1.0,
                         low_watermark=0.95), namespace="bench")
        try:
            yield s
        finally:
            s.close()
        return
    from tierstore.client import Client

    proc, sock, ns = start_daemon(d, "--host-bytes", str(host_bytes), "--nvme-bytes", str(nvme_bytes),
                                  "--policy", policy, "--prefetch", "1" if prefetch else "0",
                                  "--prefetch-budget-bytes", str(budget),
                                  env={"TIERSTORE_HIGH_WATERMARK": "1.0", "TIERSTORE_LOW_WATERMARK": "0.95"})
    try:
        with Client.connect(socket=sock, namespace="bench") as c:
            yield c
    finally:
        proc.terminate()
        proc.wait()
        ns.close()


def run_variant(layers, total_bytes: int, host_bytes: int, policy: str, prefetch: bool, steps: int,
                warmup: int, compute: Compute, per_byte_s: float, directory: str, budget: int,
                mode: str = "embedded", probe: bool = False, on_layer=None, access: str = "layer") -> dict:
    d = tempfile.mkdtemp(dir=directory)
    try:
        with open_pool(mode, d, host_bytes, 4 * total_bytes + (256 << 20), policy, prefetch, budget) as s:
            return _replay(s, layers, steps, warmup, compute, per_byte_s, probe, on_layer, access, budget)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _batches(hs: list[tuple[str, object, int]], limit: int) -> list[list[tuple[str, object, int]]]:
    """``hs`` (mode, handle, bytes) cut, in order, into batches of at most ``limit`` bytes
    (a larger object alone): a batch the prefetcher cannot fetch whole before it is asked
    for would wait, and one near the host tier's size could not be leased at all."""
    out: list[list[tuple[str, object, int]]] = [[]]
    for item in hs:
        if out[-1] and sum(n for *_, n in out[-1]) + item[2] > limit:
            out.append([])
        out[-1].append(item)
    return out


def _replay(s, layers, steps: int, warmup: int, compute: Compute, per_byte_s: float, probe: bool = False,
            on_layer=None, access: str = "layer", batch_bytes: int = 1 << 62) -> dict:
    handles = []
    for layer in layers:
        hs = []
        for name, shape in layer:
            n = 4 * math.prod(shape)
            hs.append(("r", s.put(torch.randn(shape), key=f"p/{name}"), n))
            hs.append(("rw", s.put(torch.zeros(shape), key=f"m/{name}"), n))
            hs.append(("rw", s.put(torch.zeros(shape), key=f"v/{name}"), n))
        handles.append((hs, _batches(hs, batch_bytes), sum(n for *_, n in hs)))
    times, hit_rates, stalls, read, written = [], [], [], [], []
    parts = {k: [] for k in PARTS}
    clock = time.perf_counter
    tiny, probes = torch.ones(4), []  # a torch op with no work: its time is getting the GIL back
    for step in range(warmup + steps):
        before = s.stat()
        t_out = t_in = t_upd = t_cmp = 0.0
        t0 = clock()
        for hs, batches, nbytes in handles:
            if on_layer is not None:
                on_layer(nbytes)
            for batch in (batches if access == "layer" else ()):  # one check-out, one check-in per batch
                a = clock()
                group = s.checkout_many([h for _, h, _ in batch], [mode for mode, _, _ in batch])
                b = clock()
                for (mode, _, _), lease in zip(batch, group):
                    if mode == "rw":
                        lease.tensor.mul_(0.9)
                c = clock()
                group.release()
                t_out, t_upd, t_in = t_out + b - a, t_upd + c - b, t_in + clock() - c
            for mode, h, _ in (hs if access == "object" else ()):
                a = clock()
                lease = s.checkout(h, mode)
                b = clock()
                if mode == "rw":
                    lease.tensor.mul_(0.9)  # the optimizer's update touches every state
                c = clock()
                lease.release()
                t_out, t_upd, t_in = t_out + b - a, t_upd + c - b, t_in + clock() - c
                if probe:
                    a = clock()
                    tiny.mul_(1.0)
                    if step >= warmup:
                        probes.append(clock() - a)
            a = clock()
            compute.run(nbytes * per_byte_s)
            t_cmp += clock() - a
        s.step()
        dt = clock() - t0
        after = s.stat()
        pa, pb, na, nb = after["prefetch"], before["prefetch"], after["tiers"]["nvme"], before["tiers"]["nvme"]
        n = sum(pa[k] - pb[k] for k in ("hits", "late", "misses"))
        if step >= warmup:
            times.append(dt)
            hit_rates.append((pa["hits"] - pb["hits"]) / n)
            stalls.append((pa["stall_s"] - pb["stall_s"]) / dt)
            read.append(na["bytes_read"] - nb["bytes_read"])
            written.append(na["bytes_written"] - nb["bytes_written"])
            for k, v in zip(PARTS, (t_out, t_in, t_upd, t_cmp, dt - t_out - t_in - t_upd - t_cmp)):
                parts[k].append(v)
    st = s.stat()
    return {"step_s": float(np.median(times)), "hit_rate": float(np.mean(hit_rates)),
            "stall_fraction": float(np.mean(stalls)), "prefetched_bytes": st["prefetch"]["prefetched_bytes"],
            "wasted_bytes": st["prefetch"]["wasted_bytes"], "nvme_read_bytes": st["tiers"]["nvme"]["bytes_read"],
            "nvme_written_bytes": st["tiers"]["nvme"]["bytes_written"],
            "read_bytes_per_step": float(np.mean(read)), "written_bytes_per_step": float(np.mean(written)),
            "breakdown_ms": {k: float(np.mean(v)) * 1e3 for k, v in parts.items()},
            "probe_us": float(np.mean(probes)) * 1e6 if probes else None}


VARIANTS = {"lru": ("lru", False), "lru+prefetch": ("lru", True), "trace+prefetch": ("trace", True)}
"""The compared pools: name -> (policy, prefetch)."""

PARTS = ("check-out", "check-in", "update", "compute", "other")
"""Where a replay step's time goes: check-out calls (with any wait for a fetch), check-ins,
the state updates (``mul_`` over the rw leases), the compute, the rest (loop, step mark)."""


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt2-small", choices=sorted(MODELS))
    p.add_argument("--scale", type=float, default=1.0,
                   help="width scale (1.0 = the real model; 0.25 keeps its tensor count at 1/16 of the bytes)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--fractions", default="0.25,0.5,0.75")
    p.add_argument("--dir", default=None, help="NVMe directory (default ./bench-io-tmp)")
    p.add_argument("--png", default=None, help="write a plot here (needs matplotlib)")
    p.add_argument("--mode", default="embedded", choices=["embedded", "daemon"],
                   help="the pool in this process (a Store), or a real daemon and a Client of it")
    p.add_argument("--budget", type=float, default=None,
                   help="prefetch budget as a fraction of the working set (default: 1/8, at least the largest layer)")
    p.add_argument("--compute", default="matmul", choices=["matmul", "sleep"],
                   help="between accesses: a matmul on one core (default), or a sleep of the same length, "
                        "as when the compute runs on an accelerator and leaves the CPU to the I/O")
    p.add_argument("--raw-io-at", default="even", choices=["even", "access"],
                   help="floor+raw I/O moves its bytes evenly over the step, or each layer's share when the "
                        "replay reaches that layer (when a prefetcher moves them)")
    p.add_argument("--no-raw-io", dest="raw_io", action="store_false",
                   help="skip the floor+raw I/O rows (the floor under the same disk traffic without tierstore)")
    p.add_argument("--access", default="layer", choices=["layer", "object"],
                   help="check out each layer's tensors in batches (checkout_many: one round trip through a "
                        "daemon) of at most the prefetch budget's bytes (default), or each tensor on its own")
    p.add_argument("--probe", action="store_true",
                   help="after each access, time a torch op on a 4-element tensor: the wait to get the GIL back "
                        "in the replay's process (adds that wait to every step)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"which of {', '.join(VARIANTS)} to run (comma-separated)")
    p.add_argument("--repeat", type=int, default=1,
                   help="measure each variant this many times, each between two floor runs, and report the median "
                        "of its step/floor ratios with their range (this VM's speed drifts from run to run)")
    p.add_argument("--quick", action="store_true", help="tiny model, 1 step (smoke test)")
    args = p.parse_args(argv)
    chosen = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(chosen) - set(VARIANTS))
    if unknown or not chosen:
        p.error(f"--variants: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(VARIANTS)}")
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    if args.quick:
        args.model, args.scale, args.steps, args.warmup = "tiny", 1.0, 1, 2
    torch.set_num_threads(1)  # leave the other core to the I/O threads
    base = args.dir or os.path.abspath("bench-io-tmp")
    os.makedirs(base, exist_ok=True)
    layers = layer_shapes(args.model, args.scale)
    total = sum(3 * 4 * math.prod(shape) for layer in layers for _, shape in layer)
    bw, wbw = disk_gbps(base)
    per_byte_s = 1.0 / (bw * 1e9)  # compute per layer = time to read that layer's bytes from disk
    compute_s = total * per_byte_s
    compute = Compute(sleep=args.compute == "sleep")
    largest = max(sum(4 * math.prod(sh) for _, sh in layer) for layer in layers)
    # every byte of prefetch budget is a byte the tier cannot keep resident across steps
    # (and so reads again each step): enough to cover the next objects' disk time, no more
    budget = max(largest + (1 << 20), int(total * (args.budget if args.budget is not None else 1 / 8)))
    common = dict(steps=args.steps, warmup=args.warmup, compute=compute, per_byte_s=per_byte_s, directory=base,
                  budget=budget, mode=args.mode, probe=args.probe, access=args.access)
    # This machine's speed drifts between runs (the same matmul loop 1.3-2x slower a minute
    # later): each variant is compared with floor runs made just before and just after it.
    floor_host = 2 * total + (64 << 20)
    def say(what: str, r: dict) -> None:
        """Progress on stderr: a full run takes minutes (about 15 at the default size here)."""
        ratio = f" = {r['step_vs_floor']:.2f}x the floor" if "step_vs_floor" in r else ""
        print(f"# {what}: {r['step_s']:.3f} s a step{ratio}, {r['hit_rate'] * 100:.1f}% hits", file=sys.stderr,
              flush=True)

    print(f"# {args.model} x{args.scale}: working set {format_size(total)}, compute {compute_s:.3f} s a step",
          file=sys.stderr, flush=True)
    floors = [run_variant(layers, total, floor_host, "lru", False, **common)]
    say("floor", floors[0])
    floor = floors[0]
    results = {"floor": floor, "floors_s": [], "variants": []}
    rows = []

    def next_floor() -> float:
        """A floor run after the variant just measured; the mean of it and the one before."""
        floors.append(run_variant(layers, total, floor_host, "lru", False, **common))
        return (floors[-2]["step_s"] + floors[-1]["step_s"]) / 2

    for frac in [float(f) for f in args.fractions.split(",")]:
        host = max(int(total * frac), 3 * largest + (1 << 20))
        for name in chosen:
            policy, pf = VARIANTS[name]
            runs = []
            for _ in range(args.repeat):
                one = run_variant(layers, total, host, policy, pf, **common)
                one["floor_s"] = next_floor()
                one["step_vs_floor"] = one["step_s"] / one["floor_s"]
                runs.append(one)
                say(f"{name} at {frac * 100:.0f}%", one)
            # the run with the median ratio stands for the variant; the others give the range
            ratios = [x["step_vs_floor"] for x in runs]
            r = sorted(runs, key=lambda x: x["step_vs_floor"])[len(runs) // 2]
            local_floor = r["floor_s"]
            # the target applies where the disk can move a step's bytes within its compute
            disk_s = r["read_bytes_per_step"] / (bw * 1e9) + r["written_bytes_per_step"] / (wbw * 1e9)
            r.update({"variant": name, "host_fraction": frac, "host_bytes": host, "disk_s_per_step": disk_s,
                      "disk_vs_compute": disk_s / compute_s, "step_vs_floor_runs": ratios})
            results["variants"].append(r)
            spread = f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else ""
            rows.append([name, f"{frac * 100:.0f}%", format_size(host), f"{r['hit_rate'] * 100:.1f}%",
                         f"{r['stall_fraction'] * 100:.1f}%",
                         f"{format_size(r['read_bytes_per_step'])} / {format_size(r['written_bytes_per_step'])}",
                         f"{disk_s / compute_s:.2f}", f"{r['step_s']:.3f}", f"{local_floor:.3f}",
                         f"{r['step_vs_floor']:.2f}{spread}"])
        if args.raw_io:
            # the floor under the trace variant's disk traffic, moved without tierstore
            rd, wr = r["read_bytes_per_step"], r["written_bytes_per_step"]
            io = RawIO(base, rd / local_floor, wr / local_floor, at_access=args.raw_io_at == "access")
            io.start()
            try:
                c = run_variant(layers, total, floor_host, "lru", False, **common,
                                on_layer=lambda n: io.kick(rd * n / total, wr * n / total))
            finally:
                io.stop()
            local_floor = next_floor()
            c.update({"variant": "floor+raw I/O", "host_fraction": frac, "floor_s": local_floor,
                      "step_vs_floor": c["step_s"] / local_floor, "raw_read_bytes_per_step": rd,
                      "raw_written_bytes_per_step": wr})
            say(f"floor+raw I/O at {frac * 100:.0f}%", c)
            results["variants"].append(c)
            rows.append(["floor+raw I/O", f"{frac * 100:.0f}%", "-", "-", "-",
                         f"{format_size(rd)} / {format_size(wr)} raw", f"{disk_s / compute_s:.2f}",
                         f"{c['step_s']:.3f}", f"{local_floor:.3f}", f"{c['step_vs_floor']:.2f}"])
    results["floors_s"] = [f["step_s"] for f in floors]
    floor["step_s"] = float(np.median(results["floors_s"]))
    rows.insert(0, ["floor", "100%", "-", f"{floor['hit_rate'] * 100:.1f}%", f"{floor['stall_fraction'] * 100:.1f}%",
                    "-", "0", f"{floor['step_s']:.3f}", f"{min(results['floors_s']):.3f}-{max(results['floors_s']):.3f}",
                    "1.00"])
    print(f"# prefetch replay ({args.mode}, access by {args.access}): {args.model} x{args.scale} ({len(layers)} layer groups, working set "
          f"{format_size(total)}: fp32 params + Adam exp_avg/exp_avg_sq), disk read {bw:.2f} GB/s, write {wbw:.2f} GB/s, "
          f"compute ({args.compute}) per layer = its bytes / disk bandwidth, {args.steps} steps after {args.warmup} warm-up, "
          f"prefetch budget {format_size(budget)}; each variant against the mean of floor runs just before and "
          f"after it; {machine()}")
    print_table(["variant", "host", "host bytes", "hit rate", "stall", "read/written per step", "disk/compute",
                 "step s", "floor s", "vs floor"], rows)
    print("# where a step goes, ms (steady state; update = mul_ over the rw leases)")
    def probe_col(r):
        return [f"{r['probe_us']:.1f}"] if args.probe else []
    brows = [["floor", "100%", *(f"{floors[0]['breakdown_ms'][k]:.1f}" for k in PARTS), *probe_col(floors[0])]]
    brows += [[v["variant"], f"{v['host_fraction'] * 100:.0f}%", *(f"{v['breakdown_ms'][k]:.1f}" for k in PARTS),
               *probe_col(v)] for v in results["variants"] if v["variant"] in ("trace+prefetch", "floor+raw I/O")]
    print_table(["variant", "host", *PARTS, *(["probe us"] if args.probe else [])], brows)
    if args.png:
        plot(results, args.png)
        print(f"# plot: {args.png}")
    out = {"bench": "prefetch", "mode": args.mode, "access": args.access, "compute": args.compute, "raw_io_at": args.raw_io_at, "model": args.model, "scale": args.scale, "working_set_bytes": total,
           "disk_read_gbps": bw, "disk_write_gbps": wbw, "compute_s_per_step": compute_s, "machine": machine(),
           **results}
    emit_json(out)
    return out


def plot(results: dict, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for name in ("lru", "lru+prefetch", "trace+prefetch", "floor+raw I/O"):
        vs = [v for v in results["variants"] if v["variant"] == name]
        xs = [v["host_fraction"] * 100 for v in vs]
        if name != "floor+raw I/O":
            a1.plot(xs, [v["hit_rate"] * 100 for v in vs], marker="o", label=name)
        a2.plot(xs, [v["step_vs_floor"] for v in vs], marker="o", label=name)
    a1.set_xlabel("host tier, % of working set")
    a1.set_ylabel("hit rate, %")
    a2.set_xlabel("host tier, % of working set")
    a2.set_ylabel("step time / in-memory floor")
    a2.axhline(1.0, color="gray", linestyle="--", label="floor")
    a2.axhline(1.1, color="gray", linestyle=":", label="1.10x target")
    for a in (a1, a2):
        a.legend()
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
