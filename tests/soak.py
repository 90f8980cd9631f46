"""Randomized soak of the training hooks and the object API against plain references.

    python tests/soak.py optimizer --seeds 0:200   # offloaded optimizers vs plain ones, bit-exact, every step
    python tests/soak.py params --seeds 0:500      # offloaded parameters vs the plain model
    python tests/soak.py api --seeds 0:300         # Store / Client calls (and a snapshot round trip) vs the expected bytes
    python tests/soak.py api-concurrent --seeds 0:100  # the same from 2-6 threads or connections at once

Each seed builds one random case — model and optimizer, dtypes, skipped gradients,
resumes and state_dict round trips, activation checkpointing, tied and frozen
parameters, tiers, pool sizes, policy, prefetch, I/O threads, an in-process Store or
a real daemon — and checks it after every step or call. A failure names its seed,
which replays it. A short run is part of the test suite (tests/test_soak.py).
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager, nullcontext

import numpy as np
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tierstore import Busy, CapacityExceeded, Config, Handle, InvalidArgument, NotFound, Store
from tierstore.client import Client
from tierstore.client.torch import offload_optimizer, offload_parameters


@contextmanager
def pool(rng: random.Random, base: str, host: int, nvme: int, budget: int):
    """An in-process Store or a client of a real daemon (chosen by ``rng``), with random settings."""
    policy, prefetch, io = rng.choice(["trace", "lru"]), rng.random() < 0.7, rng.choice([1, 2, 4, 8])
    chunk = rng.choice([1, 2, 4]) << 20
    if rng.random() < 0.5:
        s = Store(Config(host_bytes=host, nvme_dirs=[os.path.join(base, "nvme")], nvme_bytes=nvme, policy=policy,
                         prefetch=prefetch, prefetch_budget_bytes=budget, io_threads=io, io_chunk_bytes=chunk,
                         nvme_grow_bytes=16 << 20), namespace="soak")
        try:
            yield s, lambda: nullcontext(s)
        finally:
            s.close()
        return
    sock, notify = os.path.join(base, "run", "ts.sock"), os.path.join(base, "notify")
    ns = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    ns.bind(notify)
    ns.settimeout(120)
    with open(os.path.join(base, "daemon.log"), "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tierstore.daemon", "--socket", sock, "--nvme-dir", os.path.join(base, "nvme"),
             "--host-bytes", str(host), "--nvme-bytes", str(nvme), "--policy", policy, "--prefetch", str(int(prefetch)),
             "--prefetch-budget-bytes", str(budget), "--io-threads", str(io), "--io-chunk-bytes", str(chunk)],
            env={**os.environ, "NOTIFY_SOCKET": notify, "TIERSTORE_NVME_GROW_BYTES": "16MiB"}, stdout=log, stderr=log)
    try:
        while b"READY=1" not in ns.recv(4096):
            pass
        with Client.connect(socket=sock, namespace="soak") as c:
            yield c, lambda: Client.connect(socket=sock, namespace="soak")
    finally:
        proc.terminate()
        proc.wait()
        ns.close()


# ---------------------------------------------------------------------------- optimizers
OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5),
}


def soak_optimizer(seed: int, base: str) -> str:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    dtype = rng.choice([torch.float32, torch.float32, torch.bfloat16])
    shapes = [(rng.choice([1, 7, 64, 300]), rng.choice([1, 3, 128, 257])) for _ in range(rng.randint(2, 10))]
    plain = [nn.Parameter(torch.randn(s).to(dtype)) for s in shapes]
    off = [nn.Parameter(p.detach().clone()) for p in plain]
    name = rng.choice(sorted(OPTIMIZERS))
    make, tier = OPTIMIZERS[name], rng.choice(["nvme", None, "host"])
    # plain mixed precision: the optimizer updates fp32 masters, which are rounded into the parameters
    masters = [nn.Parameter(p.detach().float()) for p in plain] if dtype != torch.float32 else []
    big = max(p.numel() for p in plain) * 4 * (2 if masters else 1)
    budget = big * rng.choice([1, 2, 3])
    host = max(sum(p.numel() for p in plain) * 16 // rng.choice([2, 3, 4, 6]), 4 * big + budget + (1 << 20))
    bucket = rng.choice([0, 4096, 64 << 10, 16 << 20])  # one at a time .. more than the host tier (split)
    # one or two state versions (None: the tier's default), drawn apart so the other draws stay as they were;
    # a resume may take the state up with the other setting
    modes = random.Random(seed + 1_000_003)
    with pool(rng, base, host, 64 << 20, budget) as (s, _):
        opt_p = make(masters or plain)
        opt_o = offload_optimizer(make(off), s, tier=tier, prefix="opt", bucket_bytes=bucket,
                                  crash_consistent=modes.choice([None, False, True]))
        loaded_at = 0
        for step in range(rng.randint(5, 20)):
            for a, b in zip(plain, off):
                a.grad = torch.randn(a.shape).to(dtype)
                b.grad = a.grad.clone()
            if rng.random() < 0.3:  # no gradient this step: an expert not routed to
                k = rng.randrange(len(plain))
                plain[k].grad = off[k].grad = None
            for m, p in zip(masters, plain):
                m.grad = None if p.grad is None else p.grad.float()
            opt_p.step()
            opt_o.step()
            with torch.no_grad():
                for m, p in zip(masters, plain):
                    p.copy_(m)
            for i, (a, b) in enumerate(zip(plain, off)):
                assert torch.equal(a, b), f"seed {seed}: {name} {dtype} step {step}: parameter {i} differs"
            r = rng.random()
            if r < 0.1:  # a new process takes the state up from the pool
                opt_o = offload_optimizer(make(off), s, tier=tier, prefix="opt", resume=True, bucket_bytes=bucket,
                                          crash_consistent=modes.choice([None, False, True]))
                assert opt_o.completed_steps == step + 1 - loaded_at, f"seed {seed}: resumed at the wrong step"
            elif r < 0.15 and not masters:  # a checkpoint's state_dict into a fresh wrapper
                sd = opt_o.state_dict()
                opt_o = offload_optimizer(make(off), s, tier=tier, prefix="opt", bucket_bytes=bucket,
                                          crash_consistent=modes.choice([None, False, True]))
                opt_o.load_state_dict(sd)
                loaded_at = step + 1
        if not masters:
            want, got = opt_p.state_dict()["state"], opt_o.state_dict()["state"]
            for i in want:
                for k, v in want[i].items():
                    assert torch.equal(torch.as_tensor(v), torch.as_tensor(got[i][k])), f"seed {seed}: state {i}/{k}"
    return f"{name} {dtype} tier={tier}"


# ---------------------------------------------------------------------------- parameters
class RandomNet(nn.Module):
    """Nested modules run in a random plan (some twice), some frozen, some checkpointed,
    some of their weights also used functionally by the parent."""

    def __init__(self, rng: random.Random, depth: int = 0) -> None:
        super().__init__()
        leaves = [lambda: nn.Linear(16, 16), lambda: nn.LayerNorm(16), lambda: nn.Sequential(nn.Linear(16, 16),
                                                                                            nn.Tanh())]
        self.kids = nn.ModuleList(RandomNet(rng, depth + 1) if depth < 2 and rng.random() < 0.4 else rng.choice(leaves)()
                                  for _ in range(rng.randint(1, 3)))
        if rng.random() < 0.3:
            self.own = nn.Parameter(torch.randn(16) * 0.1)
        if rng.random() < 0.2:
            self.kids[0].requires_grad_(False)
        self.plan = [rng.randrange(len(self.kids)) for _ in range(rng.randint(1, 4))]
        self.ckpt = rng.random() < 0.2
        self.functional = rng.random() < 0.3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in self.plan:
            x = checkpoint(self.kids[i], x, use_reentrant=False) if self.ckpt else self.kids[i](x)
        if hasattr(self, "own"):
            x = x * (1 + self.own)
        if self.functional:
            for k in self.kids:
                w = getattr(k, "weight", None)
                if isinstance(w, nn.Parameter) and w.dim() == 2:
                    return x + 0.1 * nn.functional.linear(x, w)
        return x


def soak_params(seed: int, base: str) -> str:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    plain = RandomNet(rng)
    linears = [m for m in plain.modules() if isinstance(m, nn.Linear)]
    if len(linears) >= 2 and rng.random() < 0.4:
        linears[-1].weight = linears[0].weight  # tied
    model = copy.deepcopy(plain)
    tier = rng.choice(["host", "nvme", None])
    with pool(rng, base, rng.choice([256 << 10, 1 << 20]), 64 << 20, 64 << 10) as (s, _):
        handle = offload_parameters(model, s, tier=tier)
        opt_p, opt_o = (torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.5) for m in (plain, model))
        for step in range(3):
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
            for m in (plain, model):
                out = m(x)
                if out.requires_grad:
                    out.square().mean().backward()
            handle.materialize()
            for (n, a), b in zip(plain.named_parameters(), model.parameters()):
                assert (a.grad is None) == (b.grad is None), f"seed {seed} step {step}: {n} gradient presence"
                assert a.grad is None or torch.equal(a.grad, b.grad), f"seed {seed} step {step}: {n} gradient"
            opt_p.step()
            opt_o.step()
            handle.writeback()
            opt_p.zero_grad()
            opt_o.zero_grad()
            with torch.no_grad():
                assert torch.equal(plain(x), model(x)), f"seed {seed} step {step}: forward without autograd"
            assert all(p.numel() == 0 for p in model.parameters()), f"seed {seed} step {step}: left loaded"
        handle()
        for (n, a), b in zip(plain.named_parameters(), model.parameters()):
            assert torch.equal(a, b), f"seed {seed}: {n} after undo"
    return f"{sum(1 for _ in plain.modules())} modules tier={tier}"


# ---------------------------------------------------------------------------- object API
def _api_ops(s, rng: random.Random, where: str, prefix: str, n_ops: int,
             shared: tuple[dict, dict, dict] | None = None, eph: set | None = None) -> tuple[dict, dict]:
    """``n_ops`` random calls on ``s`` over keys under ``prefix``, each checked against the
    expected bytes; returns (expected bytes, handles) by key. ``where`` names the case.
    ``eph``: some volatile puts are ephemeral, and their keys are kept in this set.

    ``shared``: (expected bytes, handles, a lock per key) that several workers use at once
    over the same 24 keys; each call holds its key's lock, so the expected bytes stay
    exact while the workers' calls on different keys, and the pool's movement, race.
    """
    want, handles, locks = shared if shared is not None else ({}, {}, None)
    for i in range(n_ops):
        op = rng.choice(["put", "put", "replace", "get", "get_out", "r", "rw", "w", "free", "prefetch", "step",
                         "keys", "info", "batch", "source", "each"])
        if locks is not None:
            if op == "keys":
                continue  # other workers change the key set meanwhile
            if op in ("batch", "source", "each"):  # locks in one order: workers never wait on each other in a ring
                chosen = sorted(rng.sample(sorted(locks), 2 if op == "source" else rng.randint(1, 4)))
                for k in chosen:
                    locks[k].acquire()
                try:
                    _api_op(s, rng, where, i, op, [k for k in chosen if k in want], None, want, handles, prefix,
                            eph)
                finally:
                    for k in chosen:
                        locks[k].release()
                continue
            key = f"k{rng.randrange(len(locks))}"
            with locks[key]:
                if op == "put" or key in want:
                    _api_op(s, rng, where, i, "replace" if op == "put" and key in want else op, [key], key,
                            want, handles, prefix, eph)
            continue
        keys = sorted(want)
        if op not in ("put", "step") and not keys:
            continue
        key = rng.choice(keys) if keys else None
        if op in ("batch", "each"):
            keys = rng.sample(keys, min(len(keys), rng.randint(1, 5)))
        if op == "source":
            keys = rng.sample(keys, min(len(keys), 2))
        if op == "put":
            key = f"{prefix}k{i % 37}/{rng.randint(0, 3)}"
        _api_op(s, rng, where, i, op, keys, key, want, handles, prefix, eph)
    return want, handles


def _api_op(s, rng: random.Random, where: str, i: int, op: str, keys: list[str], key: str | None, want: dict,
            handles: dict, prefix: str, eph: set | None) -> None:
    """One checked call ``op`` (on ``key``, where it takes one)."""
    try:
        if op in ("put", "replace"):
            n = rng.choice([0, 1, 7, 4096, 100_000, 300_000, 1 << 20])
            a = np.frombuffer(rng.randbytes(n), np.uint8).copy()
            tier = rng.choice([None, "host", "nvme"])
            durable = rng.random() < 0.2
            ephemeral = eph is not None and not durable and rng.random() < 0.2
            handles[key] = s.put(torch.from_numpy(a) if rng.random() < 0.5 else a, key=key, tier=tier,
                                 durable=durable, replace=key in want, ephemeral=ephemeral)
            want[key] = a
            if eph is not None:
                (eph.add if ephemeral else eph.discard)(key)
        elif op in ("get", "get_out"):
            out = np.empty_like(want[key]) if op == "get_out" else None
            assert _same(s.get(handles[key], out=out), want[key]), f"{where} op {i}: get {key}"
        elif op in ("r", "rw", "w"):
            if not want[key].size:
                return
            with s.checkout(handles[key], op) as t:
                written = _use(t, op, want[key], rng, f"{where} op {i}: check-out {op} of {key}")
                if written is not None:
                    want[key] = written
        elif op == "batch":
            _batch_op(s, rng, where, i, [k for k in keys if want[k].size], want, handles)
        elif op == "source":
            _source_op(s, rng, where, i, keys, want, handles)
        elif op == "each":
            _each_op(s, rng, where, i, [k for k in keys if want[k].size], want, handles)
        elif op == "free":
            s.free(handles[key])
            del handles[key], want[key]
            if eph is not None:
                eph.discard(key)
            assert s.lookup(key) is None, f"{where} op {i}: {key} still bound after free"
        elif op == "prefetch":
            s.prefetch([handles[k] for k in rng.sample(keys, min(3, len(keys))) if k in handles])
        elif op == "step":
            s.step()
        elif op == "keys":
            assert sorted(s.keys(prefix=prefix)) == keys, f"{where} op {i}: keys"
        else:
            assert int(s.info(handles[key])["nbytes"]) == want[key].nbytes, f"{where} op {i}: info"
    except (CapacityExceeded, Busy):
        pass  # a full tier or a busy object: refused whole, nothing changed


def _use(t, mode: str, expected: np.ndarray, rng: random.Random, what: str) -> np.ndarray | None:
    """Check a leased view against ``expected`` (unless ``w``), and overwrite it with
    random bytes (unless ``r``); the new bytes, or None."""
    arr = t.numpy() if isinstance(t, torch.Tensor) else t
    if mode != "w":
        assert _same(arr, expected), what
    if mode == "r":
        return None
    arr[...] = np.frombuffer(rng.randbytes(arr.size), np.uint8).reshape(arr.shape)
    return arr.copy()


def _batch_op(s, rng: random.Random, where: str, i: int, keys: list[str], want: dict, handles: dict) -> None:
    """``checkout_many`` of ``keys`` (each with a random mode), checked and written like
    single check-outs; sometimes one lease is released on its own first, and sometimes
    the batch ends with a freed object's handle, so it must fail and change nothing."""
    if not keys:
        return
    modes = [rng.choice(["r", "rw", "w"]) for _ in keys]
    hs = [handles[k] for k in keys]
    if rng.random() < 0.15:
        gone = s.put(np.zeros(8, np.uint8))
        s.free(gone)
        try:
            s.checkout_many([*hs, gone], [*modes, "r"])
        except NotFound:  # StaleHandle is one
            return
        raise AssertionError(f"{where} op {i}: a batch with a freed object's handle was checked out")
    group = s.checkout_many(hs, modes)
    try:
        assert [lease.handle for lease in group] == [Handle.parse(h) for h in hs], f"{where} op {i}: batch order"
        new = {}
        for k, m, lease in zip(keys, modes, group):
            written = _use(lease.tensor, m, want[k], rng, f"{where} op {i}: batch check-out {m} of {k}")
            if written is not None:
                new[k] = written
        if rng.random() < 0.3:
            group[rng.randrange(len(group))].release()
    finally:
        group.release()
    want.update(new)


