"""The offloaded optimizer's step modes: single- and two-version state (pool bytes,
resume after a process killed mid-step), update-in-backward (results equal plain step
by step, with what a training loop does between backward and step) and the prefetch
hint that carries a step's first state across the step boundary."""

import contextlib
import copy
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from tierstore.client.torch import offload_optimizer

from test_torch_hooks import Gated, Net, _batches, _gated_steps, _groups


def _twin(seed=0, cls=Net):
    torch.manual_seed(seed)
    plain = cls()
    return plain, copy.deepcopy(plain)


def _assert_equal(plain, off, where):
    for (n, a), b in zip(plain.named_parameters(), off.parameters()):
        assert torch.equal(a, b), (where, n)


def _state_bytes(opt):
    return sum(v.nbytes for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor))


# ---------------------------------------------------------------------------------------- versions
def test_the_default_version_count_follows_the_tier(make_store):
    s = make_store()
    params = list(Net().parameters())
    kinds = {(tier, durable): offload_optimizer(torch.optim.SGD(params, lr=0.1), s, tier=tier, durable=durable,
                                                prefix=f"k{i}").versions
             for i, (tier, durable) in enumerate([("host", False), ("host", True), ("nvme", False), (None, False)])}
    assert kinds == {("host", False): 1, ("host", True): 2, ("nvme", False): 2, (None, False): 2}
    opt = offload_optimizer(torch.optim.SGD(params, lr=0.1), s, tier="host", crash_consistent=True, prefix="k9")
    assert opt.versions == 2 and opt.crash_consistent


@pytest.mark.parametrize("tier", ["host", "nvme"])
@pytest.mark.parametrize("crash_consistent", [False, True], ids=["one-version", "two-versions"])
def test_both_version_modes_equal_plain_and_hold_the_state_once_or_twice(make_store, tier, crash_consistent):
    plain, off = _twin()
    opt_p = torch.optim.AdamW(_groups(plain), lr=1e-3)
    s = make_store(host_bytes="1MiB")  # smaller than the states: on NVMe they really move every step
    opt_o = offload_optimizer(torch.optim.AdamW(_groups(off), lr=1e-3), s, tier=tier,
                              crash_consistent=crash_consistent)
    assert opt_o.versions == (2 if crash_consistent else 1)
    sch = [torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5) for o in (opt_p, opt_o)]
    for step in range(8):
        for (model, opt), sc in zip(((plain, opt_p), (off, opt_o)), sch):
            for x in _batches(step):
                (nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()) / 2).backward()
            opt.step()
            sc.step()
            opt.zero_grad(set_to_none=True)
        _assert_equal(plain, off, step)
    # the progress records (the last step's, and with two versions the one before it, for
    # rewind_to) are bookkeeping of a few hundred bytes, not state; so is the owner's mark
    records = [h for h in (s.lookup("opt/_progress"), s.lookup("opt/_progress.prev")) if h is not None]
    assert len(records) == opt_o.versions
    mark = s.info(s.lookup("opt/_owner"))["nbytes"]
    held = s.stat()["namespaces"]["default"]["bytes"] - sum(s.info(h)["nbytes"] for h in records) - mark
    assert held == opt_o.versions * _state_bytes(opt_p)  # 1.0x or 2.0x the state, nothing else
    assert s.lookup("opt/_torn") is None  # no step under way
    assert s.stat()["leases"] == 0


TRAIN = r"""
import os, signal, sys, torch
from torch import nn
from tierstore.client import Client
from tierstore.client.torch import offload_optimizer
sock, total, resume, out, mode, kill_at = sys.argv[1:7]
total, resume, consistent = int(total), resume == "1", mode.startswith("two")
kill_step, kill_update = (int(v) for v in kill_at.split(":"))  # -1: no kill; update 0: between steps
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 16))
c = Client.connect(socket=sock, namespace="modes/rank0")
inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
opt = offload_optimizer(inner, c, tier="host", master_weights=True, crash_consistent=consistent, resume=resume,
                        bucket_bytes=0, update_in_backward=mode.endswith("backward"))
updates = 0
step_of_inner = inner.step
def counted(*a, **k):  # the process dies after this many parameter updates of the step (deterministic)
    global updates
    r = step_of_inner(*a, **k)
    updates += 1
    if step == kill_step and updates == kill_update:
        os.kill(os.getpid(), signal.SIGKILL)
    return r
inner.step = counted
for step in range(opt.completed_steps, total):
    updates = 0
    if step == kill_step and kill_update == 0:
        os.kill(os.getpid(), signal.SIGKILL)  # between steps: the last step completed
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
    nn.functional.mse_loss(model(x), x.flip(1)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    print("step", step + 1, flush=True)
torch.save([p.detach() for p in model.parameters()], out)
"""


