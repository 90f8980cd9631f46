"""Where the daemon's socket and NVMe scratch are by default: a leaf the client imports
without the settings (``config.py``) that the daemon reads."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["default_nvme_dir", "default_socket_path"]


def default_socket_path() -> str:
    """``$XDG_RUNTIME_DIR/tierstore/tierstore.sock``, else ``/run/tierstore/tierstore.sock``."""
    base = os.environ.get("XDG_RUNTIME_DIR") or "/run"
    return str(Path(base) / "tierstore" / "tierstore.sock")


def default_nvme_dir() -> str:
    """``$XDG_DATA_HOME/tierstore/nvme`` (``~/.local/share/tierstore/nvme``)."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return str(Path(base) / "tierstore" / "nvme")
