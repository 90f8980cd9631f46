"""Distributed training under torchrun (gloo, CPU): checkpoints with resharding, tensor
and pipeline parallelism, and several nodes, each against the same run without tierstore.

The scripts (tests/dist_*.py) do the checking on every rank and print ``rank R ... ok``."""

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(__file__)


def torchrun(nproc, script, *args, node=None, env=None, timeout=600):
    """Run ``script`` under torchrun on ``nproc`` local ranks (one node of two with ``node=(rank, port)``)."""
    launch = ["--standalone"] if node is None else [
        "--nnodes=2", f"--node-rank={node[0]}", "--master-addr=127.0.0.1", f"--master-port={node[1]}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", *launch, f"--nproc-per-node={nproc}",
           os.path.join(HERE, script), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def assert_ranks_ok(r, nproc, what, first=0):
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    for rank in range(first, first + nproc):
        assert f"rank {rank} {what} ok" in r.stdout, r.stdout[-2000:]


@pytest.mark.parametrize("ranks", [1, pytest.param(4, marks=pytest.mark.slow)])
def test_dcp_saved_on_two_ranks_loads_on_another_number_and_continues_as_plain(daemon, tmp_path, ranks):
    """FSDP2 + offloaded AdamW: dcp.save of get_state_dict on 2 ranks; dcp.load + set_state_dict
    on ``ranks`` ranks gives the same parameters and optimizer state as plain AdamW saved and
    loaded the same way, at the saved step, and the next steps stay equal."""
    ckpt = tmp_path / "ckpt"
    assert_ranks_ok(torchrun(2, "dist_checkpoint.py", "save", ckpt, daemon.socket, "dcp-save"), 2, "save")
    assert_ranks_ok(torchrun(ranks, "dist_checkpoint.py", "load", ckpt, daemon.socket, "dcp-load"), ranks, "load")
    with daemon.client("dcp-load/rank0") as c:
        assert set(c.stat()["namespaces"]) >= {f"dcp-load/rank{r}" for r in range(ranks)}


def test_dcp_save_streams_offloaded_state_from_the_pool_and_dcp_load_puts_it_back(make_store, tmp_path):
    """dcp_save fetches each state tensor from the pool when the writer writes it, and the
    writer drops it when its file closes: with files of one tensor's size, at most two
    tensors' worth of state is in memory at once (the counter inside the planner), where
    one file per rank holds all of it. The checkpoint is DCP's format: plain AdamW loads it
    with dcp.load + set_state_dict, dcp_load puts it back into a fresh offloaded optimizer
    a shard at a time, and both continue equal to the original plain run."""
    import copy
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from tierstore.client.torch import dcp_load, dcp_save, offload_optimizer

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process, no group

    def steps(model, opt, start, end):
        for step in range(start, end):
            x = torch.randn(4, 256, generator=torch.Generator().manual_seed(step))
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    torch.manual_seed(0)
    plain = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])
    init, off = copy.deepcopy(plain), copy.deepcopy(plain)
    opt_p = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    store = make_store(host_bytes="64MiB")
    opt_o = offload_optimizer(torch.optim.AdamW(off.parameters(), lr=1e-2), store, tier="host", prefix="a")
    steps(plain, opt_p, 0, 2)
    steps(off, opt_o, 0, 2)
    one = 256 * 256 * 4  # a weight's exp_avg
    streamed = dcp_save(off, opt_o, tmp_path / "streamed", file_bytes=one)
    whole = dcp_save(off, opt_o, tmp_path / "whole", file_bytes=1 << 40)  # one file: the writer keeps it all
    assert streamed.total_bytes == whole.total_bytes >= 16 * one and streamed.tensors == 48
    assert whole.peak_bytes == whole.total_bytes
    assert streamed.peak_bytes <= 2 * one, streamed.peak_bytes
    assert streamed.live_bytes == 0 and len(list((tmp_path / "streamed").glob("*.distcp"))) > 16

    plain2 = copy.deepcopy(init)
    opt_p2 = torch.optim.AdamW(plain2.parameters(), lr=1e-3)
    msd, osd = get_state_dict(plain2, opt_p2)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=tmp_path / "streamed")
    set_state_dict(plain2, opt_p2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    off2 = copy.deepcopy(init)
    opt_o2 = offload_optimizer(torch.optim.AdamW(off2.parameters(), lr=1e-3), store, tier="host", prefix="b")
    loaded = dcp_load(off2, opt_o2, tmp_path / "streamed")
    assert loaded.total_bytes == streamed.total_bytes and loaded.peak_bytes <= 2 * one and loaded.live_bytes == 0
    assert opt_o2.param_groups[0]["lr"] == 1e-2
    for p, q in zip(plain.parameters(), off2.parameters()):
        assert torch.equal(opt_p.state[p]["exp_avg_sq"], opt_o2.state[q]["exp_avg_sq"])
    for model, opt in ((plain, opt_p), (plain2, opt_p2), (off2, opt_o2)):
        steps(model, opt, 2, 4)
    for a, b, c in zip(plain.parameters(), plain2.parameters(), off2.parameters()):
        assert torch.equal(a, b) and torch.equal(a, c)
    with pytest.raises(TypeError, match="offloaded optimizer"):
        dcp_save(plain, opt_p, tmp_path / "no")
    dcp_save(off2, opt_o2, tmp_path / "nested", key="stage0")  # a pipeline stage's own name
    meta = dcp.FileSystemReader(str(tmp_path / "nested")).read_metadata()
    assert all(k.startswith("stage0.") for k in meta.state_dict_metadata)
    off3 = copy.deepcopy(init)
    opt_o3 = offload_optimizer(torch.optim.AdamW(off3.parameters(), lr=1e-3), store, tier="host", prefix="c")
    dcp_load(off3, opt_o3, tmp_path / "nested", key="stage0")
    for p, q in zip(off2.parameters(), off3.parameters()):
        assert torch.equal(p, q) and torch.equal(opt_o2.state[p]["exp_avg"], opt_o3.state[q]["exp_avg"])


@pytest.mark.parametrize("options", ["default", "flatten", "full"])
def test_get_and_set_state_dict_speak_parameter_names_without_a_process_group(make_store, options):
    """get_state_dict of a trained offloaded optimizer gives the plain optimizer's state under
    parameter names (no extra zero-gradient step taken on it), and set_state_dict of that
    into a fresh offloaded optimizer continues as plain does."""
    import copy

    import torch
    from torch import nn
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    from tierstore.client.torch import offload_optimizer

    opts = {"default": StateDictOptions(), "flatten": StateDictOptions(flatten_optimizer_state_dict=True),
            "full": StateDictOptions(full_state_dict=True)}[options]

    def steps(model, opt, start, end):
        for step in range(start, end):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            nn.functional.mse_loss(model(x), x).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 8))
    off = copy.deepcopy(plain)
    opt_p = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    store = make_store()
    opt_o = offload_optimizer(torch.optim.AdamW(off.parameters(), lr=1e-2), store, tier="host", prefix="a")
    assert not opt_o.state
    steps(plain, opt_p, 0, 2)
    steps(off, opt_o, 0, 2)
    assert len(opt_o.state) == 4 and torch.equal(opt_o.state[off[0].weight]["exp_avg"], opt_p.state[plain[0].weight]["exp_avg"])
    _, osd_p = get_state_dict(plain, opt_p, options=opts)
    _, osd_o = get_state_dict(off, opt_o, options=opts)
    if options == "flatten":  # "state.0.weight.exp_avg": one flat key per tensor
        assert set(osd_o) == set(osd_p) and "state.0.weight.exp_avg" in osd_o
        for k, v in osd_p.items():
            assert torch.equal(v, osd_o[k]) if isinstance(v, torch.Tensor) else v == osd_o[k], k
    else:
        assert set(osd_o["state"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
        for fqn, st in osd_p["state"].items():
            for k, v in st.items():
                assert torch.equal(v, osd_o["state"][fqn][k]), (fqn, k)
    fresh = copy.deepcopy(off)
    opt_f = offload_optimizer(torch.optim.AdamW(fresh.parameters(), lr=1e-2), store, tier="host", prefix="b")
    set_state_dict(fresh, opt_f, model_state_dict=fresh.state_dict(), optim_state_dict=osd_o, options=opts)
    steps(plain, opt_p, 2, 4)
    steps(fresh, opt_f, 2, 4)
    for a, b in zip(plain.parameters(), fresh.parameters()):
        assert torch.equal(a, b)


SHARDED_RUNS = [(2, ""), pytest.param(6, "", marks=pytest.mark.slow), pytest.param(4, "prefetch", marks=pytest.mark.slow)]
"""(steps, extra): the default run, a longer one, and one with FSDP2's explicit prefetching
and a block kept unsharded from forward to backward."""


@pytest.mark.parametrize("steps,extra", SHARDED_RUNS)
def test_fsdp2_with_offloaded_parameter_shards_and_optimizer_equals_plain(daemon, tmp_path, steps, extra):
    """FSDP2 over 2 ranks, a GPT-style model: each rank's local parameter shards and
    optimizer state in its own namespace, brought in for FSDP2's all-gathers and the
    optimizer step and released between; losses and parameters equal plain AdamW's bit for
    bit every step, no shard is resident between steps, and the pool holds each shard.
    Then dcp_save, dcp_load into a fresh offloaded model and optimizer, and one more step
    equal to plain's."""
    assert_ranks_ok(torchrun(2, "dist_parallel.py", "fsdp2", daemon.socket, "fsdp-job", "params", steps, tmp_path,
                             *[extra][:bool(extra)]), 2, "fsdp2")
    with daemon.client("fsdp-job/rank1") as c:
        assert c.keys(prefix="fsdp2-params/")


@pytest.mark.parametrize("steps,extra", SHARDED_RUNS)
def test_tensor_parallel_x_fsdp2_on_a_2x2_mesh_equals_plain(daemon, tmp_path, steps, extra):
    """GPT-style blocks with q/k/v/fc1 column- and o/fc2 row-parallel over "tp", FSDP2 over "dp":
    with the parameters' 2-D local shards and the optimizer state offloaded, losses and
    parameters equal plain AdamW's bit for bit every step, each rank's shards and state
    in its own namespace; through dcp_save / dcp_load into a fresh model, one more step
    equal to plain's."""
    assert_ranks_ok(torchrun(4, "dist_parallel.py", "tp", daemon.socket, "tp-job", "params", steps, tmp_path,
                             *[extra][:bool(extra)]), 4, "tp")
    with daemon.client("tp-job/rank0") as c:
        assert {f"tp-job/rank{r}" for r in range(4)} <= set(c.stat()["namespaces"])
        assert c.keys(prefix="tp-params/")


@pytest.mark.parametrize("schedule", ["gpipe", pytest.param("1f1b", marks=pytest.mark.slow)])
def test_pipeline_stages_with_offloaded_parameters_and_optimizer_equal_plain(daemon, schedule):
    """Two pipeline stages, 4 microbatches: each stage's parameters and optimizer state in
    its rank's namespace; per-microbatch losses and parameters equal plain every step."""
    assert_ranks_ok(torchrun(2, "dist_parallel.py", schedule, daemon.socket, "pp-job", "params"), 2, schedule)


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _errors(outs):
    """The lines of the ranks' output that say what failed."""
    return "\n".join(line for o in outs for line in o.splitlines() if "Error" in line or " ok" in line)[-4000:]


_AGENT_EXIT_S = 420
"""How long a node's torchrun may take: its agent's exit barrier alone waits up to 300 s
for the other node's agent (torch's ``exit_barrier_timeout``, not settable from torchrun)."""


def _two_nodes(daemons, *args, node0_stdout=None):
    """Start both nodes' torchrun (2 ranks each), each with its own node's daemon socket."""
    port = _free_port()
    procs = []
    for node, d in enumerate(daemons):
        env = dict(os.environ, TIERSTORE_SOCKET=d.socket)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
               "--nproc-per-node=2", "--master-addr=127.0.0.1", f"--master-port={port}",
               os.path.join(HERE, "dist_nodes.py"), *map(str, args)]
        out = node0_stdout if node == 0 and node0_stdout is not None else subprocess.PIPE
        procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, text=True))
    return procs


