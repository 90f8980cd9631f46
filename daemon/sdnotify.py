"""systemd's notify protocol: one datagram to ``$NOTIFY_SOCKET`` per state change.

No-op when the variable is unset (not started by systemd with Type=notify).
"""

from __future__ import annotations

import array
import logging
import os
import socket

__all__ = ["Notifier", "inherited_fds"]

SD_LISTEN_FDS_START = 3


def inherited_fds(env: dict[str, str] | None = None) -> dict[str, int]:
    """File descriptors systemd passed back (``LISTEN_FDS`` / ``LISTEN_FDNAMES``), by name.

    Only when ``LISTEN_PID`` names this process, as sd_listen_fds(3) requires.
    """
    env = dict(os.environ) if env is None else env
    if env.get("LISTEN_PID") != str(os.getpid()):
        return {}
    try:
        n = int(env.get("LISTEN_FDS", "0"))
    except ValueError:
        return {}
    names = env.get("LISTEN_FDNAMES", "").split(":") if env.get("LISTEN_FDNAMES") else []
    out = {}
    for i in range(n):
        fd = SD_LISTEN_FDS_START + i
        name = names[i] if i < len(names) else f"fd{i}"
        os.set_inheritable(fd, False)
        out[name] = fd
    return out

log = logging.getLogger(__name__)


class Notifier:
    def __init__(self, env: dict[str, str] | None = None) -> None:
        env = dict(os.environ) if env is None else env
        addr = env.get("NOTIFY_SOCKET", "")
        if addr.startswith("@"):
            addr = "\0" + addr[1:]  # abstract namespace
        self.addr = addr or None
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        ok = usec.isdigit() and (not pid or pid == str(os.getpid()))
        self.watchdog_interval_s = int(usec) / 2e6 if ok and int(usec) > 0 else None
        """Half of WatchdogSec, as systemd recommends; None when no watchdog is set."""

    def notify(self, *lines: str, fds: list[int] | None = None) -> bool:
        if not self.addr:
            return False
        msg = "\n".join(lines).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
                if fds:
                    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
                    s.sendmsg([msg], anc, 0, self.addr)
                else:
                    s.sendto(msg, self.addr)
            return True
        except OSError as e:
            log.warning("sd_notify to %r failed: %s", self.addr, e)
            return False

    def ready(self, status: str) -> bool:
        return self.notify("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def status(self, status: str) -> bool:
        return self.notify(f"STATUS={status}")

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def store_fd(self, name: str, fd: int) -> bool:
        """Hand ``fd`` to systemd's file-descriptor store under ``name`` (FDSTORE=1)."""
        return self.notify("FDSTORE=1", f"FDNAME={name}", fds=[fd])

    def stopping(self) -> bool:
        return self.notify("STOPPING=1", "STATUS=draining I/O and flushing the journal")
