"""Configuration: the single source of every knob, in two typed sections.

``Config`` holds a ``store`` section (``StoreConfig``: tiers, NVMe I/O, placement,
leases, journal, prefetcher; all an in-process ``Store`` reads) and a ``daemon``
section (``DaemonConfig``: socket, admission, time limits, metrics). Each field of a
section is one setting, its name unique across sections. Its name is the TOML key (in
the section's table, ``[store]`` or ``[daemon]``; flat keys at the top level are read
too); ``TIERSTORE_`` + the upper-cased name is its environment variable; the dashed
name is its flag (``--nvme-dir`` and ``--allowed-group`` are singular and may be
repeated). Flags and variables are generated from the fields, so every setting has
both, and every source's text goes through one
parser per field (``parse_setting``), so ``"8GiB"`` means the same everywhere and an
error names the setting as it was given (``TIERSTORE_IO_THREADS='abc': expected an
integer``). Precedence, lowest first: embedded defaults, TOML file, environment,
flags. ``Config.load_sourced`` also says where each effective value came from.

Length: the settings are one table (every field with its default, type, help text and
checks) and the one parser that reads them from every source; split, a setting's
rules would live in two places.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import stat
import tomllib
import typing
from dataclasses import dataclass, field, fields
from typing import Any, Literal, Mapping

from .paths import default_nvme_dir, default_socket_path
from .units import format_size, parse_size

__all__ = ["Config", "StoreConfig", "DaemonConfig", "SECTIONS", "ConfigError", "ArgumentParser", "daemon_parser",
           "default_socket_path", "default_nvme_dir", "default_host_bytes",
           "DEFAULT_NVME_BYTES", "add_config_flags", "config_from_args", "sourced_config_from_args",
           "parse_setting", "env_name", "flag_name", "describe_value"]

_HOST_BYTES_CAP = 16 << 30
_HOST_BYTES_MIN = 64 << 20
DEFAULT_NVME_BYTES = 64 << 30
"""nvme_bytes when not set: 64 GiB, or less where the filesystem has less free (with a warning)."""

_PATH_LISTS = {"nvme_dirs"}  # separated by ':' in the environment, like PATH; other lists by ','


class ConfigError(ValueError):
    """A setting that cannot be used. ``field`` is the Config field, ``setting`` the
    place it came from as the user wrote it (``TIERSTORE_IO_THREADS='abc'``, ``--io-threads
    abc``, ``FILE: io_threads = 'abc'``), ``problem`` what is wrong with it."""

    def __init__(self, problem: str, *, field: str | None = None, value: Any = None,
                 setting: str | None = None) -> None:
        if setting:
            message = f"{setting}: {problem}"
        elif field:
            message = f"{field}: {problem}" + ("" if value is None else f", got {value!r}")
        else:
            message = problem
        super().__init__(message)
        self.problem, self.field, self.value, self.setting = problem, field, value, setting


def total_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_host_bytes() -> int:
    """A quarter of total memory, capped at 16 GiB, at least 64 MiB, in whole MiB.

    From total, not available, memory: the same machine gets the same arena on every
    start, whatever else happens to be running.
    """
    size = min(total_memory_bytes() // 4, _HOST_BYTES_CAP)
    return max(size // (1 << 20) * (1 << 20), _HOST_BYTES_MIN)


def _knob(default: Any = dataclasses.MISSING, help: str = "", *, factory: Any = dataclasses.MISSING,
          flag: str | None = None, minimum: float | None = None) -> Any:
    meta = {"help": help, "flag": flag, "minimum": minimum}
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def _check(section: Any) -> None:
    """Parse a section's values given as text (or sizes as ints or text) and check minimums."""
    for f in fields(section):
        value = getattr(section, f.name)
        if _kind(f.name) in ("list", "size") or (isinstance(value, str) and _kind(f.name) != "str"):
            setattr(section, f.name, parse_setting(f.name, value))
    for f in fields(section):
        low = f.metadata.get("minimum")
        value = getattr(section, f.name)
        if _kind(f.name) == "float" and isinstance(value, float) and not math.isfinite(value):
            raise ConfigError("must be a finite number of seconds or a fraction (nan and inf are not)",
                              field=f.name, value=value)
        if low is not None and value is not None and value < low:
            raise ConfigError(f"must be at least {low:g}", field=f.name, value=value)


