"""Scale: the daemon with many small objects and many namespaces, through a real daemon.

For each N (objects in one namespace): the put rate of small objects from pipelining
client processes (``put_async``), volatile and durable; the time of ``keys()``,
``ls()``, ``stat()`` and ``tierstore snapshot``; the daemon's heap (RssAnon: the host
arena, shared memory, is not counted) per object; restart with the durable objects, to
the first request answered and to READY=1 (the journal replayed, every object there),
and to the STATUS saying the host arena's pages are all populated; another client's
ping p50/p99 while two clients loop ``keys(prefix=...)`` and ``ls(prefix=...)`` scans.
Then 10 000 namespaces of one object each: the time to fill them, ``stat()`` and
``tierstore stat --json``.

With ``--journal N``: N durable objects written straight into the journal (the records
durable puts of 16-byte objects write), then restart to READY=1 replaying every record,
the heap per object, ``keys()``/``ls()``/``stat()`` and pings through the daemon, then a
wait for the background index checkpoint the grown journal starts, 1 000 durable puts
after it, ``kill -9`` and a restart (loading that checkpoint, replaying the tail), then a
SIGTERM (whose clean close writes the index checkpoint) and a restart from the
checkpoint: the figures at 1 000 000 objects in minutes rather than the put phase's hour.
The restart after the put phase (``--sizes``) follows a SIGTERM, so it uses the checkpoint.

Usage: python bench/scale.py [--sizes 10000,100000] [--million] [--journal 1000000] [--namespaces 10000]
       [--clients 4] [--snapshot-max 10000] [--quick] [--png FILE]
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit_json, machine, print_table, proc_status_bytes, pyplot, start_daemon  # noqa: E402

PUTTER = r"""
import json, sys, time, collections
import torch
from tierstore.client import Client
sock, ns, first, count, durable, window = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), \
    sys.argv[5] == "1", int(sys.argv[6])
c = Client.connect(socket=sock, namespace=ns)
x = torch.zeros(4)
sys.stdout.write("ready\n"); sys.stdout.flush()
sys.stdin.readline()
t0 = time.time()
inflight = collections.deque()
for i in range(first, first + count):
    if len(inflight) >= window:
        inflight.popleft().result()
    inflight.append(c.put_async(x, key=f"obj/{i:08d}", durable=durable))
for f in inflight:
    f.result()
print(json.dumps({"t0": t0, "t1": time.time()}))
c.close()
"""

SCANNER = r"""
import sys
from tierstore.client import Client
sock, ns = sys.argv[1], sys.argv[2]
c = Client.connect(socket=sock, namespace=ns)
empty = Client.connect(socket=sock, namespace=ns + "-empty")
sys.stdout.write("ready\n"); sys.stdout.flush()
n = 0
while True:
    c.keys(prefix="obj/0000")
    c.ls(prefix="obj/0000")
    empty.keys(prefix="obj/")
    n += 1
"""

FILLER = r"""
import sys, torch
from tierstore.client import Client
sock, first, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
x = torch.zeros(1)
for i in range(first, first + count):
    with Client.connect(socket=sock, namespace=f"scale-ns/{i:06d}") as c:
        c.put(x, key="k", tier="nvme")
