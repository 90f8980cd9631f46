"""The daemon's cyclic garbage collector: a full collection costs the objects made since
the last one, not the whole index.

A daemon holding a million objects keeps tens of millions of containers alive for its
whole life (metadata, specs, keys, extents). CPython's full collection walks every one
of them each time the survivors grow by a quarter, on whichever thread allocates, with
the interpreter lock held: at 100 000 objects that was ~9 µs of CPU per durable put,
and a pause of the event loop that grows with the index. After each full collection the
survivors are frozen (``gc.freeze``: the collector no longer walks them; reference
counting still frees them), so the next one walks only what is new.

The price: a reference cycle among frozen objects is not found while they stay frozen.
So every ``thaw_every_s`` the frozen objects are handed back, and the next full
collection walks everything once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import time

log = logging.getLogger(__name__)


class FreezeAfterFullCollections:
    """Installed once per process (``install``); ``uninstall`` takes it out again."""

    def __init__(self, thaw_every_s: float = 3600.0) -> None:
        self.thaw_every_s = thaw_every_s
        self._thawed = time.monotonic()
        self.full_collections = 0
        self.thaws = 0

    def install(self) -> None:
        if self._after not in gc.callbacks:
            gc.callbacks.append(self._after)

    def uninstall(self) -> None:
        if self._after in gc.callbacks:
            gc.callbacks.remove(self._after)

    def _after(self, phase: str, info: dict) -> None:
        # (on the thread whose allocation triggered the collection, after it finished)
        if phase != "stop" or info.get("generation") != 2:
            return
        self.full_collections += 1
        now = time.monotonic()
        if now - self._thawed >= self.thaw_every_s:
            self._thawed = now
            self.thaws += 1
            gc.unfreeze()  # the next full collection looks at everything again
            log.debug("gc: frozen objects handed back; the next full collection walks all of them")
        else:
            gc.freeze()


def release_free_heap() -> bool:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim``): after
    a replay, the memory of a million decoded records is free but still held by the
    process. False where there is no glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):
        return False
