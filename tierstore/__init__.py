"""tierstore: a tiered tensor store (GPU / pinned host / NVMe) for training models larger
than GPU memory. The core is usable in-process (``Store``); the daemon and the client
(``tierstore.daemon``, ``tierstore.client``) share one pool per node."""

from ._version import __version__
from .config import Config
from .errors import (Busy, CapacityExceeded, ChecksumMismatch, Closed, DaemonUnavailable, InvalidArgument,
                     KeyExists, NoSpace, NotFound, PermissionDenied, ProtocolError, ReadOnlyView, StaleHandle,
                     StorageError, TierstoreError)
from .batch import LeaseGroup
from .index import Handle
from .store import Lease, Store

__all__ = [
    "__version__", "Config", "Store", "Lease", "LeaseGroup", "Handle",
    "TierstoreError", "InvalidArgument", "NotFound", "StaleHandle", "KeyExists", "CapacityExceeded",
    "NoSpace", "ChecksumMismatch", "StorageError", "Busy", "PermissionDenied", "ProtocolError",
    "DaemonUnavailable", "Closed", "ReadOnlyView",
]
