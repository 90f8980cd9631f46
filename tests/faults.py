"""Fault-injection harness: rounds of a randomized multi-process workload against a real
daemon, with SIGKILL of the daemon or of a client at a random moment, then a restart
(half of them handed the previous daemon's arena through an emulated systemd fd store,
so the host tier is adopted) and a check of every invariant DESIGN.md promises. Half
the rounds add a client that stalls holding leases until the daemon revokes them
(``lease_timeout_s``), then writes through its old views.

    python tests/faults.py --rounds 20 --seed 7          # a fixed number of rounds
    python tests/faults.py --soak 30                     # as many rounds as fit in 30 minutes
    python tests/faults.py --journal-damage --rounds 100 # journal damage between stop and restart

``--journal-damage`` runs other rounds (``run_journal_damage``): durable puts,
replaces, write-backs and frees, then a stop (SIGKILL or SIGTERM), damage anywhere in
the journal (flipped bytes, a zeroed page, a cut-out stretch), a restart, and checks
against what the damaged image still vouches for (``journal_evidence``).

Seeded: the same seed replays the same schedule of operations and kills (timing
still varies with the machine). The short version runs in CI (tests/test_faults.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

PAGE = 4096

PRELUDE = r"""
import json, sys, time, zlib, numpy as np
from tierstore.client import Client
from tierstore import CapacityExceeded, Busy, NotFound
sock, ns, seed, ledger_path = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
rng = np.random.default_rng(seed)

def data(key, ver, n):
    return np.random.default_rng(zlib.crc32(f"{ns}|{key}|{ver}".encode())).integers(0, 256, n, dtype=np.uint8)

ledger = open(ledger_path, "a", buffering=1)
def log(**kw):
    ledger.write(json.dumps(kw) + "\n")
c = Client.connect(socket=sock, namespace=ns)
"""
"""What a worker and a staller start with: arguments (socket, namespace, seed, ledger
path), the bytes of each key's versions, the ledger and the connection."""

WORKER = PRELUDE + r"""
n_ops = int(sys.argv[5])
live = {}  # key -> (ver, n, durable)
for i in range(n_ops):
    r = rng.random()
    if r < 0.35 or not live:
        key, n = f"k{seed}-{i}", int(rng.integers(0, 300_000))
        if live and rng.random() < 0.3:  # the size of another object: a source for check-outs of it
            n = live[list(live)[int(rng.integers(len(live)))]][1]
        durable, tier = bool(rng.random() < 0.4), (None if rng.random() < 0.7 else "nvme")
        ephemeral = not durable and bool(rng.random() < 0.25)  # goes when this worker's connection does
        log(op="put-begin", key=key, ver=0, n=n, durable=durable, ephemeral=ephemeral)
        try:
            c.put(data(key, 0, n), key=key, durable=durable, tier=tier, ephemeral=ephemeral)
        except CapacityExceeded:
            log(op="put-failed", key=key)
            continue
        log(op="put", key=key, ver=0, n=n, durable=durable)
        live[key] = (0, n, durable)
    elif r < 0.65:
        key = list(live)[int(rng.integers(len(live)))]
        ver, n, _ = live[key]
        got = c.get(c.lookup(key))
        assert np.array_equal(got, data(key, ver, n)), f"wrong bytes for {key}"
    elif r < 0.75 and any(live[a][1] == live[b][1] and a != b and live[a][1] for a in live for b in live):
        # a check-out that starts with another object's bytes (source=): the source must stay as it was
        dst, src = next((a, b) for a in rng.permutation(list(live)) for b in live
                        if a != b and live[a][1] == live[b][1] and live[a][1])
        dst = str(dst)
        log(op="rw-begin", key=dst, ver=live[dst][0] + 1)
        try:
            with c.checkout(c.lookup(dst), "w", source=c.lookup(src), timeout_s=5) as v:
                ver, n, _ = live[dst]
                assert np.array_equal(v, data(src, live[src][0], n)), f"{dst} did not start as {src}"
                v[:] = data(dst, ver + 1, n)
        except CapacityExceeded:
            log(op="rw-failed", key=dst)
            continue
        ver, n, durable = live[dst]
        log(op="rw", key=dst, ver=ver + 1)
        live[dst] = (ver + 1, n, durable)
        assert np.array_equal(c.get(c.lookup(src)), data(src, live[src][0], n)), f"source {src} changed"
    elif r < 0.85:  # a write check-out of one object, or of up to 3 in one batch
        keys = [str(k) for k in rng.choice(list(live), size=min(len(live), int(rng.integers(1, 4))), replace=False)]
        for key in keys:
            log(op="rw-begin", key=key, ver=live[key][0] + 1)
        try:
            if len(keys) == 1:
                lease = c.checkout(c.lookup(keys[0]), "rw", timeout_s=5)
            elif rng.random() < 0.5:  # all or nothing
                lease = c.checkout_many([c.lookup(k) for k in keys], "rw", timeout_s=5)
            else:  # one message, each on its own (a failed one gives the others back)
                lease = c.checkout_each([(c.lookup(k), "rw", None) for k in keys], timeout_s=5)
            with lease as vs:
                for key, v in zip(keys, vs if len(keys) > 1 else [vs]):
                    ver, n, _ = live[key]
                    assert np.array_equal(v, data(key, ver, n)), f"wrong bytes in checkout of {key}"
                    v[:] = data(key, ver + 1, n)
        except CapacityExceeded:
            for key in keys:
                log(op="rw-failed", key=key)
            continue
        for key in keys:
            ver, n, durable = live[key]
            log(op="rw", key=key, ver=ver + 1)
            live[key] = (ver + 1, n, durable)
    else:
        key = list(live)[int(rng.integers(len(live)))]
        log(op="free-begin", key=key)
        c.free(c.lookup(key))
        log(op="free", key=key)
        del live[key]
log(op="done")
"""