def _plain_reference(total):
    """The uninterrupted run's parameters, with the plain optimizer (``TRAIN``'s model and data)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(total):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        nn.functional.mse_loss(model(x), x.flip(1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach() for p in model.parameters()]


def _train(daemon, tmp_path, name, mode, total, resume, kill_at="-1:0"):
    out = tmp_path / f"{name}.pt"
    return subprocess.run([sys.executable, "-c", TRAIN, daemon.socket, str(total), "1" if resume else "0", str(out),
                           mode, kill_at], capture_output=True, text=True, timeout=300), out


@pytest.mark.parametrize("mode", ["two-versions", "two-versions+backward", "one-version", "one-version+backward"])
def test_a_process_killed_mid_step_resumes_or_is_refused_by_mode(daemon, tmp_path, mode):
    """Two versions: a process SIGKILLed in the middle of a step (after 3 of its 6
    parameter updates) resumes from the last completed step and ends with the
    uninterrupted run's parameters. One version: the same kill leaves a torn state and
    the resume is refused with ``TornState``; a kill between steps resumes exactly."""
    ref = _plain_reference(8)
    r, out = _train(daemon, tmp_path, "run", mode, 8, False, kill_at="5:3")
    assert r.returncode == -9 and r.stdout.split()[-1] == "5", (r.returncode, r.stdout, r.stderr[-2000:])
    r, out = _train(daemon, tmp_path, "run", mode, 8, True)
    if mode.startswith("two"):
        assert r.returncode == 0, r.stderr
        assert r.stdout.splitlines()[0] == "step 6"  # step 6 again, from step 5's state
        for a, b in zip(ref, torch.load(out)):
            assert torch.equal(a, b)
        return
    assert r.returncode != 0 and "TornState" in r.stderr and "during step 6" in r.stderr, r.stderr[-2000:]
    r, out = _train(daemon, tmp_path, "run", mode, 8, False, kill_at="5:0")  # afresh; killed between steps
    assert r.returncode == -9 and r.stdout.split()[-1] == "5"
    r, out = _train(daemon, tmp_path, "run", mode, 8, True)
    assert r.returncode == 0 and r.stdout.splitlines()[0] == "step 6", r.stderr[-2000:]
    for a, b in zip(ref, torch.load(out)):
        assert torch.equal(a, b)


def test_resume_switches_between_one_and_two_versions(make_store):
    """State written with two versions resumes with one (the other version is freed) and
    back (the second version is made again), with the plain optimizer's numbers."""
    plain, off = _twin(cls=Gated)
    opt_p = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    s = make_store()
    opt_o = None
    for upto, consistent in ((3, True), (6, False), (9, True), (12, False)):
        opt_o = offload_optimizer(torch.optim.AdamW(off.parameters(), lr=1e-3), s, tier="nvme", prefix="sw",
                                  crash_consistent=consistent, resume=opt_o is not None)
        _gated_steps(plain, opt_p, upto, start=opt_o.completed_steps)
        _gated_steps(off, opt_o, upto, start=opt_o.completed_steps)
        _assert_equal(plain, off, upto)
        versions = {k.rsplit("@", 1)[1] for k in s.keys(prefix="sw/") if "@" in k}
        assert versions == ({"0", "1"} if consistent else {"0"}), (upto, versions)


# ---------------------------------------------------------------------------------------- in backward
def _loss(model, x, micro=1):
    return nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()) / micro


def _loop(model, opt, steps, *, defer="accumulate", clip=None, scaler=None, bad_step=None):
    """A training loop: gradient accumulation over two micro-batches, then clipping, loss
    scaling and the step. ``defer``: which backwards run in ``opt.deferred()`` (where
    ``opt`` has it): "accumulate" (all but the last micro-batch), "all" or "none"."""
    for step in range(steps):
        xs = _batches(step)
        for i, x in enumerate(xs):
            loss = _loss(model, x, len(xs))
            if step == bad_step:
                loss = loss * float("inf")  # every gradient non-finite: GradScaler skips the step
            last = i == len(xs) - 1
            wanted = defer == "all" or (defer == "accumulate" and not last)
            with opt.deferred() if wanted and hasattr(opt, "deferred") else contextlib.nullcontext():
                (scaler.scale(loss) if scaler else loss).backward()
        if scaler is not None:
            scaler.unscale_(opt)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("bucket_bytes", [0, 16 << 20], ids=["one-at-a-time", "buckets"])
