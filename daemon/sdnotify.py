"""systemd's notify protocol: one datagram to ``$NOTIFY_SOCKET`` per state change.

No-op when the variable is unset (not started by systemd with Type=notify).
"""

from __future__ import annotations

import logging
import os
import socket

__all__ = ["Notifier"]

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

    def notify(self, *lines: str) -> bool:
        if not self.addr:
            return False
        msg = "\n".join(lines).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
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

    def stopping(self) -> bool:
        return self.notify("STOPPING=1", "STATUS=draining I/O and flushing the journal")
