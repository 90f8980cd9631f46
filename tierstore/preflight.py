"""Start-up checks: everything that can refuse a start, before anything slow happens.

A store (and so the daemon) checks, in milliseconds and in this order: each NVMe
directory exists or can be created and is writable; no other store or daemon holds it
(its lock file); each filesystem has room for its part of the NVMe tier (an unset ``nvme_bytes``
shrinks to fit; a set one that does not fit is refused when the data files are
reserved whole at start, the default, and a warning with the size that would fit
when they grow in ``nvme_grow_bytes`` steps); the host arena fits in memory. Only then is the arena mapped, which takes seconds for large
arenas. A check that fails raises ``InvalidArgument`` with one line saying what to
change. This module decides nothing about placement; it only reads the machine.
"""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import os
import socket
import stat
import struct
from collections.abc import Callable

from .config import DEFAULT_NVME_BYTES, Config, StoreConfig, total_memory_bytes, unknown_groups
from .errors import InvalidArgument, StorageError
from .files import open_own
from .units import PAGE, format_size

__all__ = ["check_start", "check_daemon_start", "check_dir", "nvme_room"]

log = logging.getLogger(__name__)

LOCK_FILE = "lock"  # the NVMe tier's lock (tierstore.nvme.LOCK_FILE; not imported: numpy-free here)
DATA_FILE = "data.bin"
_OWN_FILES = (LOCK_FILE, DATA_FILE, "journal.log", "index.ckpt", "tier.id")
"""The tier's files by name (``tierstore.journal.JOURNAL_FILE``, ``tierstore.checkpoint.CHECKPOINT_FILE``,
``tierstore.tierid.ID_FILE``): each is a regular file or absent."""
_MIN_AUTO_NVME_BYTES = 16 << 20
_AUTO_NVME_SHARE = 0.9
"""An unset nvme_bytes takes at most this share of a filesystem's room, leaving some for
the journal and for whatever else lives there."""


