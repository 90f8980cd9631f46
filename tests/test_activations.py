"""Activation offload: saved tensors go to the pool in forward and come back in backward,
bit for bit (loss and every gradient compared with torch.equal)."""

import contextlib
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch
from conftest import poll_until
from torch import nn
from torch.utils.checkpoint import checkpoint

from tierstore.client.torch import offload_activations, offload_optimizer, offload_parameters
from tierstore.client.activations import _Kept

D, HEADS, T = 64, 4, 64


class Block(nn.Module):
    """A GPT block with separate q/k/v projections (the same input saved three times)."""

    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.f1, self.f2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        b, t, d = x.shape
        y = self.ln1(x)
        q, k, v = (m(y).view(b, t, HEADS, d // HEADS).transpose(1, 2) for m in (self.q, self.k, self.v))
        a = (q @ k.transpose(-1, -2)) / (d // HEADS) ** 0.5
        a = a.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        a = nn.functional.dropout(a, 0.1)  # a bool mask saved, and the RNG must line up
        x = x + self.o((a @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.f2(nn.functional.gelu(self.f1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, layers=2, ckpt=False):
        super().__init__()
        self.emb = nn.Embedding(50, D)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Linear(D, 50)
        self.ckpt = ckpt

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False) if self.ckpt else b(x)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), idx.roll(-1, 1).flatten())


def _model(seed=0, **kw):
    torch.manual_seed(seed)
    return GPT(**kw)


def _batch(step, b=2):
    return torch.randint(0, 50, (b, T), generator=torch.Generator().manual_seed(step))


def _step(model, idx, acts=None, seed=7):
    torch.manual_seed(seed)  # dropout draws the same masks in both runs
    with acts if acts is not None else contextlib.nullcontext():
        loss = model(idx)
    loss.backward()
    return loss.detach()


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _ns_objects(store):
    return sum(n["objects"] for n in store.stat()["namespaces"].values())


def test_training_equals_plain_bit_for_bit_and_frees_every_object(make_store):
    store = make_store()
    plain, off = _model(), _model()
    opt_p = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    opt_o = torch.optim.AdamW(off.parameters(), lr=1e-2)
    acts = offload_activations(store, min_bytes=4096, prefetch_bytes=256 << 10)
    for step in range(3):
        lp = _step(plain, _batch(step))
        lo = _step(off, _batch(step), acts)
        assert torch.equal(lp, lo) and _same(_grads(plain), _grads(off)), f"step {step} differs"
        opt_p.step(), opt_o.step()
        opt_p.zero_grad(), opt_o.zero_grad()
        assert acts.flush(timeout_s=60) and _ns_objects(store) == 0  # each object went as backward used it
    st = acts.snapshot()
    assert st["offloaded"] > 0 and st["fetched_bytes"] > 0 and st["bytes_in_flight"] == 0 and st["held_bytes"] == 0
    assert st["kept"] > 0  # parameters and small tensors stayed
    assert st["deduped"] >= 2 * 2 * 3  # ln1's output saved by q, k and v: one object, per block and step
    assert st["peak_bytes_in_flight"] > 0
    # the last saved, read first, stayed here (puts not started are cancelled at the forward's end)
    # or were fetched from then on, the rest ahead of backward: nothing fetched on demand
    assert st["misses"] == 0 and st["hits"] > 0
    acts.close()
    assert _same(list(plain.parameters()), list(off.parameters()))


class Save(torch.autograd.Function):
    """Saves ``keep`` (any dtype, any view) for backward and hands back what it got there."""

    seen = []

    @staticmethod
    def forward(ctx, x, keep):
        ctx.save_for_backward(keep)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        (keep,) = ctx.saved_tensors
        Save.seen.append(keep)
        return g * 2, None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.bool,
                                   torch.int64, torch.int32, torch.uint8, torch.complex64])
def test_dtypes_views_and_strides_come_back_exactly(make_store, dtype):
    store = make_store()
    acts = offload_activations(store, min_bytes=1, prefetch_bytes=0)
    def base():  # a storage of its own per case: each is its own object, no sharing
        return (torch.randn(40, 70) * 100).to(dtype) if dtype != torch.bool else torch.randn(40, 70) > 0
    cases = {"whole": base(), "transposed": base().t(), "slice": base()[3:17, 5:61], "step": base()[::3, 1::2],
             "expanded": base()[7].unsqueeze(0).expand(9, 70), "offset_row": base()[39],
             "scalar_like": base()[5:6, 9:10]}
    Save.seen = []
    x = torch.randn(3, requires_grad=True)
    with acts:
        outs = [Save.apply(x, v) for v in cases.values()]
    refs = [(v.clone(), v.size(), v.stride(), v.data_ptr() % 64) for v in cases.values()]
    assert acts.flush(timeout_s=60)  # every put done: backward reads the pool
    sum(o.sum() for o in outs).backward()
    got = list(reversed(Save.seen))
    assert acts.stats.offloaded == len(cases) and acts.stats.cancelled == 0
    for (name, _), (ref, size, stride, align), g in zip(cases.items(), refs, got):
        assert g.dtype == dtype and g.size() == size and g.stride() == stride, name
        assert torch.equal(g, ref), name
        assert g.data_ptr() % 64 == align, name  # same alignment: vector kernels split the same way
    acts.close()
    assert _ns_objects(store) == len(cases)  # the tensors backward handed out still read the pool
    del got, g
    Save.seen = []
    assert _ns_objects(store) == 0  # gone with them


def test_the_same_storage_saved_twice_is_put_once(make_store):
    store = make_store()
    acts = offload_activations(store, min_bytes=1, prefetch_bytes=0)
    x = torch.randn(64, 64, requires_grad=True)
    with acts:
        h = x * 3  # one tensor
        y = Save.apply(Save.apply(x, h), h) + Save.apply(x, h[2:30])  # twice itself, once a view inside it
    assert acts.flush(timeout_s=60)
    assert acts.stats.offloaded == 1 and acts.stats.deduped == 2
    Save.seen = []
    y.sum().backward()
    assert torch.equal(Save.seen[0], h[2:30].detach()) and all(torch.equal(s, h.detach()) for s in Save.seen[1:])
    acts.close()


def test_views_of_one_output_share_its_object(make_store):
    """q, k and v of one fused QKV projection: one object for the three (their base's bytes)."""
    store = make_store()
    acts = offload_activations(store, min_bytes=1, prefetch_bytes=0)
    x = torch.randn(2, 64, 3 * 32, requires_grad=True)
    with acts:
        qkv = x * 1
        q, k, v = qkv.view(2, 64, 3, 2, 16).permute(2, 0, 3, 1, 4)
        y = Save.apply(Save.apply(Save.apply(x, q), k), v)
    assert acts.flush(timeout_s=60)
    assert acts.stats.offloaded == 1 and acts.stats.deduped == 2
    Save.seen = []
    y.sum().backward()
    assert [torch.equal(a, b.detach()) and a.stride() == b.stride() for a, b in zip(Save.seen, (v, k, q))] == [True] * 3
    acts.close()


def test_small_tensors_and_parameters_stay_where_they_are(make_store):
    store = make_store()
    acts = offload_activations(store, min_bytes=64 << 10, prefetch_bytes=0)
    lin = nn.Linear(256, 256)  # a 256 KiB weight: above min_bytes, kept for being a parameter
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(acts._pack(t)) or t, lambda t: t):
        lin(torch.randn(4, 256, requires_grad=True) * 1).sum()  # a 4 KiB input: kept for being small
        big = torch.randn(1024, 512, requires_grad=True) * 1
        (big * big).sum()
    kept = [p.t for p in packed if isinstance(p, _Kept)]
    assert any(p.data_ptr() == lin.weight.data_ptr() for p in kept)  # the parameter (or a view): no object
    assert acts.stats.kept >= 2 and acts.stats.saved == len(packed)
    # only the 2 MiB activation went (saved twice, as both factors: one object)
    assert sum(not isinstance(p, _Kept) for p in packed) == 2 and acts.stats.deduped == 1
    del packed
    acts.close()
    assert _ns_objects(store) == 0


