"""The offloaded optimizer where training code does what plain torch allows: weights
changed through ``p.data``, a state dict that cannot be loaded, an older torch's state,
state-dict hooks, sparse gradients in backward, a second wrap, a bad tier, a second
update-in-backward optimizer over the same parameters, ``torch.compile(opt.step)``.
Each compared with the plain optimizer doing the same, or refused before anything
changes."""

import copy

import pytest
import torch
from torch import nn

from tierstore import InvalidArgument
from tierstore.client.torch import offload_optimizer


def _step(model, opt, k, dtype=torch.float32):
    model(torch.full((2, model.in_features), float(k + 1), dtype=dtype)).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def _twins(dtype=torch.float32):
    torch.manual_seed(0)
    plain = nn.Linear(8, 8).to(dtype)
    return plain, copy.deepcopy(plain)


def _change_through_data(w, how):
    if how == "p.data.mul_":
        w.data.mul_(0.5)
    elif how == "p.data.copy_":
        w.data.copy_(torch.ones_like(w))
    elif how == "p.data =":
        w.data = torch.full_like(w, 0.25)
    else:
        w.data[3].zero_()


_THROUGH_DATA = ["p.data.mul_", "p.data.copy_", "p.data =", "p.data[row].zero_()"]


@pytest.mark.parametrize("how", _THROUGH_DATA)
def test_a_weight_changed_through_data_is_not_undone_by_the_master(make_store, how):
    """A parameter with an fp32 master (``master_weights=True``) changed through ``p.data``
    — which leaves ``_version`` as it was — between steps: the next update starts from
    the parameter as changed, as the plain optimizer's does, bit for bit."""
    s = make_store()
    plain, off = _twins()
    popt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    oopt = offload_optimizer(torch.optim.AdamW(off.parameters(), lr=1e-2), s, prefix="m", master_weights=True)
    for k in range(2):
        _step(plain, popt, k)
        _step(off, oopt, k)
    for m in (plain, off):
        _change_through_data(m.weight, how)
    for k in range(2, 4):
        _step(plain, popt, k)
        _step(off, oopt, k)
        for a, b in zip(plain.parameters(), off.parameters()):
            assert torch.equal(a, b), (how, k)


@pytest.mark.parametrize("how", _THROUGH_DATA)
def test_a_bf16_weight_changed_through_data_stays_changed(make_store, how):
    """The same for a bf16 parameter (its master kept by default), with a learning rate of
    0: a step changes nothing, so the parameter must stay as it was changed."""
    s = make_store()
    _, off = _twins(torch.bfloat16)
    oopt = offload_optimizer(torch.optim.AdamW(off.parameters(), lr=0.0), s, prefix="bf")
    _step(off, oopt, 0, torch.bfloat16)
    _change_through_data(off.weight, how)
    changed = off.weight.detach().clone()
    _step(off, oopt, 1, torch.bfloat16)
    assert torch.equal(off.weight, changed), how


def test_a_state_dict_refused_by_a_load_changes_nothing(make_store):
    """A state dict with a value the pool cannot hold (a string) for its second parameter:
    refused whole before anything changes — the groups' settings, the state, the progress
    record — and training goes on exactly as the plain optimizer's after its load."""
    s = make_store()
    plain, off = _twins()
    popt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    oopt = offload_optimizer(torch.optim.AdamW(off.parameters(), lr=1e-2), s, prefix="bad")
    for k in range(3):
        _step(plain, popt, k)
        _step(off, oopt, k)
    bad = copy.deepcopy(popt.state_dict())
    bad["param_groups"][0]["lr"] = 0.5
    bad["state"][1]["note"] = "from my trainer"
    with pytest.raises(TypeError, match="parameter 0.1's state 'note'"):
        oopt.load_state_dict(bad)
    bad["state"][1]["note"] = torch.empty(8, device="meta")
    with pytest.raises(TypeError, match="parameter 0.1's state 'note': a meta tensor"):
        oopt.load_state_dict(bad)
    assert oopt.param_groups[0]["lr"] == 1e-2 and oopt.completed_steps == 3
    assert s.lookup("bad/_progress") is not None
    assert torch.equal(oopt.state[off.bias]["exp_avg"], popt.state[plain.bias]["exp_avg"])
    for k in range(3, 5):
        _step(plain, popt, k)
        _step(off, oopt, k)
        assert torch.equal(plain.weight, off.weight) and torch.equal(plain.bias, off.bias), k


