"""The client library as real training code misuses it: a forked worker that calls the
client it inherited, a helper process that outlives its parent, Ctrl-C in the middle of
a call, a client dropped without ``close()``, futures waited on with a timeout, a
``get(out=)`` into a tensor autograd saved, ranks that autostart a daemon together, and
a durable object replaced while its write-back runs. Each against a real daemon."""

import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from tierstore import Closed, InvalidArgument
from tierstore.client import Client


def _in_child(fn):
    """Run ``fn`` in a forked child (under a 20 s alarm: a hang fails, it does not hang the
    test); what it returns (bytes) comes back."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            signal.alarm(20)
            out = fn()
        except BaseException as e:  # noqa: BLE001
            out = f"raised {type(e).__name__}".encode()
        try:
            os.write(w, out)
        finally:
            os._exit(0)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    got = os.read(r, 1000)
    os.close(r)
    assert status == 0, status
    return got


def test_a_forked_childs_calls_are_refused_before_they_touch_the_parents_staging_area_or_threads(daemon):
    """A DataLoader worker calling the client it inherited: ``put`` (which would copy into
    the parent's staging area first), ``put_async`` and ``get_async`` (whose threads the
    child does not have) raise ``InvalidArgument`` at once; the staging area holds the
    parent's bytes still; the child's ``close()`` waits on none of the parent's futures."""
    with daemon.client("forked") as c:
        h = c.put(torch.full((256,), 3.0), key="k")
        c.get(h)  # the staging area holds these bytes now
        off, _ = c._staging
        before = bytes(c._arena[off:off + 1024])
        c.get_async(h).result()  # (the parent's executor exists: the child inherits its threads' objects)

        def child():
            out = []
            for name, call in (("put", lambda: c.put(torch.full((256,), 666.0), key="child")),
                               ("put_async", lambda: c.put_async(torch.full((256,), 666.0))),
                               ("get_async", lambda: c.get_async(h))):
                try:
                    call()
                    out.append(f"{name}: no error")
                except InvalidArgument as e:
                    out.append(f"{name}: refused" if "forked" in str(e) else f"{name}: other message")
            t0 = time.monotonic()
            c.close()
            out.append(f"close {time.monotonic() - t0 < 5}")
            return ";".join(out).encode()
        got = _in_child(child).decode()
        assert got == "put: refused;put_async: refused;get_async: refused;close True", got
        assert bytes(c._arena[off:off + 1024]) == before
        assert c.lookup("child") is None
        for _ in range(5):
            assert torch.equal(c.get(h), torch.full((256,), 3.0))
            assert torch.equal(c.put_async(torch.ones(4)).result(timeout=30) and c.get(c.lookup("k")),
                               torch.full((256,), 3.0))


_TRAINER = textwrap.dedent("""
    import os, sys, time, torch
    from tierstore.client import Client
    c = Client.connect(sys.argv[1], namespace="job", prefault=False)
    h = c.put(torch.zeros(1 << 16), key="opt/m")
    c.put(torch.zeros(1 << 16), key="acts", ephemeral=True)
    lease = c.checkout(h, "rw")
    if os.fork() == 0:  # a helper that never touches the client, and outlives the trainer
        time.sleep(60)
        os._exit(0)
    print("ready", flush=True)
    time.sleep(3600)
""")


def test_a_forked_helper_does_not_keep_its_dead_parents_session(daemon):
    """The trainer is killed while a helper it forked lives on: the daemon sees the
    trainer's connection end (the helper closed its copy of the socket at the fork), so its
    lease and its ephemeral object go, and a restarted rank checks the object out."""
    p = subprocess.Popen([sys.executable, "-c", _TRAINER, daemon.socket], stdout=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
        with daemon.client("job") as c:
            deadline = time.monotonic() + 20
            while c.stat()["leases"] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert c.stat()["leases"] == 0 and c.keys() == ["opt/m"]
            with c.checkout(c.lookup("opt/m"), "rw", timeout_s=5):
                pass
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _waiting(call):
    """``call`` on a thread of its own, blocked in it by the time this returns (its request
    is in); the thread and the list its error goes to."""
    errors = []

    def run():
        try:
            call()
        except Exception as e:  # noqa: BLE001
            errors.append(e)
    th = threading.Thread(target=run)
    th.start()
    time.sleep(0.5)
    return th, errors


def _interrupt_after(seconds):
    threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT)).start()