def test_retain_graph_and_double_backward(make_store):
    store = make_store()

    def run(acts):
        torch.manual_seed(0)
        w = torch.randn(32, 32, requires_grad=True)
        x = torch.randn(16, 32)
        if acts:
            with acts:
                y = torch.tanh(x @ w).sin().sum()
        else:
            y = torch.tanh(x @ w).sin().sum()
        (g,) = torch.autograd.grad(y, w, create_graph=True, retain_graph=True)
        y.backward(retain_graph=True)
        g.square().sum().backward(retain_graph=True)  # through the saved tensors again, as a graph
        y.backward()  # a third pass over the same saved tensors
        return w.grad
    acts = offload_activations(store, min_bytes=1, prefetch_bytes=0)
    assert torch.equal(run(None), run(acts))
    assert acts.stats.misses + acts.stats.hits >= 6
    acts.close()
    assert _ns_objects(store) == 0


def test_with_activation_checkpointing_only_the_kept_inputs_go(make_store):
    store = make_store()
    plain, ck, both = _model(ckpt=False), _model(ckpt=True), _model(ckpt=True)
    a_all = offload_activations(store, min_bytes=4096, prefetch_bytes=64 << 10)
    a_ck = offload_activations(store, min_bytes=4096, prefetch_bytes=64 << 10)
    lp, lc = _step(plain, _batch(0), a_all), _step(ck, _batch(0))
    lb = _step(both, _batch(0), a_ck)
    assert torch.equal(lp, lc) and torch.equal(lc, lb)
    assert _same(_grads(ck), _grads(both)) and _same(_grads(plain), _grads(both))
    # checkpointing keeps each block's input (one per block): that is all that was offered
    assert a_ck.stats.saved < a_all.stats.saved / 4
    assert a_ck.stats.offloaded + a_ck.stats.cancelled >= 1
    a_all.close(), a_ck.close()


