"""The daemon at scale: listings of any size, bounded per-connection memory, index scans
confined to one namespace, no cross-namespace handle oracle, connection caps with room
for root. Real daemon processes, real client processes, real sockets."""

import json
import os
import selectors
import pwd
import signal
import socket
import subprocess
import sys
import time

import hypothesis
import hypothesis.strategies as st
import msgpack
import numpy as np
import pytest
import torch
from conftest import poll_until

from tierstore import NotFound, StaleHandle
from tierstore.index import KeyIndex
from tierstore.protocol import PROTOCOL_VERSION

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another uid needs root")


def _fill(c, n, prefix="layer", pad=40):
    x = torch.zeros(4)
    keys = [f"{prefix}{i:05d}/" + "x" * pad for i in range(n)]
    for f in [c.put_async(x, key=k) for k in keys]:
        f.result()
    return keys


def _cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "tierstore.client.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def _raw(sock_path, namespace, fragments, joined=False):
    """A bare protocol client: hello (taking fragments, joined replies or not), nothing else."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(sock_path)
    s.settimeout(30)
    s.send(msgpack.packb({"id": 0, "op": "hello", "version": PROTOCOL_VERSION, "namespace": namespace, "fragments": fragments,
                          "joined": joined}))
    _data, fds, _, _ = socket.recv_fds(s, 1 << 20, 4)
    for fd in fds:
        os.close(fd)
    return s


def test_a_namespace_of_5000_objects_lists_and_snapshots(daemon, tmp_path):
    """keys()/ls() of 5 000 objects (~250 KB of keys, ~1.3 MB of ls: more than one socket
    message could ever hold), `tierstore ls` and `tierstore snapshot` through the daemon."""
    with daemon.client("big") as c:
        keys = _fill(c, 5000)
        assert c.keys() == keys
        rows = c.ls()
        assert [r["key"] for r in rows] == keys and all(r["nbytes"] == 16 for r in rows)
        assert list(c.iter_keys(page=7)) == keys  # a small page: many round trips, none twice
        assert [r["key"] for r in c.iter_ls("layer049", page=3)] == [k for k in keys if k.startswith("layer049")]
        assert c.keys("layer04999") == keys[-1:] and c.keys("nope") == []
    r = _cli("ls", "--socket", daemon.socket, "--namespace", "big")
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.splitlines()) == 5001 and keys[-1][:40] in r.stdout
    r = _cli("snapshot", "--socket", daemon.socket, "big", str(tmp_path / "snap"))
    assert r.returncode == 0, r.stderr
    assert "5000 objects" in r.stdout, r.stdout


def test_a_reply_too_big_for_one_message_is_an_error_not_a_closed_connection(daemon):
    """A client that takes no fragments and asks for an unpaged listing bigger than one
    socket message gets an error reply, logged, and keeps its connection."""
    with daemon.client("wide") as c:
        _fill(c, 6000, pad=60)
    s = _raw(daemon.socket, "wide", fragments=False)
    s.send(msgpack.packb({"id": 1, "op": "keys", "prefix": ""}))
    reply = msgpack.unpackb(s.recv(1 << 24))
    assert reply["id"] == 1 and "err" in reply and "pages" in reply["err"]["message"], reply
    s.send(msgpack.packb({"id": 2, "op": "ping"}))
    assert msgpack.unpackb(s.recv(1 << 20)) == {"id": 2, "ok": {}}
    s.close()
    assert "does not fit one message" in daemon.log.read_text()


def test_a_client_that_takes_no_fragments_cannot_take_leases_it_could_not_be_told_of(daemon):
    """A batch check-out whose reply could not fit one message is refused before it takes
    anything (else its leases would be held with the reply naming them unsendable)."""
    with daemon.client("wide") as c:
        hs = [str(c.put(torch.ones(2))) for _ in range(1000)]
        s = _raw(daemon.socket, "wide", fragments=False)
        s.send(msgpack.packb({"id": 1, "op": "checkout_many", "handles": hs, "modes": "rw"}))
        reply = msgpack.unpackb(s.recv(1 << 24))
        assert reply["id"] == 1 and reply["err"]["code"] == "InvalidArgument" and "fragments" in \
            reply["err"]["message"], reply
        assert c.stat()["leases"] == 0
        s.send(msgpack.packb({"id": 2, "op": "checkout_many", "handles": hs[:200], "modes": "rw"}))
        reply = msgpack.unpackb(s.recv(1 << 24))
        assert len(reply["ok"]["leases"]) == 200, reply
        s.close()
        with c.checkout(hs[0], "rw", timeout_s=30):  # the closed connection's leases went with it
            pass


def test_ls_pages_travel_by_column_with_one_value_columns_sent_once(daemon):
    """A page of ``ls`` asked for by column is the fields once, one list per column, and a
    column whose every row holds the same scalar as ``{"all": value}``; the client turns
    them back into ``info`` maps that equal ``info`` and share nothing mutable."""
    with daemon.client("cols") as c:
        keys = _fill(c, 1500)
        odd = c.put(np.zeros((2, 3), dtype=np.float64), key=keys[5] + "x", tier="nvme")  # other shape, size, tier
        keys.insert(6, keys[5] + "x")
        rows = c.ls()
        assert [r["key"] for r in rows] == keys
        assert rows[7] == c.info(c.lookup(keys[7])) and rows[6] == c.info(odd)
        assert rows[6]["shape"] == [2, 3] and rows[7]["shape"] != [2, 3]
        for name in ("shape", "residency"):  # each entry's lists are its own
            rows[8][name].append(99)
            assert rows[9][name] == rows[7][name] and 99 not in rows[9][name]
            del rows[8][name][-1]
        assert list(c.iter_ls(page=100)) == rows  # pages asked for ahead: none lost, none twice
    s = _raw(daemon.socket, "cols", fragments=False)
    s.send(msgpack.packb({"id": 1, "op": "ls", "page": True, "columns": True, "prefix": "", "limit": 10}))
    page = msgpack.unpackb(s.recv(1 << 20))["ok"]
    assert page["n"] == 10 and page["next"] == keys[9]
    by_name = dict(zip(page["fields"], page["columns"]))
    assert by_name["namespace"] == {"all": "cols"} and by_name["key"] == keys[:10]
    assert isinstance(by_name["shape"], list) and isinstance(by_name["nbytes"], list)  # 24 B once among 16s
    rebuilt = [dict(zip(page["fields"], [col["all"] if isinstance(col, dict) else col[i] for col in page["columns"]]))
               for i in range(10)]
    assert rebuilt == rows[:10]
    s.close()


def test_a_large_ls_page_is_built_off_the_event_loop_and_a_small_one_on_it(make_store):
    """An ``ls`` page of more than ``_INLINE_LS`` rows is ``Later`` (an op worker builds and
    encodes it, so two clients paging through a large namespace do not hold up another
    client's requests); a small page is answered at once. Both list the same rows."""
    from types import SimpleNamespace

    from tierstore.daemon.handlers import _INLINE_LS, PAGE_ROWS, Handlers
    from tierstore.waits import Later

    s = make_store(host_bytes="64MiB")
    for i in range(_INLINE_LS * 2):
        s.put(torch.zeros(1), key=f"k{i:05d}")
    h = Handlers(s, lambda uid: {})
    sess = SimpleNamespace(namespace="default")
    big = h.ls(sess, {"page": True, "columns": True})
    assert PAGE_ROWS > _INLINE_LS and isinstance(big, Later)
    big = big.run()
    small = h.ls(sess, {"page": True, "columns": True, "limit": _INLINE_LS})
    assert not isinstance(small, Later) and small["n"] == _INLINE_LS and small["next"] == f"k{_INLINE_LS - 1:05d}"
    assert big["n"] == 2 * _INLINE_LS and big["next"] is None
    assert big["columns"][1][:_INLINE_LS] == small["columns"][1]


def test_a_non_root_stat_among_many_namespaces_is_built_off_the_event_loop(make_store):
    """A client not running as root sees its uid's namespaces only, found by a walk over
    every namespace: with more than a page of them, its ``stat`` and ``namespaces`` run on
    an op worker, not on the loop that serves everyone. Root's stay on the loop."""
    from types import SimpleNamespace

    from tierstore.daemon.handlers import PAGE_NAMESPACES, Handlers
    from tierstore.daemon.auth import PeerCred
    from tierstore.waits import Later

    s = make_store(host_bytes="64MiB")
    for i in range(PAGE_NAMESPACES + 1):
        s.put(torch.zeros(1), namespace=f"ns{i:05d}")
    h = Handlers(s, lambda uid: {})
    stranger = SimpleNamespace(namespace="ns00000", cred=PeerCred(pid=1, uid=4242, gid=4242))
    root = SimpleNamespace(namespace="ns00000", cred=PeerCred(pid=1, uid=0, gid=0))
    for op in (h.stat, h.namespaces):
        later = op(stranger, {})
        assert isinstance(later, Later)
        out = later.run()
        assert not (out["namespaces"]), out["namespaces"]  # uid 4242 owns none of them
        assert not isinstance(op(root, {}), Later)


def test_the_replies_of_a_burst_of_requests_travel_joined_in_one_packet(daemon):
    """A client that takes joined replies gets the answers of requests it sent together as
    one packet (a msgpack array of the reply maps), in order; one that did not say so gets
    one map per packet, as before."""
    s = _raw(daemon.socket, "joined", fragments=True, joined=True)
    daemon.proc.send_signal(signal.SIGSTOP)  # forty in the socket before the daemon reads any: one burst
    try:
        for i in range(1, 41):
            s.send(msgpack.packb({"id": i, "op": "ping"} if i % 2 else {"id": i, "op": "lookup", "key": f"k{i}"}))
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    got, packets = [], 0
    while len(got) < 40:
        reply = msgpack.unpackb(s.recv(1 << 20))
        packets += 1
        got += reply if isinstance(reply, list) else [reply]
    assert [r["id"] for r in got] == list(range(1, 41))
    assert all(r["ok"] == ({} if r["id"] % 2 else None) for r in got)
    assert packets <= 5  # (one, unless the daemon's read budget split the burst)
    s.close()
    s = _raw(daemon.socket, "joined", fragments=True)
    for i in range(1, 11):
        s.send(msgpack.packb({"id": i, "op": "ping"}))
    assert [msgpack.unpackb(s.recv(1 << 20)) for _ in range(10)] == [{"id": i, "ok": {}} for i in range(1, 11)]
    s.close()


def test_a_burst_ended_by_a_bad_message_or_a_half_close_still_gets_its_replies(daemon):
    """The requests before a message that ends the session, and those before a client's
    half-close, happened: their replies (held back to leave joined) are sent before the error
    and before the close, not dropped with the session."""
    for ending in ("garbage", "half-close"):
        s = _raw(daemon.socket, "joined", fragments=True, joined=True)
        daemon.proc.send_signal(signal.SIGSTOP)  # all in the socket before the daemon reads any: one burst
        try:
            for i in range(1, 11):
                s.send(msgpack.packb({"id": i, "op": "ping"}))
            if ending == "garbage":
                s.send(b"\xc1 not msgpack")
            else:
                s.shutdown(socket.SHUT_WR)
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        got = []
        s.settimeout(30)
        while True:
            data = s.recv(1 << 20)
            if not data:
                break
            reply = msgpack.unpackb(data)
            got += reply if isinstance(reply, list) else [reply]
        s.close()
        assert [r["id"] for r in got[:10]] == list(range(1, 11)), (ending, got)
        assert all(r["ok"] == {} for r in got[:10])
        if ending == "garbage":
            assert len(got) == 11 and got[10]["err"]["code"] == "ProtocolError", got[10:]
        else:
            assert len(got) == 10


def test_stat_with_many_long_named_namespaces(daemon):
    """900 namespaces of 250-character names (225 KB of names, more than a socket's send
    buffer): stat() and `tierstore stat --json` list them all."""
    names = [f"{i:04d}-" + "n" * 245 for i in range(900)]
    code = r"""
import sys
import numpy as np
from tierstore.client import Client
for ns in sys.argv[2:]:
    with Client.connect(socket=sys.argv[1], namespace=ns) as c:
        c.put(np.zeros(1, np.float32), key="k")
"""
    procs = [subprocess.Popen([sys.executable, "-c", code, daemon.socket, *names[i::4]], stderr=subprocess.PIPE,
                              text=True) for i in range(4)]
    for p in procs:
        err = p.communicate(timeout=600)[1]
        assert p.returncode == 0, err[-3000:]
    with daemon.client("watcher") as c:
        st = c.stat()
        assert sorted(st["namespaces"]) == names and st["namespaces_total"] == 900
        assert all(v == {"objects": 1, "bytes": 4} for v in st["namespaces"].values())
        assert dict(c.iter_namespaces()) == st["namespaces"]
    r = _cli("stat", "--socket", daemon.socket, "--json")
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["namespaces"]) == 900