@pytest.mark.parametrize("call", ["checkout", "checkout_many", "staged get"])
def test_ctrl_c_during_a_granting_call_gives_the_connection_up_and_the_daemon_takes_back_what_it_granted(
        daemon_factory, call):
    """Ctrl-C while a call waits for another holder's lease: the answer that would grant a
    lease (or copy bytes into the staging area) can no longer be read, so the client gives
    its connection up and says so (``Closed``) on every later call; the daemon takes back
    whatever it granted with the session — no lease stays, the other holder and others
    check the object out — and a late copy into the old staging area reaches nothing."""
    d = daemon_factory("--lease-wait-s", "10")
    a, b = d.client("job"), d.client("job")
    try:
        small = call == "staged get"
        h = a.put(torch.full((256 if small else 1 << 16,), 7.0), key="x")
        a.get(h)  # (the staging area exists)
        held = b.checkout(h, "rw")
        _interrupt_after(0.5)
        with pytest.raises(KeyboardInterrupt):
            if call == "checkout":
                a.checkout(h, "rw", timeout_s=8)
            elif call == "checkout_many":
                a.checkout_many([h], "rw", timeout_s=8)
            else:
                a.get(h)
        held.release()
        with pytest.raises(Closed, match="interrupted"):
            a.put(torch.ones(4))
        with pytest.raises(Closed, match="interrupted"):
            a.ping()
        deadline = time.monotonic() + 20
        while (b.stat()["leases"] or len(b.stat()["sessions"]) > 1) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert b.stat()["leases"] == 0
        with b.checkout(h, "rw", timeout_s=5) as t:
            t.fill_(1.0)
        c = d.client("job")
        y = c.put(torch.full((256,), 2.0), key="y")
        assert torch.equal(c.get(y), torch.full((256,), 2.0))
        c.close()
    finally:
        a.close()
        b.close()


def _view_of_a_client_never_closed(sock):
    c = Client.connect(sock, namespace="job", prefault=False)
    h = c.put(torch.zeros(1 << 16), key="mine")
    return c.checkout(h, "rw").tensor  # the client goes with this frame


