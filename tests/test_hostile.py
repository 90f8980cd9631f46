"""A real daemon under clients that mean it harm: each test runs hostile client
processes against a real daemon and checks that the other clients are still served."""

import contextlib
import json
import os
import subprocess
import sys

import numpy as np
import torch
import pytest


from conftest import poll_until, run_py


def _hostile(daemon, code: str, *args: str, timeout: float = 60) -> dict:
    """Run ``code`` in a client process of its own (``c``: a Client of ``daemon``); it
    prints one JSON line, returned. The code reaches into the client's private state on
    purpose (``c._arena_fd``, the daemon's memfd): a hostile process does what the
    library never would."""
    prelude = ("import json, os, sys, time\nimport numpy as np\nfrom tierstore.client import Client\n"
               f"c = Client.connect(socket={daemon.socket!r}, namespace='hostile')\n")
    r = run_py(prelude + code, *args, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_client_cannot_resize_the_arena_it_was_handed(daemon):
    """The arena's memfd is sealed against shrinking, growing and further seals before
    any client gets it: a client that truncates it gets EPERM, and the daemon goes on
    serving (staged and two-phase puts, NVMe reads, new clients). Punching a hole only
    zeroes bytes (no SIGBUS anywhere)."""
    with daemon.client("victim") as v:
        durable = v.put(np.full(1 << 20, 5, np.uint8), key="d", durable=True)
        on_nvme = v.put(np.full(3 << 20, 6, np.uint8), key="n", tier="nvme")
        got = _hostile(daemon, """
import ctypes, fcntl
libc = ctypes.CDLL(None, use_errno=True)
libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
out = {}
for name, fn in [("shrink", lambda: os.ftruncate(c._arena_fd, 0)),
                 ("grow", lambda: os.ftruncate(c._arena_fd, 1 << 30)),
                 ("seal_future_write", lambda: fcntl.fcntl(c._arena_fd, fcntl.F_ADD_SEALS, 0x10))]:
    try:
        fn()
        out[name] = "done"
    except OSError as e:
        out[name] = e.errno
out["fallocate_grow"] = ctypes.get_errno() if libc.fallocate(c._arena_fd, 0, 0, 1 << 30) else "done"
out["size"] = os.fstat(c._arena_fd).st_size
print(json.dumps(out))
""")
        import errno

        assert got["shrink"] == got["grow"] == got["seal_future_write"] == got["fallocate_grow"] == errno.EPERM, got
        assert got["size"] == 64 << 20
        # the daemon is alive and serves the victim and new clients: staged put (the
        # daemon copies in the arena), two-phase put, NVMe read into the arena
        small = v.put(np.arange(1000, dtype=np.int32))
        big = v.put(np.full(2 << 20, 7, np.uint8))
        assert np.array_equal(v.get(small), np.arange(1000, dtype=np.int32)) and (v.get(big) == 7).all()
        assert (v.get(on_nvme) == 6).all() and (v.get(durable) == 5).all()
        with daemon.client("new") as n:
            assert (n.get(n.put(np.full(2 << 20, 8, np.uint8), tier="nvme")) == 8).all()
        # a hole punched through the whole arena: the bytes read as zero, nothing faults
        _hostile(daemon, """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
print(json.dumps({"punch": libc.fallocate(c._arena_fd, 3, 0, os.fstat(c._arena_fd).st_size)}))
""")
        assert (v.get(on_nvme) == 6).all()  # read again from NVMe into the (re-faulted) arena
        assert v.get(small).shape == (1000,)
        with daemon.client("new") as n:
            assert (n.get(n.put(np.full(2 << 20, 9, np.uint8), durable=True)) == 9).all()
    assert daemon.proc.poll() is None
    assert daemon.stop() == 0


def test_a_write_through_an_r_view_fails_in_that_client_and_reaches_no_one(daemon):
    """An ``r`` check-out's tensor views a read-only mapping of the arena: writes through
    it raise (torch: ``ReadOnlyView``; NumPy: ``ValueError``) in the writing client, its
    views and ``numpy()`` are read-only too, a write around torch faults only that
    process, and other clients, ``info`` and a restart all see the old bytes."""
    import torch

    with daemon.client("ro") as a:
        x = a.put(torch.arange(4096, dtype=torch.float32), key="x", durable=True)
        y = a.put(np.arange(4096, dtype=np.int64), key="y", durable=True)
        z = a.put(torch.full((4096,), 2.0, dtype=torch.bfloat16), key="z")
        got = _hostile(daemon, """
import torch
from tierstore import ReadOnlyView
c.close()
c = Client.connect(socket=sys.argv[1], namespace="ro")
x, y, z = (c.lookup(k) for k in "xyz")
out = {}
with c.checkout(x, "r") as t, c.checkout(z, "r") as tz:
    other = torch.ones(4096)
    writes = {
        "add_": lambda: t.add_(1), "setitem": lambda: t.__setitem__(0, 5.0), "copy_": lambda: t.copy_(other),
        "iadd": lambda: t.__iadd__(1), "out": lambda: torch.add(other, 1, out=t),
        "view": lambda: t.view(64, 64)[0].fill_(3), "slice": lambda: t[10:20].zero_(),
        "detach": lambda: t.detach().mul_(2), "numpy": lambda: t.numpy().__setitem__(0, 9),
        "array": lambda: np.asarray(t).__setitem__(0, 9), "relu": lambda: torch.nn.functional.relu(t, inplace=True),
        "bf16": lambda: tz.add_(1), "split": lambda: t.split(1024)[1].fill_(0),
    }
    for name, fn in writes.items():
        try:
            fn()
            out[name] = "written"
        except ReadOnlyView:
            out[name] = "ReadOnlyView"
        except ValueError as e:
            out[name] = "ValueError" if "read-only" in str(e) else repr(e)
    # reading is untouched: computations give plain tensors, a clone is writable
    s = (t * 2).add_(1)
    out["compute"] = type(s).__name__ == "Tensor" and float(s[3]) == 7.0 and float(t.sum()) == 4095 * 4096 / 2
    cl = t.clone()
    cl.add_(1)
    import copy, io
    buf = io.BytesIO()
    torch.save(t, buf)
    buf.seek(0)
    copies = [copy.deepcopy(t), torch.load(buf)]  # private copies: plain, writable
    out["clone"] = float(cl[0]) == 1.0 and all(type(x) is torch.Tensor and float(x.add_(2)[1]) == 3.0
                                               for x in copies)
with c.checkout(y, "r") as arr:
    try:
        arr[0] = 42
        out["numpy_lease"] = "written"
    except ValueError:
        out["numpy_lease"] = "ValueError"
with c.checkout(x, "rw") as t:  # a write lease is writable
    out["rw_type"] = type(t).__name__
print(json.dumps(out))
""", daemon.socket)
        refused = {k: v for k, v in got.items() if k not in ("compute", "clone", "rw_type", "numpy_lease")}
        assert all(v in ("ReadOnlyView", "ValueError") for v in refused.values()), got
        assert got["numpy_lease"] == "ValueError" and got["compute"] and got["clone"] and got["rw_type"] == "Tensor"
        # a write that goes around torch: the CPU refuses it, that process alone dies
        r = run_py(f"""
import ctypes
from tierstore.client import Client
c = Client.connect(socket={daemon.socket!r}, namespace="ro")
lease = c.checkout(c.lookup("x"), "r")
ctypes.memset(lease.tensor.data_ptr(), 0xff, 64)
print("written")
""", timeout=60)
        assert r.returncode == -11 and "written" not in r.stdout, (r.returncode, r.stderr[-2000:])
        with daemon.client("ro") as b:
            assert torch.equal(b.get(x), torch.arange(4096, dtype=torch.float32))
            assert np.array_equal(b.get(y), np.arange(4096)) and torch.equal(b.get(z), torch.full((4096,), 2.0,
                                                                                             dtype=torch.bfloat16))
            assert not b.info(x)["dirty"] and not b.info(y)["dirty"]
    daemon.restart()
    with daemon.client("ro") as b:
        assert torch.equal(b.get(b.lookup("x")), torch.arange(4096, dtype=torch.float32))
        assert np.array_equal(b.get(b.lookup("y")), np.arange(4096))


_HOLDER = """
import signal, sys, time
import numpy as np
from tierstore.client import Client
c = Client.connect(socket=sys.argv[1], namespace="held")
h = c.put(np.full(1 << 20, 1, np.uint8), key="held")
lease = c.checkout(h, "rw")
print("holding", flush=True)
signal.pause()
"""

_WAITERS = """
import sys
from tierstore.client import Client
c = Client.connect(socket=sys.argv[1], namespace="held")
h = int(c.lookup("held"))
futs = [c._conn.submit("checkout", handle=h, mode="r", timeout_s=3600.0, stream="default")
        for _ in range(int(sys.argv[2]))]
print("waiting", flush=True)
def said(f):  # as each reply comes in, whichever one the reading thread waits for
    if f.exception() is not None:
        print("error", type(f.exception()).__name__, f.exception(), flush=True)
for f in futs:
    f.add_done_callback(said)
got = 0
for f in futs:
    try:
        c._conn.wait(f)
        got += 1
    except Exception:
        pass
print("leased", got, flush=True)
"""


def _start(code: str, *args: str):
    import subprocess

    p = subprocess.Popen([sys.executable, "-c", code, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    return p


@contextlib.contextmanager
def _parked(daemon, n: int = 16, waiting: int | None = None, clients: int = 1):
    """A holder of an rw lease and ``clients`` clients with ``n`` check-outs each waiting
    for it (1 h timeouts), all real processes; yields the holder and the (first) waiter
    once the daemon has ``waiting`` (all) of them waiting, kills what is left of them at
    the end."""
    waiting = n * clients if waiting is None else waiting
    holder = _start(_HOLDER, daemon.socket)
    waiters = []
    try:
        assert holder.stdout.readline().strip() == "holding", holder.stderr.read()
        for _ in range(clients):
            waiters.append(_start(_WAITERS, daemon.socket, str(n)))
            assert waiters[-1].stdout.readline().strip() == "waiting", waiters[-1].stderr.read()
        with daemon.client("watch") as w:
            poll_until(lambda: w.stat()["waiting"] >= waiting, f"{waiting} check-outs waiting in the daemon")
        yield holder, waiters[0]
    finally:
        for p in (holder, *waiters):
            if p.poll() is None:
                p.kill()
                p.communicate()


def test_lease_waiters_hold_up_no_one_and_a_killed_holders_release_goes_first(daemon):
    """16 check-outs waiting (1 h timeouts) for an object another client holds occupy no
    worker others need: when the holder is SIGKILLed its clean-up runs at once (the
    waiters get their leases), and another client's durable put, NVMe get and free
    complete promptly meanwhile and after."""
    import signal
    import time

    with _parked(daemon) as (holder, waiters):
        others = f"""
import time
import numpy as np
from tierstore.client import Client
c = Client.connect(socket={daemon.socket!r}, namespace="other")
t0 = time.monotonic()
h = c.put(np.full(1 << 20, 3, np.uint8), key="d", durable=True, replace=True)
n = c.put(np.full(1 << 20, 4, np.uint8), key="n", tier="nvme", replace=True)
assert (c.get(n) == 4).all() and (c.get(h) == 3).all()
c.free(h)
print(time.monotonic() - t0)
"""
        r = run_py(others, timeout=20)  # before the fix: queued behind the waits, for an hour
        assert r.returncode == 0 and float(r.stdout) < 10, r.stderr[-2000:]
        t0 = time.monotonic()
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        out, err = waiters.communicate(timeout=20)  # the clean-up released the lease: all 16 served
        assert "leased 16" in out and time.monotonic() - t0 < 10, (out, err[-2000:])
        r = run_py(others, timeout=20)
        assert r.returncode == 0 and float(r.stdout) < 10, r.stderr[-2000:]


def test_sigterm_stops_the_daemon_promptly_with_waiters_parked(daemon):
    """SIGTERM with 16 check-outs waiting (1 h timeouts): the waits end (the waiters get
    an error, not a hang), the daemon drains and exits cleanly within seconds."""
    import time

    with _parked(daemon) as (_holder, waiters):
        t0 = time.monotonic()
        daemon.proc.terminate()
        assert daemon.proc.wait(timeout=20) == 0
        assert time.monotonic() - t0 < 10  # before the fix: the pool drained only as the hour-long waits ended
        out, err = waiters.communicate(timeout=20)
        assert "leased 0" in out, (out, err[-2000:])


def test_a_connections_waits_queue_behind_its_own_and_end_with_it(daemon):
    """One connection with 1041 check-outs to wait: 16 wait on threads, 1024 queue behind
    them, the last is refused at once (``Busy``); another connection's check-out still
    waits on a thread of its own (its 1 s timeout is kept), and when the waiting client
    is SIGKILLed every one of its waits ends, nothing taken."""
    with _parked(daemon, n=1041, waiting=1040) as (_holder, waiters):
        r = run_py(f"""
import time
from tierstore import Busy
from tierstore.client import Client
c = Client.connect(socket={daemon.socket!r}, namespace="held")
t0 = time.monotonic()
try:
    c.checkout(c.lookup("held"), "r", timeout_s=1.0)
except Busy:
    print(time.monotonic() - t0)
""", timeout=30)  # before the fix: behind the first connection's waits, for an hour
        assert r.returncode == 0 and 0.9 < float(r.stdout) < 5, (r.stdout, r.stderr[-2000:])
        waiters.kill()
        out, _ = waiters.communicate()
        assert out.count("error Busy") == 1 and "are queued for the daemon's wait threads" in out, out[-2000:]
        with daemon.client("watch") as w:
            st = poll_until(lambda: (lambda st: st if not st["waiting"] else None)(w.stat()), "no wait left", 10)
            assert st["leases"] == 1  # the holder's; none of the waiters'


def test_one_namespaces_waits_leave_wait_threads_to_the_others_and_every_timeout_holds(daemon):
    """8 connections of one namespace with 16 check-outs each waiting (1 h timeouts) for
    a lease: enough to take every wait thread were they not shared. Another namespace's
    check-out still waits on a thread of its own (it gets its lease as soon as it is
    released there, and its 2 s timeout holds), and a further wait in the crowded
    namespace, queued behind its share, ends at its 1 s timeout, not after the hour."""
    with _parked(daemon, n=16, clients=8):
        r = run_py(f"""
import threading, time
import numpy as np
from tierstore import Busy
from tierstore.client import Client
a = Client.connect(socket={daemon.socket!r}, namespace="other")
b = Client.connect(socket={daemon.socket!r}, namespace="other")
h = a.put(np.zeros(1024, np.float32), key="x")
lease = a.checkout(h, "rw")
t0 = time.monotonic()
try:
    b.checkout(h, "r", timeout_s=2.0)
except Busy:
    print("timed out after", time.monotonic() - t0)
threading.Timer(1.0, lease.release).start()
t0 = time.monotonic()
with b.checkout(h, "r", timeout_s=60.0):
    print("leased after", time.monotonic() - t0)
c = Client.connect(socket={daemon.socket!r}, namespace="held")
t0 = time.monotonic()
try:
    c.checkout(c.lookup("held"), "r", timeout_s=1.0)
except Busy as e:
    print("queued timed out after", time.monotonic() - t0, e)
print("waiting", c.stat()["waiting"])
""", timeout=40)  # before the fix: queued behind the hour-long waits
        assert r.returncode == 0, r.stderr[-2000:]
        said = {line.split(" after ")[0]: float(line.split(" after ")[1].split()[0])
                for line in r.stdout.splitlines() if " after " in line}
        assert 1.9 < said["timed out"] < 5 and said["leased"] < 5 and said["queued timed out"] < 4, r.stdout
        assert int(r.stdout.split("waiting ")[-1]) >= 128, r.stdout  # the crowd is still waiting


def _pipelined(c, n: int, op: str, **fields):
    """``n`` requests sent at once on ``c``'s connection, not waited for."""
    return [c._conn.submit(op, **fields) for _ in range(n)]


@pytest.mark.parametrize("end", ["timeout", "sigterm", "disconnect"])
def test_a_batch_that_ends_queued_gives_back_what_it_took(daemon, end):
    """A ``checkout_many`` that took a blank ``w`` lease on a durable NVMe object, then
    had to wait and was queued (its connection's wait threads all taken) and ended
    there — at its timeout, at SIGTERM, or with its connection — gives that lease back
    unused: no lease is left, other clients check the object out at once, and its bytes
    are intact, after a restart too (a blank block checked in as written would have
    replaced them)."""
    import time

    from tierstore import Busy

    ref = torch.arange(64 * 1024, dtype=torch.float32) + 1
    with daemon.client("q") as c:
        a = c.put(ref, key="A", tier="nvme", durable=True)
        x = c.put(torch.zeros(16), key="X")
        with daemon.client("q") as holder, daemon.client("q") as r:
            held = holder.checkout(x, "rw")
            if True:
                parked = _pipelined(r, 16, "checkout", handle=int(x), mode="rw", timeout_s=60)
                poll_until(lambda: c.stat()["waiting"] >= 16, "the connection's wait threads taken")
                t0 = time.monotonic()
                batch = r._conn.submit("checkout_many", handles=[int(a), int(x)], modes=["w", "w"], timeout_s=1.0)
                poll_until(lambda: c.stat()["waiting"] >= 17, "the batch queued")
                if end == "timeout":
                    with pytest.raises(Busy):
                        r._conn.wait(batch)
                    assert time.monotonic() - t0 < 5
                    assert c.stat()["leases"] == 1  # the holder's alone
                    with c.checkout(a, "r", timeout_s=1.0) as view:
                        assert torch.equal(torch.as_tensor(view), ref)
                elif end == "disconnect":
                    r._conn.close()
                    poll_until(lambda: c.stat()["leases"] == 1 and not c.stat()["waiting"], "the batch ended")
                else:
                    assert daemon.stop() == 0
                del parked
            if end != "sigterm":
                held.release()
            if end == "sigterm":
                daemon.start()
            else:
                assert torch.equal(c.get(a), ref)
    if end != "sigterm":
        daemon.restart()
    with daemon.client("q") as c:
        assert torch.equal(c.get(c.lookup("A")), ref)


def test_a_flood_of_large_batches_leaves_op_workers_to_others_and_sigterm_prompt(daemon):
    """One connection pipelines 60 check-outs of 4 096 handles each (each goes to an op
    worker whole): another namespace's check-out of an NVMe object, which needs an op
    worker too, is served at once, not behind the flood; SIGTERM then ends the queued
    rest (answered ``Closed``) instead of running it, and the daemon exits promptly."""
    import time

    with daemon.client("flood") as c, daemon.client("victim") as v:
        x = int(c.put(torch.zeros(16), key="X"))
        obj = v.put(torch.ones(1 << 16), key="V", tier="nvme")
        flood = _pipelined(c, 60, "checkout_many", handles=[x] * 4096, modes="r")
        poll_until(lambda: v.stat()["op_queue"] > 0, "the flood queued for op workers")
        t0 = time.monotonic()
        with v.checkout(obj, "r", timeout_s=30) as view:
            assert float(torch.as_tensor(view)[0]) == 1.0
        assert time.monotonic() - t0 < 3  # before the fix: behind the whole flood
        t0 = time.monotonic()
        assert daemon.stop() == 0
        assert time.monotonic() - t0 < 10
        del flood


def test_an_abandoned_reservation_expires_and_others_proceed(daemon_factory):
    """A client process reserves (two-phase put) nearly the whole host tier and goes
    idle, connected: after ``reservation_timeout_s`` the reservation is dropped, another
    client's get that needs the room goes through, and the idle client's late commit
    gets ``NotFound``."""
    d = daemon_factory(env={"TIERSTORE_RESERVATION_TIMEOUT_S": "2", "TIERSTORE_LEASE_WAIT_S": "20"})
    with d.client("victim") as v:
        h = v.put(np.full(16 << 20, 7, np.uint8), key="n", tier="nvme")
        idle = _start(f"""
import sys
from tierstore.client import Client
c = Client.connect(socket={d.socket!r}, namespace="idle")
n = c.stat()["tiers"]["host"]["free_bytes"] - (1 << 20)
r = c._conn.request("put_reserve", kind="numpy", dtype="uint8", shape=[n], nbytes=n, key="big", tier=None,
                    durable=False, replace=False, wait_s=0.0)
print("reserved", flush=True)
sys.stdin.readline()  # idle until told to commit
try:
    c._conn.request("put_commit", rid=r["rid"])
    print("committed", flush=True)
except Exception as e:
    print(type(e).__name__, e, flush=True)
""")
        try:
            assert idle.stdout.readline().strip() == "reserved", idle.stderr.read()
            assert v.stat()["tiers"]["host"]["free_bytes"] < 16 << 20  # the room is reserved
            assert (v.get(h) == 7).all()  # waits for the room: before the fix, CapacityExceeded after 20 s
            st = v.stat()
            assert st["counters"]["reservations_expired"] == 1 and st["reservations"] == 0, st
            out, err = idle.communicate("commit\n", timeout=30)
            assert out.splitlines()[-1].startswith("NotFound") and "reservation_timeout_s" in out, (out, err[-2000:])
            with d.client("idle") as again:
                assert again.lookup("big") is None
        finally:
            if idle.poll() is None:
                idle.kill()
                idle.communicate()


_STAGING = r"""
import socket, sys, msgpack
from tierstore.protocol import PROTOCOL_VERSION
got = refused = 0
conns = []
for j in range(int(sys.argv[2])):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(sys.argv[1])
    s.send(msgpack.packb({"id": 0, "op": "hello", "version": PROTOCOL_VERSION, "namespace": "pin"}))
    socket.recv_fds(s, 1 << 20, 4)
    s.send(msgpack.packb({"id": 1, "op": "staging", "nbytes": int(sys.argv[3])}))
    r = msgpack.unpackb(s.recv(1 << 16), raw=False)
    if r.get("ok", "error" not in r) and "offset" in str(r):
        got += 1
    else:
        refused += 1
    conns.append(s)
print("got", got, "refused", refused, flush=True)
sys.stdin.read()
"""


def test_idle_connections_cannot_pin_the_host_tier_with_staging_areas(daemon_factory):
    """40 connections of one uid each ask for the largest staging area and go idle: the
    areas hold at most an eighth of the host tier (a quarter for every uid together), an
    area past the largest is refused, and another client's large put and get still fit."""
    d = daemon_factory("--host-bytes", "64MiB")
    over = subprocess.run([sys.executable, "-c", _STAGING, d.socket, "1", str(16 << 20)], input="",
                          capture_output=True, text=True, timeout=60)
    assert "got 0 refused 1" in over.stdout, over.stdout + over.stderr
    p = subprocess.Popen([sys.executable, "-c", _STAGING, d.socket, "40", str(1 << 20)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert line.startswith("got 8 refused 32"), line
        with d.client("victim") as c:
            x = torch.arange(12 << 18, dtype=torch.float32)  # 12 MiB: more than the rest of the tier would hold
            h = c.put(x, key="big")
            assert torch.equal(c.get(h), x)
            c.put(torch.ones(4), key="small")  # (its own staging area: the uid's share is spent, the long way)
            assert torch.equal(c.get(c.lookup("small")), torch.ones(4))
    finally:
        p.stdin.close()
        p.wait(timeout=60)


def test_a_forked_child_using_its_parents_client_gets_a_typed_error_and_the_parent_goes_on(daemon):
    """A process forked from one holding a client shares its socket, request ids and
    staging area: the child's request would hang both. It raises ``InvalidArgument``
    instead, the child's close reads none of the parent's replies, and the parent keeps
    using its client."""
    import torch

    from tierstore import InvalidArgument

    with daemon.client("forked") as c:
        h = c.put(torch.arange(8.0), key="k")
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report, never return into pytest
            try:
                try:
                    c.get(h)
                    out = b"no error"
                except InvalidArgument as e:
                    out = b"InvalidArgument" if b"forked" in str(e).encode() else b"other message"
                except BaseException as e:  # noqa: BLE001
                    out = type(e).__name__.encode()
                c.close()
                os.write(w, out)
            finally:
                os._exit(0)
        os.close(w)
        _, status = os.waitpid(pid, 0)
        got = os.read(r, 100)
        os.close(r)
        assert got == b"InvalidArgument" and status == 0, (got, status)
        for _ in range(20):  # the parent's requests and replies are its own still
            assert torch.equal(c.get(h), torch.arange(8.0))