@pytest.mark.parametrize("crash_consistent", [False, True], ids=["one-version", "two-versions"])
def test_update_in_backward_equals_plain_every_step(make_store, bucket_bytes, crash_consistent):
    """Two groups, a frozen layer, a block run twice per step, gradient accumulation (the
    first micro-batch in ``deferred()``), a scheduler and ``zero_grad``: once the last
    backward has run, the parameters already equal plain AdamW's after its step (the
    update happened in backward), and again after ``step()``."""
    plain, off = _twin()
    opt_p = torch.optim.AdamW(_groups(plain), lr=1e-3, weight_decay=0.1)
    s = make_store(host_bytes="1MiB")  # smaller than the states: they come up from NVMe every step
    opt_o = offload_optimizer(torch.optim.AdamW(_groups(off), lr=1e-3, weight_decay=0.1), s, tier="nvme",
                              bucket_bytes=bucket_bytes, crash_consistent=crash_consistent, update_in_backward=True)
    sch_p, sch_o = (torch.optim.lr_scheduler.StepLR(o, step_size=4, gamma=0.5) for o in (opt_p, opt_o))
    for step in range(12):
        x0, x1 = _batches(step)
        for model, opt, sch in ((plain, opt_p, sch_p), (off, opt_o, sch_o)):
            with opt_o.deferred() if opt is opt_o else contextlib.nullcontext():  # accumulated only
                _loss(model, x0, 2).backward()
            _loss(model, x1, 2).backward()
            if opt is opt_o:
                _assert_equal(plain, off, f"after backward, step {step}")
            opt.step()
            sch.step()
            opt.zero_grad(set_to_none=True)
        _assert_equal(plain, off, step)
    assert opt_o.completed_steps == 12 and s.stat()["leases"] == 0
    assert s.lookup("opt/_torn") is None


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_drop_grads_equals_plain_and_never_holds_every_gradient(make_store, tier):
    """``drop_grads``: each gradient is set to ``None`` by its update in backward, so at no
    point of a backward are all gradients alive (one parameter's at most, one at a time),
    and the results equal plain AdamW's every step, with accumulation (the first
    micro-batch deferred) and without."""
    plain, off = _twin()
    opt_p = torch.optim.AdamW(_groups(plain), lr=1e-3, weight_decay=0.1)
    s = make_store(host_bytes="4MiB")
    opt_o = offload_optimizer(torch.optim.AdamW(_groups(off), lr=1e-3, weight_decay=0.1), s, tier=tier,
                              bucket_bytes=0, update_in_backward=True, drop_grads=True)
    params = [p for p in off.parameters() if p.requires_grad]
    alive: list[int] = []
    for p in params:  # registered after the optimizer's: each sees what that update left
        p.register_post_accumulate_grad_hook(lambda _p: alive.append(sum(q.grad is not None for q in params)))
    for step in range(8):
        xs = _batches(step) if step % 2 else _batches(step)[:1]
        for model, opt in ((plain, opt_p), (off, opt_o)):
            alive.clear()
            for i, x in enumerate(xs):
                last = i == len(xs) - 1
                with opt_o.deferred() if opt is opt_o and not last else contextlib.nullcontext():
                    _loss(model, x, len(xs)).backward()
            if opt is opt_o:
                assert all(p.grad is None for p in params), step  # every gradient used, and dropped
                if len(xs) == 1:
                    assert max(alive) <= 1, (step, alive)
                _assert_equal(plain, off, f"after backward, step {step}")
            opt.step()
            opt.zero_grad(set_to_none=True)
        _assert_equal(plain, off, step)
    assert opt_o.completed_steps == 8 and s.stat()["leases"] == 0
    with pytest.raises(ValueError, match="drop_grads needs update_in_backward"):
        offload_optimizer(torch.optim.AdamW(_groups(off), lr=1e-3), s, tier=tier, prefix="other", drop_grads=True)


def test_update_in_backward_skips_parameters_without_a_gradient(make_store):
    """Parameters without a gradient in some steps keep their state, across resumes by new
    optimizers over the same parameters."""
    plain, off = _twin(cls=Gated)
    opt_p = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    s = make_store(host_bytes="1MiB")
    opt_o = offload_optimizer(torch.optim.AdamW(off.parameters(), lr=1e-3), s, tier="nvme",
                              update_in_backward=True)
    earlier = []  # kept alive: the new optimizer takes their hooks over (no parameter updated twice)
    for upto in (4, 9, 13):
        _gated_steps(plain, opt_p, upto, start=opt_o.completed_steps)
        _gated_steps(off, opt_o, upto, start=opt_o.completed_steps)
        _assert_equal(plain, off, upto)
        earlier.append(opt_o)  # a new process would find the state by key; here, the same one does
        opt_o = offload_optimizer(torch.optim.AdamW(off.parameters(), lr=1e-3), s, tier="nvme", resume=True,
                                  update_in_backward=True)
    assert not any(o.backward.enabled for o in earlier)


def test_clipping_defers_to_step_and_is_caught_when_not_deferred(make_store):
    plain, off = _twin()
    opt_p = torch.optim.SGD(_groups(plain), lr=0.1, momentum=0.9)
    s = make_store()
    opt_o = offload_optimizer(torch.optim.SGD(_groups(off), lr=0.1, momentum=0.9), s, tier="host",
                              update_in_backward=True)
    _loop(plain, opt_p, 5, clip=0.05)
    _loop(off, opt_o, 5, clip=0.05, defer="all")  # every backward deferred: step() updates, after the clip
    _assert_equal(plain, off, "clipped")
    with pytest.raises(RuntimeError, match=r"changed after backward used it.*clip_grad_norm_"):
        _loop(off, opt_o, 1, clip=0.05)  # updated in backward, then clipped: refused at step()


