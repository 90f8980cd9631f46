"""A real daemon under careless and hostile clients: raw messages with wrong values,
ops out of order, bursts cut short, clients that stop reading or are stopped, odd
tensors. After each attack the daemon serves a fresh client, every error is a typed
``TierstoreError`` with a one-line message, and no lease or reservation outlives its
connection."""

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys

import msgpack
import numpy as np
import pytest
import torch

from conftest import DaemonProc, poll_until
from tierstore import Busy, InvalidArgument, InvalidKey, NotFound, TierstoreError
from tierstore.protocol import PROTOCOL_VERSION
from tierstore.tensors import TensorSpec

_REPLY_S = 10.0
"""How long a raw client waits for one reply: a request that gets none by then hangs."""


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    # a short lease wait: an attack that meets a held lease ends in Busy within a second
    d = DaemonProc(tmp_path_factory.mktemp("attacks"), ["--lease-wait-s", "1"])
    d.start()
    yield d
    d.close()


@pytest.fixture
def ns(request):
    """A namespace of the test's own (the daemon is shared by the module's tests)."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", request.node.name)[:200]


@pytest.fixture
def victim(daemon, ns):
    """A well-behaved client in ``ns``; at teardown the daemon is alive, serves a fresh client, and
    holds no lease or reservation (the attacker is gone)."""
    with daemon.client(ns) as v:
        yield v
    assert daemon.proc.poll() is None
    with daemon.client("fresh") as f:
        h = f.put(torch.arange(7), key="probe", replace=True)
        assert torch.equal(f.get(h), torch.arange(7))
        poll_until(lambda: (lambda st: st["leases"] == 0 and st["reservations"] == 0)(f.stat()),
                   "leases and reservations back to none after the attack")
    assert "Traceback" not in daemon.log.read_text()


class Raw:
    """A client speaking msgpack over the SEQPACKET socket by hand."""

    def __init__(self, daemon, namespace="raw", joined=False):
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.s.settimeout(_REPLY_S)
        self.s.connect(daemon.socket)
        self.s.send(msgpack.packb({"id": 0, "op": "hello", "version": PROTOCOL_VERSION, "namespace": namespace,
                                   "fragments": True, "joined": joined}))
        _, fds, _, _ = socket.recv_fds(self.s, 1 << 20, 4)
        for fd in fds:
            os.close(fd)
        self.next_id = 1

    def send(self, op, **fields):
        rid, self.next_id = self.next_id, self.next_id + 1
        self.s.send(msgpack.packb({"id": rid, "op": op, **fields}, use_bin_type=True))
        return rid

    def replies(self):
        """The replies of one packet (or one fragmented reply), as a list."""
        blob = b""
        while True:
            data = self.s.recv(1 << 24)
            if not data:
                return []  # end of the connection
            r = msgpack.unpackb(data, raw=False)
            if isinstance(r, dict) and "frag" in r:
                blob += r["frag"]
                if r["more"]:
                    continue
                r = msgpack.unpackb(blob, raw=False)
            return r if isinstance(r, list) else [r]

    def call(self, op, **fields):
        rid = self.send(op, **fields)
        [r] = self.replies()
        assert r["id"] == rid
        return r

    def err(self, op, **fields):
        """The error code of a request that must fail, checked to be a one-line message."""
        r = self.call(op, **fields)
        assert "err" in r, r
        assert "\n" not in r["err"]["message"] and "Traceback" not in r["err"]["message"], r
        return r["err"]["code"]

    def close(self):
        self.s.close()


def test_put_part_is_a_typed_hint_that_keeps_no_nvme_space(daemon, victim, ns):
    """``put_part`` (a reservation's first bytes are filled: the daemon may begin writing
    them to NVMe) from a raw client: values out of range or of the wrong type, another
    connection's reservation (to write early or to abort), a host-tier one, one already
    committed are typed errors or nothing to do; what the early writes took on NVMe comes back when the reservation is
    aborted or its connection goes, and a committed object holds only its own bytes."""
    n = 8 << 20
    nvme = lambda: victim.stat()["tiers"]["nvme"]["used_bytes"]  # noqa: E731
    used0 = nvme()
    a, b = Raw(daemon, ns), Raw(daemon, ns)
    try:
        reserve = lambda **kw: a.call("put_reserve", kind="numpy", dtype="uint8", shape=[n], nbytes=n,  # noqa: E731
                                      **kw)["ok"]["rid"]
        rid = reserve(tier="nvme")
        for upto in (0, -1, n + 1, 2**64 - 1, "x", None, 1.5, [1]):
            assert a.err("put_part", rid=rid, upto=upto) == "InvalidArgument"
        assert a.err("put_part", upto=1) == "InvalidArgument"
        assert b.err("put_part", rid=rid, upto=n) == "NotFound"
        assert a.err("put_part", rid=rid + 10**6, upto=1) == "NotFound"
        assert a.call("put_part", rid=rid, upto=n // 2)["ok"]["sent"] > 0
        assert a.call("put_part", rid=rid, upto=n // 2)["ok"]["sent"] == 0  # (sent already)
        assert nvme() == used0 + n  # the object's extents, taken early
        assert b.err("put_abort", rid=rid) == "NotFound"  # another connection's: refused, nothing aborted
        assert a.err("put_abort", rid=rid + 10**6) == "NotFound"
        assert nvme() == used0 + n
        assert "ok" in a.call("put_abort", rid=rid)
        assert nvme() == used0
        assert a.call("put_part", rid=reserve(tier="host"), upto=n)["ok"]["sent"] == 0  # nothing to write early
        rid = reserve(tier="nvme", durable=True)
        a.call("put_part", rid=rid, upto=n - 1)
        h = a.call("put_commit", rid=rid)["ok"]["handle"]
        assert a.err("put_part", rid=rid, upto=n) == "NotFound"
        assert nvme() == used0 + n
        assert "ok" in a.call("free", handle=h)
        a.call("put_part", rid=reserve(tier="nvme"), upto=n // 2)  # left open: the connection goes
    finally:
        a.close()
        b.close()
    poll_until(lambda: nvme() == used0, "the NVMe space of parts left open to come back")


@contextlib.contextmanager
def _daemon_with_client(tmp_path, *args: str):
    """A daemon of the test's own (``args``) and a client of it in namespace ``s``; at the
    end the daemon is alive and logged no traceback."""
    d = DaemonProc(tmp_path, list(args))
    d.start()
    try:
        with d.client("s") as v:
            yield d, v
        assert d.proc.poll() is None and "Traceback" not in d.log.read_text()
    finally:
        d.close()


def _nvme_object(client, nbytes: int, fill: int, key: str) -> int:
    """An object of ``nbytes`` bytes of ``fill`` put with ``tier="nvme"``, returned once it
    is only on NVMe (a put's host copy goes down after it)."""
    h = int(client.put(np.full(nbytes, fill, np.uint8), key=key, tier="nvme"))
    poll_until(lambda: client.info(h)["residency"] == ["nvme"], "the put to go down to NVMe")
    return h


def test_reservations_of_empty_objects_count_against_their_bound(tmp_path):
    """Objects of no bytes take no block, so they are bounded by count (one per page of the
    tiers). Reservations of them, never committed, count too: a client cannot grow the
    daemon's memory without bound by reserving, nor pass the bound by committing them all
    later; a connection's close gives them back."""
    with _daemon_with_client(tmp_path, "--host-bytes", "8MiB", "--nvme-bytes", "16MiB") as (d, v):
        bound = (8 + 16) * 256  # pages of the tiers
        a = Raw(d, "s")
        rids = []
        empty = {"kind": "numpy", "dtype": "uint8", "shape": [0], "nbytes": 0}
        for i in range(bound + 64):
            r = a.call("put_reserve", **empty)
            if "err" in r:
                assert r["err"]["code"] == "CapacityExceeded", r
                break
            rids.append(r["ok"]["rid"])
        else:
            pytest.fail("reservations of empty objects were not bounded")
        assert len(rids) == bound, len(rids)
        for rid in rids[:100]:
            assert "ok" in a.call("put_commit", rid=rid)
        assert a.call("put_reserve", **empty)["err"]["code"] == "CapacityExceeded"  # the committed ones still count
        a.close()  # its reservations end with it
        poll_until(lambda: v.stat()["reservations"] == 0, "the closed connection's reservations dropped")
        b = Raw(d, "s")
        assert "ok" in b.call("put_reserve", **empty)  # room again
        b.close()


def test_streamed_gets_are_typed_and_give_their_blocks_back(tmp_path):
    """A streamed get (``get`` with ``parts``: a large object only on NVMe read into a
    block of the request's own) from raw clients: ``get_part`` and ``get_end`` with values
    out of range or of the wrong type, another connection's stream, one ended already are
    typed errors; past 8 streams on a connection, or half the host tier held by streams,
    a get takes a lease; the object is held only while it is read (a writer and a free
    go ahead while the stream stays open); the block comes back when the stream ends,
    also before its read is over, or when its connection goes with a ``get_part`` still
    waiting."""
    n = 130 << 20
    with _daemon_with_client(tmp_path, "--host-bytes", "640MiB", "--lease-wait-s", "1") as (d, v):
        h = _nvme_object(v, n, 7, "big")
        nvme_only = lambda h: v.info(h)["residency"] == ["nvme"]  # noqa: E731
        small = int(v.put(np.ones(8, np.uint8), key="small"))
        host = lambda: v.stat()["tiers"]["host"]["used_bytes"]  # noqa: E731
        a, b = Raw(d, "s"), Raw(d, "s")
        try:
            assert a.err("get", handle=h, parts="yes") == "InvalidArgument"
            lease = a.call("get", handle=small, parts=True)["ok"]  # in the host tier: a lease
            assert "sid" not in lease and "ok" in a.call("release", lid=lease["lid"])
            host1 = host()
            r = a.call("get", handle=h, parts=True)["ok"]
            sid = r["sid"]
            assert r["nbytes"] == n and r["handle"] == h and host() == host1 + n
            for upto in (0, -1, n + 1, 2**64 - 1, "x", None, 1.5, [1]):
                assert a.err("get_part", sid=sid, upto=upto) == "InvalidArgument"
            for bad in ("x", None, -1, 1.5):
                assert a.err("get_part", sid=bad, upto=1) == "InvalidArgument"
                assert a.err("get_end", sid=bad) == "InvalidArgument"
            assert b.err("get_part", sid=sid, upto=n) == "NotFound"
            assert b.err("get_end", sid=sid) == "NotFound"
            assert a.err("get_part", sid=sid + 10**6, upto=1) == "NotFound"
            assert a.call("get_part", sid=sid, upto=n)["ok"]["landed"] == n
            assert "ok" in a.call("get_end", sid=sid)
            assert a.err("get_part", sid=sid, upto=1) == "NotFound"
            assert a.err("get_end", sid=sid) == "NotFound"
            poll_until(lambda: host() <= host1, "an ended stream's block to come back")
            assert nvme_only(h)
            sid = a.call("get", handle=h, parts=True)["ok"]["sid"]
            assert a.call("get_part", sid=sid, upto=n)["ok"]["landed"] == n
            with v.checkout(h, "w", timeout_s=5) as t:  # read: the object is let go, the stream still open
                t[:] = 9
            assert a.call("get_part", sid=sid, upto=1)["ok"]["landed"] == n  # its block is still its own
            assert host() >= host1 + n
            assert "ok" in a.call("get_end", sid=sid)
            poll_until(lambda: nvme_only(h) and host() <= host1, "the block back, the written object down")
            for _ in range(3):  # ended before its read is over: the rest is not read, the block comes back
                sid = a.call("get", handle=h, parts=True)["ok"]["sid"]
                assert "ok" in a.call("get_end", sid=sid)
                assert a.err("get_part", sid=sid, upto=n) == "NotFound"
                # (making room may have moved the small object down: at most host1)
                poll_until(lambda: host() <= host1, "the block of a stream ended early to come back")
            a.send("get", handle=h, parts=True)  # a stream, left for the end of the connection
            b.call("get", handle=small, parts=True)
        finally:
            a.close()
            b.close()
        m = 32 << 20  # the smallest object that streams: 8 streams on a connection; a ninth get, a lease
        h32 = _nvme_object(v, m, 3, "b32")
        c = Raw(d, "s")
        try:
            sids = [c.call("get", handle=h32, parts=True)["ok"]["sid"] for _ in range(8)]
            lease = c.call("get", handle=h32, parts=True)["ok"]
            assert "sid" not in lease and "ok" in c.call("release", lid=lease["lid"])
            for sid in sids:
                assert c.call("get_part", sid=sid, upto=m)["ok"]["landed"] == m
                assert "ok" in c.call("get_end", sid=sid)
        finally:
            c.close()
        v.free(h32)
        poll_until(lambda: nvme_only(h) and host() <= host1, "the object down, no block held")
        c = Raw(d, "s")  # streams hold half the host tier at most (320 MiB): a third get takes a lease
        try:
            sids = [c.call("get", handle=h, parts=True)["ok"]["sid"] for _ in range(2)]
            lease = c.call("get", handle=h, parts=True)["ok"]
            assert "sid" not in lease and "ok" in c.call("release", lid=lease["lid"])
            for sid in sids:
                assert "ok" in c.call("get_end", sid=sid)
        finally:
            c.close()
        v.free(h)  # from the host tier: the next get streams from NVMe again
        h = _nvme_object(v, n, 5, "big2")
        c = Raw(d, "s")
        try:
            sid = c.call("get", handle=h, parts=True)["ok"]["sid"]
            assert c.call("get_part", sid=sid, upto=n)["ok"]["landed"] == n
            v.free(h)  # read: a free goes ahead of the open stream
            assert v.lookup("big2") is None and c.call("get_part", sid=sid, upto=n)["ok"]["landed"] == n
            assert "ok" in c.call("get_end", sid=sid)
            h = _nvme_object(v, n, 5, "big2")
            sid = c.call("get", handle=h, parts=True)["ok"]["sid"]
            c.send("get_part", sid=sid, upto=n)  # left waiting: the connection goes
        finally:
            c.close()
        poll_until(lambda: v.stat()["leases"] == 0 and host() <= host1, "a dropped stream's block to come back")
        with v.checkout(h, "rw", timeout_s=30) as t:  # and its object to be let go
            assert int(t[0]) == 5 and int(t[-1]) == 5


def test_a_streamed_get_left_open_is_ended_and_its_block_comes_back(tmp_path):
    """A client that opens a streamed get and then neither copies nor ends it, still
    connected, holds its block no longer than ``reservation_timeout_s``: the daemon ends
    the stream, the block comes back, and the client's ``get_part`` and ``get_end`` answer
    ``NotFound`` (a get whose stream ended under its copy fails, not returns those bytes);
    ``counters["streams_expired"]`` counts it. A stream used in time is untouched."""
    n = 40 << 20
    with _daemon_with_client(tmp_path, "--host-bytes", "256MiB", "--reservation-timeout-s", "2") as (d, v):
        h = _nvme_object(v, n, 4, "big")
        host = lambda: v.stat()["tiers"]["host"]["used_bytes"]  # noqa: E731
        a = Raw(d, "s")
        try:
            host0 = host()
            sid = a.call("get", handle=h, parts=True)["ok"]["sid"]
            assert a.call("get_part", sid=sid, upto=n)["ok"]["landed"] == n and host() >= host0 + n
            poll_until(lambda: v.stat()["counters"]["streams_expired"] == 1, "the idle stream to be ended", 30)
            assert host() <= host0
            assert a.err("get_part", sid=sid, upto=1) == "NotFound"
            assert a.err("get_end", sid=sid) == "NotFound"
            assert np.asarray(v.get(h)).min() == 4  # a get in time: whole
            assert v.stat()["counters"]["streams_expired"] == 1
        finally:
            a.close()


def test_handle_strings_that_only_look_numeric_are_typed_errors(daemon, victim, ns):
    """Superscript and other non-ASCII digits pass ``str.isdigit`` but not ``int()``, and
    5 000 ASCII digits pass neither Python's digit limit nor any id: every op that takes a
    handle answers ``InvalidArgument``, with nothing in the daemon's log (``victim``)."""
    h = victim.put(torch.arange(3), key="k")
    raw = Raw(daemon, ns)
    bad = ["1.\u00b2", "\u00b2.0", "\u0661.0", "9" * 5000 + ".0", "1." + "0" * 5000, ".", "1.", ".1", "+1.0", " 1.0"]
    for value in bad:
        for op, fields in [("info", {"handle": value}), ("get", {"handle": value}), ("free", {"handle": value}),
                           ("checkout", {"handle": value, "mode": "r"}), ("prefetch", {"handles": [value]}),
                           ("checkout_many", {"handles": [value], "mode": "r"})]:
            assert raw.err(op, **fields) == "InvalidArgument", (op, value)
    assert raw.call("info", handle=str(h))["ok"]["key"] == "k"  # the real one still works
    raw.close()


def test_nan_timeouts_are_refused_not_waited_on_forever(daemon, victim, ns):
    """NaN passes every bound check (``nan > 86400`` is false): a check-out with
    ``timeout_s`` NaN behind a held lease never ended, and a put's ``wait_s`` NaN was
    taken. Both are refused as InvalidArgument."""
    h = victim.put(np.ones(4, np.float32), key="x")
    raw = Raw(daemon, ns)
    try:
        with victim.checkout(h, "w"):
            assert raw.err("checkout", handle=int(h), mode="w", timeout_s=float("nan")) == "InvalidArgument"
            assert raw.err("checkout_many", handles=[int(h)], modes="r", timeout_s=float("nan")) == "InvalidArgument"
        assert raw.err("put_reserve", kind="torch", dtype="float32", shape=[1], nbytes=4,
                       wait_s=float("nan")) == "InvalidArgument"
    finally:
        raw.close()
    with pytest.raises(InvalidArgument, match="NaN"):
        victim.checkout(h, "r", timeout_s=float("nan"))


def test_get_into_an_r_checkouts_tensor_is_a_typed_error(victim):
    """``get(out=)`` into the read-only tensor of an ``r`` check-out: InvalidArgument
    (it was a bare ValueError from the copy), the object's bytes unchanged, no lease left."""
    a = victim.put(torch.arange(6.0), key="a")
    b = victim.put(torch.full((6,), 9.0), key="b")
    with victim.checkout(a, "r") as t:
        with pytest.raises(InvalidArgument, match="read-only"):
            victim.get(b, out=t)
        assert torch.equal(t, torch.arange(6.0))
    assert torch.equal(victim.get(a), torch.arange(6.0))


def test_ops_out_of_order_and_across_connections(daemon, victim, ns):
    """A reservation commits and a lease checks in only on its own connection; double
    and never-granted check-ins, forged handles and wrong field types are typed errors;
    the owner's work is untouched."""
    h = victim.put(np.arange(4, dtype=np.float32), key="x")
    a, b = Raw(daemon, ns), Raw(daemon, ns)
    try:
        rid = a.call("put_reserve", kind="numpy", dtype="float32", shape=[4], nbytes=16, key="y")["ok"]["rid"]
        assert b.err("put_commit", rid=rid) == "NotFound"
        lid = a.call("checkout", handle=int(h), mode="r")["ok"]["lid"]
        assert b.err("release", lid=lid) == "NotFound"
        assert b.err("release_many", lids=[lid]) == "NotFound"
        assert b.err("free", handle=int(h)) == "Busy"  # a's lease holds it
        assert "ok" in a.call("release", lid=lid)
        assert a.err("release", lid=lid) == "NotFound"
        assert a.err("release", lid=lid, unused=True) == "NotFound"
        assert a.err("release", lid=2**64 - 1) == "NotFound"
        assert "ok" in a.call("put_commit", rid=rid)
        assert a.err("put_commit", rid=rid) == "NotFound"
        for handle in (2**64 - 1, "1.99999999999999999999", "-1.0", True, 1.5, None):
            assert a.err("get", handle=handle) in ("NotFound", "InvalidArgument")
        for fields in ({"page": True, "after": 5}, {"page": True, "rows": True, "after": [1]},
                       {"page": True, "limit": 0}, {"page": True, "limit": 2**64 - 1}, {"prefix": 5}):
            assert a.err("ls", **fields) == "InvalidArgument"
            assert a.err("keys", **fields) == "InvalidArgument"
        assert a.err("namespaces", after=7) == "InvalidArgument"
        assert a.err("put_reserve", kind="torch", dtype="float32", shape=[-1], nbytes=4) == "InvalidArgument"
        assert a.err("put_reserve", kind="torch", dtype="float32", shape=[1], nbytes=-4) == "InvalidArgument"
        assert a.err("checkout_many", handles=[int(h), int(h)], modes=["r"]) == "InvalidArgument"
        # a reservation and a lease left open when the connection goes are given back
        a.call("put_reserve", kind="numpy", dtype="uint8", shape=[1 << 20], nbytes=1 << 20)
        a.call("checkout", handle=int(h), mode="w")
    finally:
        a.close()
        b.close()
    assert victim.lookup("y") is not None
    with victim.checkout(h, "w") as t:  # a's write lease went with its connection
        assert np.array_equal(t, np.arange(4, dtype=np.float32))


def test_a_cursor_reaches_no_other_namespace(daemon, victim):
    """An ``after`` cursor names a key, never a place in another namespace: a cursor
    taken from (or forged for) another namespace lists only the caller's own keys."""
    for i in range(5):
        victim.put(torch.ones(1), key=f"k{i}")
    other = Raw(daemon, "attacker")
    try:
        for fields in ({"page": True, "after": "k2"}, {"page": True, "rows": True, "after": "k2"},
                       {"page": True, "after": ""}, {"page": True, "after": "\uffff" * 300}):
            r = other.call("ls", **fields)["ok"]
            assert r.get("objects", r.get("rows")) == [] and r["next"] is None
            assert other.call("keys", **fields)["ok"] == {"keys": [], "next": None}
    finally:
        other.close()


@pytest.mark.parametrize("joined", [True, False])
def test_a_burst_then_a_half_close_gets_every_reply(daemon, victim, ns, joined):
    """Hundreds of requests (small replies mixed with fragmented ``stat`` ones), then
    ``shutdown(SHUT_WR)``: every request gets its reply, then EOF; the read leases
    taken are given back with the connection."""
    h = victim.put(np.ones(4, np.float32), key="x")
    raw = Raw(daemon, ns, joined=joined)
    n = 300
    for i in range(n):
        if i % 3:
            raw.send("checkout", handle=int(h), mode="r")
        else:
            raw.send("stat")
    raw.s.shutdown(socket.SHUT_WR)
    ids = []
    try:
        while len(ids) < n:
            got = raw.replies()
            assert got, f"EOF after {len(ids)} of {n} replies"
            ids += [r["id"] for r in got]
        assert raw.s.recv(16) == b""
    finally:
        raw.close()
    assert sorted(ids) == list(range(1, n + 1))


def test_a_burst_then_an_immediate_close(daemon, victim, ns):
    """A burst of check-outs and puts closed before any reply is read: nothing is held."""
    h = victim.put(np.ones(4, np.float32), key="x")
    for joined in (True, False):
        raw = Raw(daemon, ns, joined=joined)
        for i in range(400):
            if i % 2:
                raw.send("checkout", handle=int(h), mode="r" if i % 4 == 1 else "w")
            else:
                raw.send("put_reserve", kind="numpy", dtype="uint8", shape=[4096], nbytes=4096)
        raw.close()
    with victim.checkout(h, "w"):
        pass


def test_a_joined_client_that_never_reads_holds_up_no_one(daemon, victim, ns):
    """A client sends ``stat`` requests until its socket is full and never reads: the
    others are served meanwhile."""
    raw = Raw(daemon, ns, joined=True)
    raw.s.setblocking(False)
    try:
        for _ in range(20000):
            raw.send("stat")
    except BlockingIOError:
        pass
    try:
        h = victim.put(torch.arange(3), key="served")
        assert torch.equal(victim.get(h), torch.arange(3))
        with daemon.client("another") as c:
            assert c.stat()["tiers"]["host"]["capacity_bytes"] > 0
    finally:
        raw.close()


def test_a_stopped_client_holding_a_lease(daemon, victim, ns):
    """A SIGSTOP'ed client's write lease makes other check-outs Busy after the lease wait
    (nobody hangs); once it is killed its lease is gone."""
    h = victim.put(np.ones(4, np.float32), key="held")
    code = ("import sys\nfrom tierstore.client import Client\n"
            f"c = Client.connect(socket={daemon.socket!r}, namespace={ns!r})\n"
            "c.checkout(c.lookup('held'), 'w').__enter__()\nprint('held', flush=True)\nsys.stdin.read()\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        p.send_signal(signal.SIGSTOP)
        with pytest.raises(Busy):
            victim.checkout(h, "r")
        assert victim.stat()["leases"] == 1
    finally:
        p.kill()
        p.wait()
    poll_until(lambda: victim.stat()["leases"] == 0, "the killed client's lease given back")
    with victim.checkout(h, "w"):
        pass


def test_keys_and_namespaces_at_their_length_limits(daemon, victim):
    h = victim.put(torch.ones(1), key="k" * 1024)
    assert victim.lookup("k" * 1024) == h
    victim.put(torch.ones(1), key="é" * 512)
    for key in ("k" * 1025, "é" * 513):
        with pytest.raises(InvalidKey):
            victim.put(torch.ones(1), key=key)
    for ns in ("n" * 255, "é" * 255):
        with daemon.client(ns) as c:
            assert c.get(c.put(torch.ones(2), key="a", replace=True)).sum() == 2
    with pytest.raises(InvalidArgument):
        daemon.client("n" * 256)


ODD = {
    "zero-bytes": torch.empty(0), "zero-dim": torch.tensor(3.5), "empty-middle": torch.empty(3, 0, 2),
    "transposed": torch.arange(12.0).reshape(3, 4).t(), "strided": torch.arange(100.0)[::3],
    "expanded": torch.tensor([1.0, 2.0]).expand(4, 2), "flipped": torch.arange(4.0).flip(0),
    "bool": torch.tensor([True, False, True]), "complex": torch.tensor([1 + 2j, 3 - 1j]),
    "conj": torch.tensor([1 + 2j]).conj(), "bfloat16": torch.arange(5, dtype=torch.bfloat16),
    "float8": torch.ones(4, dtype=torch.float8_e4m3fn), "requires-grad": torch.ones(3, requires_grad=True),
    "np-0d": np.array(7, np.int16), "np-bool": np.array([True, False]), "np-strided": np.arange(12.0).reshape(3, 4)[:, ::2],
}


def test_odd_tensors_round_trip(victim):
    for name, t in ODD.items():
        got = victim.get(victim.put(t))
        if isinstance(t, np.ndarray):
            assert got.dtype == t.dtype and got.shape == t.shape and np.array_equal(got, t), name
        else:
            want = t.detach().resolve_conj()
            assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, want), name
    with pytest.raises(InvalidArgument):
        victim.put(torch.eye(3).to_sparse())
    with pytest.raises(InvalidArgument):
        victim.put(np.array(["a"], dtype=object))


def test_get_into_a_wrong_out_is_a_typed_error(victim):
    h = victim.put(torch.arange(6.0))
    ro = np.empty(6, np.float32)
    ro.flags.writeable = False
    n = victim.put(np.arange(6, dtype=np.float32))
    for out, handle in [(torch.empty(5), h), (torch.empty(6, dtype=torch.int32), h), (torch.empty(6, 2)[:, 0], h),
                        (ro, n), (np.empty(6, np.float64), n), ([0] * 6, h), (torch.empty(6, device="meta"), h)]:
        with pytest.raises(InvalidArgument) as e:
            victim.get(handle, out=out)
        assert "\n" not in str(e.value)
    assert isinstance(e.value, TierstoreError)
    with pytest.raises(NotFound):
        victim.get(2**40)


def test_two_clients_replace_a_key_while_a_third_checks_it_out(daemon, victim, ns):
    """Replacing puts race check-outs of the same key: each check-out sees one whole
    version (never a torn mix), a lost race is a typed StaleHandle/NotFound, nothing is
    left held."""
    from conftest import in_threads

    victim.put(torch.zeros(4096), key="hot", replace=True)
    done = []
    torn = []

    def work(k):
        with daemon.client(ns) as c:
            if k < 2:  # the replacers: each version is one value throughout
                for i in range(60):
                    c.put(torch.full((4096,), float(k * 1000 + i + 1)), key="hot", replace=True)
                done.append(k)
                return
            while len(done) < 2:
                h = c.lookup("hot")
                try:
                    with c.checkout(h, "r") as t:
                        if len(set(t.tolist())) != 1:
                            torn.append(h)
                except NotFound:  # StaleHandle too: replaced between lookup and check-out
                    pass

    assert in_threads(work, 3) == []
    assert torn == []
    assert victim.get(victim.lookup("hot"))[0].item() in (60.0, 1060.0)


def test_stream_names_cannot_grow_the_daemon_without_bound(daemon, victim, ns):
    """Every access stream a connection names gets a trace: a name longer than
    MAX_STREAM_CHARS is InvalidArgument, and past MAX_STREAMS names a connection's further
    accesses share one trace, so a client inventing a name per access is bounded."""
    from tierstore.trace import MAX_STREAM_CHARS, MAX_STREAMS, OVERFLOW_STREAM

    h = victim.put(np.ones(4, np.float32), key="s")
    raw = Raw(daemon, ns)
    try:
        assert raw.err("get", handle=int(h), stream="s" * (MAX_STREAM_CHARS + 1)) == "InvalidArgument"
        for i in range(3 * MAX_STREAMS):
            r = raw.call("checkout", handle=int(h), mode="r", stream=f"s{i}")
            assert "ok" in r, r
            assert "ok" in raw.call("release", lid=r["ok"]["lid"]), r
        traces = [t for t in victim.stat()["prefetch"]["traces"] if t["stream"].startswith("s")
                  or t["stream"] == OVERFLOW_STREAM]
        assert len(traces) == MAX_STREAMS + 1, len(traces)
        assert sum(t["stream"] == OVERFLOW_STREAM for t in traces) == 1
    finally:
        raw.close()


def test_a_half_close_still_gets_the_replies_of_requests_under_way(daemon, victim, ns):
    """Requests that run on op workers (frees, a namespace's first put, which journals
    its claim) sent, then ``shutdown(SHUT_WR)`` at once: each gets its reply, then EOF,
    and each happened."""
    handles = [victim.put(np.full(64, i, np.float32), key=f"k{i}", durable=True) for i in range(40)]
    fresh = f"{ns}-fresh"
    raw, first = Raw(daemon, ns), Raw(daemon, fresh)
    try:
        ids = [raw.send("free", handle=int(h)) for h in handles]
        first_id = first.send("put_reserve", kind="numpy", dtype="uint8", shape=[4096], nbytes=4096, durable=True)
        for r in (raw, first):
            r.s.shutdown(socket.SHUT_WR)
        got = []
        while len(got) < len(ids):
            batch = raw.replies()
            assert batch, f"EOF after {len(got)} of {len(ids)} replies"
            got += batch
        assert sorted(r["id"] for r in got) == ids and all("ok" in r for r in got), got[:3]
        assert raw.s.recv(16) == b""
        [r] = first.replies()
        assert r["id"] == first_id and "rid" in r["ok"], r
        assert first.s.recv(16) == b""
    finally:
        raw.close()
        first.close()
    assert all(victim.lookup(f"k{i}") is None for i in range(40))


def test_an_empty_message_is_a_protocol_error_not_an_end(daemon, victim, ns):
    """A message of no bytes reads as 0 bytes, as EOF does: the daemon tells them apart
    and answers it as the malformed request it is, before closing."""
    raw = Raw(daemon, ns)
    try:
        raw.s.send(b"")
        [r] = raw.replies()
        assert r["err"]["code"] == "ProtocolError" and "empty message" in r["err"]["message"], r
        assert raw.replies() == []
    finally:
        raw.close()


def test_a_refused_hello_binds_nothing_and_a_corrected_one_is_served(daemon, victim, ns):
    """A hello whose ``fragments`` or ``joined`` is of the wrong type is refused and leaves
    the connection without a namespace: requests other than hello are still refused, and
    a corrected hello gets the arena."""
    for bad in ({"fragments": "yes"}, {"joined": 3}):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.settimeout(_REPLY_S)
        s.connect(daemon.socket)
        try:
            hello = {"id": 1, "op": "hello", "version": PROTOCOL_VERSION, "namespace": ns}
            s.send(msgpack.packb({**hello, **bad}))
            r = msgpack.unpackb(s.recv(1 << 16), raw=False)
            assert r["err"]["code"] == "InvalidArgument", r
            s.send(msgpack.packb(hello))
            data, fds, _, _ = socket.recv_fds(s, 1 << 16, 4)
            for fd in fds:
                os.close(fd)
            assert "ok" in msgpack.unpackb(data, raw=False) and len(fds) == 1
            s.send(msgpack.packb({"id": 2, "op": "ping"}))
            assert msgpack.unpackb(s.recv(1 << 16), raw=False) == {"id": 2, "ok": {}}
        finally:
            s.close()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(_REPLY_S)
    s.connect(daemon.socket)
    try:
        s.send(msgpack.packb({"id": 1, "op": "hello", "version": PROTOCOL_VERSION, "namespace": ns,
                              "fragments": []}))
        assert "err" in msgpack.unpackb(s.recv(1 << 16), raw=False)
        s.send(msgpack.packb({"id": 2, "op": "stat"}))
        r = msgpack.unpackb(s.recv(1 << 16), raw=False)
        assert r["err"]["code"] == "ProtocolError" and "before 'hello'" in r["err"]["message"], r
    finally:
        s.close()


def test_an_abort_sent_behind_its_commit_is_never_answered_as_done(daemon, victim, ns):
    """``put_abort`` right behind ``put_commit`` (not waiting for its reply): the commit
    stores the object, and the abort says it aborted nothing — it is never answered ``{}``
    for a put that was stored."""
    raw = Raw(daemon, ns)
    try:
        for i in range(20):
            rid = raw.call("put_reserve", kind="numpy", dtype="uint8", shape=[4096], nbytes=4096, key=f"a{i}",
                           durable=True)["ok"]["rid"]
            commit, abort = raw.send("put_commit", rid=rid), raw.send("put_abort", rid=rid)
            replies = {}
            while len(replies) < 2:
                replies.update((r["id"], r) for r in raw.replies())
            assert "ok" in replies[commit], replies
            assert replies[abort].get("err", {}).get("code") in ("InvalidArgument", "NotFound"), replies
            assert victim.lookup(f"a{i}") is not None
    finally:
        raw.close()


def test_an_admitted_uid_looping_on_bad_messages_does_not_flood_the_log(daemon, victim, ns):
    """Hundreds of connections that each send garbage and close: every one is answered
    and counted, and the log gets at most 5 lines a second from that uid, the next
    saying how many were left out."""
    import time

    start = len(daemon.log.read_text().splitlines())
    errors = victim.stat()["errors"].get("ProtocolError", 0)
    t0 = time.monotonic()
    for _ in range(300):
        raw = Raw(daemon, ns)
        raw.s.send(b"\xc1")  # never valid msgpack
        [r] = raw.replies()
        assert r["err"]["code"] == "ProtocolError"
        raw.close()
    elapsed = time.monotonic() - t0
    assert victim.stat()["errors"]["ProtocolError"] - errors == 300
    raw = Raw(daemon, ns)  # one more, in a new second: its line says how many were left out
    poll_until(lambda: time.monotonic() - t0 > elapsed + 1.1, "a new second")
    raw.s.send(b"\xc1")
    raw.replies()
    raw.close()
    lines = [ln for ln in daemon.log.read_text().splitlines()[start:] if "undecodable" in ln]
    assert len(lines) <= 5 * (int(elapsed) + 3), (len(lines), elapsed)
    assert any("more of this uid's left out" in ln for ln in lines), lines


def test_a_connections_clean_up_run_twice_at_once_ends_each_lease_once(make_store, caplog):
    """A closed connection's clean-up can run on two threads at once (the close's own, and
    a request of it that finished after the close): between them every lease and
    reservation is ended once, with no error and no double count."""
    import logging
    import threading

    s = make_store()
    h = s.put(torch.arange(16.0), key="x")
    for trial in range(5):
        owner = object()
        for _ in range(500):
            s.daemon.checkout(h, "r", owner=owner, namespace="default")
        for _ in range(50):
            s.daemon.reserve_put(TensorSpec("numpy", "uint8", (4096,), 4096), key=None, tier=None, durable=False,
                                 replace=False, ephemeral=False, wait_s=0.0, namespace="default", owner=owner)
        go, counts = threading.Barrier(2), []

        def drop():
            go.wait()
            counts.append(s.daemon.drop_owner(owner))

        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)  # the two threads take turns often, as on a loaded machine
        try:
            with caplog.at_level(logging.ERROR, logger="tierstore"):
                threads = [threading.Thread(target=drop) for _ in range(2)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
        finally:
            sys.setswitchinterval(interval)
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.records[:2]
        assert sum(c[0] for c in counts) == 500 and sum(c[1] for c in counts) == 50, (trial, counts)
        assert s.stat()["leases"] == 0 and s.daemon.puts.open_count() == 0


def test_a_half_closed_client_that_dies_while_its_request_waits_is_cleaned_up(daemon, victim, ns):
    """A client holds a lease, sends a check-out that waits (60 s) behind another's lease,
    half-closes, then dies: its connection is closed, and its lease released, within
    seconds, not when the wait ends."""
    x = victim.put(np.ones(4, np.float32), key="x")
    y = victim.put(np.ones(4, np.float32), key="y")
    held = victim.checkout(x, "w")  # the raw client's check-out of x waits behind this
    raw = Raw(daemon, ns)
    try:
        assert "ok" in raw.call("checkout", handle=int(y), mode="r")
        raw.send("checkout", handle=int(x), mode="r", timeout_s=60)
        raw.s.shutdown(socket.SHUT_WR)
        poll_until(lambda: victim.stat()["waiting"] >= 1, "the raw client's check-out waiting")
    finally:
        raw.close()

    def y_free():
        try:
            with victim.checkout(y, "w", timeout_s=0.2):
                return True
        except Busy:
            return False

    try:
        poll_until(y_free, "the dead client's lease on y released", timeout_s=15)
    finally:
        held.release()
