"""I/O engines behind one interface; ``select_engine`` picks one and says why."""

from __future__ import annotations

import logging

from ..errors import InvalidArgument
from .base import EngineFile, IOEngine
from .posix import PosixEngine, dio_memory_alignment, probe_direct_io

__all__ = ["IOEngine", "EngineFile", "PosixEngine", "dio_memory_alignment", "probe_direct_io", "select_engine"]

log = logging.getLogger(__name__)


def select_engine(choice: str, threads: int, task_bytes: int = 4 << 20) -> IOEngine:
    """``auto``: kvikio when the CUDA driver loads and kvikio imports, else posix.
    ``task_bytes``: kvikio's task size (the posix engine's chunks are the NVMe tier's)."""
    from . import kvikio_engine

    if choice == "posix":
        return PosixEngine(threads, "posix engine requested by configuration")
    ok, why = kvikio_engine.detect()
    if choice == "kvikio":
        if not ok:
            raise InvalidArgument(f"engine=kvikio requested but unusable here: {why}; use --engine auto or posix")
        return kvikio_engine.KvikioEngine(threads, f"requested by configuration; {why}", task_bytes)
    if ok:
        log.info("I/O engine kvikio: %s", why)
        return kvikio_engine.KvikioEngine(threads, why, task_bytes)
    log.info("I/O engine posix: kvikio unusable (%s)", why)
    return PosixEngine(threads, f"kvikio unusable: {why}")
