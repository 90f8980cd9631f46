"""``Store`` and ``Client`` both satisfy ``tierstore.contract.Pool``, with the contract's
own signatures: a parameter, default or return type that drifts on one side fails here."""

from __future__ import annotations

import inspect
import json
import os
import sys
from typing import Any

import numpy as np
import pytest

from tierstore import Store
from tierstore.client import Client
from tierstore.contract import Objects, Pool, PoolLease, ReportsActivations

_KW = inspect.Parameter.KEYWORD_ONLY


def _members(proto: type) -> list[str]:
    """The methods a protocol lists (its own and those of the protocols it extends)."""
    names = {n for c in proto.__mro__ if c in (Objects, Pool, PoolLease)
             for n, v in vars(c).items() if callable(v) and (not n.startswith("_") or n in ("__enter__", "__exit__"))}
    return sorted(names)


def _satisfies_lease(cls: Any) -> bool:
    return isinstance(cls, type) and all(callable(getattr(cls, n, None)) for n in _members(PoolLease))


def _resolve(impl: type, name: str) -> Any:
    return vars(sys.modules[impl.__module__]).get(name.strip("'\""))


def drift(impl: type, proto: type = Pool) -> list[str]:
    """How ``impl``'s methods differ from ``proto``'s. Positional parameters must match
    in order, name, kind, default and annotation; keyword-only ones by name; a side may
    add keyword-only parameters with defaults (``Store``'s ``namespace=``). Return
    types match, except that a lease is the side's own class with a lease's methods,
    and ``__enter__`` returns the class itself."""
    out = []
    for name in _members(proto):
        fn = getattr(impl, name, None)
        if not callable(fn):
            out.append(f"{impl.__name__} has no {name}")
            continue
        want, got = inspect.signature(getattr(proto, name)), inspect.signature(fn)
        wp = [p for p in want.parameters.values() if p.kind != _KW]
        gp = [p for p in got.parameters.values() if p.kind != _KW]
        if [(p.name, p.kind, p.default, p.annotation) for p in wp] != \
                [(p.name, p.kind, p.default, p.annotation) for p in gp]:
            out.append(f"{impl.__name__}.{name}: positional parameters {gp} != {wp}")
        wk = {p.name: p for p in want.parameters.values() if p.kind == _KW}
        gk = {p.name: p for p in got.parameters.values() if p.kind == _KW}
        for n, p in wk.items():
            q = gk.get(n)
            if q is None or (q.default, q.annotation) != (p.default, p.annotation):
                out.append(f"{impl.__name__}.{name}: keyword {n}: {q} != {p}")
        for n, q in gk.items():
            if n not in wk and q.default is inspect.Parameter.empty:
                out.append(f"{impl.__name__}.{name}: its own keyword {n} has no default")
        if name == "__enter__":
            ok = _resolve(impl, got.return_annotation) is impl
        elif want.return_annotation == "PoolLease":
            ok = _satisfies_lease(_resolve(impl, got.return_annotation))
        else:
            ok = got.return_annotation == want.return_annotation
        if not ok:
            out.append(f"{impl.__name__}.{name} returns {got.return_annotation}, the contract "
                       f"{want.return_annotation}")
    return out


@pytest.mark.parametrize("impl", [Store, Client], ids=["Store", "Client"])
def test_store_and_client_have_the_contracts_signatures(impl):
    assert drift(impl) == []


def test_a_drifted_signature_is_found():
    class Drifted(Client):
        def prefetch(self, handles, *, wait: bool = True) -> Any:  # returns something else
            return None

        def keys(self, prefix: str = "", limit: int = 0) -> list[str]:  # a positional parameter more
            return []

        def stat(self, *, ops: bool) -> dict[str, Any]:  # a keyword of its own without a default
            return {}

    found = " ".join(drift(Drifted))
    assert "prefetch" in found and "keys" in found and "own keyword ops" in found


