"""The tierstore client library: a connection to the node daemon (``Client``) and, in
``tierstore.client.torch``, the PyTorch hooks. Imports the core, never the daemon.

``Client`` and ``ClientLease`` are imported on first use, so the ``tierstore`` command
answers ``--help``, ``--version`` and argument errors without loading NumPy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .client import Client, ClientLease

__all__ = ["Client", "ClientLease"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import client

        return getattr(client, name)
    raise AttributeError(f"module 'tierstore.client' has no attribute {name!r}")
