"""Training hooks: offloaded optimizers and parameters give the plain results."""

import copy
import functools
import os
import signal
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tierstore.client.torch import offload_optimizer, offload_parameters


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 24)
        self.block = nn.Sequential(nn.Linear(24, 33), nn.GELU(), nn.Linear(33, 24))
        self.norm = nn.LayerNorm(24)
        self.head = nn.Linear(24, 50, bias=False)
        self.frozen = nn.Linear(24, 24)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        h = self.emb(x)
        h = h + self.block(h)
        h = self.block(self.norm(h))  # the block runs twice per step
        return self.head(self.frozen(h))


def _batches(step, micro=2):
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randint(0, 50, (4, 7), generator=g) for _ in range(micro)]


def _groups(model):
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if p.dim() <= 1]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 3e-3}]


def _train(model, opt, sched, steps, start=0):
    for step in range(start, steps):
        for x in _batches(step):  # gradient accumulation over 2 micro-batches
            loss = nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()) / 2
            loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)


OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3, amsgrad=True),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2, initial_accumulator_value=0.1),  # state from __init__
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_offloaded_optimizer_equals_plain(make_store, name, tier):
    torch.manual_seed(0)
    plain = Net()
    off = copy.deepcopy(plain)
    opt_p = OPTIMIZERS[name](_groups(plain))
    s = make_store(host_bytes="1MiB")  # smaller than the states: they really spill to NVMe
    opt_o = offload_optimizer(OPTIMIZERS[name](_groups(off)), s, tier=tier, prefix=f"opt-{name}")
    sch_p = torch.optim.lr_scheduler.StepLR(opt_p, step_size=5, gamma=0.5)
    sch_o = torch.optim.lr_scheduler.StepLR(opt_o, step_size=5, gamma=0.5)
    _train(plain, opt_p, sch_p, 21)
    _train(off, opt_o, sch_o, 21)
    for (n, a), b in zip(plain.named_parameters(), off.parameters()):
        assert torch.equal(a, b), n  # bit-exact: the same single-tensor update, same order
    assert opt_o.completed_steps == 21
    assert not any(opt_o.inner.state.values())  # no state left in process memory
    st = s.stat()
    assert st["leases"] == 0 and st["namespaces"]["default"]["objects"] > 0
    # state_dict in the plain optimizer's format, loadable by the plain optimizer
    sd = opt_o.state_dict()
    ref = opt_p.state_dict()
    assert sd["state"].keys() == ref["state"].keys()
    for i in ref["state"]:
        for k, v in ref["state"][i].items():
            assert torch.equal(sd["state"][i][k], v) if isinstance(v, torch.Tensor) else sd["state"][i][k] == v
    assert [g["lr"] for g in sd["param_groups"]] == [g["lr"] for g in ref["param_groups"]]


@pytest.mark.parametrize("bucket_bytes", [0, 4096 * 6, 16 << 20], ids=["one-at-a-time", "small-buckets", "default"])
def test_small_parameters_are_updated_in_buckets(make_store, bucket_bytes):
    """Consecutive small parameters of a group are updated by one call of the wrapped
    optimizer (one check-out list, one check-in), their first step (which makes their state)
    too, with the same results as plain."""
    torch.manual_seed(0)
    plain = Net()
    off = copy.deepcopy(plain)
    opt_p = torch.optim.AdamW(_groups(plain), lr=1e-3)
    inner = torch.optim.AdamW(_groups(off), lr=1e-3)
    calls = []
    step = inner.step
    inner.step = lambda *a, **k: (calls.append(len(inner.param_groups[0]["params"])), step(*a, **k))[1]
    s = make_store(host_bytes="64MiB")
    opt_o = offload_optimizer(inner, s, tier="nvme", prefix="b", bucket_bytes=bucket_bytes)
    sched = [torch.optim.lr_scheduler.StepLR(o, step_size=5, gamma=0.5) for o in (opt_p, opt_o)]
    _train(plain, opt_p, sched[0], 6)
    calls.clear()
    _train(off, opt_o, sched[1], 6)
    n_params = sum(1 for g in _groups(off) for p in g["params"] if p.requires_grad)
    assert sum(calls) == 6 * n_params  # the first step (making the state) is bucketed the same way
    if bucket_bytes == 0:
        assert set(calls) == {1}
    elif bucket_bytes == 4096 * 6:  # two pages per state tensor at most: a few parameters at a time
        assert 1 < max(calls) < n_params
    else:  # each group whole
        assert len(calls) == 6 * len(_groups(off))
    for (n, a), b in zip(plain.named_parameters(), off.parameters()):
        assert torch.equal(a, b), n
    assert s.stat()["leases"] == 0