def test_two_nodes_train_with_their_own_daemons_equal_plain(daemon_factory):
    """Two simulated nodes, a daemon each (separate sockets and NVMe directories), torchrun
    --nnodes 2 with a localhost rendezvous, 2 ranks per node: each rank's state is in its
    own node's daemon and the job ends equal to plain AdamW."""
    daemons = [daemon_factory(name="node0-"), daemon_factory(name="node1-")]
    procs = _two_nodes(daemons, "nodes-job", 3)
    out = [p.communicate(timeout=_AGENT_EXIT_S)[0] for p in procs]
    # (node 0's torchrun agent hosts the rendezvous store: when it is done first on a busy
    # machine, node 1's agent can fail its exit barrier after every rank finished, and an
    # agent whose peer left can wait out the barrier's timeout; the ranks' own lines below
    # are what this test checks)
    assert all(p.returncode == 0 or "Error waiting on exit barrier" in o for p, o in zip(procs, out)), _errors(out)
    for node, d in enumerate(daemons):
        for rank in (2 * node, 2 * node + 1):
            assert f"rank {rank} nodes ok from 0 (found 0)" in out[node], out[node][-2000:]
        with d.client(f"nodes-job/rank{2 * node}") as c:  # each node's daemon holds its own ranks only
            own = {ns for ns in c.stat()["namespaces"] if ns.startswith("nodes-job/")}
            assert own == {f"nodes-job/rank{2 * node + r}" for r in range(2)}, own


