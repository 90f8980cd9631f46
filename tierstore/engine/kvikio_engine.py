"""The KvikIO engine: host buffers move exactly as in the posix engine (``preadv`` /
``pwritev`` with O_DIRECT where the filesystem allows it: KvikIO's own POSIX path would
read through the page cache), device buffers (CUDA memory) move through
``kvikio.CuFile`` — GPUDirect Storage, NVMe <-> GPU with no host bounce, where the driver
and filesystem allow it, KvikIO's compat mode (its own pinned bounce) otherwise.

This is the only module in tierstore that imports kvikio. KvikIO needs the CUDA
driver (``libcuda.so.1``) even for host buffers, so ``detect()`` checks for it
before importing.

Notes
-----
Device I/O has no checksum of its own: the caller verifies the per-block CRC32C after
the transfer, from a device-to-host copy of the data (``NvmeTier.read_device``). A
CRC32C kernel would spare that copy; none ships with our dependencies, and the copy
(tens of GB/s) is cheaper than the drive read it follows.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

from .posix import PooledEngine, PosixFile

__all__ = ["KvikioEngine", "KvikioFile", "detect", "device_io"]

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


def device_io() -> tuple[bool, str]:
    """(GPUDirect Storage, reason): whether reads and writes of device buffers go NVMe <->
    GPU without a host bounce. False still allows device I/O, through KvikIO's compat
    mode; the reason says which and why."""
    ok, why = detect()
    if not ok:
        return False, f"no device I/O: {why}"
    if _compat_mode():
        return False, ("KvikIO compat mode: device buffers bounce through host memory (libcufile missing, "
                       "/run/udev unreadable, KVIKIO_COMPAT_MODE=ON, or no nvidia-fs driver)")
    return True, "GPUDirect Storage: device buffers move NVMe <-> GPU; CRC32C verified on the host after the read"


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


def _zero(buf: Any) -> None:
    """Zero a device buffer (a torch CUDA tensor or a CuPy array)."""
    if hasattr(buf, "zero_"):
        buf.zero_()
    else:
        buf.fill(0)


class KvikioFile(PosixFile):
    """A data file: host buffers through ``PosixFile`` (O_DIRECT where ``direct``), device
    buffers through a ``kvikio.CuFile`` opened on the first device transfer."""

    def __init__(self, path: str, *, direct: bool) -> None:
        super().__init__(path, direct=direct)
        self._cu: Any = None

    def _cufile(self) -> Any:
        if self._cu is None:
            import kvikio

            self._cu = kvikio.CuFile(self.path, "r+")
        return self._cu

    def pread_device(self, buf: Any, offset: int) -> int:
        """Fill the contiguous uint8 device buffer ``buf`` (``__cuda_array_interface__``)
        from ``offset``; a tail past the end of the file reads as zeros (never written)."""
        n = int(buf.nbytes) if hasattr(buf, "nbytes") else buf.numel() * buf.element_size()
        done = 0
        while done < n:
            got = int(self._cufile().read(buf[done:], n - done, offset + done))
            if got <= 0:
                _zero(buf[done:])
                break
            done += got
        return n

    def pwrite_device(self, buf: Any, offset: int) -> int:
        """Write all of the device buffer ``buf`` at ``offset``."""
        n = int(buf.nbytes) if hasattr(buf, "nbytes") else buf.numel() * buf.element_size()
        done = 0
        while done < n:
            put = int(self._cufile().write(buf[done:], n - done, offset + done))
            if put <= 0:
                raise OSError(f"kvikio wrote {put} bytes to {self.path} at offset {offset + done}")
            done += put
        return n

    def close(self) -> None:
        if self._cu is not None:
            self._cu.close()
            self._cu = None
        super().close()


class KvikioEngine(PooledEngine):
    name = "kvikio"

    def __init__(self, threads: int, reason: str, task_bytes: int = 4 << 20) -> None:
        import kvikio.defaults

        super().__init__(threads, reason, "tierstore-kvikio")
        self.task_bytes = task_bytes
        self.gds, self.device_reason = device_io()
        setter = getattr(kvikio.defaults, "set", None)
        for name, value in (("num_threads", threads), ("task_size", task_bytes)):
            try:
                if setter is not None:
                    setter(name, value)
                else:  # older kvikio: one reset function per setting
                    getattr(kvikio.defaults, f"{name}_reset")(value)
            except Exception as e:
                log.info("kvikio %s left at its default: %s", name, e)
        log.info("kvikio device I/O: %s", self.device_reason)

    def open(self, path: str, *, direct: bool) -> KvikioFile:
        return KvikioFile(path, direct=direct)