def test_a_load_that_fails_part_way_is_said_until_a_load_succeeds(make_store):
    """A load whose puts fail part-way (the fourth put raises, as a pool gone away
    would) leaves no half-loaded state to train on silently: ``step()`` and
    ``state_dict()`` say so until a load succeeds (or ``free()``)."""
    s = make_store()
    plain, off = _twins()
    popt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    oopt = offload_optimizer(torch.optim.AdamW(off.parameters(), lr=1e-2), s, prefix="half")
    for k in range(2):
        _step(plain, popt, k)
        _step(off, oopt, k)
    sd = copy.deepcopy(popt.state_dict())
    real, calls = oopt.state_tensors.put_both, []

    def failing(gi, pi, name, t):
        calls.append(name)
        if len(calls) > 3:
            raise OSError("the pool went away")
        return real(gi, pi, name, t)
    oopt.state_tensors.put_both = failing
    with pytest.raises(OSError):
        oopt.load_state_dict(sd)
    oopt.state_tensors.put_both = real
    with pytest.raises(InvalidArgument, match="a load_state_dict failed part-way"):
        _step(off, oopt, 2)
    oopt.zero_grad()  # (the refused step left its gradients)
    with pytest.raises(InvalidArgument, match="load a state dict again"):
        oopt.state_dict()
    oopt.load_state_dict(sd)
    for k in range(2, 4):
        _step(plain, popt, k)
        _step(off, oopt, k)
        assert torch.equal(plain.weight, off.weight), k


def test_an_older_torchs_none_state_loads_and_wraps_as_plain(make_store):
    """torch 1.x's SGD kept ``momentum_buffer: None`` without momentum: a state dict with it
    loads, and an optimizer holding it wraps, as plain torch takes it."""
    s = make_store()
    plain, off = _twins()
    popt = torch.optim.SGD(plain.parameters(), lr=0.1)
    sd = {"state": {0: {"momentum_buffer": None}, 1: {"momentum_buffer": None}},
          "param_groups": copy.deepcopy(popt.state_dict()["param_groups"])}
    popt.load_state_dict(copy.deepcopy(sd))
    inner = torch.optim.SGD(off.parameters(), lr=0.1)
    inner.load_state_dict(copy.deepcopy(sd))
    oopt = offload_optimizer(inner, s, prefix="none")  # (wrapping moves the state it holds)
    oopt.load_state_dict(copy.deepcopy(sd))
    for k in range(3):
        _step(plain, popt, k)
        _step(off, oopt, k)
        assert torch.equal(plain.weight, off.weight), k


def test_state_dict_hooks_run_and_loaded_groups_are_copies(make_store):
    s = make_store()
    plain, off = _twins()
    ran = []
    src = offload_optimizer(torch.optim.AdamW(plain.parameters(), lr=torch.tensor(1e-2)), s, prefix="src")
    dst = offload_optimizer(torch.optim.AdamW(off.parameters(), lr=torch.tensor(1e-3)), s, prefix="dst")
    _step(plain, src, 0)
    src.register_state_dict_pre_hook(lambda o: ran.append("pre"))
    src.register_state_dict_post_hook(lambda o, sd: ran.append("post") or {**sd, "extra": 1})
    dst.register_load_state_dict_pre_hook(lambda o, sd: ran.append("load_pre"))
    dst.register_load_state_dict_post_hook(lambda o: ran.append("load_post"))
    sd = src.state_dict()
    assert sd["extra"] == 1
    dst.load_state_dict(sd)
    assert ran == ["pre", "post", "load_pre", "load_post"]
    assert dst.param_groups[0]["lr"] is not src.param_groups[0]["lr"]  # (torch deep-copies the groups)
    dst.param_groups[0]["lr"].fill_(1e-4)
    assert float(src.param_groups[0]["lr"]) == pytest.approx(1e-2)


