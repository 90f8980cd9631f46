"""The I/O engine interface. This is the whole surface the NVMe tier uses.

An engine opens files and runs blocking positional reads and writes of whole,
aligned buffers on its own pool of workers. Chunking, checksums and bounce
buffers are the NVMe tier's business, not the engine's.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Callable, Protocol

import numpy as np

__all__ = ["IOEngine", "EngineFile"]


class EngineFile(Protocol):
    """An open data file. ``buf`` is a contiguous uint8 array; calls block."""

    path: str
    direct: bool
    """True when the file is open with O_DIRECT (buffers and offsets must be 4 KiB aligned)."""

    def pread_into(self, buf: np.ndarray, offset: int) -> int: ...
    def pwrite_from(self, buf: np.ndarray, offset: int) -> int: ...
    def fileno(self) -> int: ...
    def sync(self) -> None: ...
    def close(self) -> None: ...


class IOEngine(Protocol):
    name: str
    """``posix`` or ``kvikio``."""
    reason: str
    """Why this engine was chosen (shown by ``tierstore stat``)."""
    threads: int
    gds: bool
    """Whether reads and writes can go straight between a file and GPU memory
    (GPUDirect Storage, kvikio only)."""
    device_reason: str
    """Why device I/O is or is not available (shown by ``tierstore stat``)."""

    def open(self, path: str, *, direct: bool) -> EngineFile: ...
    def submit(self, fn: Callable[..., Any], *args: Any, priority: int = 0) -> Future:
        """Run ``fn(*args)`` on a worker; lower ``priority`` first (0 demand, 1 prefetch)."""
        ...
    def queued(self) -> int:
        """Requests submitted and not yet taken by a worker."""
        ...
    def close(self) -> None: ...