def _mem_kib(pid, field="VmRSS"):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


_FLOOD = r"""
import os, socket, sys, msgpack
from tierstore.protocol import PROTOCOL_VERSION
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect(sys.argv[1])
s.send(msgpack.packb({"id": 0, "op": "hello", "version": PROTOCOL_VERSION, "namespace": "flood", "fragments": True}))
_, fds, _, _ = socket.recv_fds(s, 1 << 20, 4)
s.send(msgpack.packb({"id": 1, "op": "lookup", "key": "held"}))
h = msgpack.unpackb(s.recv(1 << 20))["ok"]
s.send(msgpack.packb({"id": 2, "op": "checkout", "handle": h, "mode": "rw"}))
assert "ok" in msgpack.unpackb(s.recv(1 << 20))
print("holding", flush=True)
sent = 0
try:
    for i in range(3, 6003):  # never reads another reply
        s.send(msgpack.packb({"id": i, "op": "keys", "prefix": ""}))
        sent += 1
except OSError as e:
    print("closed by the daemon after", sent, "requests:", e, flush=True)
    sys.exit(0)
print("never closed", flush=True)
"""


def test_a_client_that_stops_reading_is_disconnected_and_memory_stays_bounded(daemon):
    """6 000 unread ~100 KB replies would be 600 MB; the daemon holds at most its outbox
    limit, disconnects the reader with a log line, releases its lease, and serves others."""
    with daemon.client("flood") as c:
        _fill(c, 1500, pad=50)
        c.put(torch.zeros(4), key="held")
    rss0 = _mem_kib(daemon.proc.pid)
    with open(f"/proc/{daemon.proc.pid}/clear_refs", "w") as f:
        f.write("5")  # the peak RSS (VmHWM) starts again from here
    flood = subprocess.Popen([sys.executable, "-c", _FLOOD, daemon.socket], stdout=subprocess.PIPE, text=True)
    assert flood.stdout.readline().startswith("holding")
    with daemon.client("other") as other:
        other.ping()
        out = flood.communicate(timeout=300)[0]
        assert "closed by the daemon" in out, out
        other.put(torch.ones(2), key="x")
        assert other.keys() == ["x"]
    grown_mib = (_mem_kib(daemon.proc.pid, "VmHWM") - rss0) / 1024
    assert grown_mib < 150, f"daemon grew by {grown_mib:.0f} MiB at its peak"
    assert "does not read its replies" in daemon.log.read_text()
    with daemon.client("flood") as c:  # the lease ended with the connection
        deadline = time.monotonic() + 30
        while True:
            try:
                with c.checkout(c.lookup("held"), "rw", timeout_s=1):
                    break
            except Exception:
                if time.monotonic() > deadline:
                    raise