def test_with_gradient_accumulation_and_optimizer_and_parameter_offload(make_store):
    store = make_store(host_bytes="64MiB")
    plain, off = _model(ckpt=True), _model(ckpt=True)
    opt_p = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    undo = offload_parameters(off, store, prefix="p")
    opt_o = offload_optimizer(torch.optim.AdamW(off.parameters(), lr=1e-2), store, tier="nvme", prefix="o")
    acts = offload_activations(store, min_bytes=1024, prefetch_bytes=64 << 10)
    for step in range(2):
        for micro in range(3):
            lp = _step(plain, _batch(10 * step + micro), seed=micro)
            lo = _step(off, _batch(10 * step + micro), acts, seed=micro)
            assert torch.equal(lp, lo)
        undo.materialize()
        assert _same(_grads(plain), _grads(off))
        opt_p.step(), opt_o.step()
        opt_p.zero_grad(), opt_o.zero_grad()
        undo.writeback()
    undo()
    assert _same(list(plain.parameters()), list(off.parameters()))
    assert acts.stats.offloaded > 0
    acts.close()


def test_backward_reads_the_pool_in_place_and_each_object_goes_after_its_check_in(make_store):
    store = make_store()
    plain, off = _model(), _model()
    acts = offload_activations(store, min_bytes=4096, prefetch_bytes=256 << 10)
    for step in range(2):
        lp, lo = _step(plain, _batch(step)), _step(off, _batch(step), acts)
        assert torch.equal(lp, lo) and _same(_grads(plain), _grads(off))
        assert acts.flush(timeout_s=60)
        assert _ns_objects(store) == 0 and store.stat()["leases"] == 0
    assert acts.stats.read_in_place > 0 and acts.stats.put_errors == 0
    acts.close()