def test_instances_satisfy_the_contract_and_only_a_client_reports_activations(make_store, daemon):
    s = make_store()
    with daemon.client("contract") as c:
        for pool in (s, c):
            assert isinstance(pool.namespace, str)
            with pool.checkout(pool.put(np.ones(4), key="k")) as t:
                assert t.sum() == 4
            lease = pool.checkout(pool.lookup("k"))
            assert {"tensor", "handle", "mode"} <= set(vars(lease))
            lease.release()
            assert pool.prefetch([pool.lookup("k")]) is None  # a hint on both sides
        assert isinstance(c, ReportsActivations) and not isinstance(s, ReportsActivations)


def _fake_daemon(tmp_path, features):
    """A listening SEQPACKET socket, a 1 MiB arena memfd, and ``answer_hello(conn)``, which
    reads a hello and answers it as a daemon with ``features`` would."""
    import os
    import socket

    from tierstore.protocol import PROTOCOL_VERSION, reply_ok

    path = str(tmp_path / "fake.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    srv.bind(path)
    srv.listen(1)
    fd = os.memfd_create("arena")
    os.ftruncate(fd, 1 << 20)

    def answer_hello(conn) -> None:
        conn.recv(4096)
        hello = {"version": PROTOCOL_VERSION, "server_version": "0.0.1", "arena_bytes": 1 << 20, "session": 1,
                 "pid": os.getpid(), "gpu_tier": False, "gpu_reason": "none", "features": features}
        socket.send_fds(conn, [reply_ok(0, hello)], [fd])
    return path, srv, fd, answer_hello


def test_a_daemon_without_a_feature_this_client_uses_is_refused_at_connect(tmp_path):
    """No call falls back for an older daemon: one that lacks a feature is refused at
    ``connect``, with what it lacks and what to do."""
    import os
    import socket
    import threading

    from tierstore import ProtocolError

    path, srv, fd, answer_hello = _fake_daemon(  # no "ephemeral"
        tmp_path, ["batch", "source", "each", "activations", "pages", "columns"])
    closed = threading.Event()

    def old_daemon() -> None:
        conn, _ = srv.accept()
        with conn:
            answer_hello(conn)
            if conn.recv(4096) == b"":  # the client hung up instead of mapping the arena
                closed.set()

    t = threading.Thread(target=old_daemon)
    t.start()
    try:
        with pytest.raises(ProtocolError, match="lacks ephemeral.*install matching tierstore versions"):
            Client.connect(socket=path, timeout_s=5)
        t.join(timeout=10)
        assert closed.is_set()
    finally:
        srv.close()
        os.close(fd)


def test_a_reply_packet_larger_than_the_protocol_allows_fails_the_connection_with_a_protocol_error(tmp_path):
    """Replies are read into one reused buffer sized for the largest packet the daemon
    sends (a fragment, a joined batch); a bigger one is a broken daemon: ProtocolError,
    never a silently cut reply."""
    import os
    import socket
    import threading

    from tierstore import ProtocolError
    import msgpack

    from tierstore.protocol import PACKET_BYTES, encode

    path, srv, fd, answer_hello = _fake_daemon(
        tmp_path, ["ephemeral", "batch", "source", "unused", "each", "activations", "pages", "columns"])

    def daemon_sending_too_much() -> None:
        conn, _ = srv.accept()
        with conn:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
            answer_hello(conn)
            rid = msgpack.unpackb(conn.recv(4096))["id"]
            conn.send(encode({"id": rid, "ok": b"x" * (3 * PACKET_BYTES)}))
            conn.recv(4096)  # until the client hangs up

    t = threading.Thread(target=daemon_sending_too_much)
    t.start()
    try:
        c = Client.connect(socket=path, timeout_s=5, prefault=False)
        with pytest.raises(ProtocolError, match="reply packet from the daemon over"):
            c.ping()
        c.close()
        t.join(timeout=10)
    finally:
        srv.close()
        os.close(fd)


def test_a_client_finds_the_machines_daemon_where_none_listens_on_its_own_socket(daemon, tmp_path, monkeypatch):
    """A login session sets XDG_RUNTIME_DIR; the systemd unit's daemon listens on
    /run/tierstore/tierstore.sock (here: a stand-in path). With no socket of its own a
    client connects to the machine's; one of its own, where there is one, comes first."""
    import tierstore.paths as paths
    from tierstore import DaemonUnavailable
    from tierstore.client import Client

    monkeypatch.delenv("TIERSTORE_SOCKET", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "user"))
    system = tmp_path / "system.sock"
    monkeypatch.setattr(paths, "SYSTEM_SOCKET", str(system))
    with pytest.raises(DaemonUnavailable, match=str(tmp_path / "user")):  # neither: the user's own path is named
        Client.connect(namespace="found", timeout_s=2)
    os.symlink(daemon.socket, system)
    with Client.connect(namespace="found") as c:
        c.put(np.ones(2), key="via-system")
    mine = tmp_path / "user" / "tierstore" / "tierstore.sock"
    mine.parent.mkdir(parents=True)
    mine.write_text("")  # not a socket: still the machine's
    assert paths.client_socket_path() == str(system)
    mine.unlink()
    import socket as socket_mod

    stale = socket_mod.socket(socket_mod.AF_UNIX, socket_mod.SOCK_SEQPACKET)
    stale.bind(str(mine))  # a socket file nobody listens on (a daemon that was killed)
    stale.close()
    assert paths.client_socket_path() == str(system)
    mine.unlink()
    os.symlink(daemon.socket, mine)
    assert paths.client_socket_path() == str(mine)


