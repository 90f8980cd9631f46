"""Opening the store's own files in its directories without following links: a link
planted in an NVMe directory (one that others can write, or that was made by someone
else) must never turn the daemon's writes, which may run as root, onto another file.

``open_own`` opens a file of the store with ``O_NOFOLLOW``; ``create_fresh`` makes a
temporary file anew (whatever held its name is removed first, a link included, never
what the link points to; then ``O_EXCL``). A link found is ``StorageError`` naming it.
"""

from __future__ import annotations

import errno
import os

from .errors import StorageError

__all__ = ["FALLOC_KEEP_SIZE", "create_fresh", "fallocate", "fsync_dir", "open_own", "refuse_link"]

FALLOC_KEEP_SIZE = 1
"""fallocate(2)'s ``FALLOC_FL_KEEP_SIZE``: blocks past the end, the size unchanged."""


def open_own(path: str, flags: int, mode: int = 0o600) -> int:
    """``os.open`` of one of the store's files, refusing to follow a symbolic link there."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _planted(path) from None
        raise


def refuse_link(path: str) -> None:
    """``StorageError`` if ``path`` is a symbolic link (for a file opened by a library that
    takes a path, not a descriptor: KvikIO)."""
    if os.path.islink(path):
        raise _planted(path)


def _planted(path: str) -> StorageError:
    return StorageError(f"{path} is a symbolic link; the store does not follow links among its own files (someone "
                        "may have planted it): remove it, and keep the directory writable by this uid only")


def create_fresh(path: str, flags: int = os.O_WRONLY, mode: int = 0o600) -> int:
    """A new, empty file at ``path`` for writing (a temporary file, renamed into place later)."""
    try:
        os.unlink(path)  # (a link is removed itself, not what it points to)
    except FileNotFoundError:
        pass
    return open_own(path, flags | os.O_CREAT | os.O_EXCL, mode)


def fallocate(fd: int, offset: int, length: int, mode: int = 0) -> int:
    """fallocate(2) (not ``posix_fallocate``, which writes the whole range where the
    filesystem cannot reserve it); returns 0 or the errno (EOPNOTSUPP where unsupported)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "fallocate64", None) or getattr(libc, "fallocate", None)
    if fn is None:
        return errno.EOPNOTSUPP
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    if fn(fd, mode, offset, length) == 0:
        return 0
    return ctypes.get_errno() or errno.EIO


def fsync_dir(directory: str) -> None:
    """Make the names in ``directory`` (a rename, a new file) survive a crash."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
