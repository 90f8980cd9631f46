"""The client's CUDA logic on a CPU host: what it does, and what it never does, where CUDA
calls are replaced by stand-ins that record them (as tests/test_gpu_tier.py does for the
daemon's side). The same paths run against CUDA in tests/test_gpu.py (gpu marker)."""

import contextlib
import os
import threading

import numpy as np
import pytest
import torch

from tierstore.client import gpu as client_gpu


def test_no_cuda_means_pageable_with_a_reason(daemon):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: tests/test_gpu.py covers the pinned path")
    pieces, why = client_gpu.register_host_memory(1 << 20, 1 << 20)
    assert pieces == [] and "no CUDA device" in why
    with daemon.client("cpu") as c:
        assert c.pinned is False and "not page-locked yet" in c.pinned_reason
        assert c.pinned_reason.count("not page-locked yet") == 1  # both mappings' reasons, said once
    assert client_gpu.clear_cuda_error() is False  # no runtime loaded here: said, not raised


class FakeCudart:
    """torch.cuda.cudart() stand-in: records registrations; ``refuse_after`` of them succeed."""

    def __init__(self, refuse_after=None):
        self.registered, self.unregistered, self.refuse_after = [], [], refuse_after

    def cudaHostRegister(self, address, size, flags):
        if self.refuse_after is not None and len(self.registered) >= self.refuse_after:
            return 2  # cudaErrorMemoryAllocation
        self.registered.append((address, size, flags))
        return 0

    def cudaHostUnregister(self, address):
        self.unregistered.append(address)
        return 0


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA 'available' to the client's checks, its runtime calls recorded."""
    rt = FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    return rt


def test_a_refused_registration_clears_the_cuda_error_it_left(fake_cuda, monkeypatch):
    """cudaHostRegister's failure stays the thread's last CUDA error; PyTorch's next kernel
    launch check would raise it. The pageable fallback clears it."""
    cleared = []
    monkeypatch.setattr(client_gpu, "clear_cuda_error", lambda: cleared.append(1) or True)
    fake_cuda.refuse_after = 1
    pieces, why = client_gpu.register_host_memory(1 << 40, 3 << 30)  # three pieces; the second is refused
    assert pieces == [] and "cudaHostRegister failed with error 2" in why and "MEMLOCK" in why
    assert cleared == [1] and fake_cuda.unregistered == [1 << 40]  # the first piece was given back


def test_the_arena_is_page_locked_piece_by_piece_on_first_use(fake_cuda):
    G = client_gpu.REGISTER_CHUNK
    p = client_gpu.ArenaPinning(1 << 40, 3 * G + 4096)
    assert not p.pinned and "not page-locked yet" in p.reason and fake_cuda.registered == []
    assert p.ensure(G - 10, 20)  # straddles pieces 0 and 1
    assert [a for a, _, _ in fake_cuda.registered] == [1 << 40, (1 << 40) + G] and p.pinned
    assert not p.ensure(5, 100)  # already registered: nothing to do, no CUDA call
    assert len(fake_cuda.registered) == 2
    assert p.spans(G - 10, 20) == [(G - 10, 10), (G, 10)]  # a copy never spans two registrations
    assert p.ensure(3 * G, 4096) and fake_cuda.registered[-1][1] == 4096  # the last piece is short
    assert "of %d arena bytes page-locked" % (3 * G + 4096) in p.reason
    fake_cuda.refuse_after = len(fake_cuda.registered)
    assert p.ensure(2 * G, 1) and not p.pinned and "cudaHostRegister failed" in p.reason
    assert not p.ensure(2 * G, 1)  # refused once: no more tries
    p.close()
    assert sorted(fake_cuda.unregistered) == sorted(a for a, _, _ in fake_cuda.registered)
    fake_cuda.refuse_after = None
    ro = client_gpu.ArenaPinning(1 << 41, G, read_only=True)
    assert ro.ensure(0, 1) and fake_cuda.registered[-1][2] == 0x01 | 0x08  # cudaHostRegisterReadOnly


def test_check_out_views_are_page_locked_only_where_cuda_is_already_initialised(fake_cuda, monkeypatch):
    p = client_gpu.ArenaPinning(1 << 40, 1 << 20)
    assert not p.ensure_if_cuda(0, 4096) and fake_cuda.registered == []  # no context: none made for it
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert p.ensure_if_cuda(0, 4096) and len(fake_cuda.registered) == 1


class _Connects(torch.utils.data.Dataset):
    def __init__(self, socket):
        self.socket = socket

    def __len__(self):
        return 2

    def __getitem__(self, i):
        from tierstore.client import Client

        with Client.connect(socket=self.socket, namespace="worker") as c:
            h = c.put(torch.full((1000,), float(i)))
            with c.checkout(h, "r") as v:
                total = float(v.sum())
            got = c.get(h)
            c.free(h)
        return torch.tensor([total, float(got[0]), float(torch.cuda.is_initialized())])