def _each_op(s, rng: random.Random, where: str, i: int, keys: list[str], want: dict, handles: dict) -> None:
    """``checkout_each`` of ``keys`` (random modes; a ``w`` one often from a source among
    the keys the same call reads), checked and written like single check-outs; sometimes
    the list ends with a freed object's handle, so it fails and gives the others back
    unused: unchanged, but a ``w`` from a source, which then holds the source's bytes
    (or, when a full tier refused it too, its own)."""
    room = s.stat()["tiers"]["host"]["capacity_bytes"] // 2  # well below the tier: none waits on another
    keys = [k for k in keys if (room := room - want[k].nbytes - 4096) >= 0]
    if not keys:
        return
    modes = {k: rng.choice(["r", "rw", "w"]) for k in keys}
    reqs = []
    for k in keys:
        src = None
        if modes[k] == "w":
            same = [o for o in keys if modes[o] == "r" and want[o].nbytes == want[k].nbytes]
            if same and rng.random() < 0.7:
                src = rng.choice(same)
        reqs.append((k, modes[k], src))
    wire = [(handles[k], m, None if src is None else handles[src]) for k, m, src in reqs]

    def given_back() -> None:
        for k, m, src in reqs:
            got = s.get(handles[k])
            got = got.numpy() if isinstance(got, torch.Tensor) else got
            if src is None:
                assert _same(got, want[k]), f"{where} op {i}: {k} changed by a failed checkout_each"
            else:  # its check-out from the source was taken (then it holds those bytes) or refused
                assert _same(got, want[src]) or _same(got, want[k]), f"{where} op {i}: {k} after a failure"
                want[k] = np.asarray(got).reshape(want[k].shape).copy()

    if rng.random() < 0.15:
        gone = s.put(np.zeros(8, np.uint8))
        s.free(gone)
        try:
            s.checkout_each([*wire, (gone, "r", None)])
        except NotFound:  # StaleHandle is one
            given_back()
            return
        raise AssertionError(f"{where} op {i}: checkout_each with a freed object's handle succeeded")
    try:
        leases = s.checkout_each(wire)
    except (CapacityExceeded, Busy):
        given_back()
        return
    new = {}
    try:
        for (k, m, src), lease in zip(reqs, leases):
            what = f"{where} op {i}: checkout_each {m} of {k}" + (f" from {src}" if src else "")
            written = _use(lease.tensor, "rw" if src else m, want[src] if src else want[k], rng, what)
            if written is not None:
                new[k] = written
    finally:
        for lease in leases:
            lease.release()
    want.update(new)