def test_an_in_place_read_held_past_backward_keeps_its_object_until_it_goes(make_store):
    """A tensor backward got from the pool (kept by the caller here) stays valid; its
    object is checked in and freed once the tensor goes."""
    store = make_store()
    Save.seen.clear()
    acts = offload_activations(store, min_bytes=1, prefetch_bytes=0)
    keep = torch.arange(1 << 16, dtype=torch.float32)
    x = torch.ones(4, requires_grad=True)
    with acts:
        y = Save.apply(x, keep * 1)  # a fresh tensor: it goes to the pool
    assert acts.flush(timeout_s=60)  # put before backward asks for it
    y.sum().backward()
    assert acts.stats.read_in_place == 1
    assert acts.flush(timeout_s=60)
    assert store.stat()["leases"] == 1 and _ns_objects(store) == 1  # the tensor kept still reads the pool
    assert torch.equal(Save.seen[0], keep)
    Save.seen.clear()
    assert acts.flush(timeout_s=60)
    assert store.stat()["leases"] == 0 and _ns_objects(store) == 0
    acts.close()


class WritesSaved(torch.autograd.Function):
    """A backward that overwrites the tensor it saved (allowed: nothing reads it after)."""

    @staticmethod
    def forward(ctx, x):
        y = x.exp()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return y.mul_(g)


def test_a_backward_that_writes_what_it_saved_through_a_daemon(daemon):
    """An in-place read is a writable check-out: a write through it changes the pool's
    copy, which is freed next; the process goes on and the gradient is right."""
    torch.manual_seed(0)
    x0 = torch.randn(1 << 16)
    x = x0.clone().requires_grad_()
    WritesSaved.apply(x).sum().backward()
    with daemon.client("writes") as c:
        acts = offload_activations(c, min_bytes=1, prefetch_bytes=0)
        x2 = x0.clone().requires_grad_()
        with acts:
            y = WritesSaved.apply(x2)
        assert acts.flush(timeout_s=60)
        y.sum().backward()
        assert acts.stats.read_in_place == 1 and torch.equal(x.grad, x2.grad)
        del y
        x2.grad = None  # the gradient was the saved tensor itself: it held the pool's memory
        assert acts.flush(timeout_s=60)
        acts.close()
        assert c.stat()["leases"] == 0 and c.stat()["namespaces"].get("writes", {}).get("objects", 0) == 0


def test_a_full_host_tier_sends_activations_to_nvme(make_store):
    store = make_store(host_bytes="4MiB")
    plain, off = _model(), _model()
    acts = offload_activations(store, min_bytes=4096, inflight_bytes=1 << 20, prefetch_bytes=1 << 20)
    for step in range(2):
        lp, lo = _step(plain, _batch(step, 8)), _step(off, _batch(step, 8), acts)
        assert torch.equal(lp, lo) and _same(_grads(plain), _grads(off))
    assert acts.stats.peak_bytes_in_flight > 4 << 20  # more than the host tier holds
    assert store.stat()["tiers"]["nvme"]["bytes_written"] > 0
    assert acts.flush(timeout_s=60) and acts.stats.put_errors == 0 and _ns_objects(store) == 0
    acts.close()


def test_forward_waits_when_puts_fall_behind(make_store):
    """inflight_bytes bounds what waits in memory for a put."""
    store = make_store()
    acts = offload_activations(store, min_bytes=1, inflight_bytes=1 << 20, threads=1)
    x = torch.randn(256, 1024, requires_grad=True)  # 1 MiB per saved tensor
    with acts:
        y = x
        for _ in range(12):
            y = torch.sin(y)  # saves its input
    assert acts.stats.peak_held_bytes <= 2 * (1 << 20) + 4096
    y.sum().backward()
    acts.close()