@pytest.mark.slow
def test_two_nodes_train_with_their_own_daemons_and_resume_after_one_daemon_is_killed(daemon_factory, tmp_path):
    """Two simulated nodes (a daemon each, separate sockets and NVMe directories; torchrun
    --nnodes 2 with a localhost rendezvous, 2 ranks per node) train data-parallel with
    durable offloaded state; node 1's daemon is SIGKILLed after step 3, so node 1's ranks fail
    in step 4's optimizer step while node 0's complete it; the daemon restarts on the same
    directory, and the relaunched job's ranks agree on step 3 (node 0's go back one step)
    and end equal to plain AdamW."""
    daemons = [daemon_factory(name="node0-"), daemon_factory(name="node1-")]
    gate = tmp_path / "gate"
    node0, node1 = _two_nodes(daemons, "nodes-job", 6, 3, gate)
    for line in node0.stdout:
        if line.strip() == "gate":
            break
    else:
        node1.kill()
        raise AssertionError("the job never reached the gate: " + node1.communicate()[0][-3000:])
    daemons[1].kill()  # SIGKILL while every rank waits between steps 3 and 4; then they go on
    gate.touch()
    out = [p.communicate(timeout=_AGENT_EXIT_S)[0] for p in (node0, node1)]
    assert node1.returncode != 0 and "DaemonUnavailable" in out[1], out[1][-3000:]
    assert node0.returncode != 0
    daemons[1].start()
    procs = _two_nodes(daemons, "nodes-job", 6)
    out = [p.communicate(timeout=_AGENT_EXIT_S)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), _errors(out)
    for rank in range(4):  # node 0's ranks had completed step 4, node 1's step 3
        assert f"rank {rank} nodes ok from 3 (found {4 if rank < 2 else 3})" in out[rank // 2], out[rank // 2][-2000:]
    for node, d in enumerate(daemons):
        with d.client(f"nodes-job/rank{2 * node}") as c:
            assert {f"nodes-job/rank{2 * node + r}" for r in range(2)} <= set(c.stat()["namespaces"])


def test_sharded_snapshot_of_two_nodes_has_a_store_per_rank_and_an_index_and_restores_the_layout(
        daemon_factory, tmp_path):
    """`tierstore snapshot --sharded` on each of two nodes writes one Zarr store per rank
    namespace into a shared directory and an index fragment per node; the merged index says
    which rank is in which store on which node; after the objects are freed, `tierstore
    restore --sharded` on each node puts every rank's objects back into the same namespace
    on the same node, and a node the index does not name is refused."""
    import torch

    from tierstore.client.sharded import read_index, restore_job
    from tierstore.errors import NotFound
    from tierstore.snapshot import open_snapshot

    def cli(*args):
        r = subprocess.run([sys.executable, "-m", "tierstore.client.cli", *map(str, args)], capture_output=True,
                           text=True, timeout=120)
        return r

    nodes = [daemon_factory(name="snap-node0-"), daemon_factory(name="snap-node1-")]
    want = {}
    for rank in range(4):
        with nodes[rank // 2].client(f"job7/rank{rank}") as c:
            for key, t in {f"opt/0.{rank}/exp_avg@0": torch.full((5, 3), float(rank)),
                           f"params/w{rank}": torch.arange(7 + rank, dtype=torch.int64)}.items():
                c.put(t, key=key, durable=True)
                want[(rank, key)] = t
    with nodes[0].client("other-job/rank0") as c:
        c.put(torch.ones(2), key="not/this/job")
    dest = tmp_path / "shared"
    for n, d in enumerate(nodes):
        r = cli("snapshot", "--sharded", "--node", f"node{n}", "--socket", d.socket, "job7", dest)
        assert r.returncode == 0, r.stderr
        assert f"node node{n}: 2 namespaces of job7" in r.stdout
    index = read_index(str(dest))
    assert index["job"] == "job7" and index["ranks"] == {r: f"job7/rank{r}" for r in range(4)}
    for rank in range(4):
        e = index["namespaces"][f"job7/rank{rank}"]
        assert (e["node"], e["store"], e["objects"], e["prefixes"]) == (f"node{rank // 2}", f"rank{rank}.zarr", 2,
                                                                        ["opt/", "params/"])
        assert dict(open_snapshot(str(dest / e["store"])).attrs)["namespace"] == f"job7/rank{rank}"
    for rank in range(4):  # the pool loses the job's objects; the snapshot brings them back
        with nodes[rank // 2].client(f"job7/rank{rank}") as c:
            for key in c.keys(prefix=""):
                c.free(c.lookup(key))
    with pytest.raises(NotFound, match="nothing for node 'node9'"):
        restore_job(nodes[0].client, str(dest), node="node9")
    r = cli("restore", "--sharded", "--node", "node0", "--socket", nodes[0].socket, dest)
    assert r.returncode == 0, r.stderr
    assert set(restore_job(nodes[1].client, str(dest), node="node1")) == {"job7/rank2", "job7/rank3"}
    for (rank, key), t in want.items():
        with nodes[rank // 2].client(f"job7/rank{rank}") as c:
            assert torch.equal(c.get(c.lookup(key)), t), (rank, key)
        with nodes[1 - rank // 2].client(f"job7/rank{rank}") as c:
            assert c.lookup(key) is None  # each rank only on its own node


@pytest.mark.slow
def test_train_dist_bench_smoke(tmp_path):
    """bench/train_dist.py at a tiny size, every layout on 4 ranks: its results check passes
    and stdout ends with one JSON line."""
    import json

    r = subprocess.run([sys.executable, os.path.join(HERE, "..", "bench", "train_dist.py"), "--quick",
                        "--dir", str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["bench"] == "train_dist" and out["all_equal"]
    assert {(x["layout"], x["variant"]) for x in out["results"]} == {
        (lay, v) for lay in ("fsdp2", "tp+fsdp2", "pipeline") for v in ("plain", "offloaded")}


def test_sharded_snapshot_to_an_fsspec_url(daemon):
    """A sharded snapshot to a URL (fsspec's memory filesystem here): the stores and the index
    fragment go there and a restore brings the namespaces back."""
    import torch

    from tierstore.client.sharded import read_index, restore_job, snapshot_job

    for rank in (0, 1):
        with daemon.client(f"jobu/rank{rank}") as c:
            c.put(torch.full((4,), float(rank)), key="opt/x@0")
    url = f"memory://sharded-{os.getpid()}/ckpt"
    doc = snapshot_job(daemon.client, "jobu", url, node="n0")
    assert {e["store"] for e in doc["namespaces"].values()} == {"rank0.zarr", "rank1.zarr"}
    assert read_index(url)["ranks"] == {0: "jobu/rank0", 1: "jobu/rank1"}
    for rank in (0, 1):
        with daemon.client(f"jobu/rank{rank}") as c:
            c.free(c.lookup("opt/x@0"))
    assert set(restore_job(daemon.client, url, node="n0")) == {"jobu/rank0", "jobu/rank1"}
    for rank in (0, 1):
        with daemon.client(f"jobu/rank{rank}") as c:
            assert torch.equal(c.get(c.lookup("opt/x@0")), torch.full((4,), float(rank)))


@pytest.mark.parametrize("bad", ["absolute store", "store up", "namespace outside the job", "not a map",
                                 "no namespaces", "rank", "not json"])
def test_a_sharded_index_that_names_paths_or_namespaces_outside_is_refused(daemon, tmp_path, bad):
    """Every name in an index fragment is used as a path (its stores) or a namespace to
    restore into: a store that is not a plain name inside the snapshot, a namespace outside
    the job, or a fragment that does not hold together is refused in one line, and nothing
    is restored."""
    import json

    import torch

    from tierstore import InvalidArgument
    from tierstore.client.sharded import read_index, restore_job, snapshot_job

    with daemon.client("jobh/rank0") as c:
        c.put(torch.ones(4), key="x")
    dest = tmp_path / "ckpt"
    snapshot_job(daemon.client, "jobh", str(dest), node="n0")
    frag = dest / "index" / "n0.json"
    doc = json.loads(frag.read_text())
    e = doc["namespaces"]["jobh/rank0"]
    if bad == "absolute store":
        e["store"] = str(tmp_path / "elsewhere.zarr")
    elif bad == "store up":
        e["store"] = "../victim.zarr"
    elif bad == "namespace outside the job":
        doc["namespaces"]["other-team/rank7"] = doc["namespaces"].pop("jobh/rank0")
    elif bad == "not a map":
        doc = [doc]
    elif bad == "no namespaces":
        doc["namespaces"] = ["jobh/rank0"]
    elif bad == "rank":
        e["rank"] = "0; rm"
    frag.write_text("{not json" if bad == "not json" else json.dumps(doc))
    with pytest.raises(InvalidArgument) as err:
        read_index(str(dest))
    assert "\n" not in str(err.value)
    with daemon.client("jobh/rank0") as c:
        c.free(c.lookup("x"))
    with pytest.raises(InvalidArgument):
        restore_job(daemon.client, str(dest), node="n0")
    with daemon.client("jobh/rank0") as c:
        assert c.keys() == []


def test_a_sharded_snapshot_writes_through_no_planted_index_link(daemon, tmp_path):
    """A destination whose index directory is a link (planted by whoever could write the
    destination), or that another uid owns, is refused before anything is written."""
    import pwd

    import torch

    from tierstore import InvalidArgument
    from tierstore.client.sharded import snapshot_job

    with daemon.client("jobl/rank0") as c:
        c.put(torch.ones(4), key="x")
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    dest = tmp_path / "ckpt"
    dest.mkdir()
    os.symlink(private, dest / "index")
    with pytest.raises(InvalidArgument, match="is a symbolic link"):
        snapshot_job(daemon.client, "jobl", str(dest), node="n0")
    assert os.listdir(private) == [] and os.listdir(dest) == ["index"]
    if os.geteuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        nobody = pwd.getpwnam("nobody")
        os.chown(theirs, nobody.pw_uid, nobody.pw_gid)
        with pytest.raises(InvalidArgument, match="owned by uid"):
            snapshot_job(daemon.client, "jobl", str(theirs), node="n0")


def test_rewind_to_goes_back_one_step_with_two_versions_only(make_store):
    """rewind_to(completed - 1) restores the previous step's state and (fp32 masters) its
    parameters, so continuing equals plain; further back, with single-version state, or over
    a step that gave a parameter its first state and master, is refused."""
    import copy

    import torch
    from torch import nn

    from tierstore.client.torch import offload_optimizer

    def steps(model, opt, start, end, late=-1):
        for step in range(start, end):
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
            out = model[0](x) if step < late else model[1](model[0](x))  # model[1] trains from step `late` on
            nn.functional.mse_loss(out, x).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    def offloaded(model, prefix, **kw):
        return offload_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), store, prefix=prefix, **kw)

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 6))
    off, late = copy.deepcopy(plain), copy.deepcopy(plain)
    opt_p = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    store = make_store()
    opt_o = offloaded(off, "r", tier="nvme", master_weights=True, crash_consistent=True)
    steps(plain, opt_p, 0, 2)
    steps(off, opt_o, 0, 3)
    with pytest.raises(ValueError, match="one step only"):
        opt_o.rewind_to(1)
    opt_o.rewind_to(2)
    assert opt_o.completed_steps == 2
    with pytest.raises(ValueError, match="not kept"):
        opt_o.rewind_to(1)  # the step before that is gone
    steps(plain, opt_p, 2, 4)
    steps(off, opt_o, 2, 4)
    for a, b in zip(plain.parameters(), off.parameters()):
        assert torch.equal(a, b)
    opt_l = offloaded(late, "l", tier="nvme", master_weights=True, crash_consistent=True)
    steps(late, opt_l, 0, 3, late=2)
    with pytest.raises(ValueError, match="parameter 0.2 got its state and fp32 master in step 3"):
        opt_l.rewind_to(2)
    one = copy.deepcopy(plain)
    single = offloaded(one, "s", tier="host", crash_consistent=False)
    steps(one, single, 0, 2)
    single.rewind_to(2)  # where it is: nothing to do
    with pytest.raises(ValueError, match="crash_consistent=True"):
        single.rewind_to(1)
