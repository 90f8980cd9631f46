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
    cfg = Config.load(toml, env=env, overrides={"io_threads": 2, "socket": None})
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
    assert cfg.socket == str(tmp_path / "run" / "tierstore" / "tierstore.sock")
    assert cfg.nvme_dirs == [str(tmp_path / "data" / "tierstore" / "nvme")]
    assert 64 << 20 <= cfg.host_bytes <= 16 << 30