def test_a_view_whose_client_was_collected_without_close_cannot_write_the_pool(daemon):
    view = _view_of_a_client_never_closed(daemon.socket)
    gc.collect()
    with daemon.client("job") as c:
        deadline = time.monotonic() + 20
        while c.stat()["leases"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.stat()["leases"] == 0
        c.free(c.lookup("mine"))  # its block is free: the next puts take it
        others = [c.put(torch.ones(1 << 16), key=f"other{i}") for i in range(8)]
        view.fill_(-1.0)
        for h in others:
            assert torch.equal(c.get(h), torch.ones(1 << 16))


def test_futures_of_pipelined_puts_complete_under_a_timeout_and_calls_after_close_say_closed(daemon):
    c = daemon.client("job")
    futs = [c.put_async(torch.full((4,), float(i))) for i in range(8)]
    handles = [f.result(timeout=30) for f in futs]
    assert [float(c.get(h)[0]) for h in handles] == [float(i) for i in range(8)]
    import concurrent.futures

    futs = [c.put_async(torch.ones(4)) for _ in range(4)]
    time.sleep(0.5)
    assert futs[-1].exception(timeout=30) is None
    done, _ = concurrent.futures.wait(futs, timeout=30)
    assert len(done) == 4
    c.close()
    for call in (lambda: c.put_async(torch.ones(4)), lambda: c.put(torch.ones(4)), lambda: c.get(handles[0]),
                 lambda: c.get_async(handles[0])):
        with pytest.raises(Closed):
            call()


def test_a_get_into_a_tensor_autograd_saved_is_seen_by_backward(daemon):
    with daemon.client("job") as c:
        h = c.put(torch.full((4,), 10.0))
        x = torch.ones(4, requires_grad=True)
        w = torch.full((4,), 2.0)
        loss = (w * x).sum()  # saves w
        c.get(h, out=w)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
        p = torch.nn.Parameter(torch.zeros(4))
        with pytest.raises(InvalidArgument, match="requires grad"):
            c.get(h, out=p)
        with torch.no_grad():
            c.get(h, out=p)
        assert torch.equal(p.detach(), torch.full((4,), 10.0))


_RANK = textwrap.dedent("""
    import sys
    from tierstore.client import Client
    c = Client.connect(sys.argv[1], namespace="job", autostart=True, timeout_s=60, prefault=False)
    print(c.stat()["pid"], flush=True)
    c.close()
""")


def test_ranks_that_autostart_a_daemon_at_once_all_connect_to_one(tmp_path):
    sock = str(tmp_path / "run" / "ts.sock")
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path / "data"), "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "TIERSTORE_HOST_BYTES": "32MiB", "TIERSTORE_NVME_BYTES": "256MiB"}
    ranks = [subprocess.Popen([sys.executable, "-c", _RANK, sock], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    outs = [r.communicate(timeout=120) for r in ranks]
    pids = {out.strip() for out, _ in outs}
    try:
        assert all(r.returncode == 0 for r in ranks), [err[-500:] for _, err in outs]
        assert len(pids) == 1, pids
    finally:
        for pid in pids:
            if pid.isdigit():
                os.kill(int(pid), signal.SIGTERM)


def test_a_durable_object_replaced_while_its_write_back_runs_leaves_nothing_behind(daemon):
    """One connection updates a durable object in place (``rw`` check-outs, each check-in
    written back) while another replaces its key over and over: every replaced version
    goes — freeing the key leaves the namespace empty, before and after a restart."""
    a, b = daemon.client("job"), daemon.client("job")
    a.put(torch.zeros(4), key="state", durable=True)
    stop = threading.Event()
    errors = []

    def updates():
        while not stop.is_set():
            h = a.lookup("state")
            try:
                with a.checkout(h, "rw", timeout_s=5) as t:
                    t.add_(1.0)
            except Exception as e:  # (a version replaced between the lookup and the check-out)
                if type(e).__name__ not in ("StaleHandle", "NotFound"):
                    errors.append(e)
    th = threading.Thread(target=updates)
    th.start()
    try:
        for i in range(400):
            b.put(torch.full((4,), float(i)), key="state", durable=True, replace=True)
    finally:
        stop.set()
        th.join()
    assert not errors, errors[:3]
    b.free(b.lookup("state"))
    deadline = time.monotonic() + 20
    while b.stat()["namespaces"].get("job", {}).get("objects") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not b.stat()["namespaces"].get("job", {}).get("objects"), b.stat()["namespaces"]
    a.close()
    b.close()


def test_ctrl_c_gives_the_connection_up_even_while_another_thread_reads_it(daemon_factory):
    """Another thread of the client is blocked on the same connection (waiting for a lease)
    when Ctrl-C gives it up: that thread is woken (its call fails, ``Closed``), and the
    session ends at once — its lease and its ephemeral object go."""
    d = daemon_factory("--lease-wait-s", "30")
    a, b = d.client("job"), d.client("job")
    try:
        x = b.put(torch.zeros(1 << 16), key="x")
        y = b.put(torch.zeros(1 << 16), key="y")
        a.put(torch.ones(4), key="eph", ephemeral=True)
        mine = a.checkout(a.lookup("x") and x, "r")
        held = b.checkout(y, "rw")
        th, errors = _waiting(lambda: a.checkout(y, "rw", timeout_s=25))
        _interrupt_after(0.5)
        with pytest.raises(KeyboardInterrupt):
            a.checkout(y, "rw", timeout_s=20)
        th.join(timeout=20)
        assert not th.is_alive() and errors and isinstance(errors[0], Closed), errors
        deadline = time.monotonic() + 10
        while b.lookup("eph") is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert b.lookup("eph") is None
        held.release()
        with b.checkout(x, "rw", timeout_s=5):
            pass
        del mine
    finally:
        a.close()
        b.close()


def test_after_a_ctrl_c_views_keep_what_was_written_through_them(daemon_factory):
    """The abandon turned the mappings private once; ``close()`` does not turn them private
    again (which would drop what the program wrote through its views since)."""
    d = daemon_factory("--lease-wait-s", "10")
    a, b = d.client("job"), d.client("job")
    h = a.put(torch.zeros(1024), key="v")
    lease = a.checkout(h, "rw")
    other = b.put(torch.zeros(4), key="o")
    held = b.checkout(other, "rw")
    _interrupt_after(0.3)
    with pytest.raises(KeyboardInterrupt):
        a.checkout(other, "rw", timeout_s=8)
    lease.tensor.fill_(5.0)
    a.close()
    assert float(lease.tensor[0]) == 5.0
    held.release()
    b.close()


def test_a_collected_clients_pipelined_puts_complete(daemon):
    def puts():
        c = Client.connect(daemon.socket, namespace="job", prefault=False)
        return [c.put_async(torch.full((4,), float(i)), key=f"p{i}") for i in range(32)]
    futs = puts()
    gc.collect()
    assert [f.exception(timeout=30) for f in futs] == [None] * 32
    with daemon.client("job") as c:
        assert sorted(c.keys()) == sorted(f"p{i}" for i in range(32))


def test_a_future_polled_with_a_zero_timeout_completes(daemon):
    import concurrent.futures

    with daemon.client("job") as c:
        fut = c.put_async(torch.ones(4))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                fut.result(timeout=0)
                break
            except concurrent.futures.TimeoutError:
                pass
        assert fut.done()


def test_get_async_into_a_parameter_under_no_grad_runs_as_get_does(daemon):
    with daemon.client("job") as c:
        h = c.put(torch.full((4,), 3.0))
        p = torch.nn.Parameter(torch.zeros(4))
        with torch.no_grad():
            c.get_async(h, out=p).result(timeout=30)
        assert torch.equal(p.detach(), torch.full((4,), 3.0))
        with pytest.raises(InvalidArgument, match="requires grad"):
            c.get_async(h, out=p).result(timeout=30)


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
                                  "float4_e2m1fn_x2", "uint16", "uint32", "uint64", "complex32", "bool"])