_PINGS = r"""
import socket, sys, msgpack
from tierstore.protocol import PROTOCOL_VERSION
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect(sys.argv[1])
s.send(msgpack.packb({"id": 0, "op": "hello", "version": PROTOCOL_VERSION, "namespace": "pings"}))
socket.recv_fds(s, 1 << 20, 4)
print("hello", flush=True)
pkts = [msgpack.packb({"id": i, "op": "ping"}) for i in range(1, 4097)]
s.settimeout(60)
sent = 0
try:
    while sent < 3_000_000:  # (a 14-byte reply each, never read)
        for b in pkts:
            s.send(b)
        sent += len(pkts)
except OSError as e:
    print("closed by the daemon after", sent, "requests:", e, flush=True)
"""


def test_a_flood_of_tiny_unread_replies_is_bounded_by_what_they_cost_the_daemon(daemon):
    """Millions of pipelined pings whose 14-byte replies are never read: each queued reply
    is charged what it costs the daemon, not only its bytes, so the reader is
    disconnected before it grows the daemon past its outbox bound."""
    rss0 = _mem_kib(daemon.proc.pid)
    with open(f"/proc/{daemon.proc.pid}/clear_refs", "w") as f:
        f.write("5")
    flood = subprocess.Popen([sys.executable, "-c", _PINGS, daemon.socket], stdout=subprocess.PIPE, text=True)
    assert flood.stdout.readline().startswith("hello")
    out = flood.communicate(timeout=300)[0]
    assert "closed by the daemon" in out, out
    grown_mib = (_mem_kib(daemon.proc.pid, "VmHWM") - rss0) / 1024
    assert grown_mib < 100, f"daemon grew by {grown_mib:.0f} MiB at its peak"  # before: about 500 MiB
    assert "does not read its replies" in daemon.log.read_text()
    with daemon.client("other") as other:
        other.ping()