def _source_op(s, rng: random.Random, where: str, i: int, keys: list[str], want: dict, handles: dict) -> None:
    """``checkout(dst, "w", source=src)`` of two keys (src's bytes of another size are
    refused): the lease starts with src's bytes, what is written becomes dst's, src stays."""
    if len(keys) != 2 or not want[keys[1]].size:
        return
    dst, src = keys
    what = f"{where} op {i}: check-out of {dst} from {src}"
    if want[dst].nbytes != want[src].nbytes:
        try:
            s.checkout(handles[dst], "w", source=handles[src])
        except InvalidArgument:
            return
        raise AssertionError(f"{what}: sizes differ, yet it was checked out")
    with s.checkout(handles[dst], "w", source=handles[src]) as t:
        arr = t.numpy() if isinstance(t, torch.Tensor) else t
        assert _same(arr, want[src]), what
        written = _use(t, "rw", want[src], rng, what) if rng.random() < 0.7 else want[src].copy()
    want[dst] = written
    assert _same(s.get(handles[src]), want[src]), f"{what}: the source changed"


def _same(got, expected: np.ndarray) -> bool:
    """Whether ``got`` (a tensor or an array) holds exactly ``expected``'s bytes."""
    got = got.numpy() if isinstance(got, torch.Tensor) else got
    return np.array_equal(np.asarray(got).reshape(-1), expected.reshape(-1))


