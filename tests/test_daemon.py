"""A real daemon process, real client processes, real sockets."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import types

import numpy as np
import pytest
import torch

from conftest import poll_until
from tierstore import Busy, CapacityExceeded, DaemonUnavailable, InvalidArgument, KeyExists, NotFound, StaleHandle
from tierstore.client import Client
from tierstore.protocol import PROTOCOL_VERSION
from tierstore.units import align_up

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.int64, torch.bool, torch.complex64]


def test_round_trips_through_the_daemon(daemon):
    with daemon.client("job") as c:
        for dt in DTYPES:
            for shape in [(), (0,), (7,), (33, 65)]:
                t = (torch.randn(shape) * 10).to(dt) if dt != torch.bool else torch.rand(shape) > 0.5
                h = c.put(t)
                got = c.get(h)
                assert got.dtype == t.dtype and torch.equal(got, t)
        for x in (np.asarray(np.float64(0.5)), np.zeros((2, 0), np.uint8)):  # rank kept, staged or not
            got = c.get(c.put(x))
            assert got.shape == x.shape and got.dtype == x.dtype and np.array_equal(got, x)
        a = np.arange(12, dtype=np.int16).reshape(3, 4)
        h = c.put(a, key="np")
        assert np.array_equal(c.get(h), a)
        out = np.empty_like(a)
        c.get(h, out=out)
        assert np.array_equal(out, a)
        big = torch.randn(3 << 20)
        assert torch.equal(c.get(c.put(big, tier="nvme")), big)
        assert torch.equal(c.get(c.put(big, durable=True)), big)
        f1, f2 = c.put_async(torch.ones(5), key="async"), c.get_async(h)
        h_async = f1.result()
        assert np.array_equal(f2.result(), a) and c.lookup("async") == h_async


def test_errors_cross_the_wire_typed(daemon):
    with daemon.client("job") as c:
        h = c.put(torch.ones(3), key="k")
        with pytest.raises(KeyExists, match="replace=True"):
            c.put(torch.ones(3), key="k")
        c.free(h)
        with pytest.raises(StaleHandle):
            c.get(h)
        with pytest.raises(CapacityExceeded, match="every tier"):
            c.put(torch.empty(2 << 30, dtype=torch.uint8))
        t0 = time.monotonic()  # larger than the 64 MiB host tier the bytes travel through: refused at once
        with pytest.raises(CapacityExceeded, match="stages the whole object in the host tier"):
            c.put(torch.empty(65 << 20, dtype=torch.uint8), tier="nvme")
        assert time.monotonic() - t0 < 5
        lease = c.checkout(c.put(torch.ones(2)), "rw")
        with pytest.raises(Busy):
            c.checkout(lease.handle, "r", timeout_s=0.05)
        lease.release()
        assert c.keys() == []


WRITER = r"""
import sys, torch
from tierstore.client import Client
with Client.connect(socket=sys.argv[1], namespace="shared") as c:
    h = c.lookup("x")
    with c.checkout(h, "rw") as v:
        v.add_(41)
    print("written", flush=True)
"""


def test_checkout_written_in_one_process_is_seen_by_another(daemon):
    with daemon.client("shared") as c:
        h = c.put(torch.ones(1000), key="x")
        with c.checkout(h, "r") as before:
            ptr_before = before.data_ptr()
        r = subprocess.run([sys.executable, "-c", WRITER, daemon.socket], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert torch.equal(c.get(h), torch.full((1000,), 42.0))
        with c.checkout(h, "r") as v:  # the same arena memory, not a copy
            assert v.data_ptr() == ptr_before and torch.equal(v, torch.full((1000,), 42.0))


HOLDER = r"""
import sys, time
from tierstore.client import Client
c = Client.connect(socket=sys.argv[1], namespace="shared")
lease = c.checkout(c.lookup("x"), "rw")
r = c.put(__import__("numpy").ones(1 << 20, dtype="uint8"), key="held-put-done")
print("held", flush=True)
sys.stdin.read()
"""


def test_leases_released_when_client_is_sigkilled(daemon):
    with daemon.client("shared") as c:
        h = c.put(torch.zeros(10), key="x")
        p = subprocess.Popen([sys.executable, "-c", HOLDER, daemon.socket], stdout=subprocess.PIPE,
                             stdin=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "held"
        with pytest.raises(Busy):
            c.checkout(h, "r", timeout_s=0.05)
        p.send_signal(signal.SIGKILL)
        p.wait()
        with c.checkout(h, "rw", timeout_s=30) as v:  # waits until the daemon notices the dead peer
            v.add_(1)
        st = c.stat()
        assert st["leases"] == 0 and st["reservations"] == 0
        assert c.lookup("held-put-done") is not None  # its objects stay; only its leases went


EACH_WAITER = r"""
import sys
from tierstore.client import Client
c = Client.connect(socket=sys.argv[1], namespace="shared")
hs = [c.lookup(k) for k in ("a", "b", "s", "x")]
print("asking", flush=True)
c.checkout_each([(hs[0], "rw", None), (hs[1], "w", hs[2]), (hs[3], "rw", None)], timeout_s=60)
print("got", flush=True)
sys.stdin.read()
"""


def test_a_client_killed_while_its_checkout_each_waits_leaves_no_lease(daemon):
    """A list whose last check-out waits (on a daemon worker) for another client's lease:
    its client is SIGKILLed meanwhile; when the wait ends the daemon gives back what the
    list took for the dead connection, and every object is as it was."""
    with daemon.client("shared") as c:
        a = c.put(torch.full((1000,), 1.0), key="a")
        c.put(torch.zeros(1000), key="b", tier="nvme")
        c.put(torch.full((1000,), 7.0), key="s")
        x = c.put(torch.full((1000,), 3.0), key="x")
        hold = c.checkout(x, "rw")
        p = subprocess.Popen([sys.executable, "-c", EACH_WAITER, daemon.socket], stdout=subprocess.PIPE,
                             stdin=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "asking"
        # a and b taken (the event loop), x waited for (a worker)
        poll_until(lambda: c.stat()["leases"] == 3, "three leases, the third waited for")
        p.send_signal(signal.SIGKILL)
        p.wait()
        hold.release()  # the worker takes x for a connection that is gone
        poll_until(lambda: c.stat()["leases"] == 0, "the dead connection's leases given back")
        with c.checkout(a, "rw", timeout_s=5) as v:  # free again, and unchanged
            assert torch.equal(v, torch.full((1000,), 1.0))
        assert torch.equal(c.get(x), torch.full((1000,), 3.0))
        assert torch.equal(c.get(c.lookup("s")), torch.full((1000,), 7.0))


EPHEMERAL = r"""
import sys
import numpy as np
from tierstore.client import Client
c = Client.connect(socket=sys.argv[1], namespace="eph")
c.put(np.full(1 << 20, 7, np.uint8), key="e1", ephemeral=True)
c.put(np.full(3 << 20, 8, np.uint8), key="e2", tier="nvme", ephemeral=True)
c.put(np.full(1000, 9, np.uint8), key="small", ephemeral=True)  # through the staging area
c.put(np.full(1 << 20, 1, np.uint8), key="kept")
c.put(np.full(10, 2, np.uint8), key="replaced", ephemeral=True)
print("put", flush=True)
sys.stdin.read()
"""


def _wait_gone(c, key: str) -> None:
    poll_until(lambda: c.lookup(key) is None, f"{key} gone")


def test_ephemeral_objects_go_with_their_connection_and_nothing_else_does(daemon):
    """put(ephemeral=True): freed when the connection that put it ends (here SIGKILL),
    in every tier; a lease another connection holds on one keeps its bytes until its
    check-in; the connection's other objects stay, and so does a key another
    connection has since replaced."""
    with daemon.client("eph") as c:
        c.free(c.put(np.zeros(1, np.uint8)))  # this connection's staging area is counted in the base
        base = c.stat()["tiers"]["host"]["used_bytes"]
        p = subprocess.Popen([sys.executable, "-c", EPHEMERAL, daemon.socket], stdout=subprocess.PIPE,
                             stdin=subprocess.PIPE, text=True)
        try:
            assert p.stdout.readline().strip() == "put"
            assert c.info(c.lookup("e1"))["ephemeral"] and not c.info(c.lookup("kept"))["ephemeral"]
            c.put(np.full(10, 3, np.uint8), key="replaced", replace=True)  # now this connection's, not ephemeral
            lease = c.checkout(c.lookup("e1"), "r")
        finally:
            p.send_signal(signal.SIGKILL)
            p.wait()
        for key in ("e1", "e2", "small"):
            _wait_gone(c, key)
        assert int(lease.tensor.min()) == 7 == int(lease.tensor.max())  # still leased: intact
        lease.release()
        assert sorted(c.keys()) == ["kept", "replaced"]
        assert np.array_equal(c.get(c.lookup("replaced")), np.full(10, 3, np.uint8))
        st = c.stat()
        assert st["leases"] == 0 and st["namespaces"]["eph"]["objects"] == 2
        # the ephemeral bytes are back in the pool: what is left is "kept" and "replaced"
        poll_until(lambda: c.stat()["tiers"]["host"]["used_bytes"] <= base + (1 << 20) + 2 * 4096,
                   "the ephemeral objects' host bytes back")


def test_ephemeral_goes_at_a_clean_close_and_cannot_be_durable(daemon):
    with daemon.client("eph2") as a:
        a.put(np.zeros(100, np.float32), key="tmp", ephemeral=True)
        with pytest.raises(InvalidArgument, match="cannot be durable"):
            a.put(np.zeros(10, np.float32), key="bad", ephemeral=True, durable=True)
        with pytest.raises(InvalidArgument, match="cannot be durable"):  # the daemon checks it too
            a._conn.request("put_reserve", kind="numpy", dtype="uint8", shape=[10], nbytes=10, key="bad",
                            durable=True, ephemeral=True)
        assert a.lookup("bad") is None
    with daemon.client("eph2") as b:
        _wait_gone(b, "tmp")


def test_unfinished_put_is_aborted_when_client_dies(daemon):
    code = r"""