_UNREAD = r"""
import socket, sys, time, msgpack
from tierstore.protocol import PROTOCOL_VERSION
conns = []
for j in range(int(sys.argv[2])):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(sys.argv[1])
    s.send(msgpack.packb({"id": 0, "op": "hello", "version": PROTOCOL_VERSION, "namespace": "wide",
                          "fragments": True}))
    socket.recv_fds(s, 1 << 20, 4)
    for i in range(7):  # ~4 MB replies, 7 of them: under one connection's bound, never read
        s.send(msgpack.packb({"id": 1 + i, "op": "keys"}))
    conns.append(s)
print("sent", flush=True)
time.sleep(600)
"""


def test_many_connections_of_one_uid_that_do_not_read_hold_a_bounded_total(daemon):
    """40 connections each leave 7 replies of ~4 MB unread: each under one connection's
    bound, 1.1 GB together. The daemon holds at most 128 MiB of one uid's unread replies:
    the connections whose replies pass it are disconnected with a log line, and others
    are served."""
    with daemon.client("wide") as c:
        _fill(c, 4096, prefix="k", pad=1000)
    rss0 = _mem_kib(daemon.proc.pid)
    with open(f"/proc/{daemon.proc.pid}/clear_refs", "w") as f:
        f.write("5")  # the peak RSS (VmHWM) starts again from here
    flood = subprocess.Popen([sys.executable, "-c", _UNREAD, daemon.socket, "40"], stdout=subprocess.PIPE, text=True)
    try:
        assert flood.stdout.readline().startswith("sent")
        poll_until(lambda: "its uid's connections" in daemon.log.read_text(), "a connection closed for its uid's bound")
        with daemon.client("other") as other:
            other.put(torch.ones(2), key="x")
            assert other.keys() == ["x"]
        grown_mib = (_mem_kib(daemon.proc.pid, "VmHWM") - rss0) / 1024
        assert grown_mib < 300, f"daemon grew by {grown_mib:.0f} MiB at its peak"  # before: over 1 GB
    finally:
        flood.kill()
        flood.communicate()


def test_a_connection_that_reads_its_replies_is_not_closed_for_its_uids_unread_bytes():
    """Other connections of its uid leave more than their bound unread: a connection whose
    replies all leave (here, a joined reply sent when its burst ends) is not the one closed;
    one whose reply stays unread is."""
    from tierstore.config import Config
    from tierstore.daemon.server import Server
    from tierstore.daemon.session import _UID_OUTBOX_BYTES, Session
    from tierstore.protocol import reply_ok
    from tierstore.daemon.auth import PeerCred

    srv = Server(Config())
    pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(2)]
    try:
        srv._replies.add(1000, _UID_OUTBOX_BYTES + 1)  # what its uid's other connections leave unread
        reader, stuck = (Session(i, a, PeerCred(pid=1, uid=1000, gid=1000), os.getpid(), srv._sel, srv._replies)
                         for i, (a, _) in enumerate(pairs))
        for sess in (reader, stuck):
            sess.joined = True
            sess.sock.setblocking(False)
            srv._sessions[sess.cid] = sess
            srv._sel.register(sess.sock, selectors.EVENT_READ, ("sess", sess))
        srv._corked = {reader}  # a burst of its requests: replies leave when it ends
        srv._send(reader, reply_ok(1, {}), rid=1)
        srv._uncork()
        assert not reader.closed and pairs[0][1].recv(100)
        stuck.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        while not stuck.closed:  # its peer never reads: its replies stay queued, and it goes
            srv._send(stuck, reply_ok(2, {"x": b"y" * 3000}), rid=2)
        assert not reader.closed
    finally:
        for a, b in pairs:
            a.close()
            b.close()
        srv.discard()


