"""The tierstore node daemon: socket server, sessions, auth, leases, systemd integration.

Imports the core (``tierstore``), never the client.
"""

from .server import Server, Session, run

__all__ = ["Server", "Session", "run"]