def test_a_forked_dataloader_worker_connects_without_touching_cuda(daemon, monkeypatch):
    """A fork-based DataLoader worker of a process that uses CUDA cannot initialise CUDA
    ("Cannot re-initialize CUDA in forked subprocess"): connecting, putting, checking out
    and getting host tensors there must not try."""
    def forbidden(*a, **k):
        raise RuntimeError("Cannot re-initialize CUDA in forked subprocess")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU host
    for name in ("cudart", "_lazy_init", "init", "current_device", "current_stream", "Stream", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, forbidden)
    loader = torch.utils.data.DataLoader(_Connects(daemon.socket), batch_size=None, num_workers=1,
                                         multiprocessing_context="fork")
    rows = [r.tolist() for r in loader]
    assert rows == [[0.0, 0.0, 0.0], [1000.0, 1.0, 0.0]]  # and CUDA never initialised in the worker


def test_close_waits_for_async_work_and_side_streams_before_unmapping(daemon, monkeypatch):
    events = []
    go = threading.Event()
    with daemon.client("close") as c:
        class Side:
            def synchronize(self):
                events.append("side streams synchronised")

        class Slabs:
            def close(self):
                events.append("slabs closed")
                go.set()
        c._side, c._slabmap = Side(), Slabs()
        monkeypatch.setattr(c._pinning, "close", lambda: events.append("arena unregistered") or go.set())
        real_pool = c._pool()
        real_shutdown = real_pool.shutdown

        def shutdown(wait=True):
            events.append("executor shut down")
            go.set()
            real_shutdown(wait=wait)
        monkeypatch.setattr(real_pool, "shutdown", shutdown)

        def async_work():
            go.wait(30)  # runs until close() begins tearing down
            events.append("async work done")
        fut = real_pool.submit(async_work)
    assert fut.done()
    assert events == ["executor shut down", "async work done", "side streams synchronised", "slabs closed",
                      "arena unregistered"]


def test_put_async_copies_on_the_callers_current_stream(daemon, monkeypatch):
    """The pool thread's own current stream is the default stream; the copy must come after
    the caller's work on its stream, so the call runs under the caller's stream, captured
    on the calling thread."""
    from tierstore.client import client as client_mod
    from tierstore.client import gpu as gpu_mod

    local = threading.local()

    def current_stream(device=None):
        return getattr(local, "stream", f"default stream of {threading.current_thread().name}")

    @contextlib.contextmanager
    def stream(s):
        old = getattr(local, "stream", None)
        local.stream = s
        try:
            yield
        finally:
            local.stream = old
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    marker = torch.zeros(4)
    for mod in (client_mod, gpu_mod):  # the client's choice of path, and the stream runner's
        monkeypatch.setattr(mod, "is_cuda", lambda t: t is marker)
    seen = []
    with daemon.client("async") as c:
        monkeypatch.setattr(c, "put", lambda t, *a, **k: seen.append((threading.current_thread().name,
                                                                     current_stream())))
        monkeypatch.setattr(c, "get", lambda h, out=None, **k: seen.append((threading.current_thread().name,
                                                                            current_stream())))
        with stream("the caller's stream"):
            c.put_async(marker).result()
            c.get_async(1, out=marker).result()
    assert [s for _, s in seen] == ["the caller's stream"] * 2
    assert all(name != threading.current_thread().name for name, _ in seen)  # and it ran on the pool


def test_devices_are_matched_by_uuid_across_cuda_visible_devices():
    from tierstore.client.gpu import DeviceMap
    from tierstore.errors import InvalidArgument, TierstoreError
    from tierstore.gpu import uuid_hex

    a, b, c = ("%032x" % n for n in (1, 2, 3))
    m = DeviceMap({0: a, 1: b, 2: c}, [c, a])  # this process: CUDA_VISIBLE_DEVICES=2,0
    assert m.local(0) == 1 and m.local(2) == 0 and m.daemon(1) == 0 and m.daemon(0) == 2
    with pytest.raises(TierstoreError, match="not visible in this process"):
        m.local(1)
    with pytest.raises(InvalidArgument, match="has no GPU tier"):
        m.daemon(5)
    assert DeviceMap({0: None, 1: None}, [a]).to_local == {0: 0}  # no UUIDs: same numbering, said so
    raw = bytes(range(16))
    assert uuid_hex(raw) == uuid_hex(list(raw)) == uuid_hex("GPU-00010203-0405-0607-0809-0a0b0c0d0e0f") == raw.hex()
    assert uuid_hex("MIG-whatever") is None and uuid_hex(None) is None


def test_no_loaded_cuda_runtime_is_found_on_a_cpu_host():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert client_gpu._loaded_cudart() is None
    assert os.path.exists("/proc/self/maps")
    np.zeros(1)  # (numpy loaded: the maps scan saw real libraries and matched none)