import sys, os
from tierstore.client import Client
c = Client.connect(socket=sys.argv[1], namespace="job")
r = c._conn.request("put_reserve", kind="numpy", dtype="uint8", shape=[8 << 20], nbytes=8 << 20, key="half")
os._exit(0)  # die between reserve and commit
"""
    before = None
    with daemon.client("job") as c:
        before = c.stat()["tiers"]["host"]["used_bytes"]
    subprocess.run([sys.executable, "-c", code, daemon.socket], check=True, timeout=60)
    with daemon.client("job") as c:
        for _ in range(200):
            st = c.stat()
            if st["reservations"] == 0:
                break
            c.ping()
        assert st["reservations"] == 0 and c.lookup("half") is None
        assert st["tiers"]["host"]["used_bytes"] == before


def _as_nobody(fn_code: str, sock: str, ns: str) -> subprocess.CompletedProcess:
    # everything is imported before dropping to nobody, who cannot read root's Python install
    code = r"""
import os, sys, pwd, traceback
import numpy as np, msgpack
from tierstore.client import Client
from tierstore import TierstoreError
import tierstore.errors, tierstore.tensors, tierstore.arena
pw = pwd.getpwnam("nobody")
os.setgroups([]); os.setgid(pw.pw_gid); os.setuid(pw.pw_uid)
try:
""" + "\n".join("    " + line for line in fn_code.strip().splitlines()) + r"""
except TierstoreError as e:
    print("ERR", e.code, e)
    sys.exit(3)
"""
    return subprocess.run([sys.executable, "-c", code, sock, ns], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "HOME": "/tmp"})


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another uid needs root")


@pytest.fixture
def public_daemon(daemon_factory):
    return daemon_factory(public=True)


@needs_root
def test_socket_and_directory_modes(daemon):
    st_sock = os.stat(daemon.socket)
    st_dir = os.stat(os.path.dirname(daemon.socket))
    assert oct(st_sock.st_mode & 0o777) == "0o660"
    assert oct(st_dir.st_mode & 0o777) == "0o750"


@needs_root
def test_other_uid_is_refused(public_daemon):
    daemon = public_daemon
    r = _as_nobody("Client.connect(socket=sys.argv[1], namespace=sys.argv[2])", daemon.socket, "x")
    assert r.returncode == 3 and "PermissionDenied" in r.stdout and "0750" in r.stdout, r.stdout + r.stderr
    # even with the filesystem opened up, SO_PEERCRED keeps it out
    os.chmod(os.path.dirname(daemon.socket), 0o755)
    os.chmod(daemon.socket, 0o666)
    r = _as_nobody("Client.connect(socket=sys.argv[1], namespace=sys.argv[2])", daemon.socket, "x")
    assert r.returncode == 3 and "PermissionDenied" in r.stdout and "may not use this daemon" in r.stdout, r.stdout
    with daemon.client() as c:
        assert c.stat()["connections_refused"] >= 1


@needs_root
def test_namespace_isolation_between_uids(daemon_factory):
    import grp
    import pwd

    group = grp.getgrgid(pwd.getpwnam("nobody").pw_gid).gr_name
    d = daemon_factory("--allowed-group", group, public=True)
    with d.client("root-job") as c:
        h = c.put(torch.ones(4), key="secret")
    r = _as_nobody("Client.connect(socket=sys.argv[1], namespace=sys.argv[2])", d.socket, "root-job")
    assert r.returncode == 3 and "PermissionDenied" in r.stdout and "belongs to uid 0" in r.stdout, r.stdout
    r = _as_nobody("Client.connect(socket=sys.argv[1], namespace=sys.argv[2]).get(%d)" % int(h), d.socket,
                   "nobody-job")
    assert r.returncode == 3 and "NotFound" in r.stdout, r.stdout
    ok = r"""
import numpy as np
c = Client.connect(socket=sys.argv[1], namespace=sys.argv[2])
h = c.put(np.arange(5), key="mine")
assert (c.get(h) == np.arange(5)).all() and c.keys() == ["mine"]
print("OK")
"""
    r = _as_nobody(ok, d.socket, "nobody-job/rank0")
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr
    with d.client("nobody-job/rank0") as c:  # root may look in
        assert c.keys() == ["mine"]


MIXED = r"""
import sys, numpy as np
from tierstore.client import Client
from tierstore import CapacityExceeded
sock, me = sys.argv[1], int(sys.argv[2])
rng = np.random.default_rng(me)
with Client.connect(socket=sock, namespace=f"load/rank{me}") as c:
    mine = {}
    for i in range(60):
        op = rng.random()
        if op < 0.4 or not mine:
            a = rng.integers(0, 255, int(rng.integers(1, 200_000)), dtype=np.uint8)
            try:
                h = c.put(a, key=f"k{i}", durable=bool(rng.random() < 0.1), tier="nvme" if rng.random() < 0.2 else None)
            except CapacityExceeded:
                continue
            mine[h] = a
        elif op < 0.7:
            h = list(mine)[int(rng.integers(len(mine)))]
            assert np.array_equal(c.get(h), mine[h]), "wrong bytes"
        elif op < 0.85:
            h = list(mine)[int(rng.integers(len(mine)))]
            with c.checkout(h, "rw") as v:
                assert np.array_equal(v, mine[h])
                v[:1] += np.uint8(1)  # wraps at 256
            mine[h] = mine[h].copy(); mine[h][:1] += np.uint8(1)
        else:
            h = list(mine)[int(rng.integers(len(mine)))]
            c.free(h)
            del mine[h]
    for h, a in mine.items():
        assert np.array_equal(c.get(h), a), "wrong bytes at the end"
    assert sorted(c.keys()) == sorted(c.info(h)["key"] for h in mine)
