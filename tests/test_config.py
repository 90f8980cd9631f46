import pytest

from tierstore import Config
from tierstore.units import parse_size


def test_sizes_parse():
    assert parse_size("8GiB") == 8 << 30
    assert parse_size("512 MB") == 512 * 1000**2
    assert parse_size(4096) == 4096
    assert parse_size("1.5GiB") == 3 << 29
    assert parse_size("0.001 KB") == 1
    assert parse_size("9007199254740993") == 9007199254740993  # exact beyond a float's 53 bits
    assert parse_size("1" * 400) == int("1" * 400)  # no OverflowError: the range check comes later
    with pytest.raises(ValueError, match="cannot parse"):
        parse_size("eight gigs")
    with pytest.raises(ValueError, match=">= 0"):
        parse_size(-1)


def test_validation():
    with pytest.raises(ValueError, match="policy"):
        Config(policy="fifo")
    with pytest.raises(ValueError, match="multiple of 1 MiB"):
        Config(io_chunk_bytes=1000)
    with pytest.raises(ValueError, match="watermarks"):
        Config(low_watermark=0.95, high_watermark=0.9)


def test_precedence_toml_env_flags(tmp_path):
    toml = tmp_path / "t.toml"
    toml.write_text('host_bytes = "1GiB"\nnvme_bytes = "10GiB"\npolicy = "trace"\nio_threads = 4\n')
    env = {"TIERSTORE_NVME_BYTES": "20GiB", "TIERSTORE_NVME_DIRS": "/a:/b", "TIERSTORE_PROMOTE_ON_GET": "no"}
    cfg = Config.load(toml, env=env, overrides={"io_threads": 2, "socket": None}).store
    assert cfg.host_bytes == 1 << 30
    assert cfg.nvme_bytes == 20 << 30
    assert cfg.nvme_dirs == ["/a", "/b"]
    assert cfg.policy == "trace"
    assert cfg.io_threads == 2
    assert cfg.promote_on_get is False


def test_unknown_toml_key_is_an_error(tmp_path):
    toml = tmp_path / "t.toml"
    toml.write_text("host_byts = 1\n")
    with pytest.raises(ValueError, match="unknown keys"):
        Config.load(toml, env={})