def check_start(cfg: StoreConfig, *, warn: bool = True) -> StoreConfig:
    """Check a resolved store section against the machine; return it with ``nvme_bytes`` set
    (64 GiB, or less with a warning where the filesystems have less room). ``warn=False``:
    refusals only, the warnings left to the store's own check (the daemon's early checks
    would otherwise print each one three times)."""
    say = log.warning if warn else _silent
    seen: dict[str, str] = {}
    for d in cfg.nvme_dirs:
        real = os.path.realpath(d)
        if real in seen:
            raise InvalidArgument(f"nvme_dirs names one directory twice ({seen[real]!r} and {d!r} are both {real}); "
                                  "give each drive's directory once")
        seen[real] = d
    for d in cfg.nvme_dirs:
        check_dir(d)
        _check_private(d, say)
    for d in cfg.nvme_dirs:
        _check_unlocked(d)
    room = nvme_room(cfg.nvme_dirs)
    n = len(cfg.nvme_dirs)
    if cfg.nvme_bytes is None:
        per_dir = min(int(r * _AUTO_NVME_SHARE) // k for r, k, _ in room)
        size = min(DEFAULT_NVME_BYTES // n, per_dir) // (1 << 20) * (1 << 20) * n
        if size < _MIN_AUTO_NVME_BYTES:
            raise InvalidArgument(f"the NVMe directory {_where(room)} has only {format_size(min(r for r, _, _ in room))} "
                                  "free; free space there or choose another --nvme-dir")
        if size < DEFAULT_NVME_BYTES // PAGE * PAGE:
            say("nvme_bytes is not set and %s has room for less than the default %s: using %s "
                "(set nvme_bytes to choose)", _where(room), format_size(DEFAULT_NVME_BYTES),
                format_size(size))
        cfg = _no_smaller_than_its_files(dataclasses.replace(cfg, nvme_bytes=size), say)
    elif (kept := _no_smaller_than_its_files(cfg, say)) is not cfg:
        cfg = kept  # (files that large are there already: no room to check)
    else:
        per_dir = cfg.nvme_bytes // n
        for r, k, dirs in room:
            if per_dir * k <= r:
                continue
            usable = min(rr // kk for rr, kk, _ in room) * n // (1 << 20) * (1 << 20)
            what = (f"nvme_bytes is {format_size(cfg.nvme_bytes)} but the filesystem of {', '.join(dirs)} has room "
                    f"for {format_size(r)} (free space plus the tier's own files)")
            if cfg.nvme_grow_bytes == 0:
                # the data files are reserved whole at start: a reservation the filesystem cannot
                # hold would take all of its free space before failing
                raise InvalidArgument(f"{what}; lower nvme_bytes to at most {format_size(usable)} or free space "
                                      "there")
            # growing files: a warning, not a refusal; free space changes while the daemon runs
            # anyway, and a full filesystem costs the request that met it (NoSpace), never the store
            say("%s: puts fail with NoSpace beyond that; lower nvme_bytes to at most %s or free space "
                "there", what, format_size(usable))
    ram = total_memory_bytes()
    if cfg.host_bytes > ram:
        raise InvalidArgument(f"host_bytes is {format_size(cfg.host_bytes)} but this machine has "
                              f"{format_size(ram)} of memory; lower host_bytes")
    avail = _mem_available()
    if avail is not None and cfg.host_bytes > avail:
        say("host_bytes is %s but only %s of memory is available now; the arena will push other "
            "memory out (or meet the OOM killer)", format_size(cfg.host_bytes), format_size(avail))
    return cfg


def check_daemon_start(cfg: Config) -> None:
    """``check_start`` (refusals only: the store's open warns) plus the daemon's socket
    directory (made if missing, writable)."""
    resolved = cfg.resolved()
    missing = unknown_groups(resolved.daemon.allowed_groups)
    if missing:
        raise InvalidArgument(f"allowed_groups names {', '.join(map(repr, missing))}, which this machine has no "
                              "group of: create it (groupadd), give a gid, or remove it")
    check_dir(os.path.dirname(resolved.daemon.socket) or ".", mode=0o750, what="socket directory", flag="--socket")
    _socket_path_usable(resolved.daemon.socket)
    _no_daemon_serving(resolved.daemon.socket)  # (before the NVMe directories, which such a daemon holds)
    check_start(resolved.store, warn=False)


_SUN_PATH_MAX = 107
"""The longest path a Unix socket can be bound at (``sun_path`` holds 108 bytes with its NUL)."""


def _socket_path_usable(path: str) -> None:
    """The refusals the socket's bind would make, before the store opens (a journal
    replayed for nothing): a path too long for a Unix socket, a directory another uid
    owns, or one others may write in without the sticky bit (they could replace the
    socket). The daemon's bind checks them again."""
    if len(os.fsencode(path)) > _SUN_PATH_MAX:
        raise InvalidArgument(f"the socket path {path} is {len(os.fsencode(path))} bytes, longer than a Unix "
                              f"socket's {_SUN_PATH_MAX}; choose a shorter --socket")
    d = os.path.dirname(path) or "."
    st = os.stat(d)
    if st.st_uid not in (os.geteuid(), 0):
        raise InvalidArgument(f"socket directory {d} belongs to uid {st.st_uid}, who could replace the daemon's "
                              f"socket; use a directory of uid {os.geteuid()} (or root's)")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise InvalidArgument(f"socket directory {d} has mode {stat.S_IMODE(st.st_mode):o}: others may replace the "
                              "daemon's socket in it; use a directory only its owner writes (0750), or a sticky one")


def _no_daemon_serving(path: str) -> None:
    """``InvalidArgument`` naming the daemon already serving ``path``, where one answers
    there (a stale socket, or none, passes: the daemon replaces it)."""
    if not os.path.exists(path):
        return
    try:
        pid = serving_pid(path)
    except OSError:
        return  # (not a live daemon's socket: the daemon's own check says what it is)
    if pid is not None:
        raise InvalidArgument(already_serving(pid, path))


def serving_pid(path: str) -> int | None:
    """The pid of the process answering on the Unix socket ``path``; None where nothing
    answers (no socket there, or a stale one). ``OSError``: it could not be probed."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    probe.settimeout(2.0)
    try:
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return None
        return struct.unpack("3i", probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[0]
    finally:
        probe.close()


def already_serving(pid: int, path: str) -> str:
    """The refusal of a daemon started on a socket another one serves."""
    return f"a tierstore daemon (pid {pid}) is already serving {path}; stop it first or use another --socket"


def _silent(*_args: object) -> None:
    pass


def _no_smaller_than_its_files(cfg: StoreConfig, say: Callable[..., None]) -> StoreConfig:
    """``cfg`` with ``nvme_bytes`` raised, with a warning, to cover the data files an
    earlier, larger tier left in its directories: the durable objects in them are kept
    (an unset size follows the filesystem's free room, which others' files change from
    one start to the next; a set one may have been lowered). Their space is on disk
    already; a tier is made smaller only by starting with empty directories."""
    n = len(cfg.nvme_dirs)
    largest = 0
    for d in cfg.nvme_dirs:
        try:
            st = os.lstat(os.path.join(d, DATA_FILE))
        except FileNotFoundError:
            continue
        if stat.S_ISREG(st.st_mode):
            largest = max(largest, st.st_size)
    need = -(-largest // (1 << 20)) * (1 << 20) * n
    if need <= cfg.nvme_bytes:
        return cfg
    say("nvme_bytes is %s, but the data files in %s hold up to %s each, from an earlier, larger tier: "
        "using %s, so the durable objects in them are kept (start with empty directories to make the "
        "tier smaller)", format_size(cfg.nvme_bytes), ", ".join(cfg.nvme_dirs), format_size(largest),
        format_size(need))
    return dataclasses.replace(cfg, nvme_bytes=need)


def nvme_room(dirs: list[str]) -> list[tuple[int, int, list[str]]]:
    """Per filesystem: (room in bytes, how many of ``dirs`` are on it, which). Room is
    the free space an unprivileged writer may use plus what the tier's data files there
    already occupy (they are reused)."""
    by_dev: dict[int, list[str]] = {}
    for d in dirs:
        by_dev.setdefault(os.stat(d).st_dev, []).append(d)
    out = []
    for dev_dirs in by_dev.values():
        st = os.statvfs(dev_dirs[0])
        room = st.f_bavail * st.f_frsize
        for d in dev_dirs:
            try:
                room += os.stat(os.path.join(d, DATA_FILE)).st_blocks * 512
            except FileNotFoundError:
                pass
        out.append((room, len(dev_dirs), dev_dirs))
    return out


def _where(room: list[tuple[int, int, list[str]]]) -> str:
    return ", ".join(d for _, _, dirs in room for d in dirs)


def check_dir(d: str, *, mode: int = 0o700, what: str = "NVMe directory", flag: str = "--nvme-dir") -> None:
    """Create ``d`` if needed and check that this uid may write in it; one-line errors."""
    try:
        os.makedirs(d, mode=mode, exist_ok=True)
    except FileExistsError:
        raise InvalidArgument(f"{what} {d} exists and is not a directory; choose another {flag}") from None
    except OSError as e:
        raise InvalidArgument(f"cannot create {what} {d}: {e.strerror}; choose a directory you can write "
                              f"({flag})") from None
    if not os.access(d, os.W_OK | os.X_OK):
        raise InvalidArgument(f"{what} {d} is not writable by uid {os.geteuid()}; fix its owner or choose "
                              f"another {flag}")


def _check_private(d: str, say: Callable[..., None]) -> None:
    """Refuse an NVMe directory holding a symbolic link (the store's files are its own:
    a planted link would turn its writes onto another file; ``tierstore.files`` never
    follows one anyway), and warn about one that other users may write in or that
    another uid owns (they could plant one at any time)."""
    with os.scandir(d) as entries:
        for entry in entries:
            if entry.is_symlink():
                raise InvalidArgument(f"NVMe directory {d} holds a symbolic link, {entry.name}; the tier's directory "
                                      "holds only its own files (someone may have planted it): remove it")
            if entry.name in _OWN_FILES and not entry.is_file(follow_symlinks=False):
                # (a FIFO would hang the start's read of it; a directory would fail it obscurely)
                raise InvalidArgument(f"NVMe directory {d} holds {entry.name}, which is not a regular file; the "
                                      "tier's files are its own (someone may have planted it): remove it")
    st = os.stat(d)
    if st.st_mode & 0o022 or st.st_uid != os.geteuid():
        say("NVMe directory %s is %s (mode %o, owner uid %d): others could plant files or links there; "
            "tierstore follows no link among its files, but give it to uid %d with mode 0700", d,
            "writable by other users" if st.st_mode & 0o022 else "owned by another uid",
            stat.S_IMODE(st.st_mode), st.st_uid, os.geteuid())


def _check_unlocked(d: str) -> None:
    """Fail now if another store holds ``d`` (the NVMe tier takes the lock for real later)."""
    path = os.path.join(d, LOCK_FILE)
    try:
        fd = open_own(path, os.O_RDWR | os.O_CREAT)
    except StorageError as e:
        raise InvalidArgument(e.message) from None
    except OSError as e:
        raise InvalidArgument(f"cannot open {path}: {e.strerror}; choose a directory you can write") from None
    dir_fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for held in (dir_fd, fd):  # (the directory too: ``nvme._Drive`` locks both)
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(held, fcntl.LOCK_UN)
    except BlockingIOError:
        other = os.pread(fd, 32, 0).decode(errors="replace").strip() or "another process"
        raise InvalidArgument(f"NVMe directory {d} is in use by pid {other}; stop that store/daemon or "
                              "configure another directory") from None
    finally:
        os.close(fd)
        os.close(dir_fd)


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