def test_the_client_loads_only_the_core_modules_it_uses(daemon, tmp_path):
    """A process that only talks to a daemon imports the handles, the arena mapping, the
    wire codec and the tensor helpers of the core, not the store, its NVMe tier (and its
    checksum library), the I/O engines or the settings."""
    from conftest import run_py

    code = """
import json, sys, numpy as np
from tierstore.client import Client
def core():
    return {m for m in sys.modules if m.startswith("tierstore.") and not m.startswith(("tierstore.client", "tierstore.daemon"))}
imported = core()
with Client.connect() as c:  # the default socket path: $XDG_RUNTIME_DIR/tierstore/tierstore.sock
    h = c.put(np.ones(8), key="k")
    assert c.get(h).sum() == 8 and c.keys() == ["k"]
    with c.checkout(h, "rw") as t:
        t += 1
    c.free(h)
print(json.dumps([sorted(imported), sorted(core()), "sortedcontainers" in sys.modules]))
"""
    runtime = tmp_path / "runtime"
    (runtime / "tierstore").mkdir(parents=True)
    os.symlink(daemon.socket, runtime / "tierstore" / "tierstore.sock")
    env = {k: v for k, v in os.environ.items() if k != "TIERSTORE_SOCKET"}
    r = run_py(code, timeout=120, env={**env, "XDG_RUNTIME_DIR": str(runtime)})
    assert r.returncode == 0, r.stderr
    imported, used, sorted_maps = json.loads(r.stdout.splitlines()[-1])
    imported, used = set(imported), set(used)
    heavy = {"tierstore.store", "tierstore.nvme", "tierstore.checksum", "tierstore.engine", "tierstore.config",
             "tierstore.journal", "tierstore.allocator", "tierstore.index"}
    assert not (imported | used) & heavy, sorted((imported | used) & heavy)
    assert not sorted_maps  # the index's key maps (sortedcontainers) are the daemon's
    assert imported <= {"tierstore._version", "tierstore.errors", "tierstore.arena", "tierstore.batch",
                        "tierstore.names", "tierstore.paths", "tierstore.protocol", "tierstore.tensors",
                        "tierstore.units"}