def test_grad_scaler_with_a_skipped_step(make_store):
    """Loss scaling needs every gradient's inf check before any update: scaled backwards run
    in ``deferred()`` and give plain's results, the skipped step included; an in-backward
    update of a scaled gradient is refused."""
    plain, off = _twin()
    opt_p = torch.optim.Adam(_groups(plain), lr=1e-3)
    s = make_store()
    opt_o = offload_optimizer(torch.optim.Adam(_groups(off), lr=1e-3), s, tier="nvme", update_in_backward=True)
    sc_p, sc_o = (torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) for _ in range(2))
    _loop(plain, opt_p, 6, scaler=sc_p, bad_step=3)
    _loop(off, opt_o, 6, scaler=sc_o, bad_step=3, defer="all")
    assert sc_p.get_scale() == sc_o.get_scale() < 2.0 ** 10  # a step was skipped in both
    _assert_equal(plain, off, "scaled")
    assert opt_o.completed_steps == 5
    with pytest.raises(RuntimeError, match="GradScaler"):
        _loop(off, opt_o, 1, scaler=sc_o)


def test_accumulating_without_deferring_is_refused(make_store):
    _, off = _twin()
    opt_o = offload_optimizer(torch.optim.AdamW(off.parameters(), lr=1e-3), make_store(), tier="host",
                              update_in_backward=True)
    with pytest.raises(RuntimeError, match=r"again after its update in backward.*opt\.deferred\(\)"):
        _loop(off, opt_o, 1, defer="none")


def test_zero1_and_fsdp2_with_update_in_backward_under_torchrun(daemon):
    script = os.path.join(os.path.dirname(__file__), "dist_backward.py")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        script, daemon.socket, "bwd-job"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    for rank in (0, 1):
        assert f"rank {rank} zero1 ok (updates in step)" in r.stdout
        assert f"rank {rank} fsdp2 ok (updates in backward)" in r.stdout
        assert f"rank {rank} fsdp2 ok (updates in backward, gradients dropped)" in r.stdout


