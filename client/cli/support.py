"""Helpers for the CLI's daemon-backed subcommands."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..client import Client


def connect(socket: str | None, namespace: str) -> Client:
    """A daemon ``Client``: the CLI's commands are a daemon's (``stat``, paged ``ls``), so they
    use its extras beyond ``tierstore.contract.Pool``."""
    from ..client import Client

    return Client.connect(socket=socket, namespace=namespace, prefault=False)  # short-lived: touches little
