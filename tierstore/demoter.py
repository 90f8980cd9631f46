"""The demoter: the background thread that keeps the memory tiers under their watermarks.

``Demoter`` owns the thread, its wake-up event and the list of objects to return to
NVMe (home-NVMe objects nobody uses any more). What one pass does is placement's
(``Passes``): it wakes on ``wake`` (a tier went over its high watermark, an object was
queued with ``demote_soon``) or once a second, and runs the passes until the index closes;
once a second it also lets the NVMe tier give back its files' free tails.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Protocol

__all__ = ["Demoter", "Passes"]

log = logging.getLogger(__name__)


class Passes(Protocol):
    """What the demoter runs on each wake-up (placement provides them)."""

    def demote_home_nvme(self, oids: list[int]) -> None:
        """Move these home-NVMe objects back down, where nobody uses them."""

    def demote_gpu_tiers(self) -> None:
        """Bring every device's GPU tier under the low watermark."""

    def demote_host_tier(self) -> None:
        """Bring the host tier under the low watermark, if it is over the high one."""

    def trim_nvme(self) -> None:
        """Give back the NVMe data files' tails that stayed free (``NvmeTier.trim``)."""


class Demoter:
    """The background demotion thread; see the module docstring."""

    def __init__(self, passes: Passes, closed: Callable[[], bool]) -> None:
        self._passes, self._closed = passes, closed
        self._wake = threading.Event()
        self._soon: list[int] = []
        self._soon_lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="tierstore-demoter", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop the thread (the index is already closed)."""
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join()

    def wake(self) -> None:
        """Run a pass now."""
        self._wake.set()

    def demote_soon(self, oid: int) -> None:
        """Return ``oid`` (a home-NVMe object released from use) to NVMe on the next pass."""
        with self._soon_lock:
            self._soon.append(oid)
        self._wake.set()

    def _loop(self) -> None:
        log.debug("demoter started")
        last_trim = time.monotonic()
        while True:
            self._wake.wait(timeout=1.0)
            self._wake.clear()
            if self._closed():
                break
            with self._soon_lock:
                soon, self._soon = self._soon, []
            if soon:
                self._passes.demote_home_nvme(soon)
            self._passes.demote_gpu_tiers()
            self._passes.demote_host_tier()
            if time.monotonic() - last_trim >= 1.0:
                last_trim = time.monotonic()
                self._passes.trim_nvme()
        log.info("demoter stopped")
