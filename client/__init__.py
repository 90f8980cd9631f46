"""The tierstore client library: a connection to the node daemon (``Client``) and, in
``tierstore.client.torch``, the PyTorch hooks. Imports the core, never the daemon."""

from .client import Client, ClientLease

__all__ = ["Client", "ClientLease"]