def test_state_dict_round_trip_both_ways(make_store):
    torch.manual_seed(1)
    a = Net()
    b = copy.deepcopy(a)
    s = make_store()
    opt_a = torch.optim.AdamW(_groups(a), lr=1e-3)
    sch_a = torch.optim.lr_scheduler.StepLR(opt_a, 3)
    _train(a, opt_a, sch_a, 4)
    # plain -> offloaded, then both continue
    opt_b = offload_optimizer(torch.optim.AdamW(_groups(b), lr=1e-3), s, tier="nvme")
    b.load_state_dict(a.state_dict())
    opt_b.load_state_dict(opt_a.state_dict())
    sch_b = torch.optim.lr_scheduler.StepLR(opt_b, 3)
    sch_b.load_state_dict(sch_a.state_dict())
    _train(a, opt_a, sch_a, 8, start=4)
    _train(b, opt_b, sch_b, 8, start=4)
    for x, y in zip(a.parameters(), b.parameters()):
        assert torch.equal(x, y)
    # offloaded -> plain
    c = copy.deepcopy(b)
    opt_c = torch.optim.AdamW(_groups(c), lr=1e-3)
    opt_c.load_state_dict(opt_b.state_dict())
    _train(b, opt_b, sch_b, 10, start=8)
    sch_c = torch.optim.lr_scheduler.StepLR(opt_c, 3)
    sch_c.load_state_dict(sch_b.state_dict())
    sch_c.last_epoch = sch_b.last_epoch - 2
    _train(c, opt_c, sch_c, 10, start=8)
    for x, y in zip(b.parameters(), c.parameters()):
        assert torch.equal(x, y)


@pytest.mark.parametrize("name", ["adamw", "adagrad"])
def test_bf16_parameters_with_fp32_masters(make_store, name):
    """Adagrad makes its state in its constructor, in the parameters' dtype (bf16): it
    is widened to fp32 for the masters (0.25 is exact in bf16; 0.1 would be rounded)."""
    torch.manual_seed(2)
    make = {"adamw": OPTIMIZERS["adamw"],
            "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2, initial_accumulator_value=0.25)}[name]
    ref = Net()
    model = copy.deepcopy(ref).to(torch.bfloat16)
    plain_model = copy.deepcopy(ref).to(torch.bfloat16)
    masters = [p.detach().float().clone().requires_grad_(p.requires_grad) for p in plain_model.parameters()]
    opt_p = make([m for m in masters if m.requires_grad])
    s = make_store()
    opt_o = offload_optimizer(make([p for p in model.parameters() if p.requires_grad]), s)
    for step in range(20):
        x = _batches(step, 1)[0]
        for m, net in ((plain_model, "p"), (model, "o")):
            loss = nn.functional.cross_entropy(m(x).flatten(0, 1).float(), x.flatten())
            loss.backward()
        # plain mixed precision: fp32 masters take the bf16 grads, update, round back
        with torch.no_grad():
            for mst, p in zip(masters, plain_model.parameters()):
                if p.requires_grad:
                    mst.grad = p.grad.float()
        opt_p.step()
        with torch.no_grad():
            for mst, p in zip(masters, plain_model.parameters()):
                p.copy_(mst)
        opt_o.step()
        plain_model.zero_grad(set_to_none=True)
        opt_p.zero_grad(set_to_none=True)
        opt_o.zero_grad(set_to_none=True)
    for a, b in zip(plain_model.parameters(), model.parameters()):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)
    assert any(k.split("@")[0].endswith("/master") for k in s.keys(prefix="opt/"))