# ---------------------------------------------------------------------------------------- step boundary
@pytest.mark.parametrize("update_in_backward", [False, True], ids=["in-step", "in-backward"])
@pytest.mark.parametrize("crash_consistent", [False, True], ids=["one-version", "two-versions"])
def test_the_next_steps_first_state_is_hinted_at_the_end_of_a_step(make_store, update_in_backward,
                                                                   crash_consistent):
    """At the end of a step the pool is told which state the next step reads first (the
    version that is then current; with updates in backward, the parameters whose
    gradients come first), so it comes up from NVMe during the forward pass."""
    _, off = _twin()
    s = make_store(host_bytes="1MiB")
    opt = offload_optimizer(torch.optim.AdamW(off.parameters(), lr=1e-3), s, tier="nvme", bucket_bytes=0,
                            crash_consistent=crash_consistent, update_in_backward=update_in_backward)
    calls = []
    prefetch, each = s.prefetch, s.checkout_each

    def spy_prefetch(hs, **kw):
        calls.append(("hint", {str(h) for h in hs}))
        return prefetch(hs, **kw)

    def spy_each(reqs, **kw):
        reqs = list(reqs)
        calls.append(("read", {str(src if src is not None else h) for h, _, src in reqs}))
        return each(reqs, **kw)

    s.prefetch, s.checkout_each = spy_prefetch, spy_each
    for step in range(4):
        calls.append(("step", step))
        x = _batches(step, 1)[0]
        nn.functional.cross_entropy(off(x).flatten(0, 1), x.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for step in (2, 3):  # once every parameter has state (and the backward order is known)
        at = calls.index(("step", step))
        last_hint = [c for c in calls[:at] if c[0] == "hint"][-1][1]
        first_read = next(c for c in calls[at:] if c[0] == "read")[1]
        assert first_read <= last_hint, step


def test_two_offloaded_optimizers_on_one_prefix_cannot_share_state(make_store):
    """A GAN's two optimizers, both on the default prefix: the second takes the prefix
    over, and the first raises on its next step (and update in backward) instead of
    updating with the other's state; with a prefix each, both equal plain."""
    from tierstore import InvalidArgument

    s = make_store()
    torch.manual_seed(0)
    g, d = nn.Linear(8, 8), nn.Linear(8, 8)  # equal shapes: their state keys would be the same
    opt_g = offload_optimizer(torch.optim.AdamW(g.parameters(), lr=1e-2), s, tier="host")
    opt_d = offload_optimizer(torch.optim.AdamW(d.parameters(), lr=1e-2), s, tier="host", update_in_backward=True)
    for p in g.parameters():
        p.grad = torch.ones_like(p)
    with pytest.raises(InvalidArgument, match="taken over by a newer one"):
        opt_g.step()
    d(torch.ones(2, 8)).sum().backward()
    opt_d.step()  # the newer one is its prefix's
    opt_g2 = offload_optimizer(torch.optim.AdamW(g.parameters(), lr=1e-2), s, tier="host", update_in_backward=True)
    x = torch.ones(2, 8)
    with pytest.raises(InvalidArgument, match="taken over by a newer one"):
        d(x).sum().backward()  # opt_d's hooks: its prefix is opt_g2's now

    torch.manual_seed(0)
    g, d = nn.Linear(8, 8), nn.Linear(8, 8)
    pg, pd = copy.deepcopy(g), copy.deepcopy(d)
    plain = [torch.optim.AdamW(pg.parameters(), lr=1e-2), torch.optim.AdamW(pd.parameters(), lr=1e-2)]
    off = [offload_optimizer(torch.optim.AdamW(g.parameters(), lr=1e-2), s, tier="host", prefix="opt_g"),
           offload_optimizer(torch.optim.AdamW(d.parameters(), lr=1e-2), s, tier="host", prefix="opt_d")]
    for _ in range(3):
        for models, opts in [((pg, pd), plain), ((g, d), off)]:
            for m, o in zip(models, opts):
                m(torch.ones(2, 8)).square().sum().backward()
                o.step()
                o.zero_grad()
    for a, b in zip([*pg.parameters(), *pd.parameters()], [*g.parameters(), *d.parameters()]):
        assert torch.equal(a, b)
    del opt_g2


@pytest.mark.parametrize("update_in_backward", [False, True])
def test_a_parameter_changed_in_place_between_steps_is_not_undone_by_its_master(make_store, update_in_backward):
    """fp32 masters (``master_weights=True`` on fp32 parameters: each step equals plain bit
    for bit): after steps, the model's weights are loaded anew and one is scaled in place.
    The next updates start from the parameters as the model has them, as plain AdamW's do,
    instead of from the masters (which would silently undo the change)."""
    s = make_store()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
    twin = copy.deepcopy(model)
    plain = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    off = offload_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), s, tier="host", master_weights=True,
                            update_in_backward=update_in_backward)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))

    def steps(n):
        for m, o in ((twin, plain), (model, off)):
            for _ in range(n):
                m(x).square().mean().backward()
                o.step()
                o.zero_grad(set_to_none=True)
    steps(2)
    fresh = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    for m in (twin, model):
        m.load_state_dict(fresh)
        with torch.no_grad():
            m[1].weight.mul_(0.5)
    steps(3)
    for a, b in zip(twin.parameters(), model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("update_in_backward", [False, True])
def test_a_rule_without_state_and_a_state_reset_equal_plain(make_store, update_in_backward):
    """SGD without momentum keeps no state per parameter (every step is a first one); and
    ``optimizer.state[p] = {}`` resets one parameter's AdamW state, as plain code does:
    its next update starts the state again, as the plain optimizer's does."""
    s = make_store()
    for rule, reset_at in [(lambda ps: torch.optim.SGD(ps, lr=0.1), None),
                           (lambda ps: torch.optim.AdamW(ps, lr=1e-2), 2)]:
        plain, model = _twin(3)
        opt_p = rule(plain.parameters())
        opt_o = offload_optimizer(rule(model.parameters()), s, tier="nvme", update_in_backward=update_in_backward,
                                  prefix=f"opt{reset_at}")
        for step in range(5):
            if step == reset_at:
                opt_p.state[plain.block[0].weight] = {}
                opt_o.state[model.block[0].weight] = {}
                assert opt_o.state[model.block[0].weight] == {}
            for m, o in [(plain, opt_p), (model, opt_o)]:
                _loss(m, _batches(step)[0]).backward()
                o.step()
                o.zero_grad()
            _assert_equal(plain, model, (reset_at, step))
        assert sorted(opt_o.state[model.block[0].weight]) == sorted(opt_p.state[plain.block[0].weight])
        done = opt_o.completed_steps
        opt_o.make_state()  # what DCP's get_state_dict asks: nothing to make, no step counted
        assert opt_o.completed_steps == done
        opt_o.free()


def test_an_optimizer_relaunched_on_another_connection_takes_the_prefix_over(daemon):
    """Two connections to one namespace (a job relaunched while the old process still
    runs, or two models' optimizers each on its own Client): the newer optimizer takes
    the prefix over through the pool, and the older one's next step raises instead of
    updating with the newer one's state; the newer one equals plain."""
    from tierstore import InvalidArgument

    plain, model = _twin(4)
    old_model = copy.deepcopy(model)
    with daemon.client("job") as c1, daemon.client("job") as c2:
        old = offload_optimizer(torch.optim.AdamW(old_model.parameters(), lr=1e-2), c1, tier="nvme")
        _loss(old_model, _batches(0)[0]).backward()
        old.step()
        opt_p = torch.optim.AdamW(plain.parameters(), lr=1e-2)
        new = offload_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), c2, tier="nvme")
        for step in range(3):
            for m, o in [(plain, opt_p), (model, new)]:
                _loss(m, _batches(step)[0]).backward()
                o.step()
                o.zero_grad()
            _assert_equal(plain, model, step)
            _loss(old_model, _batches(step)[0]).backward()
            with pytest.raises(InvalidArgument, match="taken over by a newer one"):
                old.step()
        held = sorted(c2.keys("opt/"))
        for touch in (old.free, lambda: old.load_state_dict(new.state_dict())):
            with pytest.raises(InvalidArgument, match="taken over by a newer one"):
                touch()  # nothing under the prefix is the old one's to free or replace
        assert sorted(c2.keys("opt/")) == held
        _loss(model, _batches(3)[0]).backward()
        new.step()


