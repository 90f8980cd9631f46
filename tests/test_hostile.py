"""A real daemon under clients that mean it harm: each test runs hostile client
processes against a real daemon and checks that the other clients are still served."""

import json
import os
import sys

import numpy as np
import pytest

from tierstore import NotFound

from conftest import run_py


def _hostile(daemon, code: str, *args: str, timeout: float = 60) -> dict:
    """Run ``code`` in a client process of its own (``c``: a Client of ``daemon``); it
    prints one JSON line, returned."""
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
    out["clone"] = float(cl[0]) == 1.0
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
