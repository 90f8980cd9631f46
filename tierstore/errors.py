"""Typed errors shared by the core, the daemon and the client.

Every error carries a stable ``code`` (the class name) that travels over the wire
unchanged, so a client raises the same class the daemon raised. Messages say what to
do next.
"""

from __future__ import annotations

__all__ = [
    "TierstoreError",
    "InvalidArgument",
    "InvalidKey",
    "NotFound",
    "StaleHandle",
    "KeyExists",
    "CapacityExceeded",
    "NoSpace",
    "ChecksumMismatch",
    "StorageError",
    "Busy",
    "PermissionDenied",
    "ProtocolError",
    "DaemonUnavailable",
    "Closed",
    "error_for_code",
]


class TierstoreError(Exception):
    """Base class of every tierstore error; ``code`` is stable across versions."""

    code = "TierstoreError"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(TierstoreError, ValueError):
    """The caller passed something tierstore cannot use (wrong type, size, dtype...)."""

    code = "InvalidArgument"


class ReadOnlyView(InvalidArgument):
    """A write through the tensor of an ``r`` check-out (read-only memory)."""

    code = "ReadOnlyView"


class InvalidKey(InvalidArgument, KeyError):
    """A key tierstore cannot store: not a str, empty, too long, not UTF-8, or with
    control characters (they would break listings). A ``ValueError`` and a ``KeyError``."""

    code = "InvalidKey"

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.message


class NotFound(TierstoreError, KeyError):
    """No object with that handle or key exists."""

    code = "NotFound"

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.message


class StaleHandle(NotFound):
    """The handle named an object that has since been freed (or replaced)."""

    code = "StaleHandle"


class KeyExists(TierstoreError):
    """A put named a key that is already bound; pass replace=True to overwrite it."""

    code = "KeyExists"


class CapacityExceeded(TierstoreError):
    """No tier has room for the request, even after demoting what could be demoted."""

    code = "CapacityExceeded"


class NoSpace(CapacityExceeded):
    """The filesystem under an NVMe directory is full (ENOSPC)."""

    code = "NoSpace"


class ChecksumMismatch(TierstoreError):
    """Stored bytes failed their checksum; the object is not served."""

    code = "ChecksumMismatch"


class StorageError(TierstoreError):
    """An I/O error from the NVMe tier other than a full disk (EIO, EROFS...)."""

    code = "StorageError"


class Busy(TierstoreError):
    """The object is leased in a conflicting mode and the wait timed out."""

    code = "Busy"


class PermissionDenied(TierstoreError):
    """The peer's uid may not use this daemon or this namespace."""

    code = "PermissionDenied"


class ProtocolError(TierstoreError):
    """A malformed, oversized or out-of-order message."""

    code = "ProtocolError"


class DaemonUnavailable(TierstoreError):
    """No daemon answers on the socket."""

    code = "DaemonUnavailable"


class Closed(TierstoreError):
    """The store or connection has been closed."""

    code = "Closed"


_BY_CODE: dict[str, type[TierstoreError]] = {
    cls.code: cls
    for cls in (
        TierstoreError, InvalidArgument, InvalidKey, NotFound, StaleHandle, KeyExists, CapacityExceeded,
        NoSpace, ChecksumMismatch, StorageError, Busy, PermissionDenied, ProtocolError,
        DaemonUnavailable, Closed, ReadOnlyView,
    )
}


def error_for_code(code: str, message: str) -> TierstoreError:
    """Rebuild a typed error from its wire form; unknown codes become the base class."""
    cls = _BY_CODE.get(code, TierstoreError)
    return cls(message)
