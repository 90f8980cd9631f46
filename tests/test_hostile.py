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