def test_a_resume_makes_volatile_state_durable_and_refuses_a_record_whose_state_is_gone(make_store):
    """A job that ran with durable=False resumed with durable=True: its state is put again
    durable, so it survives the pool's restart (the store closed and opened again, which
    keeps only durable objects). A progress record that names a parameter whose objects are
    gone is refused, not resumed with that parameter's state started afresh."""
    plain, model = _twin(5)
    opt_p = torch.optim.AdamW(plain.parameters(), lr=1e-2)

    def steps(opt, first, last):
        for step in range(first, last):
            for m, o in [(plain, opt_p), (model, opt)]:
                _loss(m, _batches(step)[0]).backward()
                o.step()
                o.zero_grad()
            _assert_equal(plain, model, step)

    s = make_store()
    opt = offload_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), s, tier="nvme", durable=False,
                            master_weights=True)
    steps(opt, 0, 2)
    opt = offload_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), s, tier="nvme", durable=True,
                            master_weights=True, resume=True)
    steps(opt, 2, 3)
    assert all(e["durable"] for e in s.ls("opt/") if not e["key"].endswith("/_owner"))
    s.close()
    s = make_store()
    opt = offload_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), s, tier="nvme", durable=True,
                            master_weights=True, resume=True)
    assert opt.completed_steps == 3
    steps(opt, 3, 5)
    for k in s.keys("opt/0.2/"):
        s.free(s.lookup(k))
    with pytest.raises(ValueError, match="does not hold"):
        offload_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), s, tier="nvme", durable=True,
                          master_weights=True, resume=True)


def test_a_deleted_optimizer_updates_nothing_more(make_store):
    """An optimizer updating in backward, deleted (its state carried over to a plain one):
    nothing keeps it alive (no reference cycle waits for the collector), so its hooks stop
    at once and the plain optimizer's steps are the only updates."""
    import gc
    import weakref

    plain, model = _twin(6)
    opt_p = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    opt_o = offload_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), make_store(), tier="host",
                              update_in_backward=True)
    enabled = gc.isenabled()
    gc.disable()
    try:
        for step in range(2):
            for m, o in [(plain, opt_p), (model, opt_o)]:
                _loss(m, _batches(step)[0]).backward()
                o.step()
                o.zero_grad()
        then = torch.optim.AdamW(model.parameters(), lr=1e-2)
        then.load_state_dict(opt_o.state_dict())
        gone = weakref.ref(opt_o)
        del opt_o, o
        assert gone() is None
        for step in range(2, 4):
            for m, o in [(plain, opt_p), (model, then)]:
                _loss(m, _batches(step)[0]).backward()
                o.step()
                o.zero_grad()
            _assert_equal(plain, model, step)
    finally:
        if enabled:
            gc.enable()


def test_a_gan_whose_generator_backward_runs_deferred_equals_plain(make_store):
    """DCGAN's loop with both optimizers updating in backward: the generator's loss flows
    through the discriminator, so its backward runs in ``opt_d.deferred()`` (docs/training.md);
    both networks then equal plain Adam's every iteration."""
    s = make_store()
    torch.manual_seed(0)
    g0 = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6))
    d0 = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 1))
    runs = {}
    for name in ("plain", "offloaded"):
        g, d = copy.deepcopy(g0), copy.deepcopy(d0)
        opt_g, opt_d = torch.optim.Adam(g.parameters(), lr=2e-3), torch.optim.Adam(d.parameters(), lr=2e-3)
        if name == "offloaded":
            opt_g = offload_optimizer(opt_g, s, tier="nvme", prefix="opt_g", update_in_backward=True)
            opt_d = offload_optimizer(opt_d, s, tier="nvme", prefix="opt_d", update_in_backward=True)
        bce = nn.BCEWithLogitsLoss()
        for it in range(4):
            gen = torch.Generator().manual_seed(it)
            real, z = torch.randn(8, 6, generator=gen), torch.randn(8, 4, generator=gen)
            d.zero_grad()
            fake = g(z)
            (bce(d(real), torch.ones(8, 1)) + bce(d(fake.detach()), torch.zeros(8, 1))).backward()
            opt_d.step()
            g.zero_grad()
            with opt_d.deferred() if name == "offloaded" else contextlib.nullcontext():
                bce(d(fake), torch.ones(8, 1)).backward()
            opt_g.step()
            runs.setdefault(name, []).append([p.detach().clone() for p in [*g.parameters(), *d.parameters()]])
    for it, (a, b) in enumerate(zip(runs["plain"], runs["offloaded"])):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), it


