"""The command line as an operator meets it: one-line errors that say what to do, quiet
broken pipes, --version, help for every option, `tierstore config`, and the paper cuts
of a first hour (ls hints at other namespaces, demo --resume that cannot, bad keys)."""

import argparse
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

from tierstore import InvalidArgument, InvalidKey


def cli(*args, env=None, timeout=120):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "tierstore.client.cli", *args], capture_output=True, text=True,
                          env=e, timeout=timeout)


def _one_line(r):
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    return r.stderr.strip()


def test_version_flag_and_command():
    from tierstore import __version__

    assert cli("--version").stdout.strip() == f"tierstore {__version__}"
    assert cli("version").stdout.strip() == f"tierstore {__version__}"


def test_argument_errors_are_one_line_with_where_the_help_is():
    r = cli("ls", "--bogus")
    assert r.returncode == 2 and "--help" in _one_line(r)
    r = cli("demo", "--steps", "x")
    assert r.returncode == 2 and "tierstore demo: argument --steps" in _one_line(r)
    r = cli("stat", "--socket", "/nonexistent/ts.sock")  # no daemon there: the advice a command line can take
    line = _one_line(r)
    assert r.returncode == 1 and "DaemonUnavailable" in line and "--socket PATH" in line and "autostart" not in line
    for bad in ("inf", "1e300", "-1", "0", "1e-300", "0.001", "nan", "x"):  # refused before anything is drawn
        r = cli("stat", "--watch", bad, "--socket", "/nonexistent/ts.sock")
        assert r.returncode == 2 and "argument --watch" in _one_line(r) and not r.stdout, bad


def _all_actions(parser):
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sub in a.choices.values():
                yield from _all_actions(sub)
        else:
            yield parser.prog, a


def test_every_option_has_help():
    from tierstore.client.cli import build_parser
    from tierstore.client.cli.demo import build_parser as demo_parser
    from tierstore.config import daemon_parser

    for p in (build_parser(), demo_parser(), daemon_parser()):
        for prog, a in _all_actions(p):
            if a.help != argparse.SUPPRESS:
                assert a.help, f"{prog} {a.option_strings or a.dest} has no help"
    text = cli("demo", "--help").stdout
    assert text.rstrip().endswith(")") and "--resume" in text and "kill PID stops it gracefully" in text


def _all_parsers(parser):
    yield parser
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sub in a.choices.values():
                yield from _all_parsers(sub)