def test_parameter_offload_matches_plain_forward_and_grads(make_store):
    torch.manual_seed(3)
    plain = Net()
    plain.head.weight = plain.emb.weight  # tied parameters
    model = copy.deepcopy(plain)
    s = make_store()
    undo = offload_parameters(model, s, tier="host")
    assert all(p.numel() == 0 for p in model.parameters())  # the bytes live in the pool
    x = _batches(0, 1)[0]
    out_p = plain(x)
    out_o = model(x)
    assert torch.equal(out_p, out_o)
    out_p.square().mean().backward()
    out_o.square().mean().backward()
    for (n, a), b in zip(plain.named_parameters(), model.parameters()):
        if a.requires_grad:
            assert torch.equal(a.grad, b.grad), n
        assert b.numel() == 0, n  # released again after backward
    undo()
    for a, b in zip(plain.parameters(), model.parameters()):
        assert torch.equal(a, b)


class Functional(nn.Module):
    """Parameters used outside their own module's forward: a tied output projection
    written as a matmul in the parent, and a frozen submodule's weight through F.linear."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 24)
        self.block = nn.Linear(24, 24)
        self.mix = nn.Linear(24, 24)
        self.mix.requires_grad_(False)

    def forward(self, x):
        h = torch.tanh(self.block(self.emb(x)))
        h = nn.functional.linear(h, self.mix.weight)  # self.mix itself never runs
        return h @ self.emb.weight.T


def _offloaded_twin(make_store, cls, seed):
    """(plain model, its copy with parameters offloaded, the offload handle)."""
    torch.manual_seed(seed)
    plain = cls()
    model = copy.deepcopy(plain)
    return plain, model, offload_parameters(model, make_store())


def test_parameters_used_outside_their_module_are_loaded_on_demand(make_store):
    plain, model, handle = _offloaded_twin(make_store, Functional, 5)
    xs = _batches(0)
    # two forwards, then one backward (accumulation over a summed loss)
    loss_p = sum(plain(x).square().mean() for x in xs)
    loss_o = sum(model(x).square().mean() for x in xs)
    assert torch.equal(loss_p, loss_o)
    with torch.no_grad():  # an evaluation between forward and backward releases nothing the backward needs
        assert torch.equal(plain(xs[0]), model(xs[0]))
    loss_p.backward()
    loss_o.backward()
    for (n, a), b in zip(plain.named_parameters(), model.parameters()):
        if a.requires_grad:
            assert torch.equal(a.grad, b.grad), n
            assert b.numel() == 0, n  # released once its gradient is in
    assert model.mix.weight.numel() > 0  # frozen, loaded on demand: until the next writeback
    handle.writeback()
    assert all(p.numel() == 0 for p in model.parameters())
    with torch.no_grad():
        assert torch.equal(plain(xs[0]), model(xs[0]))
    assert all(p.numel() == 0 for p in model.parameters())  # no backward follows: released at once
    handle()
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())  # hooks and watch gone
    for a, b in zip(plain.parameters(), model.parameters()):
        assert torch.equal(a, b)


class _Region(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.LayerNorm(16)
        self.stem.requires_grad_(False)
        self.lin = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.norm.requires_grad_(False)
        self.scale = nn.Parameter(torch.randn(16) * 0.1)
        self.mix = nn.Linear(16, 16)
        self.mix.requires_grad_(False)

    def forward(self, x):
        h = self.stem(x)  # frozen, on an input that needs no gradient: never has a backward
        h = self.mix(h)
        if self.mix.weight.dim() == 2:  # code that reads a parameter's shape, in the region and its re-run
            h = h + 0.1 * nn.functional.linear(h, self.mix.weight)
        return self.norm(torch.tanh(self.lin(h))) * (1 + self.scale)


class Checkpointed(nn.Module):
    """Activation checkpointing: a region re-run in backward before its modules' backward
    hooks fire (frozen ones among them), and a module checkpointed once per call."""

    def __init__(self):
        super().__init__()
        self.region = _Region()
        self.out = nn.Linear(16, 16)

    def forward(self, x):
        ck = functools.partial(checkpoint, use_reentrant=False)
        h = ck(self.region, ck(self.region, x))  # the second's backward unloads the frozen ones early
        for _ in range(2):
            h = ck(self.out, h)
        return h


def test_parameter_offload_under_activation_checkpointing(make_store):
    plain, model, handle = _offloaded_twin(make_store, Checkpointed, 6)
    opt_p, opt_o = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (plain, model))
    for step in range(3):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
        for m in (plain, model):
            m(x).square().mean().backward()
        handle.materialize()
        for (n, a), b in zip(plain.named_parameters(), model.parameters()):
            assert (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad), (step, n)
        opt_p.step()
        opt_o.step()
        handle.writeback()
        opt_p.zero_grad()
        opt_o.zero_grad()
        assert all(p.numel() == 0 for p in model.parameters()), step  # nothing left loaded between steps
    handle()
    for a, b in zip(plain.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_parameter_offload_with_optimizer_steps(make_store):
    plain, model, handle = _offloaded_twin(make_store, Net, 4)
    opt_p = torch.optim.SGD(plain.parameters(), lr=0.1)
    opt_o = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(5):
        x = _batches(step, 1)[0]
        for m in (plain, model):
            nn.functional.cross_entropy(m(x).flatten(0, 1), x.flatten()).backward()
        opt_p.step()
        handle.materialize()
        opt_o.step()
        handle.writeback()
        opt_p.zero_grad(set_to_none=True)
        opt_o.zero_grad(set_to_none=True)
    handle()
    for a, b in zip(plain.parameters(), model.parameters()):
        assert torch.equal(a, b)


def _sgd_through_data(model):
    """A hand-written SGD step as many third-party optimizers write it: through ``p.data``
    (which leaves the parameter's version counter as it was)."""
    for p in model.parameters():
        if p.grad is not None:
            p.data.add_(p.grad, alpha=-0.1)
            p.grad = None


def test_a_forgotten_writeback_after_a_step_through_p_data_loses_nothing(make_store):
    plain, model, handle = _offloaded_twin(make_store, Net, 10)
    x = _batches(0, 1)[0]
    for step in range(3):
        for m in (plain, model):
            m(x).square().mean().backward()
        handle.materialize()
        _sgd_through_data(plain)
        _sgd_through_data(model)  # and no writeback()
    with torch.no_grad():
        assert torch.equal(plain(x), model(x))


@pytest.mark.parametrize("cls", [Net, Functional])
def test_a_step_whose_writeback_is_forgotten_is_stored_before_its_parameters_are_released(make_store, cls):
    # materialize(); opt.step(); then the next forward without writeback(): each module uses
    # the loaded (updated) bytes, and a changed parameter is put in the pool before it is
    # released, also one loaded outside its module's forward (Functional's tied projection)
    plain, model, handle = _offloaded_twin(make_store, cls, 8)
    opt_p = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    opt_o = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(4):
        x = _batches(step, 1)[0]
        for m in (plain, model):
            m(x).square().mean().backward()
        opt_p.step()
        handle.materialize()
        opt_o.step()
        if step == 3:
            handle.writeback()
        opt_p.zero_grad()
        opt_o.zero_grad()
    assert all(p.numel() == 0 for p in model.parameters())
    with torch.no_grad():
        assert torch.equal(plain(x), model(x))
    handle()
    for (n, a), b in zip(plain.named_parameters(), model.parameters()):
        assert torch.equal(a, b), n


def test_an_offloaded_models_state_dict_dtype_and_prefix_behave_as_a_plain_models(make_store):
    """``state_dict()`` between steps holds the values (not placeholders) and
    ``load_state_dict`` sets them; ``model.to(dtype)`` casts what the pool keeps; a second
    model offloaded under the same prefix takes it over (the first raises at its next
    load instead of computing with the other's weights); an optimizer updating in
    backward over offloaded parameters is refused, in either order."""
    from tierstore import InvalidArgument

    s = make_store()
    torch.manual_seed(9)
    plain = Net()
    model = copy.deepcopy(plain)
    handle = offload_parameters(model, s, prefix="m")
    sd = model.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in plain.state_dict().items())
    with torch.no_grad():
        for p in plain.parameters():
            p.mul_(0.5)
    model.load_state_dict(plain.state_dict())
    x = _batches(0, 1)[0]
    with torch.no_grad():
        assert torch.equal(plain(x), model(x))
    plain.to(torch.float64)
    model.to(torch.float64)
    with torch.no_grad():
        out = model(x)
        assert out.dtype == torch.float64 and torch.equal(plain(x), out)
    handle.materialize()
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    handle.writeback()

    with pytest.raises(ValueError, match="update_in_backward"):
        offload_optimizer(torch.optim.AdamW(model.parameters()), s, update_in_backward=True)
    handle()
    other = Net()
    opt = offload_optimizer(torch.optim.AdamW(other.parameters()), s, update_in_backward=True)
    with pytest.raises(ValueError, match="update_in_backward"):
        offload_parameters(other, s)
    del opt

    gone = Net()
    opt = offload_optimizer(torch.optim.AdamW(gone.parameters()), s, update_in_backward=True, prefix="gone")
    del opt  # its hooks come off with it: the parameters may be offloaded now
    offload_parameters(gone, s, prefix="gone-params")
    nested = Net()  # parameters under "run", an optimizer under "run/opt": no key of one is the other's
    run = offload_parameters(nested, s, prefix="run")
    run_opt = offload_optimizer(torch.optim.SGD(nested.parameters(), lr=0.1), s, prefix="run/opt")
    nested(x).sum().backward()
    run.materialize()
    run_opt.step()
    run.writeback()
    del run_opt

    a, b = Net(), Net()
    ref_b = copy.deepcopy(b)
    offload_parameters(a, s)
    offload_parameters(b, s)  # the same prefix: b takes it over
    with torch.no_grad():
        with pytest.raises(InvalidArgument, match="taken over"):
            a(x)
        assert torch.equal(b(x), ref_b(x))
        c = Net()
        ref_c = copy.deepcopy(c)
        offload_parameters(c, s, prefix="c")  # a prefix of its own: both models keep their weights
        assert torch.equal(c(x), ref_c(x)) and torch.equal(b(x), ref_b(x))