print("OK", len(mine))
"""


def test_32_concurrent_clients_mixed_operations(daemon):
    procs = [subprocess.Popen([sys.executable, "-c", MIXED, daemon.socket, str(i)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(32)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0 and out.startswith("OK"), err[-2000:]
    with daemon.client() as c:
        st = c.stat()
        assert st["leases"] == 0 and st["reservations"] == 0
        assert sum(v["objects"] for k, v in st["namespaces"].items() if k.startswith("load/")) == \
            sum(int(o.split()[1]) for o, _ in outs)


def test_sigkill_and_sigterm_restarts_keep_durable_objects(daemon):
    with daemon.client("job") as c:
        data = {f"d{i}": torch.randn(1000 + i * 5000) for i in range(6)}
        for k, t in data.items():
            c.put(t, key=k, durable=True)
        c.put(torch.ones(3), key="volatile")
        gone = c.put(torch.ones(3), key="gone", durable=True)
        c.free(gone)
    daemon.kill()
    assert os.path.exists(daemon.socket)  # a stale socket is left behind ...
    daemon.start()  # ... and replaced
    with daemon.client("job") as c:
        assert sorted(c.keys()) == sorted(data)
        for k, t in data.items():
            assert torch.equal(c.get(c.lookup(k)), t)
    assert daemon.stop() == 0
    assert not os.path.exists(daemon.socket)  # SIGTERM removes the socket
    daemon.start()
    with daemon.client("job") as c:
        assert sorted(c.keys()) == sorted(data)


@pytest.mark.parametrize("same_nvme_dir", [False, True])
def test_second_daemon_on_a_live_socket_refuses(daemon, tmp_path, same_nvme_dir):
    """A second daemon on a live daemon's socket is refused naming that daemon, whether
    it was given NVMe directories of its own or the same ones (as two starts with the
    same settings are): the socket is checked before the directories the first holds."""
    env = dict(os.environ)
    nvme = daemon.nvme if same_nvme_dir else str(tmp_path / "other")
    r = subprocess.run([sys.executable, "-m", "tierstore.daemon", "--socket", daemon.socket, "--nvme-dir",
                        nvme, "--host-bytes", "16MiB"], capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 1 and f"(pid {daemon.proc.pid}) is already serving" in r.stderr, r.stderr
    with daemon.client() as c:
        c.ping()


@pytest.mark.parametrize("target", ["missing", "a file"])
def test_a_link_at_the_socket_path_is_refused_not_followed(tmp_path, target):
    """A symbolic link where the socket is to be (dangling, or to a file elsewhere) is
    neither followed nor taken for a live daemon's socket: the start is refused naming it,
    and what it points to is left as it was."""
    run = tmp_path / "run"
    run.mkdir(mode=0o750)
    elsewhere = tmp_path / "elsewhere"
    if target == "a file":
        elsewhere.write_text("keep")
    os.symlink(elsewhere, run / "s.sock")
    r = subprocess.run([sys.executable, "-m", "tierstore.daemon", "--socket", str(run / "s.sock"), "--nvme-dir",
                        str(tmp_path / "n"), "--host-bytes", "16MiB"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "is a symbolic link; remove it" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert os.path.islink(run / "s.sock")
    assert (elsewhere.read_text() == "keep") if target == "a file" else not elsewhere.exists()


def test_settings_the_machine_cannot_honour_stop_the_daemon_with_a_message(daemon, tmp_path):
    def start(*flags):
        return subprocess.run([sys.executable, "-m", "tierstore.daemon", "--socket", str(tmp_path / "s.sock"),
                               *flags], capture_output=True, text=True, timeout=60)

    r = start("--nvme-dir", str(tmp_path / "n"), "--host-bytes", "100000TiB")
    assert r.returncode == 1 and "lower host_bytes" in r.stderr and "Traceback" not in r.stderr, r.stderr
    # the live daemon's NVMe directory is locked
    r = start("--nvme-dir", daemon.nvme, "--host-bytes", "16MiB")
    assert r.returncode == 1 and "is in use by pid" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_sd_notify_messages(daemon_factory):
    d = daemon_factory(env={"WATCHDOG_USEC": "400000"})
    ready = d.wait_for("READY=1")
    assert "STATUS=serving on" in ready and f"MAINPID={d.proc.pid}" in ready
    assert d.wait_for("WATCHDOG=1") == "WATCHDOG=1"
    d.proc.terminate()
    assert "STOPPING=1" in d.wait_for("STOPPING=1")
    d.proc.wait(timeout=60)


def test_daemon_unavailable_and_autostart(tmp_path, monkeypatch):
    sock = str(tmp_path / "auto" / "ts.sock")
    with pytest.raises(DaemonUnavailable, match="tierstore daemon"):
        Client.connect(socket=sock)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("TIERSTORE_HOST_BYTES", "32MiB")
    with Client.connect(socket=sock, autostart=True, namespace="auto") as c:
        h = c.put(torch.ones(3), key="a")
        pid = c.stat()["pid"]
    with Client.connect(socket=sock, namespace="auto") as c:
        assert c.lookup("a") == h
    os.kill(pid, signal.SIGTERM)


def test_cli_stat_ls_free(daemon):
    with daemon.client("job") as c:
        c.put(torch.ones(3), key="opt/a")
        c.put(torch.ones(3), key="opt/b", durable=True)
    env = {**os.environ, "TIERSTORE_SOCKET": daemon.socket}

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "tierstore.client.cli", *args], capture_output=True, text=True,
                              env=env, timeout=60)
    r = cli("stat")
    assert r.returncode == 0 and "host" in r.stdout and "engine: posix" in r.stdout and "job" in r.stdout
    assert "checksums: CRC32C per 1 MiB block (fastcrc)" in r.stdout
    import json

    r = cli("stat", "--json")
    st = json.loads(r.stdout)
    assert st["namespaces"]["job"]["objects"] == 2 and st["tiers"]["nvme"]["engine"] == "posix"
    assert st["tiers"]["nvme"]["checksums"] == "fastcrc"
    r = cli("ls", "--namespace", "job", "--json")
    assert [row["key"] for row in json.loads(r.stdout)] == ["opt/a", "opt/b"]
    r = cli("ls", "--namespace", "job")
    lines = r.stdout.splitlines()
    assert "FLAGS" in lines[0] and lines[1].split()[0] == "opt/a" and lines[2].split()[-1] == "durable", r.stdout
    r = cli("free", "--namespace", "job", "opt/a", "nope")
    assert r.returncode == 1 and "freed opt/a" in r.stdout and "no key 'nope'" in r.stderr
    r = cli("stat", "--watch", "0.1", "--json", "--iterations", "2")
    assert r.returncode == 0 and len(r.stdout.strip().splitlines()) == 2
    r = subprocess.run([sys.executable, "-m", "tierstore.client.cli", "stat"], capture_output=True, text=True,
                       env={**os.environ, "TIERSTORE_SOCKET": str(daemon.base / "nothing.sock")}, timeout=60)
    assert r.returncode == 1 and "DaemonUnavailable" in r.stderr and "tierstore daemon" in r.stderr


def test_malformed_input_never_hurts_others(daemon_factory):
    import msgpack

    daemon = daemon_factory("--max-message-bytes", "64KiB")
    good = daemon.client("job")
    h = good.put(torch.arange(10), key="keep")

    def raw():
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.settimeout(10)
        s.connect(daemon.socket)
        return s

    def exchange(s, payload):
        s.send(payload)
        try:
            data = s.recv(1 << 20)
        except (ConnectionResetError, TimeoutError):
            return None
        return msgpack.unpackb(data, raw=False) if data else None

    def hello(s):
        rep, fds, _, _ = socket.recv_fds(s, 1 << 16, 4) if not s.send(
            msgpack.packb({"id": 0, "op": "hello", "version": PROTOCOL_VERSION, "namespace": "evil"})) is None else (None,) * 4
        for fd in fds:
            os.close(fd)
        return msgpack.unpackb(rep)

    cases = [
        os.urandom(64),  # random bytes
        msgpack.packb([1, 2, 3]),  # not a map
        msgpack.packb({"op": "hello"}),  # no id
        msgpack.packb({"id": "x", "op": "hello"}),  # wrong id type
        msgpack.packb({"id": 1, "op": "get", "handle": 1}),  # before hello
        msgpack.packb({"id": 2**64 - 1, "op": "hello"}),  # id out of range
        msgpack.packb({"id": 1, "op": "hello", "version": 99, "namespace": "x"}),  # wrong version
    ]
    for payload in cases:
        s = raw()
        rep = exchange(s, payload)
        assert rep is None or rep["err"]["code"] == "ProtocolError"
        s.close()
    s = raw()
    assert "ok" in hello(s)
    after_hello = [
        ({"id": 2, "op": "nope"}, "ProtocolError"),
        ({"id": 3, "op": "get"}, "InvalidArgument"),  # missing field
        ({"id": 4, "op": "get", "handle": [1, 2]}, "InvalidArgument"),  # wrong type
        ({"id": 5, "op": "get", "handle": -5}, "InvalidArgument"),
        ({"id": 6, "op": "put_reserve", "kind": "torch", "dtype": "float32", "shape": [-1], "nbytes": -4},
         "InvalidArgument"),
        ({"id": 7, "op": "put_reserve", "kind": "torch", "dtype": "float32", "shape": [1 << 40], "nbytes": 1 << 42},
         "CapacityExceeded"),
        ({"id": 77, "op": "put_reserve", "kind": "torch", "dtype": "uint8", "shape": [1 << 60], "nbytes": 1 << 60},
         "InvalidArgument"),
        ({"id": 8, "op": "put_reserve", "kind": "torch", "dtype": "float32", "shape": [2], "nbytes": 9},
         "InvalidArgument"),
        ({"id": 9, "op": "put_reserve", "kind": "torch", "dtype": "object", "shape": [2], "nbytes": 8},
         "InvalidArgument"),
        ({"id": 10, "op": "put_commit", "rid": 1}, "NotFound"),  # someone else's (or no) reservation
        ({"id": 11, "op": "release", "lid": 12345}, "NotFound"),
        ({"id": 12, "op": "hello", "version": PROTOCOL_VERSION, "namespace": "again"}, "ProtocolError"),
        ({"id": 13, "op": "checkout", "handle": int(h), "mode": "r"}, "NotFound"),  # other namespace
        ({"id": 16, "op": "checkout", "handle": int(h), "mode": "x"}, "InvalidArgument"),
        ({"id": 14, "op": "lookup", "key": {"nested": [1, {"a": None}]}}, "InvalidArgument"),
        ({"id": 15, "op": "prefetch", "handles": "all"}, "InvalidArgument"),
        ({"id": 17, "op": "put_staged", "src": 0, "kind": "numpy", "dtype": "uint8", "shape": [4], "nbytes": 4},
         "InvalidArgument"),  # no staging area yet
        ({"id": 18, "op": "staging", "nbytes": 1 << 40}, "InvalidArgument"),
        ({"id": 19, "op": "staging", "nbytes": 65536}, None),
        ({"id": 21, "op": "put_staged", "src": 65000, "kind": "numpy", "dtype": "uint8", "shape": [4096],
          "nbytes": 4096}, "InvalidArgument"),  # outside its staging area
        ({"id": 22, "op": "checkout_many", "handles": int(h)}, "InvalidArgument"),  # not a list
        ({"id": 23, "op": "checkout_many", "handles": []}, "InvalidArgument"),
        ({"id": 24, "op": "checkout_many", "handles": [int(h)] * 5000}, "InvalidArgument"),  # too many
        ({"id": 25, "op": "checkout_many", "handles": [int(h)], "modes": [1]}, "InvalidArgument"),
        ({"id": 26, "op": "checkout_many", "handles": [int(h)], "modes": ["r", "r"]}, "InvalidArgument"),
        ({"id": 27, "op": "checkout_many", "handles": [int(h)]}, "NotFound"),  # other namespace
        ({"id": 28, "op": "checkout_many", "handles": [{"a": 1}]}, "InvalidArgument"),
        ({"id": 33, "op": "checkout_each", "requests": [int(h), "r", None]}, "InvalidArgument"),  # not pairs
        ({"id": 34, "op": "checkout_each", "requests": []}, "InvalidArgument"),
        ({"id": 35, "op": "checkout_each", "requests": [[int(h), "r", None]] * 5000}, "InvalidArgument"),
        ({"id": 36, "op": "checkout_each", "requests": [[int(h), 1, None]]}, "InvalidArgument"),
        ({"id": 37, "op": "checkout_each", "requests": [[None, "r", None]]}, "InvalidArgument"),
        ({"id": 38, "op": "checkout_each", "requests": [[int(h), "r", {"a": 1}]]}, "InvalidArgument"),
        ({"id": 39, "op": "checkout_each", "requests": [[int(h), "r", int(h)]]}, "InvalidArgument"),  # r + source
        ({"id": 40, "op": "checkout_each", "requests": [[int(h), "rw", None]]}, "NotFound"),  # other namespace
        ({"id": 29, "op": "release_many", "lids": [True]}, "InvalidArgument"),
        ({"id": 31, "op": "release_many", "lids": [12345, -1]}, "InvalidArgument"),
        ({"id": 32, "op": "release_many", "lids": [12345]}, "NotFound"),
    ]
    for msg, code in after_hello:
        rep = exchange(s, msgpack.packb(msg))
        assert rep["id"] == msg["id"], (msg, rep)
        assert (code is None and "ok" in rep) or rep["err"]["code"] == code, (msg, rep)
    # a reservation of a well-behaved client cannot be committed by another connection
    r = good._conn.request("put_reserve", kind="numpy", dtype="uint8", shape=[10], nbytes=10, key="race")
    rep = exchange(s, msgpack.packb({"id": 20, "op": "put_commit", "rid": r["rid"]}))
    assert rep["err"]["code"] == "NotFound"
    good._conn.request("put_abort", rid=r["rid"])
    # oversized message: error and the connection is closed
    rep = exchange(s, msgpack.packb({"id": 30, "op": "ping", "pad": "x" * (100 << 10)}))
    assert rep is None or rep["err"]["code"] == "ProtocolError"
    s.close()
    # a client that connects and never speaks does not hold anyone up
    silent = raw()
    assert torch.equal(good.get(h), torch.arange(10))
    silent.close()
    assert torch.equal(good.get(good.lookup("keep")), torch.arange(10))
    with pytest.raises(NotFound):
        good.get(10**6)
    good.close()


LAUNCH = r"""
import os, sys
arena, index = int(sys.argv[1]), int(sys.argv[2])
os.dup2(arena, 3); os.dup2(index, 4)
os.environ.update(LISTEN_FDS="2", LISTEN_FDNAMES="arena:index", LISTEN_PID=str(os.getpid()))
os.execv(sys.executable, [sys.executable, "-m", "tierstore.daemon", *sys.argv[3:]])
"""


@contextlib.contextmanager
def _relaunched(daemon, stored: dict, host_bytes: str = "64MiB"):
    """The next daemon, handed the arena and index fds ``stored`` as systemd would; yields
    its READY=1 status."""
    args = ["--socket", daemon.socket, "--nvme-dir", daemon.nvme, "--host-bytes", host_bytes, "--nvme-bytes", "1GiB"]
    with open(daemon.log, "ab") as logf:
        p = subprocess.Popen([sys.executable, "-c", LAUNCH, str(stored["arena"]), str(stored["index"]), *args],
                             pass_fds=(stored["arena"], stored["index"]), stdout=logf, stderr=logf,
                             env={**os.environ, "NOTIFY_SOCKET": daemon.notify_path})
        try:
            yield daemon.wait_for("READY=1")
        finally:
            p.terminate()
            p.wait()


@pytest.mark.parametrize("how", ["sigkill", "sigterm"])
def test_host_tier_survives_a_restart_through_the_fd_store(daemon, how):
    """systemd emulated: the fds the daemon stores with FDSTORE=1 are handed to the next one."""
    stored = dict(daemon.fdstore)  # what the daemon handed to "systemd" before READY=1
    assert set(stored) == {"arena", "index"}
    with daemon.client("survive") as c:
        keep = {f"v{i}": torch.randn(1000 * (i + 1)) for i in range(20)}
        for k, t in keep.items():
            c.put(t, key=k)
        c.free(c.lookup("v3"))
        del keep["v3"]
        with c.checkout(c.lookup("v5"), "rw") as v:
            v.fill_(5.0)
        keep["v5"] = torch.full((6000,), 5.0)
        d = c.put(torch.arange(7.0), key="durable", durable=True)
        keep["durable"] = torch.arange(7.0)
        c.put(torch.ones(100), key="spilled", tier="nvme")  # volatile and only on NVMe: not kept
    eph = daemon.client("survive")  # open across the restart: its ephemeral object is not handed on
    eph.put(torch.ones(5000), key="ephemeral", ephemeral=True)
    if how == "sigkill":
        daemon.kill()
    else:
        daemon.stop()
    try:
        eph.close()
    except DaemonUnavailable:
        pass
    with _relaunched(daemon, stored) as ready:
        assert "20 host-resident objects adopted" in ready, ready
        with daemon.client("survive") as c:
            assert sorted(c.keys()) == sorted(keep)
            for k, t in keep.items():
                assert torch.equal(c.get(c.lookup(k)), t), k
            assert c.lookup("v3") is None  # freed stays freed
            assert c.lookup("durable") == d
            h = c.put(torch.ones(3), key="after")  # the adopted arena keeps working
            assert torch.equal(c.get(h), torch.ones(3))


def test_a_restart_with_another_host_bytes_says_the_handed_back_arena_keeps_its_size(daemon):
    """``systemctl restart`` after host_bytes was changed: the arena handed back keeps its
    size and objects (as documented), and the start warns that only a stop and a start
    give it the new size, instead of the settings line alone claiming the new one."""
    stored = dict(daemon.fdstore)
    with daemon.client("size") as c:
        c.put(torch.ones(10), key="k")
    daemon.stop()
    with _relaunched(daemon, stored, host_bytes="128MiB"):
        with daemon.client("size") as c:
            assert torch.equal(c.get(c.lookup("k")), torch.ones(10))
            assert c.stat()["tiers"]["host"]["capacity_bytes"] == 64 << 20
    log = daemon.log.read_text()
    assert "host_bytes is 128.0 MiB, but the host arena handed back by the service manager holds 64.0 MiB" in log


@needs_root
def test_connections_per_uid_are_capped(daemon_factory):
    import grp
    import pwd

    group = grp.getgrgid(pwd.getpwnam("nobody").pw_gid).gr_name
    d = daemon_factory("--allowed-group", group, "--max-clients-per-uid", "2", public=True)
    code = r"""