def test_a_handle_from_another_namespace_is_not_found(daemon):
    """Live, replaced or freed, an id of another namespace is NotFound; never "stale
    (the object now has generation G)", which would tell that the id exists."""
    with daemon.client("a") as a, daemon.client("b") as b:
        live = a.put(torch.ones(2), key="k")
        gone = a.put(torch.ones(2), key="f")
        a.free(gone)
        other_gen = type(live)(live.id, live.gen + 1)
        for h in (live, other_gen, gone):
            for call in (b.get, b.info, b.free):
                with pytest.raises(NotFound) as e:
                    call(h)
                assert type(e.value) is NotFound and "generation" not in str(e.value), (h, e.value)
        with pytest.raises(StaleHandle):  # in its own namespace a freed handle is stale
            a.get(gone)
        with pytest.raises(StaleHandle, match="generation"):
            a.get(other_gen)


_HOLD = r"""
import os, sys
uid, n = int(sys.argv[3]), int(sys.argv[4])
from tierstore.client import Client
from tierstore import TierstoreError
import tierstore.errors, tierstore.tensors, tierstore.arena, numpy, msgpack
os.setgroups([]); os.setgid(int(sys.argv[5])); os.setuid(uid)
cs = []
try:
    for _ in range(n):
        cs.append(Client.connect(socket=sys.argv[1], namespace=sys.argv[2]))
    print("admitted", len(cs), flush=True)
except TierstoreError as e:
    print("admitted", len(cs), "refused:", e, flush=True)
sys.stdin.read()  # hold them until told
"""


@needs_root
def test_connection_caps_leave_room_for_root_and_other_uids(daemon_factory):
    import grp

    nobody = pwd.getpwnam("nobody")
    group = grp.getgrgid(nobody.pw_gid).gr_name
    d = daemon_factory("--allowed-group", group, "--max-clients", "32", "--max-clients-per-uid", "16", public=True)
    held = []

    def hold(uid, ns, n):
        p = subprocess.Popen([sys.executable, "-c", _HOLD, d.socket, ns, str(uid), str(n), str(nobody.pw_gid)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "HOME": "/tmp"})
        held.append(p)
        return p.stdout.readline()

    try:
        line = hold(nobody.pw_uid, "n1", 20)
        assert line.startswith("admitted 16 refused") and "max_clients_per_uid" in line, line
        line = hold(nobody.pw_uid - 1, "n2", 20)  # another uid still gets in, up to the reserves
        assert line.startswith("admitted 12 refused") and "kept for root" in line, line
        line = hold(nobody.pw_uid - 2, "n3", 20)  # a third uid: the two kept for other uids
        assert line.startswith("admitted 2 refused") and "kept for root" in line, line
        with d.client(), d.client() as c:  # root: the last two
            c.ping()
    finally:
        for p in held:
            p.stdin.close()
            p.wait(timeout=60)


def test_key_index_pages_one_namespace_in_order():
    ki = KeyIndex({("a", "x2"): 2, ("a", "x1"): 1, ("a", "y"): 3, ("b", "x0"): 4})
    assert ki.scan("a") == [("x1", 1), ("x2", 2), ("y", 3)]
    assert ki.scan("a", "x") == [("x1", 1), ("x2", 2)]
    assert ki.scan("a", "x", after="x1") == [("x2", 2)]
    assert ki.scan("a", "x", after="a") == [("x1", 1), ("x2", 2)]  # a cursor before the prefix
    assert ki.scan("a", "", after="x1", limit=1) == [("x2", 1 + 1)]
    assert ki.scan("c") == [] and len(ki) == 4 and ki.count("a") == 3
    del ki[("b", "x0")]
    assert ki.count("b") == 0 and ("b", "x0") not in ki and ki.pop(("b", "x0"), None) is None


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(keys=st.sets(st.text(alphabet="ab\U0010ffff\u00e9", max_size=4), max_size=30),
                  prefix=st.text(alphabet="ab\U0010ffff\u00e9", max_size=3),
                  after=st.none() | st.text(alphabet="ab\U0010ffff\u00e9", max_size=4),
                  limit=st.none() | st.integers(1, 8))
def test_key_index_scans_are_bounded_by_the_prefix_exactly(keys, prefix, after, limit):
    """A scan walks from its cursor to the end of its prefix's range only, and returns what
    filtering every key would: keys with the prefix, after the cursor, in order, at most
    ``limit`` (keys at the top of Unicode included)."""
    ki = KeyIndex({("n", k): i for i, k in enumerate(sorted(keys))})
    want = [k for k in sorted(keys) if k.startswith(prefix) and (after is None or k > after)][:limit]
    assert ki.scan_keys("n", prefix, after, limit) == want
    assert [k for k, _ in ki.scan("n", prefix, after, limit)] == want


def test_stat_counters_match_a_recount_through_moves_replaces_frees_and_a_restart(make_store):
    """stat's object counts come from counters kept as objects change (O(1) in objects);
    through demotions, promotions, replaces, frees, ephemeral drops and a restart they
    equal a count over every object."""

    def check(s):
        st = s.stat()
        metas = list(s.index.objects.values())
        assert st["tiers"]["host"]["objects"] == sum(m.host_valid for m in metas)
        assert st["tiers"]["nvme"]["objects"] == sum(m.nvme_valid for m in metas)
        per_ns = {}
        for m in metas:
            c = per_ns.setdefault(m.namespace, {"objects": 0, "bytes": 0})
            c["objects"] += 1
            c["bytes"] += m.nbytes
        assert st["namespaces"] == per_ns

    s = make_store(host_bytes="8MiB")
    hs = [s.put(torch.full((1 << 18,), float(i)), key=f"k{i}", durable=i % 2 == 0, namespace=f"ns{i % 3}")
          for i in range(40)]  # 40 MiB through an 8 MiB host tier: demotions
    check(s)
    for i in range(0, 40, 5):
        assert s.get(hs[i], namespace=f"ns{i % 3}")[0] == i  # promotions
    s.put(torch.zeros(3), key="k1", replace=True, namespace="ns1")
    s.put(torch.zeros(5), key="nv", tier="nvme", namespace="ns1")
    with s.checkout(hs[4], "rw", namespace="ns1") as v:
        v += 1
    for i in range(0, 40, 3):
        s.free(s.lookup(f"k{i}", namespace=f"ns{i % 3}"), namespace=f"ns{i % 3}")
    check(s)
    s.close()
    check(make_store(host_bytes="8MiB"))  # the durable ones, replayed


