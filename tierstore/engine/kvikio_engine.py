"""The KvikIO engine: ``kvikio.CuFile`` reads and writes, GPUDirect Storage where the
driver and filesystem allow it, KvikIO's POSIX compat mode otherwise.

This is the only module in tierstore that imports kvikio. KvikIO needs the CUDA
driver (``libcuda.so.1``) even for host buffers, so ``detect()`` checks for it
before importing.
"""

from __future__ import annotations

import ctypes
import logging

import numpy as np

from .posix import PooledEngine

__all__ = ["KvikioEngine", "detect"]

log = logging.getLogger(__name__)


def detect() -> tuple[bool, str]:
    """(usable, reason): kvikio is usable when libcuda loads and kvikio imports."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        return False, f"no CUDA driver ({e})"
    try:
        import kvikio  # noqa: F401
        import kvikio.defaults
    except Exception as e:  # ImportError, or a driver/runtime mismatch raised on import
        return False, f"kvikio not importable: {type(e).__name__}: {e}"
    compat = _compat_mode()
    mode = "POSIX compat mode (no GPUDirect Storage)" if compat else "GPUDirect Storage"
    return True, f"kvikio {getattr(kvikio, '__version__', '?')} with {mode}"


def _compat_mode() -> bool:
    import kvikio.defaults

    for name in ("is_compat_mode_preferred", "compat_mode"):
        fn = getattr(kvikio.defaults, name, None)
        if fn is not None:
            try:
                val = fn()
            except TypeError:
                continue
            return bool(val) if not hasattr(val, "name") else val.name != "OFF"
    return True


class KvikioFile:
    def __init__(self, path: str, *, direct: bool) -> None:
        import kvikio

        self.path = path
        self.direct = direct  # kvikio opens with O_DIRECT itself when GDS is active
        open(path, "ab").close()
        self._f = kvikio.CuFile(path, "r+")

    def pread_into(self, buf: np.ndarray, offset: int) -> int:
        return int(self._f.read(buf, buf.nbytes, offset))

    def pwrite_from(self, buf: np.ndarray, offset: int) -> int:
        return int(self._f.write(buf, buf.nbytes, offset))

    def fileno(self) -> int:
        return self._f.fileno()

    def sync(self) -> None:
        import os

        os.fdatasync(self._f.fileno())

    def close(self) -> None:
        self._f.close()


class KvikioEngine(PooledEngine):
    name = "kvikio"

    def __init__(self, threads: int, reason: str, task_bytes: int = 4 << 20) -> None:
        import kvikio.defaults

        super().__init__(threads, reason, "tierstore-kvikio")
        self.task_bytes = task_bytes
        setter = getattr(kvikio.defaults, "set", None)
        for name, value in (("num_threads", threads), ("task_size", task_bytes)):
            try:
                if setter is not None:
                    setter(name, value)
                else:  # older kvikio: one reset function per setting
                    getattr(kvikio.defaults, f"{name}_reset")(value)
            except Exception as e:
                log.info("kvikio %s left at its default: %s", name, e)

    def open(self, path: str, *, direct: bool) -> KvikioFile:
        return KvikioFile(path, direct=direct)