def test_through_a_daemon_and_stat_and_metrics_show_bytes_in_flight(daemon_factory):
    from test_metrics import _scrape

    daemon = daemon_factory("--metrics-port", "0")
    with daemon.client("acts") as c:
        plain, off = _model(), _model()
        acts = offload_activations(c, min_bytes=4096, prefetch_bytes=256 << 10)
        lp = _step(plain, _batch(0))
        torch.manual_seed(7)
        with acts:
            lo = off(_batch(0))
        assert acts.flush(timeout_s=120)  # the puts finish in the background
        acts._report(force=True)  # stat shows them once the report after them is in
        st = c.stat()
        a = st["activations"]
        assert a["clients"] == 1 and "backward_stall_s" in a and a["peak_bytes_in_flight"] >= 0
        assert st["namespaces"].get("acts", {}).get("objects", 0) > 0
        m = _scrape(st["metrics_port"])
        assert m["tierstore_activation_bytes_in_flight"] == a["bytes_in_flight"]
        assert m["tierstore_activation_backward_stall_seconds"] == a["backward_stall_s"]
        lo.backward()
        assert torch.equal(lp, lo.detach()) and _same(_grads(plain), _grads(off))
        assert acts.stats.read_in_place > 0  # backward read the arena through check-outs
        acts.close()  # reports the last counters
        a = c.stat()["activations"]
        assert a["bytes_in_flight"] == 0 and a["peak_bytes_in_flight"] > 0 and a["offloaded_bytes"] > 0
        assert c.stat()["namespaces"].get("acts", {}).get("objects", 0) == 0
        assert c.stat()["leases"] == 0  # every in-place read checked back in
        from tierstore.client.cli.statview import render

        assert "activations (1 clients): in flight" in render(c.stat())


_DIE = r"""
import sys, torch
sys.path.insert(0, sys.argv[2])
from test_activations import _model, _batch
from tierstore.client import Client
from tierstore.client.torch import offload_activations
c = Client.connect(socket=sys.argv[1], namespace="dies")
acts = offload_activations(c, min_bytes=4096, prefetch_bytes=256 << 10)
with acts:
    loss = _model()(_batch(0))
assert acts.flush(timeout_s=60)
print(acts.snapshot()["offloaded"], flush=True)
sys.stdin.read()  # killed here, between forward and backward
"""