# ---------------------------------------------------------------------------------------- tiles
TILED_RULES = [
    (torch.optim.AdamW, dict(lr=1e-3)),
    (torch.optim.AdamW, dict(lr=1e-3, fused=True)),
    (torch.optim.Adam, dict(lr=1e-3, amsgrad=True, weight_decay=0.1, maximize=True)),
    (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4)),
    (torch.optim.RMSprop, dict(lr=1e-3, centered=True, momentum=0.5)),
    (torch.optim.Adagrad, dict(lr=0.05, lr_decay=1e-3)),
]


class _Wide(nn.Module):
    """Parameters larger than a tile, of sizes that are no multiple of one, and a small one."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.randn(3 * (1 << 18) + 17) * 0.1)  # 3 tiles of fp32 and a 68-byte one
        self.b = nn.Parameter(torch.randn(517, 1031) * 0.1)
        self.c = nn.Parameter(torch.randn(100))

    def forward(self, x):
        return (self.a[:x.numel()] * x).sum() + (self.b[:, :x.numel()] @ x).square().sum() + self.c.sum() * x[0]


@pytest.mark.parametrize("rule,kw", TILED_RULES, ids=[f"{c.__name__}-{i}" for i, (c, _) in enumerate(TILED_RULES)])
@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_a_large_parameter_is_updated_a_tile_at_a_time_with_the_same_bits_as_plain(make_store, rule, kw, tier):
    """A parameter larger than ``TILE_BYTES`` under an elementwise rule (``ELEMENTWISE``)
    is updated a tile at a time (the wrapped optimizer's ``step`` runs once per tile:
    its temporaries stay small), and every parameter and state tensor equals plain's bit
    for bit after every step, a learning-rate schedule included; a subclass of such a
    rule (which may change it) runs whole."""
    from tierstore.client.optimizer.tiles import TILE_BYTES

    plain, off = _twin(3, _Wide)
    assert plain.a.nbytes > 3 * TILE_BYTES and plain.b.nbytes > TILE_BYTES
    opt_p = rule(plain.parameters(), **kw)
    inner = rule(off.parameters(), **kw)
    calls = []
    inner.register_step_post_hook(lambda *_: calls.append(1))
    opt_o = offload_optimizer(inner, make_store(host_bytes="64MiB"), tier=tier, bucket_bytes=0)
    sch = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (opt_p, opt_o)]
    g = torch.Generator().manual_seed(1)
    for step in range(5):
        x = torch.randn(64, generator=g)
        for model, opt, sc in ((plain, opt_p, sch[0]), (off, opt_o, sch[1])):
            model(x).backward()
            opt.step()
            sc.step()
            opt.zero_grad(set_to_none=True)
        _assert_equal(plain, off, step)
    sd_p, sd_o = opt_p.state_dict()["state"], opt_o.state_dict()["state"]
    for i in sd_p:
        for name, v in sd_p[i].items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(sd_o[i][name])), (i, name)
    tiles = 4 + -(-plain.b.nbytes // TILE_BYTES) + 1  # a, b in tiles; c whole
    # the first step makes each parameter's state whole (Adagrad makes it at construction: every step tiled)
    assert len(calls) == (5 * tiles if rule is torch.optim.Adagrad else 3 + 4 * tiles)


def test_a_subclass_of_an_elementwise_rule_is_updated_whole(make_store):
    class Clipped(torch.optim.AdamW):  # a rule of its own: tiles could change it
        pass

    _, off = _twin(3, _Wide)
    inner = Clipped(off.parameters(), lr=1e-3)
    calls = []
    inner.register_step_post_hook(lambda *_: calls.append(1))
    opt = offload_optimizer(inner, make_store(host_bytes="64MiB"), tier="host", bucket_bytes=0)
    for _ in range(3):
        off(torch.ones(64)).backward()
        opt.step()
        opt.zero_grad()
    assert len(calls) == 3 * 3  # one call per parameter and step


def test_a_resume_that_finds_state_but_no_record_warns(make_store, caplog):
    """A resume with no progress record starts fresh; where objects are left under the
    prefix (an overwriting restore or a first step stopped part-way) it says so as a
    warning, naming how many, and where there are none, at info level only."""
    import logging

    s = make_store()
    _, off = _twin()
    with caplog.at_level(logging.INFO, logger="tierstore.client.optimizer.progress"):
        offload_optimizer(torch.optim.AdamW(off.parameters(), lr=1e-3), s, tier="host", prefix="a", resume=True)
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    caplog.clear()
    s.put(torch.zeros(10), key="b/0.0/exp_avg@0")  # left by an interrupted restore: no record names it
    with caplog.at_level(logging.INFO, logger="tierstore.client.optimizer.progress"):
        opt = offload_optimizer(torch.optim.AdamW(off.parameters(), lr=1e-3), s, tier="host", prefix="b",
                                resume=True)
    assert opt.completed_steps == 0
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "1 other objects" in warned[0].getMessage()


def test_a_bf16_parameter_without_a_master_is_updated_whole_with_plains_bits(make_store):
    """A large bf16 parameter updated in bf16 (``master_weights=False``) is not tiled:
    in bf16 torch's vectorised and scalar loops round differently, so where a tile (or a
    thread's share) ends would change bits; updated whole, with 2 threads, every step
    equals plain's bit for bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _bf16_steps(make_store)
    finally:
        torch.set_num_threads(threads)