import time
cs = [Client.connect(socket=sys.argv[1], namespace=sys.argv[2]) for _ in range(2)]
try:
    Client.connect(socket=sys.argv[1], namespace=sys.argv[2])
    print("third admitted")
except TierstoreError as e:
    print("refused:", e)
"""
    r = _as_nobody(code, d.socket, "capped")
    assert "refused:" in r.stdout and "max_clients_per_uid" in r.stdout, r.stdout + r.stderr
    with d.client(), d.client(), d.client() as c:  # the daemon's own uid is exempt
        c.ping()


def test_replacing_a_leased_key_does_not_stall_the_daemon(daemon):
    import time

    with daemon.client("job") as a, daemon.client("job") as b, daemon.client("other") as c:
        a.put(torch.ones(10), key="k", durable=True)
        lease = a.checkout(a.lookup("k"), "r")  # the old object stays leased
        t0 = time.monotonic()
        h = b.put(torch.zeros(10), key="k", replace=True)
        c.lookup("nothing")  # the event loop keeps serving everybody
        assert time.monotonic() - t0 < 5.0
        assert torch.equal(b.get(h), torch.zeros(10)) and torch.equal(lease.tensor, torch.ones(10))
        lease.release()
        for _ in range(1000):  # the replaced object goes once its lease ends
            if b.stat()["namespaces"]["job"]["objects"] == 1:
                break
        assert b.stat()["namespaces"]["job"]["objects"] == 1


def test_one_connection_shared_by_many_threads(daemon):
    """Threads share a client: replies reach the right caller whether a thread reads its
    own reply directly or waits while another thread reads for everybody."""
    from conftest import in_threads

    with daemon.client("threads") as c:
        def work(k):
            for i in range(150):
                x = np.full(64 + k, k * 1000 + i, np.int64)
                h = c.put(x)
                assert np.array_equal(c.get(h), x)
                assert c.info(h)["shape"] == [64 + k]
                c.free(h)
        errors = in_threads(work, 8)
        assert not errors, errors[:3]
        c.ping()


def test_check_in_is_ordered_and_a_durable_rw_check_in_is_synchronous(daemon):
    """Read and volatile check-ins do not wait for their reply, yet the connection's next
    request sees them done; a durable object's rw check-in returns only once its bytes
    are on NVMe (they survive a kill -9 right after it)."""
    with daemon.client("ci") as c:
        hv = c.put(np.zeros(1000, np.float32), key="v")
        hd = c.put(np.zeros(1000, np.float32), key="d", durable=True)
        for _ in range(20):
            with c.checkout(hv, "rw") as v:
                v += 1
            with c.checkout(hv, "r") as v:
                assert float(v[0]) == float(v[-1])
            assert c.stat()["leases"] == 0
        c.free(hv)  # no Busy: the read lease before it is gone
        with c.checkout(hd, "rw") as v:
            v += 5
        daemon.kill()  # at once, with nothing else sent after the check-in
    daemon.start()
    with daemon.client("ci") as c:
        assert np.array_equal(c.get(c.lookup("d")), np.full(1000, 5, np.float32))
        assert c.lookup("v") is None


def test_free_waits_for_another_connections_lease_and_refuses_the_callers_own(daemon):
    """A check-in sent without waiting can reach the daemon after another connection's
    free: a free waits for other connections' leases to end (as a check-out does), while
    freeing an object one's own connection holds is Busy at once."""
    import threading
    import time

    with daemon.client("fw") as a, daemon.client("fw") as b:
        h = a.put(np.arange(1000, dtype=np.float32), key="x")
        lease = a.checkout(h, "r")
        done = {}

        def free_it():
            b.free(h)
            done["at"] = time.monotonic()
        t = threading.Thread(target=free_it)
        t.start()
        _wait_stat(a, lambda st: st["waiting"] == 1, "the free waits in the daemon")
        assert t.is_alive() and a.lookup("x") is not None  # waiting for the lease
        released = time.monotonic()
        lease.release()
        t.join(timeout=30)
        assert done["at"] >= released and a.lookup("x") is None  # it returned only once the lease ended

        h2 = b.put(np.zeros(10, np.float32), key="y")
        with b.checkout(h2, "rw"):
            t0 = time.monotonic()
            with pytest.raises(Busy, match="checked out"):
                b.free(h2)
            assert time.monotonic() - t0 < 5
        b.free(h2)