STALLER = PRELUDE + r"""
objs = {}
for key, durable in (("x", False), ("y", True), ("z", False)):
    n = int(rng.integers(4096, 1 << 20))
    log(op="put-begin", key=key, ver=0, n=n, durable=durable, ephemeral=False)
    objs[key] = (c.put(data(key, 0, n), key=key, durable=durable), n)
    log(op="put", key=key, ver=0, n=n, durable=durable)
(hx, nx), (hy, ny), (hz, nz) = objs["x"], objs["y"], objs["z"]
revoked = c.stat()["counters"]["leases_revoked"]  # (the daemon's count so far)
log(op="rw-begin", key="x", ver=1)
log(op="rw-begin", key="y", ver=1)
lx, ly, lz = c.checkout(hx, "rw"), c.checkout(hy, "w"), c.checkout(hz, "r")
cut = int(rng.integers(0, nx))
lx.tensor[:cut] = data("x", 1, nx)[:cut]  # part of an update, then it stops answering
ly.tensor[:] = data("y", 1, ny)
deadline = time.monotonic() + 120
while c.stat()["counters"]["leases_revoked"] < revoked + 3:  # this client's three: the only long holds
    assert time.monotonic() < deadline, "the daemon did not revoke the stalled client's leases"
    time.sleep(0.1)
end = time.monotonic() + 1.5
while time.monotonic() < end:  # it resumes and goes on writing through its old views
    lx.tensor[:] = 0xEE
    ly.tensor[:] = 0xEE
    time.sleep(0.02)
want_x = data("x", 0, nx)
want_x[:cut] = data("x", 1, nx)[:cut]
assert np.array_equal(c.get(hx), want_x), "x changed after its lease was revoked"
assert np.array_equal(c.get(hy), data("y", 1, ny)), "y: the revoked check-in is not what was written"
assert np.array_equal(c.get(hz), data("z", 0, nz)), "z changed"
lx.release()
lz.release()
try:
    ly.release()  # durable: its check-in is answered, and the lease is gone
    raise AssertionError("the check-in of a revoked durable lease succeeded")
except NotFound:
    pass
log(op="rw", key="y", ver=1)
for key, (h, _) in objs.items():
    log(op="free-begin", key=key)
    c.free(h)
    log(op="free", key=key)
"""
"""A client that stops answering while it holds an ``rw``, a durable ``w`` and an ``r``
lease, is revoked (``lease_timeout_s``) and then goes on writing through its views: the
other workers' objects must not change, nor its own."""