@dataclass(kw_only=True, slots=True)
class StoreConfig:
    """The ``store`` section: what an in-process ``Store`` (and so the daemon's) uses —
    the tiers, NVMe I/O, placement, leases, the journal and the prefetcher."""

    host_bytes: int | None = _knob(None, "capacity of the shared host arena, e.g. 8GiB (default: a quarter of "
                                         "total memory, at most 16GiB; 'auto' says so explicitly)")
    host_huge_pages: Literal["auto", "hugetlb", "off"] = _knob(
        "auto", "huge pages for the host arena: auto (transparent huge pages: at fault where the kernel "
                "gives shared memory any, else made by MADV_COLLAPSE while populating), hugetlb (reserved huge "
                "pages, vm.nr_hugepages) or off")
    nvme_dirs: list[str] = _knob(help="NVMe tier directory; repeat to stripe over several drives (default: "
                                      "$XDG_DATA_HOME/tierstore/nvme)", factory=list, flag="--nvme-dir")
    nvme_bytes: int | None = _knob(None, "capacity of the NVMe tier across all directories (default: 64GiB, "
                                         "or 90% of the room on their filesystems if less)")
    gpu_bytes: int = _knob(0, "capacity of the GPU tier per device; 0 disables it")
    gpu_slab_bytes: int = _knob(1 << 30, "the GPU tier is allocated in slabs of at most this size (one CUDA "
                                         "IPC handle each)")
    policy: Literal["trace", "lru"] = _knob("trace", "eviction order: trace (next use in each client's learned "
                                                     "access order; LRU until one is learned) or lru")
    engine: Literal["auto", "posix", "kvikio"] = _knob("auto", "NVMe I/O engine: auto (kvikio where CUDA works, "
                                                               "else posix), posix or kvikio")
    direct_io: Literal["auto", "on", "off"] = _knob("auto", "O_DIRECT: auto (probe each directory), on (fail if "
                                                            "unsupported) or off")
    io_threads: int = _knob(16, "NVMe requests in flight on the posix engine", minimum=1)
    io_chunk_bytes: int = _knob(16 << 20, "large transfers are split into chunks of this size (a multiple of "
                                         "1MiB)")
    nvme_grow_bytes: int = _knob(256 << 20, "NVMe data files grow (fallocate) in steps of this size; 0: each is "
                                            "reserved at its full size at start (for a drive the tier has to itself)")
    nvme_trim_after_s: float = _knob(300.0, "a data file's free tail is given back to the filesystem once no object "
                                            "reached into it for this many seconds (rounded to nvme_grow_bytes); "
                                            "0: never (nor with nvme_grow_bytes 0)", minimum=0)
    high_watermark: float = _knob(0.9, "fraction of the host tier above which cold objects move to NVMe")
    low_watermark: float = _knob(0.75, "fraction of the host tier the background demoter brings usage down to")
    promote_on_get: bool = _knob(True, "a get of an NVMe-only object also places it in the host tier when there "
                                       "is room")
    lease_wait_s: float = _knob(30.0, "seconds a check-out waits for a conflicting lease before Busy", minimum=0)
    journal_compact_bytes: int = _knob(64 << 20, "the journal is rewritten once it exceeds this size and is "
                                                 "mostly garbage")
    checkpoint_tail_bytes: int = _knob(16 << 20, "a forked child writes the index checkpoint in the background once "
                                                 "the journal has grown this much (and by an eighth of what the "
                                                 "last checkpoint covered) since it: a restart after a crash "
                                                 "replays at most that; 0: only at a clean stop and a compaction",
                                       minimum=0)
    prefetch: bool = _knob(True, "learn each client's access order and fetch the next objects ahead of use")
    prefetch_budget_bytes: int = _knob(256 << 20, "bytes the prefetcher may have in flight or resident but unused")
    prefetch_max_inflight: int = _knob(8, "prefetch reads in flight at once", minimum=1)

    def __post_init__(self) -> None:
        _check(self)
        if self.host_bytes == 0:
            raise ConfigError("0 would leave no host tier, which every object passes through; give a size such "
                              "as 8GiB, or leave it unset (auto: a quarter of total memory, at most 16GiB)",
                              field="host_bytes")
        if self.io_chunk_bytes < (1 << 20) or self.io_chunk_bytes % (1 << 20):
            raise ConfigError("must be a positive multiple of 1 MiB", field="io_chunk_bytes",
                              value=self.io_chunk_bytes)
        if not 0.0 < self.low_watermark <= self.high_watermark <= 1.0:
            raise ConfigError("watermarks must satisfy 0 < low_watermark <= high_watermark <= 1",
                              field="low_watermark", value=self.low_watermark)

    def resolved(self) -> "StoreConfig":
        """A copy with the machine-dependent defaults filled in (``nvme_bytes`` stays
        unset until the start-up checks have seen the filesystem: ``tierstore.preflight``)."""
        return dataclasses.replace(self, host_bytes=self.host_bytes or default_host_bytes(),
                                   nvme_dirs=list(self.nvme_dirs) or [default_nvme_dir()])