@pytest.mark.parametrize("rule", ["SparseAdam", "Adagrad", "SGD"])
def test_sparse_gradients_update_in_backward_as_plain(make_store, rule):
    s = make_store()
    torch.manual_seed(0)
    plain = nn.Embedding(50, 8, sparse=True)
    off = copy.deepcopy(plain)
    make = {"SparseAdam": lambda ps: torch.optim.SparseAdam(ps, lr=1e-2),
            "Adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
            "SGD": lambda ps: torch.optim.SGD(ps, lr=1e-2)}[rule]
    popt = make(list(plain.parameters()))
    oopt = offload_optimizer(make(list(off.parameters())), s, prefix=f"sp{rule}", update_in_backward=True)
    for k in range(3):
        idx = torch.tensor([k, 7, 3 * k + 1])
        for m, o in ((plain, popt), (off, oopt)):
            m(idx).pow(2).sum().backward()
            o.step()
            o.zero_grad()
        assert torch.equal(plain.weight, off.weight), k


def test_misuse_at_construction_is_refused_before_any_step(make_store):
    s = make_store()
    lin = nn.Linear(4, 4)
    for tier in ("bogus", "NVMe", 3):
        with pytest.raises(InvalidArgument, match="tier must be one of"):
            offload_optimizer(torch.optim.AdamW(lin.parameters()), s, tier=tier, prefix="t")
    opt = offload_optimizer(torch.optim.AdamW(lin.parameters()), s, prefix="once")
    with pytest.raises(TypeError, match="offloaded already"):
        offload_optimizer(opt, s, prefix="twice")


def test_a_second_update_in_backward_optimizer_over_the_same_parameters_supersedes_the_first(make_store):
    """The newer one's hooks update the parameters in backward; the older one, stepped,
    says so instead of updating them a second time (or, with ``drop_grads``, never)."""
    s = make_store()
    plain, off = _twins()
    popt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    first = offload_optimizer(torch.optim.SGD(off.parameters(), lr=0.1, momentum=0.9), s, prefix="a",
                              update_in_backward=True, drop_grads=True)
    second = offload_optimizer(torch.optim.SGD(off.parameters(), lr=0.1, momentum=0.9), s, prefix="b",
                               update_in_backward=True, drop_grads=True)
    off(torch.ones(2, 8)).pow(2).sum().backward()
    with pytest.raises(InvalidArgument, match="took over this one's parameters"):
        first.step()
    second.step()
    plain(torch.ones(2, 8)).pow(2).sum().backward()
    popt.step()
    assert torch.equal(plain.weight, off.weight)


def test_a_compiled_step_runs_as_the_eager_one(make_store):
    s = make_store()
    plain, off = _twins()
    popt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    oopt = offload_optimizer(torch.optim.AdamW(off.parameters(), lr=1e-2), s, prefix="compiled")
    step = torch.compile(oopt.step)
    for k in range(2):
        plain(torch.full((2, 8), float(k + 1))).pow(2).sum().backward()
        popt.step()
        popt.zero_grad()
        off(torch.full((2, 8), float(k + 1))).pow(2).sum().backward()
        step()
        oopt.zero_grad()
        assert torch.equal(plain.weight, off.weight), k


@pytest.mark.parametrize("master", [False, True])
def test_a_resume_under_a_model_whose_shapes_changed_is_refused_before_any_update(make_store, master):
    """As many parameters as the run that wrote the state, but the head now has 5 outputs
    instead of 3: the resume is refused naming the parameter, and nothing was updated."""
    s = make_store()

    def model(out):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, out))
    m = model(3)
    opt = offload_optimizer(torch.optim.AdamW(m.parameters(), lr=0.1), s, prefix="run", master_weights=master)
    for _ in range(2):
        m(torch.ones(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    del opt
    m2 = model(5)
    before = [p.detach().clone() for p in m2.parameters()]
    with pytest.raises(ValueError, match=r"parameter 0\.2, whose shape is \[5, 4\]: the model changed"):
        offload_optimizer(torch.optim.AdamW(m2.parameters(), lr=0.1), s, prefix="run", resume=True,
                          master_weights=master)
    assert all(torch.equal(a, b) for a, b in zip(before, m2.parameters()))