def test_a_model_offloaded_on_another_connection_takes_the_prefix_over(daemon):
    """Two connections to one namespace, a model offloaded on each under the same prefix:
    the first one's next ``materialize()`` (or ``writeback()``) raises instead of stepping
    with the other's weights; the newer one keeps its own."""
    from tierstore import InvalidArgument

    x = _batches(0, 1)[0]
    with daemon.client("job") as c1, daemon.client("job") as c2:
        a, b = Net(), Net()
        ref_b = copy.deepcopy(b)
        first = offload_parameters(a, c1)
        offload_parameters(b, c2)
        with pytest.raises(InvalidArgument, match="taken over"):
            first.materialize()
        with torch.no_grad():
            assert torch.equal(b(x), ref_b(x))


TRAIN = r"""
import sys, torch
from torch import nn
from tierstore.client import Client
from tierstore.client.torch import offload_optimizer
sock, total, resume, out = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16))
c = Client.connect(socket=sock, namespace="resume-job/rank0")
opt = offload_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), c, tier="nvme",
                        master_weights=True, durable=True, resume=resume)
for step in range(opt.completed_steps, total):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 16, generator=g)
    nn.functional.mse_loss(model(x), x.flip(1)).backward()
    if step % 3 == 1:
        model[2].bias.grad = None  # no gradient this step: its state stays as it is
    opt.step()
    opt.zero_grad(set_to_none=True)
    print("step", step + 1, flush=True)
torch.save([p.detach() for p in model.parameters()], out)
print("done", flush=True)
"""