"""


def _parallel_puts(sock: str, ns: str, n: int, clients: int, durable: bool, window: int) -> float:
    """Objects per second from ``clients`` processes putting ``n`` objects between them."""
    share = [n // clients + (i < n % clients) for i in range(clients)]
    first = np.cumsum([0] + share[:-1])
    procs = [subprocess.Popen([sys.executable, "-c", PUTTER, sock, ns, str(f), str(k), "1" if durable else "0",
                               str(window)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for f, k in zip(first, share) if k]
    for p in procs:
        if p.stdout.readline().strip() != "ready":
            raise SystemExit(f"a put client failed to start ({p.wait()})")
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    spans = []
    for p in procs:
        out, _ = p.communicate(timeout=3600)
        if p.returncode != 0:
            raise SystemExit("a put client failed")
        spans.append(json.loads(out.strip().splitlines()[-1]))
    return n / (max(s["t1"] for s in spans) - min(s["t0"] for s in spans))


def _timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    r = fn()
    return time.perf_counter() - t0, r


def _pings(c, seconds: float) -> dict:
    lat = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        t0 = time.perf_counter()
        c.ping()
        lat.append(time.perf_counter() - t0)
    a = np.asarray(lat) * 1e3
    return {"count": len(lat), "p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99))}


def _pings_under_scans(c, sock: str, ns: str, seconds: float) -> dict:
    """``_pings`` while two client processes loop ``keys(prefix=...)`` and ``ls(prefix=...)`` scans."""
    scanners = [subprocess.Popen([sys.executable, "-c", SCANNER, sock, ns], stdout=subprocess.PIPE, text=True)
                for _ in range(2)]
    try:
        for s in scanners:
            s.stdout.readline()
        return _pings(c, seconds)
    finally:
        for s in scanners:
            s.kill()
            s.wait()


def _discard(daemon: subprocess.Popen, notify, base: str) -> None:
    daemon.kill()
    daemon.wait()
    notify.close()
    shutil.rmtree(base, ignore_errors=True)


def _stop(daemon: subprocess.Popen) -> float:
    """SIGTERM (a clean close: the index checkpoint is written); seconds to exit."""
    t0 = time.perf_counter()
    daemon.send_signal(signal.SIGTERM)
    daemon.wait(timeout=600)
    return time.perf_counter() - t0


def _restarted(base: str, sock: str, flags: list[str], notify, res: dict | None = None, label: str = "restart"
               ) -> tuple[subprocess.Popen, float]:
    """The daemon of ``base`` started again, and the seconds to its READY=1 (the journal
    replayed: every durable object is there and served). ``res[label + "_serving_s"]``:
    the seconds until a client's first request was answered; ``_populated_s``: until the
    STATUS that the host arena's pages are all there (``_populate_s`` of them populating,
    in the background from the start)."""
    t0 = time.perf_counter()
    daemon = subprocess.Popen([sys.executable, "-m", "tierstore.daemon", "--socket", sock, "--log-level", "WARNING",
                               "--nvme-dir", os.path.join(base, "nvme"), *flags],
                              env={**os.environ, "NOTIFY_SOCKET": os.path.join(base, "notify"),
                                   "TIERSTORE_NVME_GROW_BYTES": "256MiB"})
    serving = _first_answer(sock, daemon)
    _wait_notify(notify, daemon, "READY=1")
    ready = time.perf_counter() - t0
    status = _wait_notify(notify, daemon, "memfd, populated in", "memfd, adopted in")
    if res is not None:
        res[label + "_serving_s"] = min(serving - t0, ready)
        res[label + "_populated_s"] = time.perf_counter() - t0
        m = re.search(r"populated in ([0-9.]+) s", status)
        if m:
            res[label + "_populate_s"] = float(m.group(1))
    return daemon, ready


def _first_answer(sock: str, proc: subprocess.Popen) -> float:
    """Poll until a client's ping is answered; when it was."""
    from tierstore.client import Client
    from tierstore.errors import TierstoreError

    while True:
        try:
            with Client.connect(socket=sock, namespace="probe", prefault=False) as c:
                c.ping()
            return time.perf_counter()
        except TierstoreError:
            if proc.poll() is not None:
                raise SystemExit(f"the daemon exited with status {proc.returncode} on restart") from None
            time.sleep(0.02)


def _cli(*args: str) -> float:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "tierstore.client.cli", *args], capture_output=True, text=True,
                       timeout=3600)
    if r.returncode != 0:
        raise SystemExit(f"tierstore {args[0]} failed: {r.stderr[-1000:]}")
    return time.perf_counter() - t0


