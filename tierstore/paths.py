"""Where the daemon's socket and NVMe scratch are by default: a leaf the client imports
without the settings (``config.py``) that the daemon reads."""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["SYSTEM_SOCKET", "client_socket_path", "default_nvme_dir", "default_socket_path"]

SYSTEM_SOCKET = "/run/tierstore/tierstore.sock"
"""The socket of a daemon run for the whole machine (the systemd unit's)."""


def default_socket_path() -> str:
    """``$XDG_RUNTIME_DIR/tierstore/tierstore.sock``, else ``/run/tierstore/tierstore.sock``."""
    base = os.environ.get("XDG_RUNTIME_DIR") or "/run"
    return str(Path(base) / "tierstore" / "tierstore.sock")


def client_socket_path() -> str:
    """The socket a client connects to when none is named: ``default_socket_path()``, or
    the machine's daemon (``SYSTEM_SOCKET``) where no daemon listens at the former and
    there is one at the latter — a login session sets ``XDG_RUNTIME_DIR``, and the
    systemd unit's daemon listens on ``/run``."""
    path = default_socket_path()
    if path != SYSTEM_SOCKET and _is_socket(SYSTEM_SOCKET) and not _listening(path):
        return SYSTEM_SOCKET
    return path


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


def _listening(path: str) -> bool:
    """Whether a daemon listens on the socket at ``path``: a stale socket file (a daemon
    that was killed) is not one, so the machine's daemon is still found."""
    if not _is_socket(path):
        return False
    import socket

    probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    probe.settimeout(2.0)
    try:
        probe.connect(path)
        return True
    except ConnectionRefusedError:
        return False
    except OSError:  # (reachable but refusing us, or too slow: a daemon of its own, all the same)
        return True
    finally:
        probe.close()


def default_nvme_dir() -> str:
    """``$XDG_DATA_HOME/tierstore/nvme`` (``~/.local/share/tierstore/nvme``)."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return str(Path(base) / "tierstore" / "nvme")