def test_warm_resume_after_sigkill_and_daemon_restart(daemon, tmp_path):
    ref = tmp_path / "ref.pt"
    with daemon.client("ref-job/rank0"):
        pass
    r = subprocess.run([sys.executable, "-c", TRAIN.replace("resume-job", "ref-job"), daemon.socket, "30", "0",
                        str(ref)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = tmp_path / "resumed.pt"
    p = subprocess.Popen([sys.executable, "-c", TRAIN, daemon.socket, "30", "0", str(out)], stdout=subprocess.PIPE,
                         text=True)
    for line in p.stdout:
        if line.strip() == "step 12":
            break
    os.kill(p.pid, signal.SIGKILL)  # mid-run, somewhere in step 13
    p.wait()
    r = subprocess.run([sys.executable, "-c", TRAIN, daemon.socket, "20", "1", str(out)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] in ("step 13", "step 14")  # continued, not restarted
    daemon.kill()  # and the durable state survives the daemon too
    daemon.start()
    r = subprocess.run([sys.executable, "-c", TRAIN, daemon.socket, "30", "1", str(out)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == "step 21"
    for a, b in zip(torch.load(ref), torch.load(out)):
        assert torch.equal(a, b)


class Gated(nn.Module):
    """Two experts; a step uses one or both: the unused one gets no gradient (MoE-like)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(12, 40)
        self.experts = nn.ModuleList([nn.Linear(40, 40), nn.Linear(40, 40)])
        self.out = nn.Linear(40, 12)

    def forward(self, x, use):
        h = torch.tanh(self.inp(x))
        return self.out(sum(self.experts[i](h) for i in use))


def _gated_steps(model, opt, steps, start=0):
    for step in range(start, steps):
        use = [(0,), (1,), (0, 1), (0,), (0,)][step % 5]  # expert 1 sits out runs of steps
        x = torch.randn(6, 12, generator=torch.Generator().manual_seed(step))
        nn.functional.mse_loss(model(x, use), x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _adamw_twin(make_store, cls, prefix, **kw):
    """(plain model, its copy, plain AdamW, offloaded AdamW on the host tier, the store)."""
    torch.manual_seed(0)
    plain = cls()
    off = copy.deepcopy(plain)
    s = make_store()
    opt_o = offload_optimizer(torch.optim.AdamW(off.parameters(), lr=1e-3), s, tier="host", prefix=prefix, **kw)
    return plain, off, torch.optim.AdamW(plain.parameters(), lr=1e-3), opt_o, s


def _assert_same_state(opt_p, opt_o):
    sd_p, sd_o = opt_p.state_dict()["state"], opt_o.state_dict()["state"]
    assert sd_p.keys() == sd_o.keys()
    for i in sd_p:
        for k, v in sd_p[i].items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(sd_o[i][k])), (i, k)


def _gated_both(plain, opt_p, off, opt_o, start, end):
    """Steps ``start..end`` of both runs; then the same parameters and optimizer state."""
    _gated_steps(plain, opt_p, end, start=start)
    _gated_steps(off, opt_o, end, start=start)
    for (n, a), b in zip(plain.named_parameters(), off.parameters()):
        assert torch.equal(a, b), n
    _assert_same_state(opt_p, opt_o)


@pytest.mark.parametrize("name", ["adamw", "sgd_momentum"])
def test_parameters_without_a_gradient_in_some_steps_keep_their_state(make_store, name):
    """A parameter with no gradient in a step is skipped and keeps its state, as the plain
    optimizer does; its next update reads that state (not the other version's older one),
    also after a resume from the pool."""
    torch.manual_seed(0)
    plain = Gated()
    off = copy.deepcopy(plain)
    opt_p = OPTIMIZERS[name](plain.parameters())
    s = make_store(host_bytes="64KiB")  # smaller than the states: they move every step
    opt_o = offload_optimizer(OPTIMIZERS[name](off.parameters()), s, tier="nvme", prefix="gated")
    for upto in (4, 9, 13):  # stop after steps where expert 1 had a gradient and where it had none
        _gated_steps(plain, opt_p, upto, start=opt_o.completed_steps)
        _gated_steps(off, opt_o, upto, start=opt_o.completed_steps)
        for (n, a), b in zip(plain.named_parameters(), off.parameters()):
            assert torch.equal(a, b), (upto, n)
        # a new process would find the state by key: the same versions must come back
        opt_o = offload_optimizer(OPTIMIZERS[name](off.parameters()), s, tier="nvme", prefix="gated", resume=True)
        assert opt_o.completed_steps == upto
    _gated_both(plain, opt_p, off, opt_o, 13, 20)


def test_resume_reads_a_step_count_only_progress_record_and_rejects_a_malformed_one(make_store):
    """A progress record holding only the step count (every parameter at the step's
    parity, as written before per-parameter versions) still resumes; one that is neither
    is refused with a clear error rather than read as versions."""
    plain, off, opt_p, opt_o, s = _adamw_twin(make_store, Gated, "legacy", crash_consistent=True)
    for model, opt in ((plain, opt_p), (off, opt_o)):
        for step in range(3):  # every parameter updated every step
            x = torch.randn(6, 12, generator=torch.Generator().manual_seed(step))
            nn.functional.mse_loss(model(x, (0, 1)), x).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    s.put(torch.tensor([3]), key="legacy/_progress", replace=True)
    opt_o = offload_optimizer(torch.optim.AdamW(off.parameters(), lr=1e-3), s, tier="host", prefix="legacy",
                              resume=True, crash_consistent=True)
    assert opt_o.completed_steps == 3
    _assert_same_state(opt_p, opt_o)
    s.put(torch.tensor([3, 0]), key="legacy/_progress", replace=True)
    with pytest.raises(ValueError, match="progress record"):
        offload_optimizer(torch.optim.AdamW(off.parameters(), lr=1e-3), s, tier="host", prefix="legacy",
                          resume=True)


def test_a_step_without_gradients_then_a_kill_resumes_without_the_unfinished_steps_state(make_store):
    """A completed step in which no parameter had a gradient records no parameter; a
    state tensor the next, unfinished step wrote (its process killed) is not taken up
    by the resume as if an older record named every parameter."""
    _, off, _, opt_o, s = _adamw_twin(make_store, Gated, "nograd", crash_consistent=True)
    opt_o.step()  # no gradients: a step that completes with no state
    assert opt_o.completed_steps == 1
    first = next(off.parameters())
    s.put(torch.ones_like(first), key="nograd/0.0/exp_avg@1")  # left by the next step, killed mid-way
    resumed = offload_optimizer(torch.optim.AdamW(off.parameters(), lr=1e-3), s, tier="host", prefix="nograd",
                                resume=True, crash_consistent=True)
    assert resumed.completed_steps == 1
    assert not any(resumed.state_dict()["state"].values())


def test_wrapping_an_optimizer_that_already_stepped_moves_its_state_into_the_pool(make_store):
    torch.manual_seed(0)
    plain = Gated()
    off = copy.deepcopy(plain)
    opt_p, inner = torch.optim.AdamW(plain.parameters(), lr=1e-3), torch.optim.AdamW(off.parameters(), lr=1e-3)
    _gated_steps(plain, opt_p, 3)
    _gated_steps(off, inner, 3)  # plain steps first, then wrapped: the state carries over
    opt_o = offload_optimizer(inner, make_store(), tier="nvme", prefix="late")
    assert not any(inner.state.values())
    _gated_both(plain, opt_p, off, opt_o, 3, 8)


def test_an_optimizer_without_per_parameter_state_is_refused_clearly(make_store):
    with pytest.raises(TypeError, match="LBFGS needs a closure .* per parameter"):
        offload_optimizer(torch.optim.LBFGS(Gated().parameters()), make_store())


def test_zero1_and_fsdp2_under_torchrun(daemon):
    script = os.path.join(os.path.dirname(__file__), "dist_train.py")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        script, daemon.socket, "dist-job"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    for rank in (0, 1):
        assert f"rank {rank} zero1 ok" in r.stdout and f"rank {rank} fsdp2 ok" in r.stdout
    with daemon.client("dist-job/rank0") as c:
        st = c.stat()
        assert {"dist-job/rank0", "dist-job/rank1"} <= set(st["namespaces"])


def test_demo_trains_and_resumes(daemon):
    """`tierstore demo`: the loss falls well below uniform, the progress lines show step
    time, tokens/s, loss and tier use, and --resume continues from the daemon's state."""
    def demo(*args):
        r = subprocess.run([sys.executable, "-m", "tierstore.client.cli", "demo", "--socket", daemon.socket,
                            "--namespace", "demo-test/rank0", *args], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        return r.stdout

    out = demo("--steps", "25")
    assert "steps 0..25" in out and "tok/s" in out and "nvme" in out
    out = demo("--steps", "75", "--resume")
    assert "steps 25..75" in out
    final = float(out.strip().splitlines()[-1].split("loss ")[1].split()[0])
    assert final < 2.0, out[-1500:]  # uniform over the corpus' characters is ~3.09


@pytest.mark.parametrize("crash_consistent", [True, False], ids=["two-versions", "one-version"])
def test_state_keys_re_bound_behind_the_optimizer_are_found_again(make_store, crash_consistent):
    """The optimizer looks each state key up once; when a key is re-bound to a new object
    (its cached handle goes stale), the next step looks it up again and the numbers stay
    those of the plain optimizer."""
    plain, off, opt_p, _, s = _adamw_twin(make_store, Net, "rebind")
    # two parameters a bucket: the second bucket's prefetch hint goes out before the first's check-out
    opt_o = offload_optimizer(torch.optim.AdamW(off.parameters(), lr=1e-3), s, tier="host", prefix="rebind",
                              bucket_bytes=4096 * 6, crash_consistent=crash_consistent)
    sch_p, sch_o = (torch.optim.lr_scheduler.StepLR(o, step_size=100) for o in (opt_p, opt_o))
    _train(plain, opt_p, sch_p, 3)
    _train(off, opt_o, sch_o, 3)
    cur = opt_o.completed_steps % 2 if crash_consistent else 0
    rebound = [k for g in ("0.0", "0.2") for k in s.keys(prefix=f"rebind/{g}/") if k.endswith(f"@{cur}")]
    assert len(rebound) == 6
    for key in rebound:
        s.put(s.get(s.lookup(key)), key=key, replace=True)  # same bytes, a new object and handle
    _train(plain, opt_p, sch_p, 5, start=3)
    _train(off, opt_o, sch_o, 5, start=3)
    for a, b in zip(plain.parameters(), off.parameters()):
        assert torch.equal(a, b)


def test_a_host_tier_too_small_for_one_update_says_how_much_it_needs(make_store):
    s = make_store(host_bytes="2MiB", lease_wait_s=0.2)
    w = nn.Parameter(torch.randn(512, 512))  # 1 MiB per state tensor; an Adam update holds three
    opt = offload_optimizer(torch.optim.Adam([w]), s, tier="nvme")
    w.grad = torch.ones_like(w)
    opt.step()  # the first step creates the state (no double hold yet)
    with pytest.raises(Exception, match=r"host tier needs at least about 2\.0 MiB") as e:
        opt.step()  # each new version is made from the old one in place: two 1 MiB blocks, no third
    assert type(e.value).__name__ == "CapacityExceeded"


def test_offloaded_adamw_through_a_daemon_under_eviction_matches_plain_every_step(daemon_factory):
    """The whole path — client, socket, daemon, host tier far smaller than the state,
    NVMe, trace prefetch — against plain AdamW, parameters compared bit for bit after
    every step. Each new state version is checked out from the old one (``source=``)."""
    import random

    from tierstore.client import Client

    rng = random.Random(7)
    torch.manual_seed(7)
    model = nn.ModuleList([nn.Linear(rng.choice([16, 64, 256, 384, 512]), rng.choice([16, 64, 256, 384]))
                           for _ in range(32)])
    ref = copy.deepcopy(model)
    state = sum(p.numel() for p in model.parameters()) * 8
    d = daemon_factory("--host-bytes", "4MiB", "--prefetch", "1", "--policy", "trace",
                       "--prefetch-budget-bytes", "1MiB")
    assert 2 * state > 6 * (4 << 20)  # both versions of the state are several times the host tier
    with Client.connect(socket=d.socket, namespace="parity/rank0") as c:
        opt = offload_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01), c, tier="nvme")
        plain = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
        g = torch.Generator().manual_seed(8)
        for step in range(15):
            for p, q in zip(model.parameters(), ref.parameters()):
                q.grad = torch.randn(p.shape, generator=g)
                p.grad = q.grad.clone()
            opt.step()
            plain.step()
            for i, (p, q) in enumerate(zip(model.parameters(), ref.parameters())):
                assert torch.equal(p, q), f"step {step}, parameter {i}"
        st = c.stat()
        assert st["tiers"]["nvme"]["bytes_read"] > 10 * state  # the state really came up from NVMe
        assert st["prefetch"]["hits"] > 0
        moved = st["counters"]["source_handovers"] + st["counters"]["source_copies"]
        assert moved > 14 * len(list(model.parameters()))
        assert st["counters"]["source_handovers"] > 0.5 * moved  # prefetched old versions change owner: no copy