def _daemon_flags(n: int) -> list[str]:
    # every small object takes a 4 KiB page of the host tier and, durable, of the NVMe tier;
    # room for all n below the high watermark, so a put phase measures puts, not the
    # demoter making room (at most 12 GiB)
    host = min(12 << 30, max(128 << 20, (n * 4096 * 5) // 4 + (64 << 20)))
    return ["--host-bytes", str(host), "--nvme-bytes", str(max(1 << 30, n * 4096 * 3)), "--lease-timeout-s", "0"]


def _wait_notify(ns_sock, proc, *needles: str) -> str:
    """Wait for the notify message holding one of ``needles`` (READY=1, whose STATUS says
    how the start went; a later STATUS that the host arena is populated); that message."""
    import socket

    while True:
        try:
            msg = ns_sock.recv(4096)
            if any(n.encode() in msg for n in needles):
                return msg.decode(errors="replace")
        except socket.timeout:
            if proc.poll() is not None:
                raise SystemExit(f"the daemon exited with status {proc.returncode} on restart")


def run_size(n: int, args) -> dict:
    from tierstore.client import Client

    base = tempfile.mkdtemp(prefix="tierstore-scale-")
    flags = _daemon_flags(2 * n)  # a volatile and a durable phase of n objects each
    daemon, sock, notify = start_daemon(base, *flags, env={"TIERSTORE_NVME_GROW_BYTES": "256MiB"})
    res: dict = {"n": n}
    try:
        heap0 = proc_status_bytes(daemon.pid, "RssAnon")
        res["volatile_puts_per_s"] = _parallel_puts(sock, "vol", n, args.clients, False, args.window)
        res["durable_puts_per_s"] = _parallel_puts(sock, "dur", n, args.clients, True, args.window)
        res["heap_bytes_per_object"] = (proc_status_bytes(daemon.pid, "RssAnon") - heap0) / (2 * n)
        with Client.connect(socket=sock, namespace="vol") as c:
            res["keys_s"], keys = _timed(c.keys)
            assert len(keys) == n, len(keys)
            res["ls_s"], rows = _timed(c.ls)
            assert len(rows) == n, len(rows)
            del keys, rows
            res["stat_s"], _ = _timed(c.stat)
            res["ping_idle"] = _pings(c, args.ping_seconds)
            res["ping_under_scans"] = _pings_under_scans(c, sock, "vol", args.ping_seconds)
        m = min(n, args.snapshot_max)
        if m < n:
            with Client.connect(socket=sock, namespace="snap") as c:
                x = np.zeros(4, np.float32)
                for f in [c.put_async(x, key=f"obj/{i:08d}") for i in range(m)]:
                    f.result()
        res["snapshot_objects"] = m
        res["snapshot_s"] = _cli("snapshot", "--socket", sock, "vol" if m == n else "snap",
                                 os.path.join(base, "snap"))
        res["stop_s"] = _stop(daemon)
        daemon, res["restart_to_ready_s"] = _restarted(base, sock, flags, notify, res)
        res["restart_durable_objects"] = n
        with Client.connect(socket=sock, namespace="dur") as c:
            st = c.stat()
            assert st["namespaces"]["dur"]["objects"] == n
            res["restart_checkpoint"] = st["journal"]["checkpoint"]
    finally:
        _discard(daemon, notify, base)
    return res


_TAIL_PUTS = 1000


def _background_checkpoint(c) -> None:
    """Wait until the daemon has written a background index checkpoint."""
    t_end = time.monotonic() + 600
    while not c.stat()["journal"].get("checkpoints_written"):
        if time.monotonic() > t_end:
            raise SystemExit("no background index checkpoint within 600 s")
        time.sleep(0.2)


def run_journal(n: int, args) -> dict:
    """N durable objects written as journal records (no put phase), then through a real
    daemon: restart to READY=1, its heap per object, ``keys()``/``ls()``/``stat()``, and
    another client's ping while two clients loop scans. The records are what durable puts
    of 16-byte objects write; the bytes they name are never read."""
    from tierstore.checkpoint import CHECKPOINT_FILE
    from tierstore.checksum import crc32c
    from tierstore.client import Client
    from tierstore.journal import Journal

    import torch

    base = tempfile.mkdtemp(prefix="tierstore-scale-j-")
    flags = _daemon_flags(n)
    daemon, sock, notify = start_daemon(base, *flags, env={"TIERSTORE_NVME_GROW_BYTES": "256MiB"})
    try:
        heap0 = proc_status_bytes(daemon.pid, "RssAnon")
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=600)
        t0 = time.perf_counter()
        j = Journal(os.path.join(base, "nvme"))
        j.open_for_append()
        uid, crc = os.getuid(), crc32c(bytes(16))
        j.append({"op": "ns", "name": "dur", "uid": uid}, sync=False)
        for i in range(n):
            j.append({"op": "put", "id": 1000 + i, "gen": 1, "ns": "dur", "key": f"obj/{i:08d}", "kind": "torch",
                      "dtype": "float32", "shape": [4], "nbytes": 16, "ext": [[0, i * 4096, 0, 16]], "crc": [crc],
                      "home": None, "nsuid": uid}, sync=False)
        j.close()
        res: dict = {"n": n, "journal_bytes": os.path.getsize(j.path), "write_s": time.perf_counter() - t0}
        # (the default tail, 16 MiB, is about 120 000 objects' records: a smaller journal
        # gets a tail of a quarter of it, so the kill -9 restart below has a checkpoint)
        flags = [*flags, "--checkpoint-tail-bytes", str(min(16 << 20, res["journal_bytes"] // 4))]
        # the first daemon's stop checkpointed an empty index; the records were appended after
        # it, so it would still be used (with every record as its tail): without it, this
        # start is the full replay, record by record
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(base, "nvme", CHECKPOINT_FILE))
        daemon, res["restart_full_replay_s"] = _restarted(base, sock, flags, notify, res, "restart_full_replay")
        res["heap_bytes_per_object"] = (proc_status_bytes(daemon.pid, "RssAnon") - heap0) / n
        with Client.connect(socket=sock, namespace="dur") as c:
            # the journal is past checkpoint_tail_bytes: a forked child writes the index
            # checkpoint in the background; waited for here, so the scans below run alone
            res["background_checkpoint_s"], _ = _timed(lambda: _background_checkpoint(c))
            res["keys_s"], keys = _timed(c.keys)
            assert len(keys) == n, len(keys)
            del keys
            res["ls_s"], rows = _timed(c.ls)
            assert len(rows) == n, len(rows)
            del rows
            res["stat_s"], st = _timed(c.stat)
            assert st["namespaces"]["dur"]["objects"] == n
            res["ping_idle"] = _pings(c, args.ping_seconds)
            res["ping_under_scans"] = _pings_under_scans(c, sock, "dur", args.ping_seconds)
            for i in range(_TAIL_PUTS):  # a tail after the background checkpoint
                c.put(torch.zeros(4), key=f"tail/{i:05d}", durable=True)
        # kill -9: the restart loads the background checkpoint and replays only the tail
        daemon.kill()
        daemon.wait()
        daemon, res["restart_after_kill_s"] = _restarted(base, sock, flags, notify, res, "restart_after_kill")
        with Client.connect(socket=sock, namespace="dur") as c:
            st = c.stat()
            assert st["namespaces"]["dur"]["objects"] == n + _TAIL_PUTS
            assert st["journal"]["checkpoint"] == "used", st["journal"]
            res["restart_after_kill_records_replayed"] = st["journal"]["records_replayed"]
        # a clean stop writes the index checkpoint; the next start loads it instead of replaying
        res["stop_s"] = _stop(daemon)
        daemon, res["restart_to_ready_s"] = _restarted(base, sock, flags, notify, res, "restart")
        res["heap_bytes_per_object_checkpoint"] = (proc_status_bytes(daemon.pid, "RssAnon") - heap0) / n
        with Client.connect(socket=sock, namespace="dur") as c:
            st = c.stat()
            assert st["namespaces"]["dur"]["objects"] == n + _TAIL_PUTS
            assert st["journal"]["checkpoint"] == "used", st["journal"]
            res["restart_records_replayed"] = st["journal"]["records_replayed"]
    finally:
        _discard(daemon, notify, base)
    return res


def run_namespaces(count: int, args) -> dict:
    from tierstore.client import Client

    base = tempfile.mkdtemp(prefix="tierstore-scale-ns-")
    # a small host tier (the objects live on NVMe): every connection maps all of it
    daemon, sock, notify = start_daemon(base, "--host-bytes", "32MiB", "--nvme-bytes", str(max(1 << 30, count * 8192)),
                                        env={"TIERSTORE_NVME_GROW_BYTES": "256MiB"})
    try:
        share = [count // args.clients + (i < count % args.clients) for i in range(args.clients)]
        first = np.cumsum([0] + share[:-1])
        t0 = time.perf_counter()
        procs = [subprocess.Popen([sys.executable, "-c", FILLER, sock, str(f), str(k)]) for f, k in zip(first, share)]
        if any(p.wait(timeout=3600) != 0 for p in procs):
            raise SystemExit("a namespace filler failed")
        fill = time.perf_counter() - t0
        with Client.connect(socket=sock, namespace="watcher") as c:
            stat_s, st = _timed(c.stat)
            assert len(st["namespaces"]) == count, len(st["namespaces"])
        stat_cli_s = _cli("stat", "--socket", sock, "--json")
    finally:
        _discard(daemon, notify, base)
    return {"namespaces": count, "fill_s": fill, "stat_s": stat_s, "stat_cli_s": stat_cli_s}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="10000,100000", help="objects in one namespace, comma-separated")
    p.add_argument("--million", action="store_true", help="add N = 1 000 000 (long: minutes per phase)")
    p.add_argument("--namespaces", type=int, default=10000)
    p.add_argument("--clients", type=int, default=min(4, os.cpu_count() or 1),
                   help="put client processes (default: one per core, at most 4)")
    p.add_argument("--window", type=int, default=64, help="puts in flight per client")
    p.add_argument("--snapshot-max", type=int, default=10000,
                   help="snapshot a namespace of at most this many objects (a Zarr array each)")
    p.add_argument("--ping-seconds", type=float, default=3.0)
    p.add_argument("--journal", default="", help="also: N durable objects written as journal records, then "
                   "restart, heap, keys/ls/stat and pings through the daemon (comma-separated Ns; fast at 1 000 000)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--png", default=None, help="write a plot here (needs matplotlib)")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    journal_sizes = [int(s) for s in args.journal.split(",") if s]
    if args.million:
        sizes.append(1_000_000)
    if args.quick:
        sizes, args.namespaces, args.clients, args.snapshot_max, args.ping_seconds = [200], 20, 2, 100, 0.5
        journal_sizes = [300]
    results = []
    for n in sizes:
        print(f"# N = {n} ...", file=sys.stderr, flush=True)
        results.append(run_size(n, args))
    journal = []
    for n in journal_sizes:
        print(f"# N = {n} durable objects from journal records ...", file=sys.stderr, flush=True)
        journal.append(run_journal(n, args))
    print(f"# {args.namespaces} namespaces ...", file=sys.stderr, flush=True)
    nss = run_namespaces(args.namespaces, args)

    print(f"# scale: small objects (16 B) through one daemon, {args.clients} put clients x {args.window} in flight; "
          f"{machine()}")
    print_table(["N", "vol put/s", "dur put/s", "keys s", "ls s", "stat ms", "snapshot s (objs)", "heap B/obj",
                 "restart s served / ready (populated)", "ping p99 ms idle", "ping p99 ms scans"],
                [[r["n"], f"{r['volatile_puts_per_s']:.0f}", f"{r['durable_puts_per_s']:.0f}", f"{r['keys_s']:.2f}",
                  f"{r['ls_s']:.2f}", f"{r['stat_s'] * 1e3:.1f}", f"{r['snapshot_s']:.1f} ({r['snapshot_objects']})",
                  f"{r['heap_bytes_per_object']:.0f}",
                  f"{r.get('restart_serving_s', r['restart_to_ready_s']):.2f} / {r['restart_to_ready_s']:.2f} "
                  f"({r.get('restart_populated_s', 0):.1f})",
                  f"{r['ping_idle']['p99_ms']:.2f}", f"{r['ping_under_scans']['p99_ms']:.2f}"] for r in results])
    if journal:
        print("# durable objects written as journal records (no put phase), then through the daemon: restart "
              "replaying every record; the background checkpoint it starts (bg ckpt); 1 000 durable puts, kill -9, "
              "restart (that checkpoint and the tail); SIGTERM (writes the index checkpoint); restart from it")
        print("# (restart s: to the first answered request / to READY=1; in parentheses the seconds spent "
              "populating the host arena, in the background from the start)")
        print_table(["N", "restart s full replay", "bg ckpt s", "restart s kill -9", "stop s", "restart s checkpoint",
                     "heap B/obj", "keys s", "ls s",
                     "stat ms", "ping p99 ms idle", "ping p99 ms scans"],
                    [[r["n"], f"{r['restart_full_replay_serving_s']:.2f} / {r['restart_full_replay_s']:.2f} "
                      f"({r.get('restart_full_replay_populate_s', 0):.1f})", f"{r['background_checkpoint_s']:.1f}",
                      f"{r['restart_after_kill_serving_s']:.2f} / {r['restart_after_kill_s']:.2f}",
                      f"{r['stop_s']:.2f}",
                      f"{r['restart_serving_s']:.2f} / {r['restart_to_ready_s']:.2f} "
                      f"({r.get('restart_populate_s', 0):.1f})",
                      f"{r['heap_bytes_per_object']:.0f}", f"{r['keys_s']:.2f}",
                      f"{r['ls_s']:.2f}", f"{r['stat_s'] * 1e3:.1f}", f"{r['ping_idle']['p99_ms']:.2f}",
                      f"{r['ping_under_scans']['p99_ms']:.2f}"] for r in journal])
    print(f"# {nss['namespaces']} namespaces: filled in {nss['fill_s']:.1f} s, stat() {nss['stat_s'] * 1e3:.0f} ms, "
          f"`tierstore stat --json` {nss['stat_cli_s']:.2f} s")
    if args.png:
        plt = pyplot()
        if plt is not None:
            ns_ = [r["n"] for r in results]
            fig, axs = plt.subplots(1, 3, figsize=(13, 4))
            for k, lab in (("volatile_puts_per_s", "volatile"), ("durable_puts_per_s", "durable")):
                axs[0].plot(ns_, [r[k] for r in results], marker="o", label=lab)
            axs[0].set_ylabel("puts / s")
            for k, lab in (("keys_s", "keys()"), ("ls_s", "ls()"), ("snapshot_s", "tierstore snapshot"),
                           ("restart_to_ready_s", "restart to ready")):
                axs[1].plot(ns_, [r[k] for r in results], marker="o", label=lab)
            axs[1].set_ylabel("seconds")
            axs[2].plot(ns_, [r["ping_idle"]["p99_ms"] for r in results], marker="o", label="idle")
            axs[2].plot(ns_, [r["ping_under_scans"]["p99_ms"] for r in results], marker="o", label="2 clients scanning")
            axs[2].set_ylabel("another client's ping p99, ms")
            for ax in axs:
                ax.set_xscale("log")
                ax.set_xlabel("objects in the namespace")
                ax.legend()
            fig.tight_layout()
            fig.savefig(args.png, dpi=100)
    out = {"bench": "scale", "sizes": results, "journal": journal, "namespaces": nss, "clients": args.clients, "window": args.window,
           "machine": machine()}
    emit_json(out)
    return out


if __name__ == "__main__":
    main()