def test_resolved_defaults(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    cfg = Config().resolved()
    assert cfg.daemon.socket == str(tmp_path / "run" / "tierstore" / "tierstore.sock")
    assert cfg.store.nvme_dirs == [str(tmp_path / "data" / "tierstore" / "nvme")]
    assert 64 << 20 <= cfg.store.host_bytes <= 16 << 30


# -- one field list: flags, variables, parsing, sources ------------------------------------
def _parser():
    import argparse

    from tierstore.config import add_config_flags

    p = argparse.ArgumentParser()
    add_config_flags(p)
    return p


def test_every_field_has_a_flag_a_variable_and_help():
    from dataclasses import fields

    from tierstore.config import SECTIONS, env_name, flag_name

    p = _parser()
    names = [f.name for section in SECTIONS.values() for f in fields(section)]
    assert names == Config.field_names() and len(names) == len(set(names)) == 32  # unique across sections
    for name in names:
        flag = flag_name(name)
        args = p.parse_args([flag, "1"])  # every setting has its flag, and the flag sets that setting
        assert getattr(args, name) in ("1", ["1"]), name
        assert env_name(name) in p.format_help(), name
        assert f"{flag} " in p.format_help(), name
    assert flag_name("nvme_dirs") == "--nvme-dir" and flag_name("allowed_groups") == "--allowed-group"
    assert flag_name("prefetch_max_inflight") == "--prefetch-max-inflight"


def test_flags_parse_with_the_same_rules_as_everything_else():
    from tierstore.config import sourced_config_from_args

    args = _parser().parse_args(["--host-bytes", "1GiB", "--nvme-dir", "/a", "--nvme-dir", "/b", "--prefetch", "off",
                                 "--high-watermark", "0.8", "--lease-wait-s", "2.5", "--policy", "lru",
                                 "--max-message-bytes", "2MiB", "--allowed-group", "wheel"])
    cfg, sources = sourced_config_from_args(args, env={})
    st, d = cfg.store, cfg.daemon
    assert (st.host_bytes, st.nvme_dirs, st.prefetch, st.high_watermark) == (1 << 30, ["/a", "/b"], False, 0.8)
    assert (st.lease_wait_s, st.policy, d.max_message_bytes, d.allowed_groups) == (2.5, "lru", 2 << 20, ["wheel"])
    assert sources["nvme_dirs"] == "flag --nvme-dir" and sources["io_threads"] == "default"


@pytest.mark.parametrize("env,needle", [
    ({"TIERSTORE_PREFETCH_MAX_INFLIGHT": "abc"}, "TIERSTORE_PREFETCH_MAX_INFLIGHT='abc': expected an integer"),
    ({"TIERSTORE_PREFETCH_MAX_INFLIGHT": "0"}, "TIERSTORE_PREFETCH_MAX_INFLIGHT='0': must be at least 1"),
    ({"TIERSTORE_HOST_BYTES": "8 gigs"}, "TIERSTORE_HOST_BYTES='8 gigs': expected a size such as 8GiB"),
    ({"TIERSTORE_POLICY": "fifo"}, "TIERSTORE_POLICY='fifo': expected one of trace, lru"),
    ({"TIERSTORE_PREFETCH": "maybe"}, "TIERSTORE_PREFETCH='maybe': expected a boolean"),
    ({"TIERSTORE_HIGH_WATERMARK": "x"}, "TIERSTORE_HIGH_WATERMARK='x': expected a number"),
])
def test_a_bad_variable_is_named_in_one_line(env, needle):
    from tierstore.config import ConfigError

    with pytest.raises(ConfigError) as e:
        Config.load(env=env)
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert isinstance(e.value, ValueError)


def test_a_bad_flag_and_a_bad_toml_key_are_named(tmp_path):
    from tierstore.config import ConfigError, sourced_config_from_args

    with pytest.raises(ConfigError, match=r"^--io-threads x: expected an integer$"):
        sourced_config_from_args(_parser().parse_args(["--io-threads", "x"]), env={})
    toml = tmp_path / "t.toml"
    toml.write_text('io_threads = "many"\n')
    with pytest.raises(ConfigError, match=r"t\.toml: io_threads = 'many': expected an integer"):
        Config.load(toml, env={})


def test_precedence_and_sources(tmp_path):
    from tierstore.config import sourced_config_from_args

    toml = tmp_path / "t.toml"
    toml.write_text('host_bytes = "1GiB"\nnvme_bytes = "10GiB"\nio_threads = 3\npolicy = "lru"\n')
    env = {"TIERSTORE_NVME_BYTES": "20GiB", "TIERSTORE_IO_THREADS": "5", "TIERSTORE_CONFIG": str(toml)}
    cfg, src = sourced_config_from_args(_parser().parse_args(["--io-threads", "7"]), env=env)
    st = cfg.store
    assert (st.host_bytes, st.nvme_bytes, st.io_threads, st.policy, st.lease_wait_s) == (
        1 << 30, 20 << 30, 7, "lru", 30.0)
    assert src["host_bytes"] == f"file {toml}" and src["nvme_bytes"] == "env TIERSTORE_NVME_BYTES"
    assert src["io_threads"] == "flag --io-threads" and src["lease_wait_s"] == "default"


def test_choices_are_literal_types():
    import typing

    from tierstore.config import choices

    from tierstore.config import StoreConfig

    assert typing.get_origin(typing.get_type_hints(StoreConfig)["policy"]) is typing.Literal
    assert choices("policy") == ("trace", "lru") and choices("direct_io") == ("auto", "on", "off")


def test_the_daemons_log_level_is_a_setting_with_its_variable_and_choices():
    from tierstore.config import ConfigError, choices

    assert choices("log_level") == ("DEBUG", "INFO", "WARNING", "ERROR") and Config().daemon.log_level == "INFO"
    cfg, sources = Config.load_sourced(None, env={"TIERSTORE_LOG_LEVEL": "WARNING"})
    assert cfg.daemon.log_level == "WARNING" and "TIERSTORE_LOG_LEVEL" in sources["log_level"]
    with pytest.raises(ConfigError, match="TIERSTORE_LOG_LEVEL=.LOUD.: expected one of DEBUG"):
        Config.load_sourced(None, env={"TIERSTORE_LOG_LEVEL": "LOUD"})


def test_host_bytes_zero_is_refused_and_auto_is_explicit():
    from tierstore.config import ConfigError

    with pytest.raises(ConfigError, match="host_bytes: 0 would leave no host tier"):
        Config(host_bytes=0)
    with pytest.raises(ConfigError, match="TIERSTORE_HOST_BYTES='0': 0 would leave no host tier"):
        Config.load(env={"TIERSTORE_HOST_BYTES": "0"})
    assert Config(host_bytes="auto").store.host_bytes is None
    assert Config.load(env={"TIERSTORE_HOST_BYTES": "auto"}).store.host_bytes is None


def test_default_host_size_is_stable(monkeypatch):
    """From total memory (a quarter, at most 16 GiB), not from what happens to be free."""
    from tierstore import config as config_mod

    monkeypatch.setattr(config_mod, "total_memory_bytes", lambda: 24 << 30)
    assert config_mod.default_host_bytes() == 6 << 30
    monkeypatch.setattr(config_mod, "total_memory_bytes", lambda: 512 << 30)
    assert config_mod.default_host_bytes() == 16 << 30
    monkeypatch.setattr(config_mod, "total_memory_bytes", lambda: 128 << 20)
    assert config_mod.default_host_bytes() == 64 << 20


# -- sections -------------------------------------------------------------------------------
def test_flat_settings_go_to_their_section_and_sections_can_be_given_whole():
    from tierstore.config import DaemonConfig, StoreConfig

    cfg = Config(host_bytes="8MiB", nvme_dirs=["/a"], socket="/s.sock", max_clients=4)
    assert (cfg.store.host_bytes, cfg.store.nvme_dirs, cfg.daemon.socket, cfg.daemon.max_clients) == (
        8 << 20, ["/a"], "/s.sock", 4)
    same = Config(store=StoreConfig(host_bytes="8MiB", nvme_dirs=["/a"]), daemon={"socket": "/s.sock"},
                  max_clients=4)
    assert same == cfg and cfg.get("socket") == "/s.sock"
    assert cfg.replace(policy="lru").store.policy == "lru" and cfg.store.policy == "trace"
    with pytest.raises(TypeError, match="unknown settings \\['hots_bytes'\\]"):
        Config(hots_bytes=1)
    with pytest.raises(TypeError):
        StoreConfig(socket="/s.sock")  # a daemon setting is not the store's


def test_a_store_reads_only_its_section(tmp_path):
    from tierstore import Store

    with Store(Config(host_bytes="8MiB", nvme_dirs=[str(tmp_path)], nvme_bytes="64MiB", socket="/unused"),
               policy="lru") as s:
        assert s.config.policy == "lru" and s.config.host_bytes == 8 << 20
        assert not hasattr(s.config, "socket")


def test_toml_tables_and_the_older_flat_keys_both_read(tmp_path):
    from tierstore.config import sourced_config_from_args

    tables = tmp_path / "tables.toml"
    tables.write_text('[store]\nhost_bytes = "1GiB"\nnvme_dirs = ["/a"]\n[daemon]\nsocket = "/s.sock"\n')
    flat = tmp_path / "flat.toml"
    flat.write_text('host_bytes = "1GiB"\nnvme_dirs = ["/a"]\nsocket = "/s.sock"\n')
    assert Config.load(tables, env={}) == Config.load(flat, env={}) == Config(host_bytes="1GiB", nvme_dirs=["/a"],
                                                                              socket="/s.sock")
    cfg, src = sourced_config_from_args(_parser().parse_args(["--config", str(tables), "--socket", "/f.sock"]),
                                        env={"TIERSTORE_HOST_BYTES": "2GiB"})
    assert (cfg.store.host_bytes, cfg.store.nvme_dirs, cfg.daemon.socket) == (2 << 30, ["/a"], "/f.sock")
    assert (src["host_bytes"], src["nvme_dirs"], src["socket"]) == (
        "env TIERSTORE_HOST_BYTES", f"file {tables}", "flag --socket")


def test_a_toml_key_in_the_wrong_table_is_named(tmp_path):
    from tierstore.config import ConfigError

    toml = tmp_path / "t.toml"
    toml.write_text('[store]\nsocket = "/s.sock"\n')
    with pytest.raises(ConfigError, match=r"unknown keys \['\[store\] socket \(it belongs in \[daemon\]\)'\]"):
        Config.load(toml, env={})
    toml.write_text('[daemon]\nio_threads = "many"\n[store]\n')
    with pytest.raises(ConfigError, match="belongs in \\[store\\]"):
        Config.load(toml, env={})
    toml.write_text('[store]\nio_threads = "many"\n')
    with pytest.raises(ConfigError, match=r"^.*t\.toml: \[store\] io_threads = 'many': expected an integer$"):
        Config.load(toml, env={})


@pytest.mark.parametrize("how", ["flag", "env", "toml", "python"])
def test_a_choice_outside_its_literal_is_one_line_naming_the_setting(tmp_path, how):
    from tierstore.config import ConfigError, sourced_config_from_args

    with pytest.raises(ConfigError) as e:
        if how == "flag":
            sourced_config_from_args(_parser().parse_args(["--direct-io", "maybe"]), env={})
        elif how == "env":
            Config.load(env={"TIERSTORE_DIRECT_IO": "maybe"})
        elif how == "toml":
            (tmp_path / "t.toml").write_text('[store]\ndirect_io = "maybe"\n')
            Config.load(tmp_path / "t.toml", env={})
        else:
            Config(direct_io="maybe")
    named = {"flag": "--direct-io maybe", "env": "TIERSTORE_DIRECT_IO='maybe'",
             "toml": "[store] direct_io = 'maybe'", "python": "direct_io"}[how]
    assert named in str(e.value) and "expected one of auto, on, off" in str(e.value)
    assert "\n" not in str(e.value)


def _config_cli(*args, timeout=30):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "tierstore.client.cli", "config", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("case", ["fifo", "dev zero", "not utf-8", "tierstore = 5", "[tierstore] and [daemon]",
                                  "nan seconds", "inf seconds", "port 70000"])
def test_a_config_file_that_cannot_work_is_one_line_naming_it(tmp_path, case):
    """Each is refused by `tierstore config` (as by the daemon) in one line, status 2, at
    once: a FIFO or /dev/zero as the file never hangs the read."""
    import os

    f = tmp_path / "tierstore.toml"
    text = {"tierstore = 5": "tierstore = 5\n",
            "[tierstore] and [daemon]": '[tierstore]\nhost_bytes = "1GiB"\n[daemon]\nno_such_key = 3\n',
            "nan seconds": "[store]\nlease_wait_s = nan\n",
            "inf seconds": "[daemon]\nlease_timeout_s = inf\n",
            "port 70000": "[daemon]\nmetrics_port = 70000\n"}.get(case)
    if case == "fifo":
        os.mkfifo(f)
    elif case == "dev zero":
        os.symlink("/dev/zero", f)
    elif case == "not utf-8":
        f.write_bytes(b'[store]\npolicy = "\xff"\n')
    else:
        f.write_text(text)
    r = _config_cli("--config", str(f))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    want = {"fifo": "a pipe that stayed silent", "dev zero": "not a regular file", "not utf-8": "not UTF-8",
            "tierstore = 5": "[tierstore] table", "[tierstore] and [daemon]": "[tierstore] table",
            "nan seconds": "lease_wait_s", "inf seconds": "lease_timeout_s", "port 70000": "metrics_port"}[case]
    assert want in lines[0], lines[0]


def test_nan_and_inf_are_refused_from_every_source(monkeypatch):
    from tierstore.config import ConfigError

    for value in ("nan", "inf", "-inf", float("nan")):
        with pytest.raises(ConfigError, match="finite"):
            Config(lease_wait_s=value)
    monkeypatch.setenv("TIERSTORE_HIGH_WATERMARK", "nan")
    with pytest.raises(ConfigError, match="TIERSTORE_HIGH_WATERMARK"):
        Config.load()


def test_an_unknown_group_is_warned_by_config_and_refuses_a_daemon_start(tmp_path):
    import subprocess
    import sys

    r = _config_cli("--allowed-group", "no-such-group-here")
    assert r.returncode == 0 and "no-such-group-here" in r.stderr and "refuses to start" in r.stderr
    r = subprocess.run([sys.executable, "-m", "tierstore.client.cli", "daemon", "--allowed-group", "no-such-group-here",
                        "--socket", str(tmp_path / "run" / "s.sock"), "--nvme-dir", str(tmp_path / "nvme"),
                        "--host-bytes", "16MiB", "--nvme-bytes", "64MiB"], capture_output=True, text=True, timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "allowed_groups names 'no-such-group-here'" in lines[0]


def test_a_settings_file_through_a_pipe_is_read(tmp_path):
    """``--config <(envsubst < template)``: a pipe whose writer ends is read like a file."""
    import subprocess
    import sys

    r = subprocess.run(["bash", "-c", f"{sys.executable} -m tierstore.client.cli config --json --config "
                        "<(printf '[store]\\npolicy = \"lru\"\\n')"], capture_output=True, text=True, timeout=60)
    import json

    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["store"]["policy"]["value"] == "lru"