@dataclass(kw_only=True, slots=True)
class DaemonConfig:
    """The ``daemon`` section: what only the node daemon uses — its socket, who it
    admits and how many, time limits on what a connection holds, metrics."""

    socket: str = _knob("", "daemon socket path (default: $XDG_RUNTIME_DIR/tierstore/tierstore.sock, else "
                            "/run/tierstore/tierstore.sock)")
    allowed_groups: list[str] = _knob(help="admit members of this group (name or gid) besides the daemon's own "
                                           "uid and root; repeatable", factory=list, flag="--allowed-group")
    lease_timeout_s: float = _knob(0.0, "revoke leases held longer than this many seconds (0: only when the "
                                        "connection ends)", minimum=0)
    reservation_timeout_s: float = _knob(300.0, "drop a put reserved but neither committed nor aborted, and end a "
                                               "streamed get left open, after this many seconds and reuse its "
                                               "memory (0: only when the connection ends)", minimum=0)
    max_clients: int = _knob(256, "connections the daemon admits at once", minimum=1)
    max_clients_per_uid: int = _knob(128, "connections one uid may hold at once (root is exempt)", minimum=1)
    max_message_bytes: int = _knob(1 << 20, "largest control message the daemon accepts (at least 4KiB: a "
                                            "client's requests need that much)", minimum=4096)
    metrics_port: int = _knob(-1, "serve Prometheus metrics on this port (-1: off, 0: any free port, shown by "
                                  "stat)", minimum=-1)
    metrics_addr: str = _knob("127.0.0.1", "address the metrics endpoint binds")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = _knob("INFO", "daemon log level (to stderr, the "
                                                                            "journal under systemd)")

    def __post_init__(self) -> None:
        _check(self)
        if self.metrics_port > 65535:
            raise ConfigError("must be a TCP port (0 to 65535), 0 for any free one or -1 for none",
                              field="metrics_port", value=self.metrics_port)

    def resolved(self) -> "DaemonConfig":
        return dataclasses.replace(self, socket=self.socket or default_socket_path())


SECTIONS: dict[str, type] = {"store": StoreConfig, "daemon": DaemonConfig}
"""Section name (the ``Config`` attribute and the TOML table) -> its dataclass."""

_SECTION_OF: dict[str, str] = {f.name: name for name, cls in SECTIONS.items() for f in fields(cls)}
_FIELDS: dict[str, dataclasses.Field] = {f.name: f for cls in SECTIONS.values() for f in fields(cls)}