def test_every_torch_dtype_the_store_takes_goes_through_the_daemon(daemon, name):
    """What the in-process store takes, a daemon takes too, bit for bit."""
    dtype = getattr(torch, name, None)
    if dtype is None:
        pytest.skip(f"this torch has no {name}")
    raw = torch.arange(64, dtype=torch.uint8).repeat(4)
    t = raw.view(dtype) if dtype.itemsize == 1 else torch.arange(32, dtype=torch.int64).to(torch.uint8).repeat(8).view(dtype)
    with daemon.client("dtypes") as c:
        got = c.get(c.put(t))
        assert got.dtype == t.dtype and got.shape == t.shape
        assert torch.equal(got.view(torch.uint8), t.view(torch.uint8))


def test_close_wakes_a_thread_blocked_on_the_same_client(daemon_factory):
    """``close()`` while another thread of the client waits for a lease: that thread gets
    ``Closed`` (not a lost-daemon error, and not only once the daemon happens to answer),
    and the session ends."""
    d = daemon_factory("--lease-wait-s", "60")
    a, b = d.client("job"), d.client("job")
    h = b.put(torch.zeros(16), key="x")
    held = b.checkout(h, "rw")
    th, errors = _waiting(lambda: a.checkout(h, "rw", timeout_s=50))
    a.close()
    th.join(timeout=30)
    assert not th.is_alive() and len(errors) == 1 and isinstance(errors[0], Closed), errors
    deadline = time.monotonic() + 10
    while len(b.stat()["sessions"]) > 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(b.stat()["sessions"]) == 1
    held.release()
    b.close()
