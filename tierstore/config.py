"""Configuration: one dataclass, the single source of every knob.

The TOML file uses the field names, environment variables are ``TIERSTORE_`` + the
upper-cased name, command-line flags are the dashed name. Precedence, lowest first:
embedded defaults, TOML file, environment, flags.
"""

from __future__ import annotations

import argparse

import dataclasses
import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from .units import parse_size

__all__ = ["Config", "default_socket_path", "default_nvme_dir", "default_host_bytes", "add_config_flags",
           "config_from_args"]

_SIZE_FIELDS = {"host_bytes", "nvme_bytes", "gpu_bytes", "gpu_slab_bytes", "io_chunk_bytes", "nvme_grow_bytes",
                "journal_compact_bytes", "prefetch_budget_bytes", "max_message_bytes"}
_LIST_FIELDS = {"nvme_dirs", "allowed_groups"}
_HOST_BYTES_CAP = 16 << 30


def default_socket_path() -> str:
    """``$XDG_RUNTIME_DIR/tierstore/tierstore.sock``, else ``/run/tierstore/tierstore.sock``."""
    base = os.environ.get("XDG_RUNTIME_DIR") or "/run"
    return str(Path(base) / "tierstore" / "tierstore.sock")


def default_nvme_dir() -> str:
    """``$XDG_DATA_HOME/tierstore/nvme`` (``~/.local/share/tierstore/nvme``)."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return str(Path(base) / "tierstore" / "nvme")


def default_host_bytes() -> int:
    """A quarter of the memory available now, capped at 16 GiB, at least 64 MiB."""
    avail = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:
        avail = 0
    size = min(avail // 4, _HOST_BYTES_CAP)
    return max(size // (1 << 20) * (1 << 20), 64 << 20)


@dataclass(kw_only=True, slots=True)
class Config:
    """Everything a store or daemon needs to start. Sizes accept ints or "8GiB"."""

    host_bytes: int = 0
    """Capacity of the shared host arena; 0 picks a quarter of available RAM (cap 16 GiB)."""
    nvme_dirs: list[str] = field(default_factory=list)
    """Directories for the NVMe tier; several are striped. Empty: the user's data dir."""
    nvme_bytes: int = 64 << 30
    """Capacity of the NVMe tier across all directories."""
    gpu_bytes: int = 0
    """Capacity of the GPU tier per device; 0 disables it."""
    gpu_slab_bytes: int = 1 << 30
    """The GPU tier is allocated in slabs of at most this size (one CUDA IPC handle each)."""
    policy: str = "trace"
    """Eviction policy: ``trace`` (Belady on each client's learned access order; LRU until
    one is learned) or ``lru``."""
    socket: str = ""
    """Daemon socket path; empty: ``$XDG_RUNTIME_DIR/tierstore/tierstore.sock`` or ``/run/...``."""
    engine: str = "auto"
    """NVMe I/O engine: ``auto`` (kvikio where CUDA works, else posix), ``posix`` or ``kvikio``."""
    direct_io: str = "auto"
    """O_DIRECT use: ``auto`` (probe each directory), ``on`` (fail if unsupported), ``off``."""
    io_threads: int = 4
    """Requests in flight on the posix engine (4 measured best on the 2-core development VM)."""
    io_chunk_bytes: int = 4 << 20
    """Large transfers are split into chunks of this size (multiple of 1 MiB)."""
    nvme_grow_bytes: int = 256 << 20
    """NVMe data files grow (fallocate) in steps of this size."""
    high_watermark: float = 0.9
    """Fraction of the host tier above which the background demoter starts."""
    low_watermark: float = 0.75
    """Fraction of the host tier the demoter brings usage down to."""
    promote_on_get: bool = True
    """A get of an NVMe-only object also places it in the host tier when there is room."""
    lease_wait_s: float = 30.0
    """How long a check-out waits for a conflicting lease to end before ``Busy``."""
    journal_compact_bytes: int = 64 << 20
    """The journal is rewritten once it exceeds this size and is mostly garbage."""
    prefetch: bool = True
    """Learn each client's access order and fetch the next objects ahead of use."""
    prefetch_budget_bytes: int = 256 << 20
    """Bytes the prefetcher may have in flight or resident-but-unused."""
    prefetch_max_inflight: int = 8
    """Prefetch reads in flight at once."""
    allowed_groups: list[str] = field(default_factory=list)
    """Groups (names or gids) admitted to the daemon besides its own uid and root."""
    lease_timeout_s: float = 0.0
    """Daemon: leases held longer than this are revoked (0 = only on disconnect)."""
    max_clients: int = 256
    """Daemon: connections admitted at once."""
    max_clients_per_uid: int = 128
    """Daemon: connections one uid may hold at once (root and the daemon's own uid are exempt)."""
    max_message_bytes: int = 1 << 20
    """Daemon: largest control message accepted."""
    metrics_port: int = -1
    """Daemon: Prometheus metrics port; -1 off, 0 any free port (reported by ``stat``)."""
    metrics_addr: str = "127.0.0.1"
    """Daemon: address the metrics endpoint binds (loopback unless told otherwise)."""

    def __post_init__(self) -> None:
        for name in _SIZE_FIELDS:
            object.__setattr__(self, name, parse_size(getattr(self, name), field=name))
        if isinstance(self.nvme_dirs, (str, os.PathLike)):
            self.nvme_dirs = [str(self.nvme_dirs)]
        self.nvme_dirs = [str(d) for d in self.nvme_dirs]
        if self.policy not in ("lru", "trace"):
            raise ValueError(f"policy must be 'lru' or 'trace', got {self.policy!r}")
        if self.engine not in ("auto", "posix", "kvikio"):
            raise ValueError(f"engine must be 'auto', 'posix' or 'kvikio', got {self.engine!r}")
        if self.direct_io not in ("auto", "on", "off"):
            raise ValueError(f"direct_io must be 'auto', 'on' or 'off', got {self.direct_io!r}")
        if self.io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {self.io_threads}")
        if self.io_chunk_bytes < (1 << 20) or self.io_chunk_bytes % (1 << 20):
            raise ValueError(f"io_chunk_bytes must be a positive multiple of 1 MiB, got {self.io_chunk_bytes}")
        if not 0.0 < self.low_watermark <= self.high_watermark <= 1.0:
            raise ValueError("watermarks must satisfy 0 < low_watermark <= high_watermark <= 1")
        if self.lease_wait_s < 0 or self.lease_timeout_s < 0:
            raise ValueError("lease_wait_s and lease_timeout_s must be >= 0")
        if self.prefetch_max_inflight < 1:
            raise ValueError("prefetch_max_inflight must be >= 1")
        if self.max_clients < 1 or self.max_clients_per_uid < 1:
            raise ValueError("max_clients and max_clients_per_uid must be >= 1")

    # -- resolution of embedded defaults -------------------------------------------------
    def resolved(self) -> "Config":
        """A copy with the machine-dependent defaults (0 / empty) filled in."""
        return dataclasses.replace(
            self,
            host_bytes=self.host_bytes or default_host_bytes(),
            nvme_dirs=list(self.nvme_dirs) or [default_nvme_dir()],
            socket=self.socket or default_socket_path(),
        )

    # -- loading -------------------------------------------------------------------------
    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def load(cls, path: str | os.PathLike | None = None, *, env: Mapping[str, str] | None = None,
             overrides: Mapping[str, Any] | None = None) -> "Config":
        """Defaults < TOML file ``path`` (or ``$TIERSTORE_CONFIG``) < environment < overrides."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        path = path or env.get("TIERSTORE_CONFIG") or None
        if path:
            try:
                with open(path, "rb") as f:
                    data = tomllib.load(f)
            except FileNotFoundError:
                raise ValueError(f"config file {path} does not exist") from None
            except tomllib.TOMLDecodeError as e:
                raise ValueError(f"config file {path} is not valid TOML: {e}") from None
            data = data.get("tierstore", data)
            unknown = set(data) - set(cls.field_names())
            if unknown:
                raise ValueError(f"config file {path}: unknown keys {sorted(unknown)}; "
                                 f"valid keys are {cls.field_names()}")
            values.update(data)
        for name in cls.field_names():
            raw = env.get("TIERSTORE_" + name.upper())
            if raw is not None and raw != "":
                values[name] = _from_env(name, raw)
        for k, v in (overrides or {}).items():
            if v is not None:
                values[k] = v
        return cls(**values)


def _from_env(name: str, raw: str) -> Any:
    types = {f.name: f.type for f in fields(Config)}
    t = types[name]
    if name in _LIST_FIELDS:
        return [p for p in raw.split(os.pathsep if name == "nvme_dirs" else ",") if p]
    if name in _SIZE_FIELDS:
        return raw
    if t in ("int", int):
        return int(raw)
    if t in ("float", float):
        return float(raw)
    if t in ("bool", bool):
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"TIERSTORE_{name.upper()}: expected a boolean, got {raw!r}")
    return raw


def add_config_flags(p: "argparse.ArgumentParser") -> None:
    """The dashed-name flags of the daemon's configuration."""
    g = p.add_argument_group("configuration (overrides the TOML file and TIERSTORE_* variables)")
    g.add_argument("--config", help="TOML config file (default: $TIERSTORE_CONFIG)")
    g.add_argument("--host-bytes", help="host arena size, e.g. 8GiB (default: 1/4 of free RAM, cap 16GiB)")
    g.add_argument("--nvme-dir", action="append", dest="nvme_dirs", help="NVMe directory (repeat to stripe)")
    g.add_argument("--nvme-bytes", help="NVMe tier capacity, e.g. 200GiB")
    g.add_argument("--gpu-bytes", help="GPU tier capacity per device")
    g.add_argument("--gpu-slab-bytes", help="GPU tier slab size (one CUDA IPC handle each; default 1GiB)")
    g.add_argument("--socket", help="socket path (default: $XDG_RUNTIME_DIR/tierstore/tierstore.sock)")
    g.add_argument("--policy", choices=["lru", "trace"])
    g.add_argument("--prefetch", type=lambda v: v.lower() in ("1", "true", "yes", "on"), metavar="BOOL")
    g.add_argument("--prefetch-budget-bytes")
    g.add_argument("--engine", choices=["auto", "posix", "kvikio"])
    g.add_argument("--direct-io", choices=["auto", "on", "off"])
    g.add_argument("--io-threads", type=int)
    g.add_argument("--io-chunk-bytes")
    g.add_argument("--allowed-group", action="append", dest="allowed_groups", help="admit this group too")
    g.add_argument("--lease-timeout-s", type=float)
    g.add_argument("--max-clients", type=int)
    g.add_argument("--max-clients-per-uid", type=int)
    g.add_argument("--max-message-bytes", help="largest control message accepted")
    g.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port (0: any free port)")
    g.add_argument("--metrics-addr", help="address for the metrics endpoint (default 127.0.0.1)")


def config_from_args(args: "argparse.Namespace") -> Config:
    names = set(Config.field_names())
    overrides = {k: v for k, v in vars(args).items() if k in names and v is not None}
    return Config.load(getattr(args, "config", None), overrides=overrides)
