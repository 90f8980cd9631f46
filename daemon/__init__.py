"""The tierstore node daemon: socket server, sessions, admission, the ops' handlers, systemd
integration (the leases themselves are the core's).

Imports the core (``tierstore``), never the client. ``Server``, ``Session`` and ``run``
are imported on first use, so ``python -m tierstore.daemon`` can refuse a bad setting
before loading the server.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Server", "Session", "run"]


def __getattr__(name: str) -> Any:
    if name == "Session":
        from . import session

        return session.Session
    if name in __all__:
        from . import server

        return getattr(server, name)
    raise AttributeError(f"module 'tierstore.daemon' has no attribute {name!r}")