def test_free_gives_up_on_a_lease_after_lease_wait_s(daemon_factory):
    d = daemon_factory(env={"TIERSTORE_LEASE_WAIT_S": "0.5"})
    with d.client("fw") as a, d.client("fw") as b:
        h = a.put(np.zeros(10, np.float32), key="x")
        with a.checkout(h, "r"):
            with pytest.raises(Busy, match="checked out"):
                b.free(h)
            assert b.lookup("x") is not None


def test_stat_lists_sessions_and_whether_each_pinned_its_arena(daemon):
    # torch is imported in this process: its clients report their pinning
    with daemon.client("s1") as a, daemon.client("s2") as b:
        b.ping()
        st = a.stat()
        mine = {s["namespace"]: s for s in st["sessions"]}
        assert set(mine) >= {"s1", "s2"} and st["clients"] == len(st["sessions"])
        assert mine["s2"]["pid"] == os.getpid() and mine["s2"]["requests"] >= 2
        assert mine["s2"]["pinned"] is a.pinned and mine["s2"]["pinned_reason"] == a.pinned_reason
        r = subprocess.run([sys.executable, "-m", "tierstore.client.cli", "stat", "--socket", daemon.socket],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "clients pinned: 0 of 2 that reported" in r.stdout, r.stdout + r.stderr
        assert "host huge pages: " in r.stdout  # (and what it got, or which setting to change)


def test_stat_is_answered_on_the_event_loop_whatever_the_number_of_objects(make_store):
    """stat's counts are counters kept as objects change, O(1) in objects, so the event
    loop answers it inline (not ``Later``) and the counts match the objects."""
    from tierstore.daemon import handlers as hmod

    s = make_store()
    for i in range(12):
        s.put(np.zeros(4, np.float32), key=f"k{i}", namespace=f"ns{i % 3}")
    hs = hmod.Handlers(s, lambda uid: {"clients": 0})
    root = types.SimpleNamespace(cred=types.SimpleNamespace(uid=0))
    st = hs.stat(root, {})
    assert st["namespaces"] == {f"ns{j}": {"objects": 4, "bytes": 64} for j in range(3)}
    assert st["tiers"]["host"]["objects"] == 12 and st["namespaces_total"] == 3 and st["namespaces_next"] is None


def test_checkout_many_through_the_daemon(daemon):
    """One round trip leases a batch (resident objects on the event loop, the rest on
    its thread pool, in order); one message checks it in; a batch that fails part-way
    leaves nothing leased and nothing changed; a durable write batch's check-in returns
    once its bytes are on NVMe."""
    with daemon.client("batch") as c, daemon.client("batch") as other:
        mib = 1 << 18
        hs = [c.put(torch.full((mib,), float(i)), key=f"k{i}", tier="nvme" if i % 2 else None) for i in range(6)]
        g = c.checkout_many(hs, ["r", "rw", "w", "r", "rw", "r"])
        assert c.stat()["leases"] == 6 and [lease.handle for lease in g] == hs
        assert [float(t[0]) for t in g.tensors[:2]] == [0.0, 1.0]
        g[1].tensor.add_(10)
        g[2].tensor.fill_(20)
        g[0].release()
        g.release()
        assert other.stat()["leases"] == 0  # the batch check-in reached the daemon first
        assert float(other.get(hs[1])[0]) == 11.0 and float(other.get(hs[2])[0]) == 20.0

        held = other.checkout(hs[4], "rw")
        with pytest.raises(Busy, match="object #2 of the batch.*no object was checked out"):
            c.checkout_many([hs[3], hs[0], hs[4]], ["w", "rw", "r"], timeout_s=0.3)
        assert c.stat()["leases"] == 1  # only the other connection's
        held.release()
        assert torch.equal(c.get(hs[3]), torch.full((mib,), 3.0))
        with pytest.raises(InvalidArgument, match="twice"):
            c.checkout_many([hs[0], hs[0]], "w")
        with pytest.raises(InvalidArgument, match="mode"):
            c.checkout_many(hs, ["r"] * 5 + ["wr"])

        hd = [c.put(np.zeros(1000, np.float32), key=f"d{i}", durable=True) for i in range(3)]
        with c.checkout_many(hd, "rw") as ts:
            for i, t in enumerate(ts):
                t += i + 1
        daemon.kill()  # at once, with nothing sent after the check-in
    daemon.start()
    with daemon.client("batch") as c:
        for i in range(3):
            assert np.array_equal(c.get(c.lookup(f"d{i}")), np.full(1000, i + 1, np.float32))


SOURCE_HOLDER = r"""
import sys
from tierstore.client import Client
c = Client.connect(socket=sys.argv[1], namespace="src")
lease = c.checkout(c.lookup("b"), "w", source=c.lookup("a"))
lease.tensor[:10] = -1  # part of an update, then killed
print("held", flush=True)
sys.stdin.read()
"""


def test_a_checkout_from_a_source_that_waits_counts_the_sources_read_once(daemon):
    """A check-out from a source that must wait for another holder of its object is given
    up by the op worker and run again on a wait thread: the source's read lease is taken
    again, but the access is counted and recorded once, as it was made once."""
    import threading

    mib = 1 << 18
    with daemon.client("src-wait") as c, daemon.client("src-wait") as other:
        dst = c.put(torch.zeros(mib), key="dst", tier="nvme")
        hot = c.put(torch.full((mib,), 3.0), key="hot", tier="host")  # dirty, in host only: copied
        accesses = lambda st: sum(st["prefetch"][k] for k in ("hits", "late", "misses"))  # noqa: E731
        held = other.checkout(dst, "r")
        before = c.stat()
        out = {}

        def sourced():
            with c.checkout(dst, "w", source=hot, timeout_s=30) as t:
                out["t"] = t.clone()

        t = threading.Thread(target=sourced)
        t.start()
        # the request read-leases the source (counted), then would wait for the held object: the
        # op worker gives it up and its rest runs again on a wait thread (``waiting``), from the start
        poll_until(lambda: other.stat()["waiting"] == 1, "the request moved to a wait thread")
        held.release()
        t.join(30)
        assert torch.equal(out["t"], torch.full((mib,), 3.0))
        after = c.stat()
        assert accesses(after) == accesses(before) + 1
        assert after["counters"]["checkouts"] - before["counters"]["checkouts"] == 1 + 1  # the source's, dst's w
        assert after["counters"]["source_copies"] == before["counters"]["source_copies"] + 1


def test_checkout_from_a_source_through_the_daemon(daemon):
    """A ``w`` check-out that starts with another object's bytes: the source stays as it
    was (also when the holder is SIGKILLed mid-update); bad requests are refused."""
    mib = 1 << 18
    ramp = torch.arange(mib, dtype=torch.float32)
    with daemon.client("src") as c, daemon.client("src") as other:
        assert "source" in c.server["features"]
        a = c.put(ramp, key="a", tier="nvme")
        b = c.put(torch.zeros(mib), key="b", tier="nvme")
        with c.checkout(b, "w", source=a) as t:
            assert torch.equal(t, ramp)
            t.add_(1)
        assert torch.equal(other.get(b), ramp + 1) and torch.equal(other.get(a), ramp)
        counters = c.stat()["counters"]
        assert counters["source_handovers"] + counters["source_copies"] == 1

        # a source only in host (dirty): copied on a worker; its read is recorded once, not per attempt
        hot = c.put(ramp * 3, key="hot", tier="host")
        accesses = lambda st: sum(st["prefetch"][k] for k in ("hits", "late", "misses"))  # noqa: E731
        before = c.stat()
        with c.checkout(b, "w", source=hot) as t:
            assert torch.equal(t, ramp * 3)
        after = c.stat()
        assert after["counters"]["source_copies"] == before["counters"]["source_copies"] + 1
        assert accesses(after) == accesses(before) + 1

        held = other.checkout(b, "r")
        with pytest.raises(Busy):
            c.checkout(b, "w", source=a, timeout_s=0.2)
        held.release()
        assert c.stat()["leases"] == 0  # the read lease on the source was given back too

        with pytest.raises(InvalidArgument, match="'w' check-out"):
            c.checkout(b, "rw", source=a)
        with pytest.raises(InvalidArgument, match="same size"):
            c.checkout(b, "w", source=c.put(torch.zeros(4)))
        with pytest.raises(InvalidArgument, match="own source"):
            c.checkout(b, "w", source=b)
        for bad in ([int(a)], 1.5, "x.y"):
            with pytest.raises(InvalidArgument):
                c._conn.request("checkout", handle=int(b), mode="w", source=bad)
        with pytest.raises(InvalidArgument, match="'w' check-out"):
            c._conn.request("checkout", handle=int(b), mode="r", source=int(a))
        assert c.stat()["leases"] == 0

        p = subprocess.Popen([sys.executable, "-c", SOURCE_HOLDER, daemon.socket], stdout=subprocess.PIPE,
                             stdin=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "held"
        p.send_signal(signal.SIGKILL)
        p.wait()
        with c.checkout(b, "r", timeout_s=30) as t:  # the dead holder's lease ended as a check-in
            assert torch.equal(t[:10], torch.full((10,), -1.0)) and torch.equal(t[10:], ramp[10:])
        assert torch.equal(c.get(a), ramp)
        assert c.stat()["leases"] == 0


TORN_WRITER = r"""
import sys, torch
from tierstore.client import Client
c = Client.connect(socket=sys.argv[1], namespace="torn")
for k in ("hot", "cold"):
    h = c.lookup(k)
    lease = c.checkout(h, "w", source=c.lookup("src")) if sys.argv[2] == "source" else c.checkout(h, sys.argv[2])
    lease.tensor[:100] = -1.0  # never checked in
print("writing", flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize("mode", ["rw", "w", "source"])
def test_a_durable_object_under_a_write_lease_is_not_adopted_half_written(daemon, mode):
    """The daemon is SIGKILLed while a client writes into durable objects' host blocks;
    the next daemon, handed the arena through the fd store, serves their last checked-in
    bytes (from NVMe), not the half-written block."""
    stored = dict(daemon.fdstore)
    with daemon.client("torn") as c:
        c.put(torch.full((1 << 16,), 7.0), key="src", tier="nvme")
        c.put(torch.full((1 << 16,), 1.0), key="hot", durable=True)  # resident in host and on NVMe
        c.put(torch.full((1 << 16,), 2.0), key="cold", durable=True, tier="nvme")
        p = subprocess.Popen([sys.executable, "-c", TORN_WRITER, daemon.socket, mode], stdout=subprocess.PIPE,
                             stdin=subprocess.PIPE, text=True)
        try:
            assert p.stdout.readline().strip() == "writing"
            daemon.kill()
        finally:
            p.kill()
            p.wait()
    with _relaunched(daemon, stored), daemon.client("torn") as c:
        assert torch.equal(c.get(c.lookup("hot")), torch.full((1 << 16,), 1.0))
        assert torch.equal(c.get(c.lookup("cold")), torch.full((1 << 16,), 2.0))


def _wait_stat(c, ok, what: str, timeout_s: float = 30.0) -> dict:
    def check():
        st = c.stat()
        return st if ok(st) else None
    return poll_until(check, what, timeout_s)


def test_a_view_used_after_its_client_closed_cannot_write_the_pool(daemon):
    """A check-out's tensor kept past ``Client.close()`` (the connection, and so the lease,
    ended) keeps reading, but its writes land in the process's own pages: the object, and
    whatever later uses its memory, are untouched."""
    n = 1 << 20
    a = daemon.client("closer")
    h = a.put(np.full(n, 7, np.uint8), key="x")
    rw, r = a.checkout(h, "rw").tensor, a.checkout(a.put(np.full(n, 8, np.uint8), key="y"), "r").tensor
    a.close()  # with both views still referenced
    assert int(rw[0]) == 7 and int(r[0]) == 8  # still readable
    rw[:] = 99  # lands in private pages
    assert int(rw[0]) == 99
    with daemon.client("closer") as b:
        assert (b.get(b.lookup("x")) == 7).all() and (b.get(b.lookup("y")) == 8).all()
        with b.checkout(b.lookup("x"), "rw") as t:
            t[:] = 5
        rw[:] = 42  # after another writer's check-in: still nowhere in the pool
        assert (b.get(b.lookup("x")) == 5).all()
    del rw, r


def test_a_revoked_lease_cannot_reach_other_objects_memory(daemon_factory):
    """lease_timeout_s revokes the leases of a client that stopped answering; when it
    resumes, what it writes through its old views lands in memory no object uses."""
    d = daemon_factory(env={"TIERSTORE_LEASE_TIMEOUT_S": "1"})
    n = 4 << 20
    with d.client("stall") as a, d.client("other") as b:
        x = a.put(np.full(n, 1, np.uint8), key="x")  # written under rw when its writer stalls
        y = a.put(np.full(n, 2, np.uint8), key="y", durable=True)  # overwritten under w
        z = a.put(np.full(n, 3, np.uint8), key="z")  # read, then freed by its owner
        lx, ly, lz = a.checkout(x, "rw"), a.checkout(y, "w"), a.checkout(z, "r")
        lx.tensor[: n // 2] = 11
        ly.tensor[:] = 22
        st = _wait_stat(b, lambda s: s["counters"]["leases_revoked"] == 3, "revocation")
        assert st["leases"] == 0
        # each lease ended as a check-in: the bytes written so far are the objects'
        assert (a.get(x)[: n // 2] == 11).all() and (a.get(x)[n // 2:] == 1).all()
        assert (a.get(y) == 22).all() and (a.get(z) == 3).all()
        # x and y were moved off the blocks their writer maps; those are held back
        assert st["tiers"]["host"]["fenced_bytes"] == 2 * n
        a.free(z)  # z's block is the reader's view: held back as well
        assert b.stat()["tiers"]["host"]["fenced_bytes"] == 3 * n
        others = [b.put(np.full(n, 100 + i, np.uint8), key=f"o{i}") for i in range(20)]  # fill the tier
        for lease in (lx, ly):  # the stalled client resumes where it was
            lease.tensor[:] = 99
        with pytest.raises(ValueError, match="read-only"):
            lz.tensor[:] = 99  # (an r view is read-only: the write never happens)
        assert (a.get(x)[: n // 2] == 11).all() and (a.get(y) == 22).all()
        for i, h in enumerate(others):
            assert (b.get(h) == 100 + i).all(), f"o{i} was overwritten through a revoked lease"
        with pytest.raises(NotFound):
            ly.release()  # a durable check-in waits for its answer: the lease is gone
        lx.release()
        lz.release()
        assert (a.get(x)[: n // 2] == 11).all()
    with d.client("other") as b:
        _wait_stat(b, lambda s: s["tiers"]["host"]["fenced_bytes"] == 0, "unfencing at disconnect")
        for i in range(20):
            assert (b.get(b.lookup(f"o{i}")) == 100 + i).all()
    d.restart()
    with d.client("stall") as a:
        assert (a.get(a.lookup("y")) == 22).all()  # the revoked durable check-in was journaled


@pytest.mark.parametrize("where", ["daemon", "in-process"])
def test_checkout_each_sends_check_outs_together_and_gives_back_all_on_an_error(daemon, make_store, where):
    c = daemon.client("each") if where != "in-process" else make_store()
    holder = daemon.client("each") if where != "in-process" else c
    try:
        a = c.put(torch.arange(1000.0), key="a")
        b = c.put(torch.zeros(1000), key="b", tier="nvme")
        s = c.put(torch.full((1000,), 7.0), key="s")
        la, lb = c.checkout_each([(a, "r", None), (b, "w", s)])
        assert torch.equal(la.tensor, torch.arange(1000.0)) and torch.equal(lb.tensor, torch.full((1000,), 7.0))
        lb.tensor.add_(1)
        for lease in (la, lb):
            lease.release()
        assert torch.equal(c.get(b), torch.full((1000,), 8.0)) and torch.equal(c.get(s), torch.full((1000,), 7.0))
        n = c.put(torch.full((1000,), 3.0), key="n", tier="nvme")
        gone = c.put(torch.zeros(3), key="gone")
        c.free(gone)
        with pytest.raises((NotFound, StaleHandle)):
            c.checkout_each([(a, "rw", None), (n, "w", None), (b, "w", s), (gone, "r", None)])
        # a list is checked before anything is taken
        assert torch.equal(c.get(n), torch.full((1000,), 3.0)) and torch.equal(c.get(a), torch.arange(1000.0))
        assert torch.equal(c.get(b), torch.full((1000,), 8.0))
        with c.checkout(b, "rw") as v:
            v.fill_(8.0)
        held = c.put(torch.full((1000,), 5.0), key="held")
        hold = holder.checkout(held, "rw")  # the last check-out of the list waits for it, then fails
        with pytest.raises(Busy):
            c.checkout_each([(a, "rw", None), (n, "w", None), (b, "w", s), (held, "r", None)], timeout_s=0.3)
        hold.release()
        # the three taken first were given back unused: unchanged (the NVMe object's blank w
        # block dropped), but b holds its source's bytes
        assert torch.equal(c.get(n), torch.full((1000,), 3.0)) and torch.equal(c.get(a), torch.arange(1000.0))
        assert torch.equal(c.get(b), torch.full((1000,), 7.0)) and torch.equal(c.get(held), torch.full((1000,), 5.0))
        group = c.checkout_each([(a, "r", None), (n, "rw", None)])
        group[1].tensor.add_(1)
        group.release()  # one check-in for the list
        assert torch.equal(c.get(n), torch.full((1000,), 4.0))
        if where == "in-process":  # more than the host tier at once: refused before anything waits
            big = [(c.put(torch.zeros(1 << 20), key=f"big{i}"), "r", None) for i in range(9)]  # 36 MiB
            with pytest.raises(CapacityExceeded, match="fewer objects"):
                c.checkout_each(big)
        with pytest.raises(InvalidArgument):
            c.checkout_each([(a, "r", s)])  # a source needs mode "w"
        for twice in ([(b, "w", s), (s, "rw", None)],  # written after being read as a source
                      [(a, "r", None), (a, "w", None)],
                      [(a, "r", None), (b, "w", a), (s, "w", a), (a, "rw", None)]):
            with pytest.raises(InvalidArgument, match="named twice"):
                c.checkout_each(twice)  # they could wait on each other
        la, lb = c.checkout_each([(a, "r", None), (b, "w", a)])  # reading an object twice is fine
        assert torch.equal(lb.tensor, torch.arange(1000.0))
        la.release()
        lb.release()
        if where != "in-process":
            c.ping()
        assert c.stat()["leases"] == 0  # what the failed call took was given back
        with c.checkout(a, "rw", timeout_s=1) as v:  # nothing left behind holds it
            assert torch.equal(v, torch.arange(1000.0))
        c.prefetch([gone], wait=False) if where != "in-process" else None  # a hint for a freed object: no error
        c.prefetch([b], wait=False)
        assert torch.equal(c.get(a), torch.arange(1000.0))  # the connection is fine
    finally:
        c.close()
        if holder is not c:
            holder.close()


def test_clients_fill_their_arena_page_tables_in_the_background_and_stop_at_close(daemon_factory):
    """Connecting does not walk the whole arena (a `tierstore stat` would pay O(arena)); a
    background thread fills the page tables and close() stops it before unmapping, so
    connecting and closing at once, many times, never touches an unmapped range."""
    import threading

    d = daemon_factory("--host-bytes", "512MiB")
    for _ in range(12):
        c = d.client()
        c.close()
        assert not any(t.name == "tierstore-prefault" and t.is_alive() for t in threading.enumerate())
    with d.client() as c:
        c._prefault.join(timeout=60)
        assert not c._prefault.is_alive()
        h = c.put(torch.arange(1 << 20, dtype=torch.float32), key="after-prefault")
        assert torch.equal(c.get(h), torch.arange(1 << 20, dtype=torch.float32))
        with c.checkout(h, "r") as v:
            assert float(v[-1]) == float((1 << 20) - 1)


def test_a_put_after_close_is_a_typed_error(daemon):
    from tierstore import Closed

    c = daemon.client()
    c.put(torch.ones(4), key="before")  # the staging area exists: a later put would copy into it first
    c.close()
    for t in (torch.ones(4), torch.ones(1 << 20)):
        with pytest.raises(Closed):
            c.put(t)


def test_a_lease_given_back_through_the_daemon_leaves_its_object_clean(daemon):
    """``ClientLease.give_back()`` (``release`` with ``unused``): after an ``rw`` check-out
    the object is not dirty and keeps its NVMe copy; the connection's next request already
    sees it checked in. ``release()`` leaves it dirty: the object (which lives on NVMe)
    is written back when it goes down again, which may already have happened when the
    next request looks."""
    with daemon.client("giveback") as c:
        t = torch.arange(100_000, dtype=torch.float32)
        kept, dirtied = c.put(t, tier="nvme"), c.put(t, tier="nvme")
        lease = c.checkout(kept, "rw")
        assert torch.equal(lease.tensor, t)
        lease.give_back()
        lease.release()  # already checked in: nothing
        info = c.info(kept)
        assert not info["dirty"] and "nvme" in info["residency"] and not info["writer"]
        poll_until(lambda: c.info(kept)["residency"] == ["nvme"], "the given-back object back down")
        written = c.stat()["tiers"]["nvme"]["bytes_written"]
        c.checkout(dirtied, "rw").release()
        # dirty until the demoter writes it back (perhaps before the next request looks):
        # the write is the evidence
        poll_until(lambda: c.info(dirtied)["residency"] == ["nvme"], "the checked-in object back down")
        assert c.stat()["tiers"]["nvme"]["bytes_written"] - written >= t.nbytes  # it was dirty: written back
        assert torch.equal(c.get(kept), t)


def test_every_get_through_the_daemon_is_counted_whichever_path_serves_it(daemon):
    """``gets`` / ``get_bytes`` count a small get served from the host tier at once, one
    read from NVMe through a pin (the staging area's slower path), and a larger one
    through a check-out, as an in-process get counts each."""
    with daemon.client("counted") as c:
        small, big = torch.arange(64, dtype=torch.float32), torch.arange(1 << 18, dtype=torch.float32)
        on_host, on_nvme, large = c.put(small), c.put(small, tier="nvme"), c.put(big, tier="nvme")
        before = c.stat()["counters"]
        for h, want in ((on_host, small), (on_nvme, small), (large, big)):
            assert torch.equal(c.get(h), want)
        after = c.stat()["counters"]
        assert after["gets"] - before["gets"] == 2  # the two staged gets; the check-out is counted as one
        assert after["checkouts"] - before["checkouts"] == 1
        assert after["get_bytes"] - before["get_bytes"] == 2 * small.nbytes


def test_small_puts_and_gets_work_when_the_host_tier_has_no_room_for_a_staging_area(daemon_factory):
    """A host tier smaller than a connection's staging area: small puts (plain and
    pipelined) and gets take the two-phase put and a lease instead, and every byte is right."""
    d = daemon_factory("--host-bytes", "256KiB")
    with d.client("nostaging") as c:
        xs = [torch.full((256,), float(i)) for i in range(8)]
        hs = [c.put(x, key=f"k{i}") for i, x in enumerate(xs)]
        hs += [c.put_async(torch.full((256,), 99.0), key="async").result()]
        for h, x in zip(hs, xs + [torch.full((256,), 99.0)]):
            assert torch.equal(c.get(h), x)
        assert c.lookup("async") == hs[-1]


def test_long_steps_and_large_batches_through_the_daemon_learn_the_order(daemon):
    """Batches larger than the event loop takes itself and a step longer than it compares
    itself both run on op workers; the order is learned all the same (its length is every
    access of the step) and prefetching follows it."""
    from tierstore.leasebatches import INLINE_BATCH
    from tierstore.hints import INLINE_STEP

    with daemon.client("long") as c:
        hs = [f.result() for f in [c.put_async(np.zeros(4, np.float32)) for _ in range(3000)]]
        passes = INLINE_STEP // len(hs) + 1
        batch = 4 * INLINE_BATCH
        for _step in range(3):
            for _ in range(passes):
                for i in range(0, len(hs), batch):
                    c.checkout_many(hs[i:i + batch], "r").release()
            c.step()
        traces = [t for t in c.stat()["prefetch"]["traces"] if t["client"] != "local"]
        assert [(t["state"], t["length"]) for t in traces] == [("learned", passes * len(hs))], traces


def test_a_hint_of_tens_of_thousands_of_handles_goes_through(daemon):
    """A prefetch hint longer than one socket message holds (70 000 handles) is sent in
    pieces by the client and taken whole by the daemon (off its event loop): the
    connection stays up and the objects are hinted."""
    with daemon.client("hint") as c:
        hs = [f.result() for f in [c.put_async(np.zeros(4, np.float32)) for _ in range(1000)]]
        c.prefetch(hs * 70)
        c.prefetch(hs * 70, wait=False)
        c.ping()
        assert c.stat()["prefetch"]["hinted"] >= 0 and c.lookup("nope") is None


def test_a_large_nvme_put_is_written_while_the_client_still_copies_it(daemon_factory):
    """A put through the daemon whose commit writes to NVMe (``tier="nvme"``, or durable)
    and that is large: the client copies it into the arena piece by piece and announces
    each piece (``put_part``), and the daemon writes those to NVMe before the commit
    (``counters["put_early_bytes"]``). The bytes come back exact through checksummed
    reads, the NVMe space is what the object takes, a durable one survives ``kill -9``,
    and a put too small for pieces writes nothing early."""
    import torch

    d = daemon_factory("--host-bytes", "384MiB", "--promote-on-get", "false")
    g = torch.Generator().manual_seed(5)
    with d.client("early") as c:
        used0 = c.stat()["tiers"]["nvme"]["used_bytes"]
        small = torch.randint(0, 1 << 30, (8 << 18,), dtype=torch.int32, generator=g)  # 8 MiB: one copy
        c.put(small, key="small", tier="nvme")
        assert c.stat()["counters"]["put_early_bytes"] == 0
        big = {}
        sizes = {False: 64 << 18, True: (160 << 18) + 3}  # 64 MiB (the least put sent in pieces); 160 MiB + 12 B
        for durable in (False, True):
            t = torch.randint(0, 1 << 30, (sizes[durable],), dtype=torch.int32, generator=g)
            before = c.stat()["counters"]["put_early_bytes"]
            c.put(t, key=f"big{durable}", tier="nvme", durable=durable)
            early = c.stat()["counters"]["put_early_bytes"] - before
            assert 0 < early < t.nbytes, early  # the pieces before the last went out before the commit
            big[durable] = t
        st = c.stat()
        assert st["tiers"]["nvme"]["used_bytes"] - used0 == small.nbytes + sum(align_up(4 * n, 4096) for n in sizes.values())
        for durable, t in big.items():
            assert torch.equal(c.get(c.lookup(f"big{durable}")), t)
    d.kill()
    d.restart()
    with d.client("early") as c:
        assert torch.equal(c.get(c.lookup("bigTrue")), big[True])
        assert c.lookup("bigFalse") is None  # volatile: gone with the daemon


def test_a_large_get_of_an_nvme_object_is_copied_while_the_daemon_reads_it(daemon_factory):
    """A get through the daemon of a large object that stays on NVMe streams: the daemon
    reads it into a block of the request's own and answers at once, and the client copies
    each piece once ``get_part`` says its bytes are in and checked
    (``counters["streamed_gets"]``). The bytes are exact, into ``out`` or a new tensor, of
    a size in whole pages or not;
    the block comes back after each get; a small object, or one in the host tier, goes
    through a lease as before; a flipped byte in the data file fails the get with
    ``ChecksumMismatch`` and costs no host memory, and the daemon goes on serving."""
    import os

    from tierstore import ChecksumMismatch

    d = daemon_factory("--host-bytes", "384MiB")
    g = torch.Generator().manual_seed(9)
    with d.client("streamed") as c:
        big = torch.randint(0, 1 << 30, (160 << 18,), dtype=torch.int32, generator=g)  # 160 MiB
        h = c.put(big, key="big", tier="nvme")
        small = c.put(torch.arange(1 << 20, dtype=torch.int32), key="small", tier="nvme")
        assert torch.equal(c.get(small), torch.arange(1 << 20, dtype=torch.int32))  # (and a staging area)
        poll_until(lambda: c.info(h)["residency"] == ["nvme"] and c.info(small)["residency"] == ["nvme"],
                   "the puts' host copies to go down to NVMe")
        st = c.stat()
        host0, streamed0 = st["tiers"]["host"]["used_bytes"], st["counters"]["streamed_gets"]
        out = torch.empty_like(big)
        assert c.get(h, out=out) is out and torch.equal(out, big)
        poll_until(lambda: c.info(h)["residency"] == ["nvme"], "the object to stay on NVMe")
        assert torch.equal(c.get(h), big)
        st = c.stat()
        assert st["counters"]["streamed_gets"] == streamed0 + 2
        assert st["tiers"]["host"]["used_bytes"] == host0  # each get's block went back
        assert streamed0 == 0  # (the small one went through a lease: too small to stream)
        odd = torch.randint(0, 256, ((32 << 20) + 4099,), dtype=torch.uint8, generator=g)  # not whole pages
        ho = c.put(odd, key="odd", tier="nvme")
        poll_until(lambda: c.info(ho)["residency"] == ["nvme"], "the odd-sized put to go down to NVMe")
        assert torch.equal(c.get(ho), odd)
        assert c.stat()["counters"]["streamed_gets"] == streamed0 + 3
        c.free(ho)
        in_host = c.put(big + 1, key="in_host")  # (host tier)
        assert torch.equal(c.get(in_host), big + 1)
        assert c.stat()["counters"]["streamed_gets"] == streamed0 + 3
        c.free(in_host)
        # the object was the first on the fresh drive: its bytes start at the data file's start
        fd = os.open(os.path.join(d.nvme, "data.bin"), os.O_RDWR)
        try:
            pos = 100 << 20
            byte = os.pread(fd, 1, pos)
            os.pwrite(fd, bytes([byte[0] ^ 0x10]), pos)
            os.fsync(fd)
        finally:
            os.close(fd)
        assert c.info(h)["residency"] == ["nvme"]
        with pytest.raises(ChecksumMismatch, match="CRC32C"):
            c.get(h, out=out)
        poll_until(lambda: c.stat()["tiers"]["host"]["used_bytes"] == host0, "the failed get's block to come back")
        assert torch.equal(c.get(small), torch.arange(1 << 20, dtype=torch.int32))