LEASE_TIMEOUT_S = 3


@dataclass
class Stats:
    rounds: int = 0
    daemon_kills: int = 0
    client_kills: int = 0
    graceful_stops: int = 0
    handbacks: int = 0
    stallers: int = 0
    objects_checked: int = 0
    durable_checked: int = 0
    ephemeral_checked: int = 0
    failures: list[str] = field(default_factory=list)


def data(ns: str, key: str, ver: int, n: int) -> np.ndarray:
    return np.random.default_rng(zlib.crc32(f"{ns}|{key}|{ver}".encode())).integers(0, 256, n, dtype=np.uint8)


class Daemon:
    def __init__(self, base: Path, host_bytes: str, extra_args: tuple[str, ...] = ()) -> None:
        self.base = base
        self.extra_args = list(extra_args)
        self.socket = str(base / "run" / "ts.sock")
        self.host_bytes = host_bytes
        self.proc: subprocess.Popen | None = None
        self.notify_path = str(base / "notify")
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(self.notify_path)
        self.notify.settimeout(120)
        self.fdstore: dict[str, int] = {}
        """What the daemon handed to "systemd" (FDSTORE=1): its arena and host index log."""

    def start(self, handback: bool = False) -> bool:
        """Start a daemon; with ``handback``, give it the previous one's arena and index
        (systemd's fd store emulated) so it adopts the host tier. Returns whether it did."""
        env = {**os.environ, "NOTIFY_SOCKET": self.notify_path, "TIERSTORE_LEASE_TIMEOUT_S": str(LEASE_TIMEOUT_S)}
        args = ["--socket", self.socket, "--nvme-dir", str(self.base / "nvme"), "--host-bytes", self.host_bytes,
                "--nvme-bytes", "2GiB", "--log-level", "INFO", *self.extra_args]
        handback = handback and {"arena", "index"} <= set(self.fdstore)
        log = open(self.base / "daemon.log", "ab")
        if handback:
            fds = (self.fdstore["arena"], self.fdstore["index"])
            self.proc = subprocess.Popen([sys.executable, "-c", LAUNCH, *map(str, fds), *args], pass_fds=fds,
                                         env=env, stdout=log, stderr=log)
        else:
            self.proc = subprocess.Popen([sys.executable, "-m", "tierstore.daemon", *args], env=env, stdout=log,
                                         stderr=log)
        log.close()
        while True:  # readiness: READY=1 means the journal was replayed (and the arena adopted)
            try:
                raw, fds, _, _ = socket.recv_fds(self.notify, 4096, 8)
            except TimeoutError:
                raise RuntimeError("daemon did not become ready; see " + str(self.base / "daemon.log")) from None
            msg = raw.decode()
            if fds and "FDSTORE=1" in msg and "FDNAME=" in msg:
                name = msg.split("FDNAME=")[1].split()[0]
                if name in self.fdstore:
                    os.close(self.fdstore[name])
                self.fdstore[name] = fds[0]
                for extra in fds[1:]:
                    os.close(extra)
            else:
                for fd in fds:
                    os.close(fd)
            if "READY=1" in msg:
                return handback

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=120)
        if self.proc.returncode != 0:
            raise RuntimeError(f"daemon exited {self.proc.returncode} on SIGTERM")

    def close(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.notify.close()
        for fd in self.fdstore.values():
            os.close(fd)
        self.fdstore.clear()


LAUNCH = r"""
import os, sys
arena, index = int(sys.argv[1]), int(sys.argv[2])
os.dup2(arena, 3); os.dup2(index, 4)
os.environ.update(LISTEN_FDS="2", LISTEN_FDNAMES="arena:index", LISTEN_PID=str(os.getpid()))
os.execv(sys.executable, [sys.executable, "-m", "tierstore.daemon", *sys.argv[3:]])
"""
"""Starts the daemon the way systemd restarts one with a file-descriptor store: the fds
as 3 and 4, named in LISTEN_FDNAMES."""


def read_ledger(path: Path) -> dict[str, dict]:
    """Per key: what the worker knows returned, and what was in flight when it died."""
    state: dict[str, dict] = {}
    if not path.exists():
        return state
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by SIGKILL
        k = r.get("key")
        if k is None:
            continue
        s = state.setdefault(k, {"ver": None, "n": None, "durable": False, "returned": False, "inflight": None})
        op = r["op"]
        if op == "put-begin":
            s.update(n=r["n"], durable=r["durable"], inflight="put", ver=0, ephemeral=r.get("ephemeral", False))
        elif op == "put":
            s.update(returned=True, inflight=None)
        elif op in ("put-failed",):
            s.update(inflight=None, gone=True)
        elif op == "rw-begin":
            s["inflight"] = "rw"
        elif op == "rw":
            s.update(ver=r["ver"], inflight=None)
        elif op == "rw-failed":
            s["inflight"] = None
        elif op == "free-begin":
            s["inflight"] = "free"
        elif op == "free":
            s.update(freed=True, inflight=None)
    return state


_STAGING_AREA_BYTES = 64 * 1024 + 32 * 4096
"""One client connection's staging area in the host tier (staged puts and gets, put_async slots)."""


def check(daemon: Daemon, namespaces: list[str], ledgers: dict[str, Path], restarted: bool, daemon_crashed: bool,
          stats: Stats, adopted: bool = False) -> None:
    """Every invariant after a round. ``adopted``: the restarted daemon was handed the
    arena, so volatile host-resident objects may have survived it (NVMe-only ones not)."""
    from tierstore.client import Client

    fail = stats.failures.append
    with Client.connect(socket=daemon.socket, namespace=namespaces[0]) as c0:
        for _ in range(2000):  # the daemon notices dead clients asynchronously
            st = c0.stat()
            if st["clients"] == 1 and st["leases"] == 0 and st["reservations"] == 0:
                break
            c0.ping()
        if st["leases"] or st["reservations"]:
            fail(f"round {stats.rounds}: {st['leases']} leases / {st['reservations']} reservations survived "
                 "their connections")
    for ns in namespaces:
        with Client.connect(socket=daemon.socket, namespace=ns) as c:
            ledger = read_ledger(ledgers[ns])
            ephemeral = {k for k, s in ledger.items() if s.get("ephemeral")}
            for _ in range(200):  # its worker's connection is gone: they go (asynchronously)
                present = {r["key"]: r for r in c.ls()}
                if not ephemeral & set(present):
                    break
                time.sleep(0.02)
            for key, s in ledger.items():
                if s.get("ephemeral"):
                    if key in present:
                        fail(f"{ns}/{key}: ephemeral, but still present after its connection ended")
                    stats.ephemeral_checked += 1
                    continue
                if s.get("freed"):
                    if key in present:
                        fail(f"{ns}/{key}: freed, but present after the restart")
                    continue
                must_exist = s["returned"] and s["inflight"] != "free" and (s["durable"] or not restarted)
                if key not in present:
                    if must_exist:
                        fail(f"{ns}/{key}: {'durable ' if s['durable'] else ''}put returned, object missing")
                    continue
                if s["inflight"] == "rw" and (not daemon_crashed or (adopted and not s["durable"])):
                    # killed while writing through its view (or, volatile, adopted as its block held it
                    # when the daemon died): the bytes are whatever it wrote
                    continue
                got = c.get(c.lookup(key)).view(np.uint8)
                ok_versions = [s["ver"]] + ([s["ver"] + 1] if s["inflight"] == "rw" else [])
                if not any(np.array_equal(got, data(ns, key, v, s["n"])) for v in ok_versions):
                    fail(f"{ns}/{key}: wrong bytes after restart (versions {ok_versions})")
                stats.objects_checked += 1
                stats.durable_checked += s["durable"]
            # free everything so the next round starts clean and the space must come back
            for key in present:
                c.free(c.lookup(key))
    with Client.connect(socket=daemon.socket, namespace=namespaces[0]) as c:
        deadline = time.monotonic() + 30
        while True:  # the connections above just closed: their staging areas go asynchronously
            st = c.stat()
            host_used, nvme_used = st["tiers"]["host"]["used_bytes"], st["tiers"]["nvme"]["used_bytes"]
            if (host_used <= _STAGING_AREA_BYTES and not nvme_used) or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        if nvme_used:
            fail(f"round {stats.rounds}: {nvme_used} NVMe bytes still allocated with no object left (leak)")
        if host_used > _STAGING_AREA_BYTES:  # at most this connection's staging area
            fail(f"round {stats.rounds}: {host_used} host bytes allocated with no object left (leak)")
        if st["tiers"]["host"]["fenced_bytes"]:
            fail(f"round {stats.rounds}: {st['tiers']['host']['fenced_bytes']} host bytes still fenced with "
                 "no revoked client connected")


def journal_evidence(data: bytes, damaged: list[tuple[int, int]]) -> tuple[set[int], set[int]]:
    """What a journal image promises after the byte ranges ``damaged`` (of that image)
    were flipped, zeroed or cut: (ids of the objects whose latest put record is intact
    and that were not freed, ids of the freed objects of which some intact record says so)."""
    from tierstore.journal import scan

    latest: dict[int, bool] = {}
    freed: set[int] = set()
    evidenced: set[int] = set()
    for s, e, r in scan(data):
        if r is None:
            continue
        intact = not any(s < hi and lo < e for lo, hi in damaged)
        ids = list(r.get("fr") or [])
        if r.get("op") == "put":
            latest[r["id"]] = intact
        elif r.get("op") == "free":
            freed.add(r["id"])
            ids.append(r["id"])
        if intact:
            evidenced.update(ids)
    return {oid for oid, ok in latest.items() if ok and oid not in freed}, evidenced


def run(rounds: int | None, seed: int, workers: int = 3, ops: int = 400, soak_s: float | None = None,
        base: Path | None = None, host_bytes: str = "32MiB", verbose: bool = True) -> Stats:
    rng = random.Random(seed)
    own = base is None
    base = Path(base or tempfile.mkdtemp(prefix="tierstore-faults-"))
    stats = Stats()
    daemon = Daemon(base, host_bytes)
    deadline = time.monotonic() + soak_s if soak_s else None
    try:
        daemon.start()
        while (rounds is None or stats.rounds < rounds) and (deadline is None or time.monotonic() < deadline):
            stats.rounds += 1
            r = stats.rounds
            namespaces = [f"fi{r}/w{i}" for i in range(workers)]
            ledgers = {ns: base / f"ledger-{r}-{i}.jsonl" for i, ns in enumerate(namespaces)}
            procs = [subprocess.Popen([sys.executable, "-c", WORKER, daemon.socket, ns, str(rng.randrange(1 << 30)),
                                       str(ledgers[ns]), str(ops)], stdout=subprocess.DEVNULL,
                                      stderr=open(base / f"worker-{r}-{i}.log", "w"))
                     for i, ns in enumerate(namespaces)]
            if rng.random() < 0.5:  # a client that stalls holding leases, revoked meanwhile
                ns = f"fi{r}/stall"
                namespaces.append(ns)
                ledgers[ns] = base / f"ledger-{r}-stall.jsonl"
                procs.append(subprocess.Popen([sys.executable, "-c", STALLER, daemon.socket, ns,
                                               str(rng.randrange(1 << 30)), str(ledgers[ns])],
                                              stdout=subprocess.DEVNULL,
                                              stderr=open(base / f"worker-{r}-{len(procs)}.log", "w")))
                stats.stallers += 1
            time.sleep(rng.uniform(0.3, 2.0))  # the fault lands at a random moment of the workload
            victim = rng.choice(["daemon", "client", "client", "none"])
            daemon_crashed = False
            if victim == "daemon":
                daemon.kill()
                stats.daemon_kills += 1
                daemon_crashed = True
                for p in procs:
                    p.kill()
            elif victim == "client":
                rng.choice(procs).kill()
                stats.client_kills += 1
            for p in procs:
                try:
                    p.wait(timeout=300)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
                    stats.failures.append(f"round {r}: a worker hung")
            for i, p in enumerate(procs):
                if p.returncode not in (0, -signal.SIGKILL) and not daemon_crashed:
                    err = (base / f"worker-{r}-{i}.log").read_text()[-800:]
                    stats.failures.append(f"round {r}: worker {i} failed: {err}")
            restarted, adopted = daemon_crashed, False
            if daemon_crashed:
                adopted = daemon.start(handback=rng.random() < 0.5)  # journal replay (and the arena, half the time)
            elif rng.random() < 0.3:
                daemon.stop()  # graceful stop, then a restart: volatile objects end with the daemon unless
                stats.graceful_stops += 1  # it is handed the arena
                adopted = daemon.start(handback=rng.random() < 0.5)
                restarted = True
            stats.handbacks += adopted
            check(daemon, namespaces, ledgers, restarted, daemon_crashed, stats, adopted)
            if verbose:
                print(f"round {r}: fault={victim} checked={stats.objects_checked} failures={len(stats.failures)}",
                      flush=True)
    finally:
        daemon.close()
        if own and not stats.failures:
            shutil.rmtree(base, ignore_errors=True)
    return stats


# ---------------------------------------------------------------------------- journal damage
@dataclass
class JournalStats:
    rounds: int = 0
    flips: int = 0
    zeroed_pages: int = 0
    cuts: int = 0
    graceful_stops: int = 0
    objects_checked: int = 0
    """Acknowledged durable objects whose latest record was intact: present and byte-exact."""
    objects_lost_with_their_records: int = 0
    """Acknowledged objects gone because their own latest record was damaged (allowed)."""
    objects_back_from_an_earlier_record: int = 0
    """Acknowledged objects whose latest record was damaged, back as an earlier intact one has
    them (allowed; not compared: an earlier version, or bytes that fail their CRC)."""
    frees_checked: int = 0
    """Acknowledged frees some intact record vouched for: not undone."""
    frees_undone_without_evidence: int = 0
    """Acknowledged frees whose record and every repeat of it were damaged (allowed, counted)."""
    ownership_checked: int = 0
    records_damaged: int = 0
    failures: list[str] = field(default_factory=list)


NOBODY_ENTERS = r"""
import os, sys, pwd
from tierstore.client import Client
from tierstore import PermissionDenied
import tierstore.errors, tierstore.tensors, tierstore.arena, numpy
pw = pwd.getpwnam("nobody")
os.setgroups([]); os.setgid(pw.pw_gid); os.setuid(pw.pw_uid)
for ns in sys.argv[2:]:
    try:
        Client.connect(socket=sys.argv[1], namespace=ns).put(numpy.zeros(3), key="taken")
        print("ENTERED", ns)
    except PermissionDenied:
        print("REFUSED", ns)
"""
"""Another uid tries to enter each namespace (and claim it with a put)."""


def _ownership_evidence(data: bytes, damaged: list[tuple[int, int]]) -> set[str]:
    """Namespaces some intact record of the journal image says are owned."""
    from tierstore.journal import scan

    out: set[str] = set()
    for s, e, r in scan(data):
        if r is None or any(s < hi and lo < e for lo, hi in damaged):
            continue
        if r.get("op") == "ns":
            out.add(r["name"])
        if r.get("op") == "put" and r.get("nsuid") is not None:
            out.add(r["ns"].split("/")[0])
        out.update(x[0] for x in r.get("own") or [])
    return out


def _damage_journal(path: Path, rng: random.Random, stats: JournalStats) -> tuple[bytes, list[tuple[int, int]]]:
    """Flip random bytes, zero a whole page or cut a stretch out, anywhere in the journal.
    Returns the image before, and the damaged ranges (in its coordinates)."""
    data = path.read_bytes()
    buf = bytearray(data)
    kind = rng.choice(["flip", "page", "cut"])
    if kind == "flip":
        spots = sorted({rng.randrange(len(buf)) for _ in range(rng.randint(1, 8))})
        for p in spots:
            buf[p] ^= 1 << rng.randrange(8)
        ranges = [(p, p + 1) for p in spots]
        stats.flips += 1
    elif kind == "page":
        page = rng.randrange(-(-len(buf) // PAGE))
        lo, hi = page * PAGE, min((page + 1) * PAGE, len(buf))
        buf[lo:hi] = bytes(hi - lo)
        ranges = [(lo, hi)]
        stats.zeroed_pages += 1
    else:
        lo = rng.randrange(len(buf))
        hi = min(len(buf), lo + rng.randint(1, 3000))
        del buf[lo:hi]
        ranges = [(lo, hi)]
        stats.cuts += 1
    path.write_bytes(bytes(buf))
    return data, ranges


def run_journal_damage(rounds: int, seed: int, base: Path | None = None, ops: int = 60,
                       verbose: bool = True) -> JournalStats:
    """Rounds of durable puts, replaces, write-backs and frees against a real daemon, which
    is then stopped (SIGKILL, or SIGTERM one round in four); its journal is damaged
    anywhere (random bytes flipped, a whole page zeroed, or a stretch cut out) and the
    daemon restarted. After each restart: it started; every acknowledged durable object
    whose latest record is intact is present and byte-exact; no acknowledged free that
    some intact record vouches for is undone; every namespace some intact record says is
    owned still refuses another uid."""
    import grp
    import pwd

    from tierstore import NotFound
    from tierstore.client import Client
    from tierstore.journal import JOURNAL_FILE, scan

    rng = random.Random(seed)
    own = base is None
    base = Path(base or tempfile.mkdtemp(prefix="tierstore-journal-", dir="/tmp"))
    base.chmod(0o755)  # nobody reaches the socket (its group is admitted)
    group = grp.getgrgid(pwd.getpwnam("nobody").pw_gid).gr_name
    stats = JournalStats()
    daemon = Daemon(base, "32MiB", ("--allowed-group", group, "--nvme-bytes", "512MiB"))
    model: dict[tuple[str, str], tuple] = {}  # (ns, key) -> (handle, ver, n)
    namespaces: list[str] = []
    freed: list[tuple[str, Any]] = []  # (ns, handle) of the frees acknowledged since the last restart
    try:
        daemon.start()
        for r in range(1, rounds + 1):
            stats.rounds = r
            fail = stats.failures.append
            ns = f"jd{r}"
            namespaces.append(ns)
            with Client.connect(socket=daemon.socket, namespace=ns) as c:
                for i in range(ops):
                    x = rng.random()
                    mine = [k for k in model if k[0] == ns]
                    if x < 0.45 or not mine:
                        key = f"k{rng.randrange(12)}"
                        n = rng.choice([0, 1000, rng.randrange(1, 300_000)])
                        h = c.put(data(ns, key, i, n), key=key, durable=True, replace=True,
                                  tier=rng.choice([None, "nvme"]))
                        old = model.get((ns, key))
                        if old is not None:
                            freed.append((ns, old[0]))  # a replace frees the object it replaced
                        model[(ns, key)] = (h, i, n)
                    elif x < 0.65:
                        k = rng.choice(mine)
                        h, _, n = model[k]
                        if n:
                            with c.checkout(h, "rw", timeout_s=5) as v:  # a write-back: a new put record
                                v[:] = data(ns, k[1], 10_000 + i, n)
                            model[k] = (h, 10_000 + i, n)
                    else:
                        h = model.pop(rng.choice(mine))[0]
                        c.free(h)
                        freed.append((ns, h))
            if rng.random() < 0.25:
                daemon.stop()
                stats.graceful_stops += 1
            else:
                daemon.kill()
            path = base / "nvme" / JOURNAL_FILE
            image, ranges = _damage_journal(path, rng, stats)
            stats.records_damaged += sum(1 for s_, e_, rec in scan(image)
                                         if rec is not None and any(s_ < hi and lo < e_ for lo, hi in ranges))
            must, evidenced = journal_evidence(image, ranges)
            owned = _ownership_evidence(image, ranges)
            try:
                daemon.start()
            except RuntimeError as e:
                fail(f"round {r}: the daemon did not start on a damaged journal: {e}")
                break
            with Client.connect(socket=daemon.socket, namespace="jd-check") as c0:
                if not c0.stat()["journal"].get("kept_aside"):
                    fail(f"round {r}: the daemon did not say what it skipped (no journal kept aside)")
            for (n_s, key), (h, ver, n) in list(model.items()):
                with Client.connect(socket=daemon.socket, namespace=n_s) as c:
                    got_h = c.lookup(key)
                    if h.id not in must:
                        # its latest record was damaged: gone, or back as its last intact record has it
                        # (an earlier version, or bytes that fail their CRC if its old space was reused)
                        del model[(n_s, key)]
                        if got_h == h:
                            stats.objects_back_from_an_earlier_record += 1
                        else:
                            stats.objects_lost_with_their_records += 1
                        if got_h is not None:
                            c.free(got_h)
                        continue
                    if got_h != h:
                        fail(f"round {r}: {n_s}/{key} ({h}): its latest record is intact, but it is "
                             f"{'missing' if got_h is None else f'now {got_h}'} after the restart")
                        del model[(n_s, key)]
                        continue
                    got = c.get(h)
                    if not np.array_equal(np.asarray(got).view(np.uint8).reshape(-1), data(n_s, key, ver, n)):
                        fail(f"round {r}: {n_s}/{key}: wrong bytes after the restart")
                    stats.objects_checked += 1
            for n_s, h in freed:
                with Client.connect(socket=daemon.socket, namespace=n_s) as c:
                    try:
                        c.info(h)
                    except NotFound:
                        stats.frees_checked += h.id in evidenced
                        continue
                    if h.id in evidenced:
                        fail(f"round {r}: {n_s} {h}: an acknowledged free was undone")
                    else:
                        stats.frees_undone_without_evidence += 1
                    c.free(h)
            freed = []
            probe = [n_ for n_ in {ns, rng.choice(namespaces)} if n_ in owned]
            if probe:
                out = subprocess.run([sys.executable, "-c", NOBODY_ENTERS, daemon.socket, *probe], capture_output=True,
                                     text=True, timeout=120, env={**os.environ, "HOME": "/tmp"})
                for n_ in probe:
                    if f"REFUSED {n_}" not in out.stdout:
                        fail(f"round {r}: another uid entered namespace {n_} after the restart: "
                             f"{(out.stdout + out.stderr)[-300:]}")
                    stats.ownership_checked += 1
            while len(model) > 40:  # keep the journal small: the oldest objects go
                (n_s, key), (h, _, _) = next(iter(model.items()))
                with Client.connect(socket=daemon.socket, namespace=n_s) as c:
                    c.free(h)
                freed.append((n_s, h))
                del model[(n_s, key)]
            for p in base.glob("nvme/journal.damaged-*"):
                p.unlink()
            if verbose:
                print(f"round {r}: checked={stats.objects_checked} frees={stats.frees_checked} "
                      f"failures={len(stats.failures)}", flush=True)
    finally:
        daemon.close()
        if own and not stats.failures:
            shutil.rmtree(base, ignore_errors=True)
    return stats


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--soak", type=float, default=None, metavar="MINUTES")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--journal-damage", action="store_true",
                   help="rounds that damage the journal anywhere (flipped bytes, zeroed pages, cut stretches) "
                        "between a stop and a restart of the daemon (needs root: another uid probes ownership)")
    args = p.parse_args()
    rounds = args.rounds if args.rounds is not None or args.soak else 10
    if args.journal_damage:
        t0 = time.monotonic()
        jstats = run_journal_damage(rounds, args.seed)
        print(json.dumps({**jstats.__dict__, "seconds": round(time.monotonic() - t0)}))
        return 1 if jstats.failures else 0
    stats = run(rounds, args.seed, workers=args.workers, soak_s=args.soak * 60 if args.soak else None)
    print(json.dumps(stats.__dict__))
    return 1 if stats.failures else 0


if __name__ == "__main__":
    sys.exit(main())