def _bf16_steps(make_store):
    g = torch.Generator().manual_seed(0)
    w0 = (torch.randn(786449, generator=g) * 0.1).to(torch.bfloat16)  # 1.5 MiB: tiled if it were fp32
    grads = [torch.randn(786449, generator=g).to(torch.bfloat16) for _ in range(3)]
    pp, po = nn.Parameter(w0.clone()), nn.Parameter(w0.clone())
    opt_p = torch.optim.SGD([pp], lr=0.05, momentum=0.9)
    inner = torch.optim.SGD([po], lr=0.05, momentum=0.9)
    calls = []
    inner.register_step_post_hook(lambda *_: calls.append(1))
    opt_o = offload_optimizer(inner, make_store(host_bytes="64MiB"), tier="host", master_weights=False)
    for step, grad in enumerate(grads):
        for p, o in ((pp, opt_p), (po, opt_o)):
            p.grad = grad.clone()
            o.step()
        assert torch.equal(pp.view(torch.int16), po.view(torch.int16)), step
    assert len(calls) == 3  # one call a step: whole


def test_sparse_optimizer_state_is_refused_with_a_clear_error(make_store):
    p = nn.Parameter(torch.randn(300, 8))
    opt = offload_optimizer(torch.optim.SGD([p], lr=0.1, momentum=0.9), make_store(), tier="host")
    p.grad = torch.sparse_coo_tensor(torch.tensor([[1, 5, 7]]), torch.ones(3, 8), (300, 8), check_invariants=True)
    with pytest.raises(TypeError, match="sparse"):
        opt.step()


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_a_state_dict_in_an_older_format_loads_as_the_rule_would_load_it(make_store, tier):
    """A state dict saved by an older torch (Adam's ``step`` a python number) loads as
    the plain optimizer's ``load_state_dict`` loads it (torch brings it up to date in
    the rule's ``__setstate__``): the next steps equal plain's."""
    plain, off = _twin(2)
    src = copy.deepcopy(plain)
    opt_src = torch.optim.Adam(src.parameters(), lr=1e-3)
    for x in _batches(0):
        nn.functional.cross_entropy(src(x).flatten(0, 1), x.flatten()).backward()
    opt_src.step()
    sd = opt_src.state_dict()
    for st in sd["state"].values():
        st["step"] = float(st["step"])  # as torch < 1.12 saved it
    opt_p = torch.optim.Adam(plain.parameters(), lr=1e-3)
    opt_o = offload_optimizer(torch.optim.Adam(off.parameters(), lr=1e-3), make_store(), tier=tier)
    opt_p.load_state_dict(copy.deepcopy(sd))
    opt_o.load_state_dict(copy.deepcopy(sd))
    for step in range(1, 4):
        for model, opt in ((plain, opt_p), (off, opt_o)):
            for x in _batches(step):
                nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        _assert_equal(plain, off, step)
    assert all(torch.is_tensor(st["step"]) for st in opt_o.state_dict()["state"].values())


@pytest.mark.parametrize("lost", ["exp_avg", "master"])
def test_a_resume_refuses_a_parameter_whose_state_is_there_in_part(make_store, lost):
    """A parameter whose state is in the pool only in part (one state tensor's objects,
    or its fp32 master's, freed by hand or lost) is refused by ``resume=True`` with a
    ``ValueError`` naming it, as a parameter whose state is all gone is: never resumed
    with a ``KeyError`` inside torch at the next step, nor silently left at its initial
    value."""
    s = make_store(host_bytes="64MiB")
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)).to(torch.bfloat16)
    make = lambda: offload_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), s, tier="host",  # noqa: E731
                                     durable=True, crash_consistent=True, resume=True)
    opt = make()
    for _ in range(2):
        model(torch.ones(2, 16, dtype=torch.bfloat16)).sum().backward()
        opt.step()
        opt.zero_grad()
    del opt
    gone = [k for k in s.keys("opt/0.2/") if k.split("/")[-1].split("@")[0].split("#")[0] == lost]
    assert gone
    for k in gone:
        s.free(s.lookup(k))
    with pytest.raises(ValueError, match="parameter 0.2"):
        make()
