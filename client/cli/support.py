"""Helpers for the CLI's daemon-backed subcommands."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..client import Client


ANSWER_WITHIN_S = 30.0
"""How long ``stat`` and ``ls`` wait for each answer: a daemon that stopped answering (a
``SIGSTOP``, a wedge) ends them with ``DaemonUnavailable`` instead of hanging them."""


def connect(socket: str | None, namespace: str, *, answer_within_s: float | None = None) -> Client:
    """A daemon ``Client``: the CLI's commands are a daemon's (``stat``, paged ``ls``), so they
    use its extras beyond ``tierstore.contract.Pool``. ``answer_within_s``: each answer
    waited for at most that long (for requests that are always short)."""
    from ..client import Client

    # (short-lived: touches little; hello waits as long as each later answer may)
    c = Client.connect(socket=socket, namespace=namespace, prefault=False, timeout_s=answer_within_s or 30.0)
    if answer_within_s is not None:
        c._conn.sock.settimeout(answer_within_s)
    return c