_STAT_AS = r"""
import json, os, sys
import torch
from tierstore.client import Client
os.setgroups([]); os.setgid(int(sys.argv[3])); os.setuid(int(sys.argv[2]))
with Client.connect(socket=sys.argv[1], namespace="mine") as c:
    c.put(torch.ones(2), key="k")
    st = c.stat()
    pages = list(c.iter_namespaces()) if hasattr(c, "iter_namespaces") else None
    print(json.dumps({"namespaces": sorted(st["namespaces"]), "total": st["namespaces_total"],
                      "session_uids": sorted({s["uid"] for s in st["sessions"]}), "pages": pages}))
"""


def test_a_non_root_client_sees_only_its_own_namespaces_and_sessions_in_stat(daemon_factory):
    import grp

    nobody = pwd.getpwnam("nobody")
    group = grp.getgrgid(nobody.pw_gid).gr_name
    d = daemon_factory("--allowed-group", group, public=True)
    with d.client("secret-project") as root_client:
        root_client.put(torch.ones(2), key="k")
        r = subprocess.run([sys.executable, "-c", _STAT_AS, d.socket, str(nobody.pw_uid), str(nobody.pw_gid)],
                           capture_output=True, text=True, timeout=120, env={**os.environ, "HOME": "/tmp"})
        assert r.returncode == 0, r.stderr[-2000:]
        seen = json.loads(r.stdout.strip().splitlines()[-1])
        assert seen["namespaces"] == ["mine"] and seen["total"] == 1, seen
        assert seen["session_uids"] == [nobody.pw_uid], seen
        if seen["pages"] is not None:
            assert "secret-project" not in json.dumps(seen["pages"]), seen
        st = root_client.stat()  # root, the operator, sees every one
        assert {"mine", "secret-project"} <= set(st["namespaces"])


_EARLY_HELLO = r"""
import os, sys
import torch
from tierstore.client import Client
os.setgroups([]); os.setgid(int(sys.argv[3])); os.setuid(int(sys.argv[2]))
with Client.connect(socket=sys.argv[1], namespace="victim") as c:  # unowned yet: admitted
    print("ready", flush=True)
    sys.stdin.readline()  # another uid claims the namespace meanwhile
    for name, call in [("lookup", lambda: c.lookup("secret")), ("keys", lambda: c.keys()),
                       ("put", lambda: c.put(torch.full((4,), -1.0), key="secret", replace=True, durable=True)),
                       ("ping", lambda: c.ping())]:
        try:
            call()
            print(name, "ok", flush=True)
        except Exception as e:
            print(name, type(e).__name__, flush=True)
"""


_QUEUED_BEHIND = r"""
import os, socket, sys
import msgpack
from tierstore.protocol import PROTOCOL_VERSION
os.setgroups([]); os.setgid(int(sys.argv[3])); os.setuid(int(sys.argv[2]))
target = int(sys.argv[4])
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect(sys.argv[1])
s.settimeout(300)
s.send(msgpack.packb({"id": 0, "op": "hello", "version": PROTOCOL_VERSION, "namespace": "shared-job",
                      "fragments": True}))  # unowned yet: admitted
_data, fds, _, _ = socket.recv_fds(s, 1 << 20, 4)
for fd in fds:
    os.close(fd)
n = 120  # slow requests of its own first (each looks 65 536 handles up on an op worker)...
for i in range(n):
    s.send(msgpack.packb({"id": 1 + i, "op": "prefetch", "handles": list(range(1, 65537)), "timeout_s": 600}))
# (requests answered as they are read, such as ``info``, run before the claim: NotFound)
asks = {"free": {"handle": target}, "checkout_many": {"handles": [target] * 300, "mode": "r"}}
ids = {}
for op, fields in asks.items():  # ...then, queued behind them, requests on the object another uid will put
    ids[n + 1 + len(ids)] = op
    s.send(msgpack.packb({"id": n + len(ids), "op": op, **fields, "timeout_s": 600}))
print("queued", flush=True)
answers = {}
while len(answers) < len(ids):
    data = s.recv(1 << 24)
    r = msgpack.unpackb(data, raw=False)
    for rep in (r if isinstance(r, list) else [r]):
        if rep.get("id") in ids:
            answers[ids[rep["id"]]] = rep["err"]["code"] if "err" in rep else "ok"
print(sorted(answers.items()), flush=True)
"""


