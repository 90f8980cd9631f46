"""tierstore: a tiered tensor store (GPU / pinned host / NVMe) for training models larger
than GPU memory. The core is usable in-process (``Store``); the daemon and the client
(``tierstore.daemon``, ``tierstore.client``) share one pool per node.

The public names below are imported on first use (PEP 562), so a command that only
reads its configuration (``tierstore daemon`` refusing a bad setting, ``tierstore
config``) starts without loading NumPy and the store.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__
from .errors import (Busy, CapacityExceeded, ChecksumMismatch, Closed, DaemonUnavailable, InvalidArgument,
                     InvalidKey, KeyExists, NoSpace, NotFound, PermissionDenied, ProtocolError, ReadOnlyView,
                     StaleHandle, StorageError, TierstoreError)

if TYPE_CHECKING:
    from .batch import LeaseGroup
    from .config import Config
    from .names import Handle
    from .store import Lease, Store

__all__ = [
    "__version__", "Config", "Store", "Lease", "LeaseGroup", "Handle",
    "TierstoreError", "InvalidArgument", "InvalidKey", "NotFound", "StaleHandle", "KeyExists", "CapacityExceeded",
    "NoSpace", "ChecksumMismatch", "StorageError", "Busy", "PermissionDenied", "ProtocolError",
    "DaemonUnavailable", "Closed", "ReadOnlyView",
]

_LAZY = {"Config": ".config", "Store": ".store", "Lease": ".store", "LeaseGroup": ".batch", "Handle": ".names"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    try:  # submodules, as `import tierstore; tierstore.store` would have found them
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError:
        raise AttributeError(f"module 'tierstore' has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