@dataclass(init=False, slots=True)
class Config:
    """Everything a store or daemon needs to start, in two sections: ``store``
    (``StoreConfig``) and ``daemon`` (``DaemonConfig``). Each setting's name is unique
    across sections, so settings may also be given flat: ``Config(host_bytes="8GiB",
    socket="/run/x.sock")`` is ``Config(store=StoreConfig(host_bytes="8GiB"),
    daemon=DaemonConfig(socket="/run/x.sock"))``. Sizes accept ints or "8GiB"."""

    store: StoreConfig
    daemon: DaemonConfig

    def __init__(self, *, store: StoreConfig | Mapping[str, Any] | None = None,
                 daemon: DaemonConfig | Mapping[str, Any] | None = None, **settings: Any) -> None:
        given = {"store": store, "daemon": daemon}
        unknown = sorted(set(settings) - set(_SECTION_OF))
        if unknown:
            raise TypeError(f"Config() got unknown settings {unknown}; the settings are listed by "
                            "`tierstore config`")
        for name, cls in SECTIONS.items():
            section, own = given[name], {k: v for k, v in settings.items() if _SECTION_OF[k] == name}
            if section is None or isinstance(section, Mapping):
                section = cls(**{**(section or {}), **own})
            elif own:
                section = dataclasses.replace(section, **own)
            setattr(self, name, section)

    def replace(self, **settings: Any) -> "Config":
        """A copy with some settings (by their flat names) changed."""
        return Config(store=self.store, daemon=self.daemon, **settings)

    def get(self, name: str) -> Any:
        """The value of setting ``name`` (``cfg.get("socket")`` is ``cfg.daemon.socket``)."""
        return getattr(getattr(self, _SECTION_OF[name]), name)

    # -- resolution of embedded defaults -------------------------------------------------
    def resolved(self) -> "Config":
        """A copy with the machine-dependent defaults filled in (``nvme_bytes`` stays
        unset until the start-up checks have seen the filesystem: ``tierstore.preflight``)."""
        return Config(store=self.store.resolved(), daemon=self.daemon.resolved())

    # -- loading -------------------------------------------------------------------------
    @classmethod
    def field_names(cls) -> list[str]:
        """Every setting's name, section by section."""
        return list(_SECTION_OF)

    @classmethod
    def load(cls, path: str | os.PathLike | None = None, *, env: Mapping[str, str] | None = None,
             overrides: Mapping[str, Any] | None = None) -> "Config":
        """Defaults < TOML file ``path`` (or ``$TIERSTORE_CONFIG``) < environment < overrides."""
        return cls.load_sourced(path, env=env, overrides=overrides)[0]

    @classmethod
    def load_sourced(cls, path: str | os.PathLike | None = None, *, env: Mapping[str, str] | None = None,
                     overrides: Mapping[str, Any] | None = None,
                     override_source: Mapping[str, str] | None = None) -> tuple["Config", dict[str, str]]:
        """``load``, and where each setting's value came from: ``default``, ``file PATH``,
        ``env TIERSTORE_X`` or (``override_source``, default ``argument``) the flag."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        sources = dict.fromkeys(cls.field_names(), "default")
        given: dict[str, str] = {}  # setting -> as written, for errors found after parsing
        if not path and env.get("TIERSTORE_CONFIG"):
            path = env["TIERSTORE_CONFIG"]
        if path:
            for name, (key, value) in _read_toml(path).items():
                given[name], sources[name] = f"{path}: {key} = {value!r}", f"file {path}"
                values[name] = _parse_from(name, value, given[name])
        for name in cls.field_names():
            raw = env.get(env_name(name))
            if raw is not None and raw != "":
                given[name], sources[name] = f"{env_name(name)}={raw!r}", f"env {env_name(name)}"
                values[name] = _parse_from(name, raw, given[name])
        for name, value in (overrides or {}).items():
            if value is not None:
                sources[name] = (override_source or {}).get(name, "argument")
                shown = " ".join(map(str, value)) if isinstance(value, list) else value
                given[name] = f"{sources[name].removeprefix('flag ')} {shown}"
                values[name] = _parse_from(name, value, given[name])
        try:
            return cls(**values), sources
        except ConfigError as e:
            if e.field in given:
                raise ConfigError(e.problem, field=e.field, setting=given[e.field]) from None
            raise


def unknown_groups(names: list[str]) -> list[str]:
    """The ``allowed_groups`` entries that are neither a gid nor a group of this machine
    (a daemon could admit no one through them: ``preflight`` refuses its start)."""
    import grp

    out = []
    for name in names:
        if name.isdigit():
            continue
        try:
            grp.getgrnam(name)
        except KeyError:
            out.append(name)
    return out


_MAX_CONFIG_BYTES = 1 << 20


def _read_toml(path: str | os.PathLike) -> dict[str, tuple[str, Any]]:
    """setting -> (its key as written in the file, value). A ``[store]`` or ``[daemon]``
    table holds that section's settings; flat keys at the top (or, alone, under
    ``[tierstore]``) are read too, as before sections existed."""
    try:
        text = _config_bytes(str(path))
        if len(text) > _MAX_CONFIG_BYTES:
            raise ConfigError(f"config file {path} is larger than {_MAX_CONFIG_BYTES} bytes; it is not a settings file")
        data = tomllib.loads(text.decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist; check --config or TIERSTORE_CONFIG") from None
    except _NotRegular as e:
        raise ConfigError(f"config file {path} {e}; check --config or TIERSTORE_CONFIG") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text: {e.reason} at byte {e.start}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    if "tierstore" in data:
        legacy = data["tierstore"]
        if not isinstance(legacy, dict) or len(data) > 1:
            raise ConfigError(f"config file {path}: a [tierstore] table holds every setting, alone (as before "
                              "sections existed); use [store] and [daemon] tables instead")
        data = legacy
    out: dict[str, tuple[str, Any]] = {}
    unknown: list[str] = []
    for key, value in data.items():
        if key in SECTIONS and isinstance(value, dict):
            for name, v in value.items():
                if _SECTION_OF.get(name) != key:
                    where = f" (it belongs in [{_SECTION_OF[name]}])" if name in _SECTION_OF else ""
                    unknown.append(f"[{key}] {name}{where}")
                else:
                    out[name] = (f"[{key}] {name}", v)
        elif key in _SECTION_OF:
            out[key] = (key, value)
        else:
            unknown.append(key)
    if unknown:
        raise ConfigError(f"config file {path}: unknown keys {unknown}; valid keys are the settings listed by "
                          "`tierstore config`, in their [store] or [daemon] table")
    return out


class _NotRegular(Exception):
    pass


_PIPE_QUIET_S = 5.0
"""How long a pipe given as the settings file (``--config <(...)``) may stay silent."""


def _config_bytes(path: str) -> bytes:
    """The settings file's bytes (at most one more than ``_MAX_CONFIG_BYTES``): a regular
    file, or a pipe whose writer ends within ``_PIPE_QUIET_S`` of quiet (process
    substitution); anything else (a device such as ``/dev/zero``, a FIFO nobody writes)
    is ``_NotRegular``, never a read that hangs. Opened without blocking: a FIFO's open
    waits for no writer."""
    import select

    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISREG(mode):
            os.set_blocking(fd, True)
            with os.fdopen(os.dup(fd), "rb") as f:
                return f.read(_MAX_CONFIG_BYTES + 1)
        if not stat.S_ISFIFO(mode):
            raise _NotRegular("is not a regular file (a device would never end the read)")
        chunks, n = [], 0
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        while n <= _MAX_CONFIG_BYTES:
            if not poller.poll(_PIPE_QUIET_S * 1000):
                raise _NotRegular(f"is a pipe that stayed silent for {_PIPE_QUIET_S:g} s (a FIFO nobody writes?)")
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                continue
            if not chunk:
                break
            chunks.append(chunk)
            n += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


# -- one parser per field, whatever the source --------------------------------------------
_HINTS: dict[str, Any] | None = None


def _hints() -> dict[str, Any]:
    global _HINTS
    if _HINTS is None:
        _HINTS = {k: v for cls in SECTIONS.values() for k, v in typing.get_type_hints(cls).items()}
    return _HINTS


def _kind(name: str) -> str:
    """``size``, ``int``, ``float``, ``bool``, ``choice``, ``list`` or ``str``."""
    t = _hints()[name]
    args = [a for a in typing.get_args(t) if a is not type(None)]
    if typing.get_origin(t) is Literal:
        return "choice"
    if t is list or typing.get_origin(t) is list:
        return "list"
    base = args[0] if args and typing.get_origin(t) is not list else t
    if base is int:
        return "size" if name.endswith("_bytes") else "int"
    return {float: "float", bool: "bool"}.get(base, "str")


def choices(name: str) -> tuple[str, ...]:
    return typing.get_args(_hints()[name]) if _kind(name) == "choice" else ()


def env_name(name: str) -> str:
    return "TIERSTORE_" + name.upper()


def flag_name(name: str) -> str:
    f = _FIELDS[name]
    return f.metadata.get("flag") or "--" + name.replace("_", "-")


def parse_setting(name: str, value: Any) -> Any:
    """Turn ``value`` (text from a flag or variable, or a TOML / Python value) into the
    type of field ``name``; ``ConfigError`` (naming nothing but the problem) otherwise."""
    kind = _kind(name)
    if kind == "size":
        if value is None and name in ("host_bytes", "nvme_bytes"):
            return None
        if isinstance(value, str) and value.strip().lower() == "auto" and name in ("host_bytes", "nvme_bytes"):
            return None
        try:
            return parse_size(value, field=name)
        except ValueError:
            raise ConfigError("expected a size such as 8GiB, 512MiB or 1048576", field=name, value=value) from None
    if kind == "list":
        if isinstance(value, (str, os.PathLike)):
            sep = os.pathsep if name in _PATH_LISTS else ","
            return [p.strip() for p in str(value).split(sep) if p.strip()]
        if isinstance(value, (list, tuple)):
            return [str(v) for v in value]
        raise ConfigError("expected a list", field=name, value=value)
    if kind == "choice":
        if value not in choices(name):
            raise ConfigError(f"expected one of {', '.join(choices(name))}", field=name, value=value)
        return value
    if kind == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on"):
            return True
        if isinstance(value, str) and value.strip().lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError("expected a boolean (true/false, yes/no, on/off, 1/0)", field=name, value=value)
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ConfigError("expected an integer", field=name, value=value)
        try:
            return int(value)
        except ValueError:
            raise ConfigError("expected an integer", field=name, value=value) from None
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ConfigError("expected a number", field=name, value=value)
        try:
            number = float(value)
        except ValueError:
            raise ConfigError("expected a number", field=name, value=value) from None
        if not math.isfinite(number):
            raise ConfigError("expected a finite number (nan and inf are not)", field=name, value=value)
        return number
    if not isinstance(value, str):
        raise ConfigError("expected a string", field=name, value=value)
    return value


def _parse_from(name: str, value: Any, setting: str) -> Any:
    try:
        return parse_setting(name, value)
    except ConfigError as e:
        raise ConfigError(e.problem, field=name, setting=setting) from None


def describe_value(name: str, value: Any) -> str:
    """A value as people read it: sizes in binary units, lists joined."""
    if value is None:
        return "auto"
    if _kind(name) == "size" and isinstance(value, int):
        return format_size(value) if value >= 1024 else f"{value} B"
    if isinstance(value, list):
        return ", ".join(value) if value else "(none)"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


# -- flags --------------------------------------------------------------------------------
class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors that say where the help is (no usage block)."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: {message}; see {self.prog} --help\n")


def add_config_flags(p: argparse.ArgumentParser) -> None:
    """One flag per ``Config`` field, with its help; values are parsed by ``parse_setting``
    after argparse, so a bad value is reported as ``--flag VALUE: problem``."""
    g = p.add_argument_group("configuration (flags override TIERSTORE_* variables, which override the TOML file)")
    g.add_argument("--config", metavar="FILE", help="TOML file of settings (default: $TIERSTORE_CONFIG)")
    groups = {name: p.add_argument_group(f"{name} settings ([{name}] in the TOML file)") for name in SECTIONS}
    for f in _FIELDS.values():
        g = groups[_SECTION_OF[f.name]]
        kind = _kind(f.name)
        default = f.default if f.default is not dataclasses.MISSING else None
        help_text = f.metadata["help"]
        if kind not in ("list",) and default not in (None, "", []) and "default" not in help_text:
            help_text += f" (default: {describe_value(f.name, default)})"
        # argparse %-formats help strings: a literal % (as in "90%") must be doubled
        kw: dict[str, Any] = {"dest": f.name, "help": (help_text + f"; env {env_name(f.name)}").replace("%", "%%")}
        if kind == "list":
            kw.update(action="append", metavar="DIR" if f.name in _PATH_LISTS else "GROUP")
        elif kind == "choice":
            kw.update(metavar="{" + ",".join(choices(f.name)) + "}")
        else:
            kw.update(metavar={"size": "SIZE", "int": "N", "float": "X", "bool": "BOOL"}.get(kind, "TEXT"))
        g.add_argument(flag_name(f.name), **kw)


def daemon_parser() -> ArgumentParser:
    """The daemon's command line (``tierstore daemon``, ``python -m tierstore.daemon``)."""
    from ._version import __version__

    p = ArgumentParser(prog="tierstore daemon", description="Run the tierstore node daemon in the foreground. "
                       "Stops cleanly on SIGTERM (drains I/O, flushes the journal). Precedence of settings: "
                       "flags > TIERSTORE_* variables > TOML file > defaults.")
    p.add_argument("--version", action="version", version=f"tierstore {__version__}")
    add_config_flags(p)
    return p


def sourced_config_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None
                             ) -> tuple[Config, dict[str, str]]:
    names = set(Config.field_names())
    overrides = {k: v for k, v in vars(args).items() if k in names and v is not None}
    where = {k: f"flag {flag_name(k)}" for k in overrides}
    return Config.load_sourced(getattr(args, "config", None), env=env, overrides=overrides, override_source=where)


def config_from_args(args: argparse.Namespace) -> Config:
    return sourced_config_from_args(args)[0]