def test_every_help_text_renders():
    from tierstore.client.cli import build_parser
    from tierstore.client.cli.demo import build_parser as demo_parser
    from tierstore.config import daemon_parser

    for top in (build_parser(), demo_parser(), daemon_parser()):
        for p in _all_parsers(top):
            assert p.format_help(), p.prog  # argparse %-formats each help string: a bare % raises here
    r = subprocess.run([sys.executable, "-m", "tierstore.daemon", "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "--nvme-bytes" in r.stdout and "Traceback" not in r.stderr, r.stderr


def test_config_shows_each_setting_and_its_source(tmp_path):
    toml = tmp_path / "t.toml"
    toml.write_text('policy = "lru"\n')
    r = cli("config", "--config", str(toml), "--io-threads", "3", env={"TIERSTORE_NVME_BYTES": "2GiB"})
    assert r.returncode == 0, r.stderr
    rows = {ln.split()[0]: ln for ln in r.stdout.splitlines()[1:]}
    assert "flag --io-threads" in rows["io_threads"] and "env TIERSTORE_NVME_BYTES" in rows["nvme_bytes"]
    assert "2.0 GiB" in rows["nvme_bytes"] and f"file {toml}" in rows["policy"] and "default" in rows["lease_wait_s"]
    got = json.loads(cli("config", "--json", env={"TIERSTORE_NVME_BYTES": "2GiB"}).stdout)
    assert got["store"]["nvme_bytes"] == {"value": 2 << 30, "source": "env TIERSTORE_NVME_BYTES"}


def test_a_bad_variable_is_one_line_naming_it():
    r = cli("config", env={"TIERSTORE_PREFETCH_MAX_INFLIGHT": "abc"})
    line = _one_line(r)
    assert r.returncode == 2 and "TIERSTORE_PREFETCH_MAX_INFLIGHT='abc': expected an integer" in line


def test_daemon_with_an_unusable_directory_is_one_line(tmp_path):
    r = cli("daemon", "--nvme-dir", "/proc/nonexistent", "--socket", str(tmp_path / "s.sock"))
    line = _one_line(r)
    assert r.returncode == 1 and line.startswith("tierstore daemon: cannot start: cannot create NVMe directory "
                                                 "/proc/nonexistent") and "--nvme-dir" in line
    r = cli("daemon", "--socket", str(tmp_path / "s.sock"), env={"TIERSTORE_IO_THREADS": "many"})
    assert r.returncode == 2 and "TIERSTORE_IO_THREADS='many': expected an integer" in _one_line(r)
    r = cli("daemon", "--version")
    assert r.returncode == 0 and r.stdout.startswith("tierstore ")


def _piped_into_head(args, env):
    """Run the CLI into `head -n 1`; its stderr and status."""
    e = {**os.environ, **env}
    p = subprocess.Popen([sys.executable, "-m", "tierstore.client.cli", *args], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=e)
    head = subprocess.run(["head", "-n", "1"], stdin=p.stdout, capture_output=True, timeout=120)
    p.stdout.close()
    err = p.stderr.read().decode()
    p.wait(timeout=120)
    return head.stdout.decode(), err, p.returncode


def test_broken_pipes_end_quietly(daemon):
    with daemon.client("many") as c:  # a listing longer than the pipe's buffer, so the writer meets the close
        for i in range(500):
            c.put(torch.ones(1), key=f"k/{i:05d}/" + "x" * 120)
    env = {"TIERSTORE_SOCKET": daemon.socket}
    out, err, rc = _piped_into_head(["ls", "--namespace", "many"], env)
    assert out.startswith("KEY") and err == "" and rc == 141, err
    out, err, rc = _piped_into_head(["stat", "--watch", "0.05"], env)
    assert out.startswith("tierstore") and err == "" and rc == 141, err


def test_ls_without_a_namespace_says_which_others_exist(daemon):
    with daemon.client("job-42") as c:
        c.put(torch.ones(1), key="a")
    r = cli("ls", env={"TIERSTORE_SOCKET": daemon.socket})
    assert r.returncode == 0 and "the daemon also has job-42" in r.stderr and "--namespace" in r.stderr
    r = cli("ls", "--namespace", "job-42", env={"TIERSTORE_SOCKET": daemon.socket})
    assert r.returncode == 0 and r.stderr == "" and r.stdout.splitlines()[1].startswith("a ")


def test_ls_escapes_format_characters_that_would_disguise_a_key(daemon):
    """Keys may hold format characters (a right-to-left override, a zero-width space): in
    `tierstore ls` they are shown escaped, so "weights\u202egnp.exe" cannot pass for
    another name, nor two keys look the same."""
    with daemon.client("disguise") as c:
        c.put(torch.ones(1), key="weights\u202egnp.exe")
        c.put(torch.ones(1), key="opt\u200b/x")
    r = cli("ls", "--namespace", "disguise", env={"TIERSTORE_SOCKET": daemon.socket})
    assert r.returncode == 0, r.stderr
    assert "\u202e" not in r.stdout and "\u200b" not in r.stdout
    assert "weights\\u202egnp.exe" in r.stdout and "opt\\u200b/x" in r.stdout


def test_demo_whose_daemon_cannot_start_is_one_line(tmp_path):
    r = cli("demo", "--socket", str(tmp_path / "run" / "d.sock"),
            env={"TIERSTORE_PREFETCH_MAX_INFLIGHT": "abc", "XDG_CACHE_HOME": str(tmp_path / "cache")})
    line = _one_line(r)
    assert r.returncode == 1 and "the daemon started for you" in line and "exited with status 2" in line
    assert "TIERSTORE_PREFETCH_MAX_INFLIGHT='abc'" in line and str(tmp_path / "cache") in line


def test_demo_resume_without_state_says_so(daemon):
    r = cli("demo", "--socket", daemon.socket, "--namespace", "nothing-here/rank0", "--steps", "5", "--resume")
    assert r.returncode == 1 and "nothing to resume in namespace 'nothing-here/rank0'" in _one_line(r)
    assert "run without --resume" in r.stderr


@pytest.mark.parametrize("key", ["a\nb", "tab\there", "nul\0", "del\x7f", "sep\u2028"])
def test_keys_with_control_characters_are_refused_in_store_and_daemon(make_store, daemon, key):
    s = make_store()
    with pytest.raises(InvalidKey, match="which would break listings") as e:
        s.put(torch.ones(1), key=key)
    assert isinstance(e.value, KeyError) and isinstance(e.value, ValueError) and "\n" not in str(e.value)
    with daemon.client("keys") as c:
        with pytest.raises(InvalidKey, match="which would break listings"):
            c.put(torch.ones(1), key=key)
        assert c.keys() == []


def test_a_meta_tensor_is_refused_with_a_message(make_store, daemon):
    t = torch.empty(4, 4, device="meta")
    with pytest.raises(InvalidArgument, match="meta tensor .* materialize it first"):
        make_store().put(t)
    with daemon.client("meta") as c, pytest.raises(InvalidArgument, match="meta tensor"):
        c.put(t)


def test_restore_over_existing_keys_speaks_to_a_python_caller(daemon, tmp_path):
    from tierstore import KeyExists

    with daemon.client("snap") as c:
        c.put(torch.ones(2), key="w", durable=True)
        c.snapshot(str(tmp_path / "s.zarr"))
        with pytest.raises(KeyExists, match=r"overwrite=True \(tierstore restore --overwrite\)"):
            c.restore(str(tmp_path / "s.zarr"))


def test_offload_parameters_trains_without_torch_warnings(make_store):
    from tierstore.client.torch import offload_parameters

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        undo = offload_parameters(model, make_store(), tier="host", prefix="p")
        for _ in range(2):
            model(torch.randn(4, 8)).sum().backward()
        undo()
    assert not [w for w in caught if "backward hook" in str(w.message)], [str(w.message) for w in caught]


def test_empty_or_undecodable_arguments_are_refused_not_taken_for_defaults(daemon):
    """`--socket ""` and `--namespace ""` are mistakes (an unset variable), not the
    defaults; a key or prefix that is not UTF-8 is refused by name, not as a codec error."""
    with daemon.client("default") as c:
        c.put(torch.ones(1), key="a")
    env = {"TIERSTORE_SOCKET": daemon.socket}
    for args, what in ((["ls", "--socket", ""], "--socket: must not be empty"),
                       (["ls", "--namespace", ""], "--namespace: must not be empty"),
                       (["free", "--namespace", "", "a"], "--namespace: must not be empty"),
                       (["free", ""], "KEY: must not be empty"),
                       (["ls", "--prefix", b"\xff"], "--prefix: is not valid UTF-8: b'\\xff'"),
                       (["free", b"k\xfe"], "KEY: is not valid UTF-8"),
                       (["snapshot", "default", "/tmp/x", "--prefix", b"\xc3"], "--prefix: is not valid UTF-8")):
        r = cli(*args, env=env)
        assert r.returncode == 2 and what in _one_line(r), (args, r.stderr)
    with daemon.client("default") as c:
        assert c.keys() == ["a"]


def test_a_snapshot_url_without_its_filesystem_is_one_line(daemon, tmp_path):
    env = {"TIERSTORE_SOCKET": daemon.socket}
    r = cli("snapshot", "default", "nosuchscheme://bucket/snap", env=env)
    assert r.returncode == 1 and "InvalidArgument: nosuchscheme://bucket/snap is not a URL" in _one_line(r)
    r = cli("restore", "nosuchscheme://bucket/snap", "--namespace", "x", env=env)
    assert r.returncode == 1 and "InvalidArgument" in _one_line(r)
    try:
        import s3fs  # noqa: F401
    except ImportError:
        r = cli("snapshot", "default", "s3://bucket/snap", env=env)
        assert r.returncode == 1 and "s3:// needs a package that is not installed" in _one_line(r)
        assert "s3fs" in r.stderr


def test_stat_and_watch_against_a_daemon_that_stopped_answering_end_in_one_line(daemon):
    """A SIGSTOPped (or wedged) daemon: `stat`, `ls` and a `stat --watch` already drawing
    wait for each answer a bounded time (30 s; 1 s here), then end with one line, status
    1 — never hang."""
    import signal

    code = ("import sys\n"
            "import tierstore.client.cli.support as s\n"
            "s.ANSWER_WITHIN_S = 1.0\n"
            "from tierstore.client.cli import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    watch = subprocess.Popen([sys.executable, "-c", code, "stat", "--watch", "0.1", "--json", "--socket",
                              daemon.socket], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert watch.stdout.readline().startswith("{")  # drawing: connected, answered
        daemon.proc.send_signal(signal.SIGSTOP)
        _, err = watch.communicate(timeout=60)
        assert watch.returncode == 1 and "did not answer within 1 s" in err and "Traceback" not in err, err
        for args in (["stat"], ["ls"]):
            r = subprocess.run([sys.executable, "-c", code, *args, "--socket", daemon.socket], capture_output=True,
                               text=True, timeout=60)
            assert r.returncode == 1 and "did not answer" in _one_line(r), (args, r.stderr)
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
        watch.kill()


def test_demo_steps_and_message_size_that_cannot_work_are_refused():
    r = cli("demo", "--steps", "-1")
    assert r.returncode == 2 and "argument --steps: must be at least 1" in _one_line(r)
    r = cli("config", "--max-message-bytes", "0")
    assert r.returncode == 2 and "must be at least 4096" in _one_line(r)