def test_a_process_that_dies_takes_its_activations_with_it(daemon):
    p = subprocess.Popen([sys.executable, "-c", _DIE, daemon.socket, os.path.dirname(__file__)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert int(p.stdout.readline()) > 0
        with daemon.client("dies") as c:
            assert c.stat()["namespaces"]["dies"]["objects"] > 0
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=60)
            # a closed connection's ephemeral objects go asynchronously
            poll_until(lambda: not c.stat()["namespaces"].get("dies", {}).get("objects", 0),
                       "the dead connection's ephemeral objects go")
    finally:
        p.kill()
        p.wait()


def test_fsdp2_under_torchrun(daemon):
    script = os.path.join(os.path.dirname(__file__), "dist_activations.py")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        script, daemon.socket, "act-job"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    for rank in (0, 1):
        assert f"rank {rank} fsdp2 activations ok" in r.stdout


def test_close_between_forward_and_backward_leaves_backward_to_fetch_on_demand(make_store):
    """A closed offload keeps serving the graphs still alive: backward fetches what is in
    the pool itself (no worker is left to prefetch), equal to plain, and frees it all."""
    store = make_store()
    plain, off = _model(), _model()
    lp = _step(plain, _batch(0))
    acts = offload_activations(store, min_bytes=4096, prefetch_bytes=64 << 10)
    torch.manual_seed(7)
    with acts:
        lo = off(_batch(0))
    assert acts.flush(timeout_s=60)
    acts.close()
    done = []
    t = threading.Thread(target=lambda: done.append(lo.backward()), daemon=True)
    t.start()
    t.join(120)
    assert done, "backward after close() did not finish"
    assert torch.equal(lp, lo.detach()) and _same(_grads(plain), _grads(off))
    assert acts.stats.misses > 0 and _ns_objects(store) == 0


@pytest.mark.parametrize("when", ["queued", "in_pool", "kept"])
def test_a_saved_tensor_changed_in_place_after_forward_raises_autograds_error(make_store, when):
    """Autograd leaves the saved tensors' version check to the hooks while they are
    active: the offload makes it, for tensors in the pool, not yet put, and kept."""
    store = make_store()
    # (no prefetch window: the end of the forward does not keep the last puts back)
    acts = offload_activations(store, min_bytes=4096 if when != "kept" else 1 << 30, prefetch_bytes=0)
    x = torch.randn(256, 1024, requires_grad=True)
    with acts:
        h = x * 2
        y = torch.sin(h)  # saves h
    if when == "in_pool":
        assert acts.flush(timeout_s=60) and acts.stats.offloaded >= 1
    h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    del y
    acts.close()
    assert _ns_objects(store) == 0


def test_a_frozen_parameter_and_its_views_stay_where_they_are(make_store):
    """A linear layer over a frozen weight (a LoRA base model) saves the weight's view
    ``W.t()``: a parameter's bytes, held by the model anyway, never go to the pool."""
    store = make_store()
    w = nn.Parameter(torch.randn(1024, 1024), requires_grad=False)
    acts = offload_activations(store, min_bytes=4096)
    x = torch.randn(8, 1024, requires_grad=True)
    with acts:
        y = (x @ w.t()).sum() + nn.functional.linear(x, w).sum()
    y.backward()
    assert acts.flush(timeout_s=60)
    assert acts.stats.offloaded_bytes < (4 << 20) and acts.stats.kept_bytes >= 2 * (4 << 20)
    acts.close()


def test_an_offload_made_for_each_step_goes_with_its_threads(make_store):
    """``with offload_activations(store):`` a step at a time, never closed: each one's
    workers stop once it is gone (they hold it weakly)."""
    import gc
    import weakref

    store = make_store()
    model = _model()
    before = threading.active_count()
    refs = []
    for step in range(6):
        acts = offload_activations(store, min_bytes=4096, prefetch_bytes=0)  # (every save put, read in place)
        refs.append(weakref.ref(acts))
        with acts:
            loss = model(_batch(step))
        loss.backward()
        del acts, loss  # no flush, no close: its last frees and check-ins may still be queued
    gc.collect()
    poll_until(lambda: all(r() is None for r in refs), "each offload goes once its queued jobs have run")
    poll_until(lambda: threading.active_count() <= before + 4, "the dropped offloads' workers stop")
    poll_until(lambda: _ns_objects(store) == 0 and store.stat()["leases"] == 0,
               "every object freed and every in-place read checked in")


def test_graphs_that_never_all_go_keep_the_save_order_short(make_store):
    """A pipeline schedule runs the next micro-batch's forward before the last one's
    backward, so some graph is always alive: what the offload keeps per save stays
    bounded by the saves alive, not by every save so far."""
    store = make_store()
    acts = offload_activations(store, min_bytes=4096)
    model = _model()
    with acts:
        held = model(_batch(0))
    for mb in range(1, 40):
        with acts:
            nxt = model(_batch(mb))
        held.backward()
        held = nxt
    alive = acts._live
    assert alive > 0 and len(acts._order) <= 2 * alive + 64 and len(acts._by_storage) <= 2 * alive + 64
    held.backward()
    assert acts.flush(timeout_s=60) and _ns_objects(store) == 0
    acts.close()


def test_the_module_form_offloads_every_forward_of_the_module_and_close_unhooks_it(make_store):
    store = make_store()
    plain, off = _model(), _model()
    acts = offload_activations(store, off, min_bytes=4096)
    for step in range(2):
        lp = _step(plain, _batch(step))
        torch.manual_seed(7)  # (as _step: the same dropout masks)
        lo = off(_batch(step))  # no `with`: the module enters it
        assert acts.flush(timeout_s=60)  # its saves are in the pool before backward (however busy the machine)
        lo.backward()
        assert torch.equal(lp, lo.detach()) and _same(_grads(plain), _grads(off))
        plain.zero_grad(), off.zero_grad()
    assert acts.stats.offloaded > 0 and acts.flush(timeout_s=60) and _ns_objects(store) == 0
    acts.close()
    n = acts.stats.saved
    _step(off, _batch(3))
    assert acts.stats.saved == n  # unhooked
    with pytest.raises(TypeError):
        acts.wrap("not a module")


def test_arguments_are_checked_with_clear_errors(make_store):
    from tierstore.errors import InvalidArgument

    store = make_store()
    for bad in (None, "/run/tierstore.sock", object()):
        with pytest.raises(TypeError, match="Client or an in-process"):
            offload_activations(bad)
    for kw in ({"threads": 2.0}, {"threads": 0}, {"wait_s": float("nan")}, {"wait_s": -1}, {"min_bytes": -1},
               {"inflight_bytes": 0}, {"prefetch_bytes": True}, {"min_bytes": "lots"}, {"tier": "gpu"}):
        with pytest.raises(InvalidArgument):
            offload_activations(store, **kw)
    acts = offload_activations(store, min_bytes="64KiB", inflight_bytes="32MiB", prefetch_bytes="1MiB")
    assert (acts.min_bytes, acts.inflight_bytes, acts.prefetch_bytes) == (64 << 10, 32 << 20, 1 << 20)
    acts.close()


def test_a_pool_that_goes_away_fails_the_next_forward(make_store):
    """The pool closed under the offload: that forward's tensors stay in memory (its
    backward is right), and the next forward raises the pool's error."""
    from tierstore.errors import Closed

    store = make_store()
    plain, off = _model(), _model()
    acts = offload_activations(store, min_bytes=4096, prefetch_bytes=0)
    store.close()
    lp = _step(plain, _batch(0))
    torch.manual_seed(7)
    with acts:
        lo = off(_batch(0))
    assert acts.flush(timeout_s=60) and acts.stats.put_errors > 0
    lo.backward()
    assert torch.equal(lp, lo.detach()) and _same(_grads(plain), _grads(off))
    with pytest.raises(Closed, match="activation offload stopped"):
        _step(off, _batch(1), acts)
    acts.close()


def test_an_object_an_in_place_read_keeps_counts_as_in_flight_until_it_goes(make_store):
    store = make_store()
    acts = offload_activations(store, min_bytes=4096, prefetch_bytes=0)
    with acts:
        x = torch.randn(1024, 1024, requires_grad=True)
        y = Save.apply(x, x.detach() * 3)
    assert acts.flush(timeout_s=60) and acts.stats.offloaded == 1
    Save.seen.clear()
    y.sum().backward()
    assert acts.flush(timeout_s=60) and len(Save.seen) == 1 and acts.stats.read_in_place == 1
    assert _ns_objects(store) == 1 and acts.stats.bytes_in_flight == 4 << 20  # backward's tensor still over it
    Save.seen.clear()
    poll_until(lambda: acts.flush(timeout_s=1) and _ns_objects(store) == 0, "the object goes with its last tensor")
    assert acts.stats.bytes_in_flight == 0
    acts.close()


def test_two_offloads_on_one_client_are_summed_in_stat(daemon):
    with daemon.client("two") as c:
        a1 = offload_activations(c, min_bytes=4096, prefetch_bytes=0)
        a2 = offload_activations(c, min_bytes=4096, prefetch_bytes=0)
        keep = []
        for acts in (a1, a2):
            with acts:
                x = torch.randn(1024, 1024, requires_grad=True)
                keep.append(torch.sin(x * 2))
            assert acts.flush(timeout_s=60)
            acts._report(force=True)
        poll_until(lambda: c.stat()["activations"]["bytes_in_flight"] == 2 * (4 << 20), "both offloads counted")
        a1.close()  # its totals stay, its bytes in flight no longer
        del keep
        a2.close()
        poll_until(lambda: c.stat()["activations"]["bytes_in_flight"] == 0, "both done")
        assert c.stat()["activations"]["offloaded_bytes"] == a1.stats.offloaded_bytes + a2.stats.offloaded_bytes


def test_a_module_wrapped_per_block_holds_no_more_than_one_window_back(make_store):
    """Each wrapped block's end looks like the end of a forward (its last saves kept in
    memory for backward); the next block's first save sends them to the pool after all."""
    store = make_store()
    blocks = nn.Sequential(*(nn.Sequential(nn.Linear(512, 512), nn.GELU()) for _ in range(8)))
    acts = offload_activations(store, min_bytes=4096, prefetch_bytes=2 << 20)
    for b in blocks:
        acts.wrap(b)
    x = torch.randn(1024, 512, requires_grad=True)  # 2 MiB a saved tensor, 2 saved a block
    y = blocks(x)
    assert acts.flush(timeout_s=60)
    assert acts.stats.held_bytes <= 2 * (2 << 20), acts.stats  # one window (and what it rounds to), not one a block
    y.sum().backward()
    assert acts.flush(timeout_s=60) and _ns_objects(store) == 0
    acts.close()


@pytest.mark.parametrize("window", [0, 128 << 20])
def test_a_change_through_a_detached_alias_never_gives_a_gradient_of_other_bytes(make_store, window):
    """The saved tensor itself gone, a ``detach()`` alias (its storage and version counter)
    changed in place: while the offload still holds the bytes (a put not yet made, or
    kept for backward), the change is caught by that counter (autograd's error); once
    only the pool holds them, backward reads the bytes as saved. Which of the two
    depends on the put's timing; never the gradient of the changed bytes."""
    store = make_store()
    acts = offload_activations(store, min_bytes=4096, prefetch_bytes=window)
    x = torch.randn(256, 1024, requires_grad=True)
    with acts:
        h = x * 2
        hd = h.detach()
        y = torch.sin(h)
    saved = hd.clone()
    del h  # the saved tensor itself is gone; its alias shares its storage and version counter
    hd.add_(1)
    try:
        y.sum().backward()
    except RuntimeError as e:
        assert "modified by an inplace operation" in str(e)
    else:
        assert torch.equal(x.grad, 2 * torch.cos(saved))  # the saved bytes, not the changed ones
    del y
    acts.close()


def test_a_graph_dropped_without_backward_is_freed_with_kept_outputs_in_it(make_store):
    """A small saved output (kept in memory) held as itself would make a reference cycle
    through its node that keeps the whole graph, and its pool objects, alive."""
    import gc

    store = make_store()
    acts = offload_activations(store, min_bytes=64 << 10, prefetch_bytes=0)
    x = torch.randn(256, 1024, requires_grad=True)
    with acts:
        big = torch.sin(x * 2)  # 1 MiB input saved: offloaded
        small = big[:4].exp()  # exp saves its 16 KiB output: kept
    assert acts.flush(timeout_s=60) and acts.stats.offloaded >= 1
    del big, small
    gc.collect()
    poll_until(lambda: acts.flush(timeout_s=1) and _ns_objects(store) == 0, "the dropped graph's objects go")
    acts.close()


def test_finished_offloads_peaks_are_not_added_up_in_stat(daemon):
    with daemon.client("peaks") as c:
        for step in range(4):
            acts = offload_activations(c, min_bytes=4096, prefetch_bytes=0)
            x = torch.randn(1024, 1024, requires_grad=True)
            with acts:
                y = torch.sin(x * 2)
            assert acts.flush(timeout_s=60)
            y.sum().backward()
            assert acts.flush(timeout_s=60)
            peak = acts.stats.peak_bytes_in_flight
            acts.close()
            del acts, y
        poll_until(lambda: c.stat()["activations"]["offloaded_bytes"] == 4 * (4 << 20), "every offload counted")
        assert c.stat()["activations"]["peak_bytes_in_flight"] == peak == 4 << 20