def test_a_request_queued_before_another_uid_claims_the_namespace_is_refused_when_it_runs(daemon_factory):
    """A uid that said hello in a free namespace queues requests behind slow ones of its
    own, naming the id the next object will get; another uid then claims the namespace
    with a put. Each queued request is refused as it starts (as one read after the claim
    is), so none frees or checks out the other uid's object."""
    import grp

    nobody = pwd.getpwnam("nobody")
    d = daemon_factory("--allowed-group", grp.getgrgid(nobody.pw_gid).gr_name, public=True)
    with d.client("probe") as probe:
        target = int(probe.put(torch.zeros(1))) + 1  # ids are handed out in order
    p = subprocess.Popen([sys.executable, "-c", _QUEUED_BEHIND, d.socket, str(nobody.pw_uid), str(nobody.pw_gid),
                          str(target)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "HOME": "/tmp"})
    try:
        assert p.stdout.readline().strip() == "queued", p.stderr.read()
        with d.client("shared-job") as owner:  # root's first put claims the namespace (uid 0)
            h = owner.put(torch.full((4,), 7.0), key="weights", durable=True)
            assert int(h) == target
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-2000:]
            refused = "PermissionDenied"
            assert out.strip() == str([("checkout_many", refused), ("free", refused)]), out
            assert owner.lookup("weights") == h and torch.equal(owner.get(h), torch.full((4,), 7.0))
            assert owner.stat()["leases"] == 0
    finally:
        p.kill()
        p.communicate()
    assert "Traceback" not in d.log.read_text()


def test_a_connection_whose_namespace_another_uid_claims_after_its_hello_is_refused(daemon_factory):
    """Ownership is checked at hello, and again on each request while the namespace is
    unclaimed: a uid that said hello first cannot use it once another uid owns it."""
    import grp

    nobody = pwd.getpwnam("nobody")
    d = daemon_factory("--allowed-group", grp.getgrgid(nobody.pw_gid).gr_name, public=True)
    p = subprocess.Popen([sys.executable, "-c", _EARLY_HELLO, d.socket, str(nobody.pw_uid), str(nobody.pw_gid)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "HOME": "/tmp"})
    try:
        assert p.stdout.readline().strip() == "ready", p.stderr.read()
        with d.client("victim") as owner:  # root's first put claims it (uid 0)
            owner.put(torch.full((4,), 7.0), key="secret", durable=True)
            out, err = p.communicate("go\n", timeout=120)
            assert p.returncode == 0, err[-2000:]
            want = ["lookup PermissionDenied", "keys PermissionDenied", "put PermissionDenied", "ping ok"]
            assert out.split("\n")[:4] == want, out
            assert torch.equal(owner.get(owner.lookup("secret")), torch.full((4,), 7.0))
    finally:
        p.kill()
        p.communicate()


@pytest.mark.parametrize("name", ["job\nFAKE-NAMESPACE", "job\x1b[2K", "job\rx", "a\x7f", "a\u2028b"])
def test_a_namespace_name_that_would_break_a_listing_is_refused_at_hello(daemon, name):
    from tierstore.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="printable"):
        daemon.client(name)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # the daemon's own check, past the client's
    s.connect(daemon.socket)
    s.settimeout(30)
    s.send(msgpack.packb({"id": 0, "op": "hello", "version": PROTOCOL_VERSION, "namespace": name}))
    reply = msgpack.unpackb(s.recv(1 << 20))
    s.close()
    assert reply["err"]["code"] == "InvalidArgument" and "printable" in reply["err"]["message"], reply


def test_stat_shows_a_name_that_is_not_printable_escaped():
    from tierstore.client.cli.statview import render

    st = {"namespaces": {"job\nFAKE 999 objects": {"objects": 1, "bytes": 8}}, "tiers": {}}
    out = render(st)
    assert "job\\nFAKE" in out and "\nFAKE" not in out


def test_a_uids_namespaces_are_found_by_its_roots_not_by_a_walk_over_every_namespace(tmp_path):
    """A client not running as root sees its uid's namespaces, in name order, in pages,
    and their number: names that sort between a root and its sub-namespaces ("a-b"
    between "a" and "a/x") belong to whoever owns their own root. The store finds them
    without asking whose every namespace is (a uid's ``stat`` must not hold the store's
    lock for a walk over a million other namespaces), and knows them after a restart."""
    from tierstore import Config, Store

    owned = {1000: ["a", "a/x", "a/x/y", "ab", "z", "z/0", "z/~"], 2000: ["a-b", "a-b/y", "a.b", "a0", "b", "y/z"]}
    cfg = Config(host_bytes="8MiB", nvme_dirs=[str(tmp_path / "nvme")], nvme_bytes="64MiB", nvme_grow_bytes="4MiB")

    def check(s):
        ask = s.daemon.durability.owner_of
        s.daemon.durability.owner_of = lambda ns: pytest.fail(f"whose {ns!r} is was asked")  # no walk
        try:
            for uid, names in owned.items():
                want = sorted(names)
                seen = s.daemon.stat_namespaces_of(uid)
                assert list(seen) == want and s.daemon.namespace_count_of(uid) == len(want)
                assert all(v == {"objects": 1, "bytes": 4} for v in seen.values())
                for after in [None, "", *want, "a/", "a/x/", "a0", "zz"]:  # pages of 2 after each name
                    rest = [n for n in want if after is None or n > after]
                    assert list(s.daemon.stat_namespaces_of(uid, after, 2)) == rest[:2], (uid, after)
            assert s.daemon.stat_namespaces_of(3000) == {} and s.daemon.namespace_count_of(3000) == 0
            assert s.daemon.stat_namespaces_of(0) is None and s.daemon.namespace_count_of(0) == 13
        finally:
            s.daemon.durability.owner_of = ask

    with Store(cfg) as s:
        for uid, names in owned.items():
            for ns in names:
                s.daemon.claim_namespace(ns, uid)
                s.put(torch.zeros(1), key="k", durable=True, namespace=ns)
        check(s)
    with Store(cfg) as s:  # the owners come back from the checkpoint or the journal
        check(s)