def _check_all(s, want: dict, where: str) -> None:
    for key in sorted(want):
        assert _same(s.get(s.lookup(key)), want[key]), f"{where}: {key} at the end"


def soak_api(seed: int, base: str) -> str:
    rng = random.Random(seed)
    host = rng.choice([1, 2, 4]) << 20
    with pool(rng, base, host, 256 << 20, host // 3) as (s, _):
        # ephemeral objects too: this connection stays open, so they stay
        want, _ = _api_ops(s, rng, f"seed {seed}", "", rng.randint(50, 300), eph=set())
        if rng.random() < 0.5:  # through a snapshot and back, over the same keys
            dest = os.path.join(base, rng.choice(["snap.zarr", "snap.zip"]))
            assert s.snapshot(dest, progress=False)["objects"] == len(want), f"seed {seed}: snapshot count"
            s.restore(dest, overwrite=True, progress=False)
        assert sorted(s.keys()) == sorted(want), f"seed {seed}: keys at the end"
        _check_all(s, want, f"seed {seed}")
        assert s.stat()["leases"] == 0, f"seed {seed}: leases left"
    return f"{len(want)} objects"


def soak_api_concurrent(seed: int, base: str) -> str:
    """2-6 workers (threads; through a daemon, each with its own connection) run the API
    soak at once on one small pool, each over its own keys or all over the same ones,
    so their eviction, write-back, prefetch and check-outs race."""
    rng = random.Random(seed)
    host = rng.choice([2, 4, 8]) << 20
    workers = rng.randint(2, 6)
    seeds = [rng.randrange(1 << 30) for _ in range(workers)]
    results: list = [None] * workers

    # half the seeds: all workers over the same keys, a lock per key held for each call
    shared = ({}, {}, {f"k{j}": threading.Lock() for j in range(24)}) if rng.random() < 0.5 else None

    with pool(rng, base, host, 512 << 20, host // 3) as (s, connect):
        via_daemon = not isinstance(s, Store)
        if via_daemon:
            # the checking connection takes its staging area now, at the top of the empty
            # tier: one taken at the end, between resident objects, can split a 2 MiB tier
            # so that a 1 MiB object no longer fits ("host tier too fragmented")
            h = s.put(np.zeros(4, np.float32))
            s.get(h)
            s.free(h)

        def work(w: int) -> None:
            try:
                # each over its own keys: some puts ephemeral, gone when the worker's
                # connection closes (through a daemon; in-process they stay)
                eph = None if shared else set()
                with connect() as c:
                    wrng = random.Random(seeds[w])
                    want = _api_ops(c, wrng, f"seed {seed} worker {w}", f"w{w}/", wrng.randint(50, 200),
                                    shared, eph)[0]
                results[w] = {k: v for k, v in want.items() if not (via_daemon and k in eph)} if eph else want
            except BaseException as e:  # reported by the main thread
                results[w] = e

        threads = [threading.Thread(target=work, args=(w,)) for w in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
            assert not t.is_alive(), f"seed {seed}: a worker is stuck"
        for r in results:
            if isinstance(r, BaseException):
                raise r
        want = {k: v for r in results for k, v in r.items()}
        for _ in range(500):  # a closed connection's ephemeral objects and leases go asynchronously
            if sorted(s.keys()) == sorted(want) and s.stat()["leases"] == 0:
                break
            time.sleep(0.02)
        assert sorted(s.keys()) == sorted(want), f"seed {seed}: keys at the end"
        _check_all(s, want, f"seed {seed}")
        assert s.stat()["leases"] == 0, f"seed {seed}: leases left"
    return f"{workers} workers, {len(want)} objects{' over shared keys' if shared else ''}"


SOAKS = {"optimizer": soak_optimizer, "params": soak_params, "api": soak_api,
         "api-concurrent": soak_api_concurrent}


def run(kind: str, seeds: range, base: str | None = None, verbose: bool = True) -> int:
    """Run ``kind`` for every seed (each in a fresh directory under ``base``); the count run."""
    for seed in seeds:
        d = tempfile.mkdtemp(prefix=f"soak-{kind}-{seed}-", dir=base)
        try:
            what = SOAKS[kind](seed, d)
        finally:
            shutil.rmtree(d, ignore_errors=True)
        if verbose:
            print(f"{kind} seed {seed}: ok ({what})", flush=True)
    return len(seeds)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("kind", choices=sorted(SOAKS))
    p.add_argument("--seeds", default="0:50", help="FIRST:END (END excluded)")
    p.add_argument("--dir", default=None, help="where the pools live (default: the temporary directory)")
    args = p.parse_args(argv)
    first, end = (int(x) for x in args.seeds.split(":"))
    n = run(args.kind, range(first, end), args.dir)
    print(f"{args.kind}: {n} seeds, no failure")


if __name__ == "__main__":
    main()
