"""Fuzzing the wire protocol and key handling against a real daemon."""

import os
import socket

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierstore.protocol import OPS, PROTOCOL_VERSION

scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**64 - 1),
                    st.floats(allow_nan=True), st.text(max_size=40), st.binary(max_size=40))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=12)
FIELDS = ["handle", "key", "prefix", "rid", "lid", "mode", "kind", "dtype", "shape", "nbytes", "tier", "durable",
          "replace", "wait_s", "timeout_s", "handles", "stream", "staged", "src", "namespace", "version"]
messages = st.fixed_dictionaries(
    {"id": st.integers(min_value=0, max_value=2**40), "op": st.one_of(st.sampled_from(sorted(OPS)), st.text(max_size=12))},
    optional={f: values for f in FIELDS})


@pytest.fixture(scope="module")
def fuzz_daemon(tmp_path_factory):
    import conftest

    base = tmp_path_factory.mktemp("fuzz")
    d = conftest.DaemonProc(base, ["--max-message-bytes", "64KiB"])
    d.start()
    yield d
    d.close()


def _hello(sock_path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(20)
    s.connect(sock_path)
    s.send(msgpack.packb({"id": 0, "op": "hello", "version": PROTOCOL_VERSION, "namespace": "fuzz"}))
    _, fds, _, _ = socket.recv_fds(s, 1 << 20, 4)
    for fd in fds:
        os.close(fd)
    return s


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(msg=messages)
def test_structured_garbage_gets_an_answer(fuzz_daemon, msg):
    s = _hello(fuzz_daemon.socket)
    try:
        s.send(msgpack.packb(msg))
        rep = msgpack.unpackb(s.recv(1 << 24), raw=False)
        assert rep["id"] in (msg["id"], None) and ("ok" in rep or "err" in rep)
        if "err" in rep:
            assert rep["err"]["code"] != "TierstoreError" or "internal" not in rep["err"]["message"], rep
    finally:
        s.close()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(blob=st.binary(min_size=1, max_size=2048))
def test_random_bytes_never_hurt_the_daemon(fuzz_daemon, blob):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(20)
    s.connect(fuzz_daemon.socket)
    try:
        s.send(blob)
        try:
            data = s.recv(1 << 20)
        except ConnectionResetError:
            data = b""
        if data:
            rep = msgpack.unpackb(data, raw=False)
            assert "err" in rep
    finally:
        s.close()


def test_daemon_survived_the_fuzzing_and_logged_no_internal_error(fuzz_daemon):
    with fuzz_daemon.client("after-fuzz") as c:
        h = c.put(torch.arange(5), key="k")
        assert torch.equal(c.get(h), torch.arange(5))
    assert fuzz_daemon.proc.poll() is None
    assert "Traceback" not in fuzz_daemon.log.read_text()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.text(min_size=1, max_size=300))
def test_any_key_stays_in_its_namespace(fuzz_daemon, key):
    from tierstore import InvalidArgument

    with fuzz_daemon.client("keys-a") as a, fuzz_daemon.client("keys-b") as b:
        try:
            h = a.put(torch.ones(2), key=key, replace=True)
        except InvalidArgument:
            # refused only for over-long keys and those with characters that break listings:
            # controls (NUL, newline, ...), line/paragraph separators, lone surrogates (not UTF-8)
            import unicodedata

            assert (len(key.encode("utf-8", "surrogatepass")) > 1024
                    or any(unicodedata.category(ch) in ("Cc", "Cs", "Zl", "Zp") for ch in key)), repr(key)
            return
        assert a.lookup(key) == h and b.lookup(key) is None and key in a.keys()
        assert key not in b.keys()
        a.free(h)


def test_connection_cap(daemon_factory):
    from tierstore import TierstoreError
    from tierstore.client import Client

    d = daemon_factory("--max-clients", "2")
    a, b = d.client(), d.client()
    with pytest.raises(TierstoreError, match="max_clients"):
        Client.connect(socket=d.socket)
    a.close()
    for _ in range(1000):  # the daemon frees the slot when it sees the close
        try:
            c = Client.connect(socket=d.socket)
            break
        except TierstoreError:
            continue
    c.ping()
    c.close()
    b.close()


def test_keys_with_path_tricks_do_not_escape_a_snapshot(make_store, tmp_path):
    s = make_store()
    for k in ("../../etc/passwd", "/abs/path", "a/../../b", "..", ".", "__x", "é/ü", "a\\b", "~7e"):
        s.put(torch.ones(300_000), key=k)  # >= 1 MiB: one array each, at the key's path
    dest = tmp_path / "inner" / "snap.zarr"
    dest.parent.mkdir()
    s.snapshot(str(dest))
    outside = {p for p in os.listdir(tmp_path)} - {"inner", "nvme"}
    assert not outside, outside  # nothing written next to the snapshot
    for root, dirs, files in os.walk(dest):
        assert os.path.realpath(root).startswith(os.path.realpath(dest))
    s2 = make_store(nvme_dirs=[str(tmp_path / "n2")])
    s2.restore(str(dest), namespace="copy")
    assert sorted(s2.keys(namespace="copy")) == sorted(s.keys())