def test_a_request_acting_for_a_uid_is_refused_where_another_uid_claimed_the_namespace_under_it(tmp_path):
    """What a daemon request of a connection whose namespace was free when last asked runs
    in (``acting_for``): its lookups of objects, keys and listings check the namespace's
    owner under the store's lock, so a claim and a put that come between the request's
    start and its lookup (another uid's first put) leave the request nothing to act on."""
    from tierstore import Config, PermissionDenied, Store
    from tierstore.objectindex import acting_for

    with Store(Config(host_bytes="8MiB", nvme_dirs=[str(tmp_path / "nvme")], nvme_bytes="64MiB")) as s:
        with acting_for(2000):  # the request started while "shared-job" was free...
            assert s.lookup("weights", namespace="shared-job") is None
            s.daemon.claim_namespace("shared-job", 1000)  # ...then another uid's first put came
            h = s.put(torch.full((4,), 7.0), key="weights", durable=True, namespace="shared-job")
            for name, call in [("free", lambda: s.free(h, namespace="shared-job")),
                               ("get", lambda: s.get(h, namespace="shared-job")),
                               ("checkout", lambda: s.checkout(h, "w", namespace="shared-job")),
                               ("info", lambda: s.info(h, namespace="shared-job")),
                               ("lookup", lambda: s.lookup("weights", namespace="shared-job")),
                               ("keys", lambda: s.keys(namespace="shared-job")),
                               ("ls", lambda: s.ls(namespace="shared-job"))]:
                with pytest.raises(PermissionDenied, match="now belongs to uid 1000"):
                    call()
            assert s.keys(namespace="mine") == []  # (a free namespace is still its to use)
        with acting_for(1000):  # the owner's own requests
            assert s.lookup("weights", namespace="shared-job") == h
        assert torch.equal(s.get(h, namespace="shared-job"), torch.full((4,), 7.0))


_STORM = r"""
import os, socket, sys, time
os.setgroups([]); os.setgid(int(sys.argv[3])); os.setuid(int(sys.argv[2]))
held = []
for _ in range(4):  # its whole share of connections, kept
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(sys.argv[1])
    held.append(s)
print("holding", flush=True)
n, end = 0, time.monotonic() + float(sys.argv[4])
while time.monotonic() < end:  # then open and close in a tight loop: each one refused
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        s.connect(sys.argv[1])
    except OSError:
        pass
    s.close()
    n += 1
print(n, flush=True)
"""


def test_a_connect_waits_while_the_listen_backlog_is_full(tmp_path):
    """A Unix socket answers a connect (with a timeout, as the client's) with EAGAIN while
    the listener's backlog is full — under a connect storm, the daemon's. The client
    waits for room up to its timeout instead of failing at once, and then says why."""
    import threading

    from tierstore import DaemonUnavailable
    from tierstore.client.connection import Connection

    path = str(tmp_path / "s")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(1)
    held = []
    try:
        while True:  # fill the backlog: nobody accepts yet
            c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            c.setblocking(False)
            held.append(c)
            try:
                c.connect(path)
            except BlockingIOError:
                break
        with pytest.raises(DaemonUnavailable, match="listen backlog stayed full for 0.3 s"):
            Connection(path, timeout_s=0.3)
        accepting = threading.Timer(0.2, listener.accept)  # room comes while the client waits
        accepting.start()
        conn = Connection(path, timeout_s=30)
        accepting.join()
        conn.sock.close()
    finally:
        for c in held:
            c.close()
        listener.close()


def test_a_connect_storm_neither_holds_up_other_uids_nor_fills_the_log(daemon_factory):
    """A uid holding its share of connections opens and closes more in a tight loop, each
    refused: the event loop still serves another uid's requests meanwhile (it accepts a
    bounded number of connections a turn), and the log gets at most one refusal line a
    second for that uid, saying how many more there were."""
    import grp

    from tierstore.client import Client

    nobody = pwd.getpwnam("nobody")
    d = daemon_factory("--allowed-group", grp.getgrgid(nobody.pw_gid).gr_name, "--max-clients-per-uid", "4",
                       public=True)
    p = subprocess.Popen([sys.executable, "-c", _STORM, d.socket, str(nobody.pw_uid), str(nobody.pw_gid), "6"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "holding", p.stderr.read()
        answered = 0
        with Client.connect(socket=d.socket, namespace="bystander", timeout_s=10) as c:
            while p.poll() is None:
                h = c.put(torch.arange(4.0), key="k", replace=True)  # each within the client's 10 s
                assert torch.equal(c.get(h), torch.arange(4.0))
                answered += 1
            refused = c.stat()["connections_refused"]
        tries = int(p.communicate(timeout=60)[0].strip())
    finally:
        p.kill()
    assert answered >= 2 and refused >= 100 and tries >= refused, (answered, refused, tries)
    lines = [ln for ln in d.log.read_text().splitlines() if "refused connection from" in ln]
    assert 1 <= len(lines) <= 12, len(lines)  # ~6 s of refusals: one line a second at most
    assert "more of that uid's in the last second" in "\n".join(lines)
