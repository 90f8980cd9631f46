"""How objects move between tiers: host allocation with eviction, demotion and
promotion, reads from the fastest tier, the background demoter and the prefetch
worker side. Part of ``Store`` (a mixin); which object to move comes from the policy."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import numpy as np

from .errors import CapacityExceeded, KeyExists, TierstoreError
from .gpu import loc_device
from .index import Handle, ObjectMeta
from .leases import LOCAL
from .tensors import TensorSpec
from .units import PAGE, align_up

__all__ = ["Movement"]

log = logging.getLogger(__name__)

_PREFETCH_WAIT_S = 1.0


class Movement:
    """Store methods that move bytes between tiers (mixed into ``Store``)."""

    # ------------------------------------------------------------------ internals: data
    def _host_has_room(self, nbytes: int) -> bool:
        with self._cv:
            need = align_up(max(nbytes, 1), PAGE)
            return (self.host.largest_free >= need
                    and self.host.used_bytes + need <= self.config.high_watermark * self.host.capacity)

    def _host_usable(self) -> int:
        """Host bytes one object can ever get: the tier less the connections' staging areas."""
        with self._cv:
            return self.host.capacity - sum(n for _, n in self._scratch.values())

    def _host_take(self, nbytes: int, *, reading: bool = False) -> int | None:
        """(under _cv) A host block now, or None.

        Reads of bytes that are on NVMe must work when everything is full, and making
        host room for one needs NVMe room to demote into. So one of the two is always
        kept: the last ``_read_reserve`` bytes of the host tier go to anything else only
        while the NVMe tier has that much free for demotions (``_nvme_take`` keeps it so
        while the host reserve is in use)."""
        if not reading and self.host.free_bytes - align_up(max(nbytes, 1), PAGE) < self._read_reserve \
                and self.nvme.free_bytes < self._read_reserve:
            return None
        return self.host.alloc(nbytes)

    def _nvme_take(self, nbytes: int, *, demoting: bool) -> list:
        """NVMe extents for ``nbytes``. Unless ``demoting`` (making host room), the last
        ``_read_reserve`` bytes of the tier are refused while the host tier's read reserve
        is in use: see ``_host_take``."""
        if not demoting and self.nvme.free_bytes - align_up(max(nbytes, 1), PAGE) < self._read_reserve \
                and self.host.free_bytes < self._read_reserve:
            raise CapacityExceeded(
                f"NVMe tier full: {nbytes} bytes requested, {self.nvme.free_bytes} free of "
                f"{self.nvme.capacity_bytes}, the last {self._read_reserve} kept for making host room for "
                "reads while the host tier is full; free objects or raise nvme_bytes")
        return self.nvme.alloc(nbytes)

    def _alloc_host(self, nbytes: int, *, wait_s: float, evict: bool, admit_distance: int | None = None,
                    reading: bool = False) -> int:
        """A host block, demoting cold objects synchronously if needed; CapacityExceeded otherwise.
        ``reading`` (see ``_host_take``): may use the read reserve, and when a demotion fails
        for want of NVMe space, only objects that need no write (a current NVMe copy) make room."""
        usable = self._host_usable()
        if align_up(max(nbytes, 1), PAGE) > usable:  # no wait can make room: say so at once
            raise CapacityExceeded(
                f"{nbytes} bytes do not fit in the host tier at all ({usable} bytes usable of "
                f"{self.host.capacity}, the rest are connections' staging areas); an object is checked out "
                "(and, through the daemon, read) in the host tier: raise host_bytes")
        clean_only = False

        def move(victim: ObjectMeta) -> None:
            nonlocal clean_only
            try:
                self._demote(victim)
            except CapacityExceeded:  # NVMe (or its filesystem) full: no dirty object can go down
                if not reading:
                    raise
                clean_only = True

        return self._alloc_evicting(
            lambda: self._host_take(nbytes, reading=reading),
            lambda: self._pick_victim(admit_distance, clean_only=clean_only) if evict else None,
            move, wait_s,
            lambda: (f"host tier full: {nbytes} bytes requested, {self.host.free_bytes} free of "
                     f"{self.host.capacity} and nothing can be demoted (leased or in flight"
                     f"{', or no NVMe room to demote into' if clean_only else ''}); "
                     "check objects in, free some, or pass a longer wait"))

    def _alloc_evicting(self, alloc, pick, move, wait_s: float, full: Callable[[], str]) -> int:
        """``alloc()`` (under _cv) until it succeeds, moving ``pick()``'s victims out of the
        way with ``move`` (outside the lock); waiting up to ``wait_s`` while nothing can move."""
        deadline = time.monotonic() + wait_s
        while True:
            with self._cv:
                self._check_open()
                got = alloc()
                if got is not None:
                    return got
                victim = pick()
                if victim is None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        self.counters["capacity_errors"] += 1
                        raise CapacityExceeded(full())
                    self._wait_for_others(remaining)
                    continue
            move(victim)

    def _pick_victim(self, admit_distance: int | None = None, *, clean_only: bool = False) -> ObjectMeta | None:
        """Best victim that may move now (under _cv); marks it moving.

        ``admit_distance`` (a prefetch of an object needed in that many accesses)
        admits only victims needed later than that, and never another prefetch.
        ``clean_only``: only objects whose NVMe copy is current (they go without a write).
        """
        for oid in self.policy.candidates():
            m = self._objects.get(oid)
            if m is None or not m.host_valid or m.host_off is None:
                continue
            if m.moving or m.pins or m.readers or m.writer or m.freeing or (clean_only and not m.nvme_valid):
                continue
            if admit_distance is not None:
                if self.prefetcher.is_protected(oid):
                    continue
                d = self.policy.distance(oid)
                if d is not None and d <= admit_distance:
                    continue
            m.moving = True
            self.prefetcher.forget(oid)  # evicted before its predicted use: wasted
            return m
        return None

    def _demote(self, meta: ObjectMeta) -> None:
        """Move a host-resident object (flagged moving) down to NVMe and free its host block."""
        try:
            if not meta.nvme_valid:
                self._write_down(meta, sync=meta.durable, demoting=True)
                if meta.durable:
                    with self.journal.lock:
                        self._journal_put(meta)
            with self._cv:
                self.policy.remove(meta.id)
                if meta.host_off is not None:
                    self._log_drop(meta)
                    self.host.free(meta.host_off, meta.nbytes)
                meta.host_off, meta.host_valid = None, False
                self.prefetcher.demoted(meta.id)
                self.counters["demotions"] += 1
                self.counters["demoted_bytes"] += meta.nbytes
        finally:
            with self._cv:
                meta.moving = False
                self._cv.notify_all()

    def _write_down(self, meta: ObjectMeta, *, sync: bool, demoting: bool = False) -> None:
        """Write the host copy of ``meta`` to fresh NVMe extents (meta.moving is set by the
        caller; ``demoting``: to free its host block, see ``_nvme_take``)."""
        n = meta.nbytes
        extents = self._nvme_take(n, demoting=demoting)
        try:
            if n:
                src = self.arena.view(meta.host_off, n)
                padded = self.arena.view(meta.host_off, align_up(n, PAGE))
                crcs = self.nvme.write(extents, src, src_padded=padded, sync=sync)
            else:
                crcs = []
        except BaseException:
            self.nvme.free(extents)
            raise
        with self._cv:
            old = meta.nvme
            meta.nvme, meta.crcs, meta.nvme_valid = extents, crcs, True
        if old:
            self.nvme.free(old)

    def _put_nvme(self, u8: np.ndarray, spec: TensorSpec, key: str | None, durable: bool, replace: bool,
                  ns: str, ephemeral: bool = False, home: str | None = "nvme") -> Handle:
        """Write a put straight to NVMe. ``home="nvme"`` (``put(tier="nvme")``): the object
        lives there, going back down after each use; None (``tier=None`` finding no room in
        the host tier): it is only placed there, and cached like any other once used."""
        if key is not None:
            with self._cv:
                if (ns, key) in self._keys and not replace:
                    raise KeyExists(f"key {key!r} already exists in namespace {ns!r}; "
                                    "pass replace=True to overwrite it or free it first")
        extents = self._nvme_take(spec.nbytes, demoting=False)
        try:
            crcs = self.nvme.write(extents, u8, sync=durable) if spec.nbytes else []
            with self._cv:
                meta = ObjectMeta(id=self._new_id(), gen=self._epoch, namespace=ns, key=key, spec=spec,
                                  durable=durable, nvme=extents, crcs=crcs, nvme_valid=True, home=home,
                                  ephemeral=LOCAL if ephemeral else None)
            with self.journal.lock:
                with self._cv:
                    self._check_key(meta, replace)
                if durable:
                    self._journal_put(meta, sync=False)
                with self._cv:
                    old = self._bind(meta)
                    self._objects[meta.id] = meta
        except BaseException:
            self.nvme.free(extents)
            raise
        if durable:
            self.journal.commit()  # group commit (see commit_put)
        self.counters["puts"] += 1
        self.counters["put_bytes"] += spec.nbytes
        if old is not None:
            self._drop_replaced(old)
        return meta.handle

    def _read_pinned(self, meta: ObjectMeta, dst: np.ndarray) -> bool:
        """Copy a pinned object's bytes into ``dst`` from the fastest tier holding them.

        Returns True when they came from the host tier (a hit)."""
        n = meta.nbytes
        with self._cv:
            host_off = meta.host_off if meta.host_valid else None
            if host_off is not None:
                self.policy.touch(meta.id)
            gpu_loc = meta.gpu_loc
        if gpu_loc is not None:  # the pin holds it in the GPU tier while we copy
            self.counters["gpu_hits"] += 1
            self.gpu.read(gpu_loc, dst.ctypes.data, n)
            return True
        if host_off is not None:
            self.counters["host_hits"] += 1
            dst[:] = self.arena.view(host_off, n)
            return True
        self.counters["nvme_reads"] += 1
        if self.config.promote_on_get and meta.home != "nvme" and self._host_has_room(n):
            with self._cv:
                # a check-out may have brought it up since (pins keep it there once it is)
                host_off = meta.host_off if meta.host_valid else None
                off = self.host.alloc(n) if host_off is None and not meta.moving else None
                if off is not None:
                    meta.moving = True
            if host_off is not None:
                dst[:] = self.arena.view(host_off, n)
                return False
            if off is not None:
                try:
                    self.nvme.read(meta.nvme, self.arena.view(off, n), meta.crcs,
                                   dst_padded=self.arena.view(off, align_up(n, PAGE)))
                except BaseException:
                    with self._cv:
                        self.host.free(off, n)
                        meta.moving = False
                        self._cv.notify_all()
                    raise
                with self._cv:
                    meta.host_off, meta.host_valid, meta.moving = off, True, False
                    self._log_host(meta)
                    self.policy.insert(meta.id)
                    self.counters["promotions"] += 1
                    self.counters["promoted_bytes"] += n
                    self._cv.notify_all()
                dst[:] = self.arena.view(off, n)
                return False
        padded = dst if (dst.ctypes.data % PAGE == 0 and n % PAGE == 0) else None
        self.nvme.read(meta.nvme, dst, meta.crcs, dst_padded=padded)
        return False

    def _promote(self, meta: ObjectMeta, *, wait_s: float, priority: int = 0,
                 admit_distance: int | None = None, read: bool = True, block: int | None = None) -> None:
        """Bring an NVMe-only object (flagged moving by the caller) into the host tier
        (``read=False``: only give it host memory; the caller overwrites it; ``block``: a
        host block the caller already allocated)."""
        n = meta.nbytes
        try:
            if block is not None:
                off = block
            else:
                # a read of bytes on NVMe may use the read reserve: it must work when all is full
                reading = read and meta.nvme_valid and meta.gpu_loc is None and admit_distance is None
                off = self._alloc_host(n, wait_s=wait_s, evict=True, admit_distance=admit_distance,
                                       reading=reading) if n else -1
            try:
                if n and read and meta.gpu_loc is not None:  # down from the GPU tier
                    self.gpu.read(meta.gpu_loc, self.arena.view(off, n).ctypes.data, n)
                elif n and read:
                    self.nvme.read(meta.nvme, self.arena.view(off, n), meta.crcs,
                                   dst_padded=self.arena.view(off, align_up(n, PAGE)), priority=priority)
            except BaseException:
                with self._cv:
                    self.host.free(off, n)
                raise
            with self._cv:
                if meta.gpu_loc is not None:
                    self.gpu.free(meta.gpu_loc, n)
                    self._gpu_lru.pop(meta.id, None)
                    meta.gpu_loc = None
                    self.counters["gpu_demotions"] += 1
                    self.counters["gpu_demoted_bytes"] += n
                meta.host_off = None if off < 0 else off
                meta.host_valid = True
                if off >= 0:
                    if read or not meta.durable:  # a durable one's blank block is not its bytes
                        self._log_host(meta)
                    self.policy.insert(meta.id)
                self.counters["promotions"] += 1
                self.counters["promoted_bytes"] += n
        finally:
            with self._cv:
                meta.moving = False
                meta.prefetching = False
                self._cv.notify_all()

    # ------------------------------------------------------------------ prefetch
    def _record(self, owner: Any, stream: str, meta: ObjectMeta, hit: bool, late: bool, t0: float,
                locked: bool = False) -> None:
        outcome = "miss" if not hit else ("late" if late else "hit")
        stall = time.monotonic() - t0 if outcome != "hit" else 0.0
        if locked:
            self.prefetcher.record(owner, stream, meta.id, meta.nbytes, outcome, stall)
        else:
            with self._cv:
                self.prefetcher.record(owner, stream, meta.id, meta.nbytes, outcome, stall)

    def _prefetch_fetch(self, oid: int) -> None:
        """Worker side of a queued prefetch: promote ``oid`` at prefetch priority."""
        with self._cv:
            meta = self._objects.get(oid)
            if not self.prefetcher.wanted(oid):
                return
            if (meta is None or meta.freeing or meta.host_valid or meta.moving or self._closed
                    or meta.gpu_loc is not None):
                self.prefetcher.done(oid, 0, fetched=False)
                return
            d = self.policy.distance(oid)
        fetched = False
        try:
            # room first, without claiming the object: a full tier is often only waiting for
            # write-backs, and a demand access must never wait behind a prefetch that waits
            off = self._alloc_host(meta.nbytes, wait_s=_PREFETCH_WAIT_S, evict=True, admit_distance=d) \
                if meta.nbytes else None
            with self._cv:
                wanted = not (meta.freeing or meta.host_valid or meta.moving or self._closed)
                if wanted:
                    meta.moving = meta.prefetching = True
                elif off is not None:
                    self.host.free(off, meta.nbytes)  # demand got there first
            if wanted:
                self._promote(meta, wait_s=0.0, priority=1, block=off)
                fetched = True
        except TierstoreError as e:
            log.debug("prefetch of %s skipped: %s", meta.handle, e)
        finally:
            with self._cv:
                self.prefetcher.done(oid, meta.nbytes, fetched)
                self._cv.notify_all()

    def _await_prefetch(self, oids: list[int]) -> int:
        with self._cv:
            self._cv.wait_for(lambda: self._closed or self.prefetcher.settled(oids))
            return sum(1 for o in oids if o in self._objects and self._objects[o].host_valid)

    # ------------------------------------------------------------------ GPU tier
    def _alloc_gpu(self, nbytes: int, device: int, *, wait_s: float) -> int:
        """A GPU-tier block, moving least recently used GPU objects down to the host tier
        synchronously if needed; CapacityExceeded when nothing can move."""
        return self._alloc_evicting(
            lambda: self.gpu.alloc(nbytes, device), lambda: self._pick_gpu_victim(device),
            lambda v: self._promote(v, wait_s=max(wait_s, self.config.lease_wait_s)), wait_s,
            lambda: (f"GPU tier full on device {device}: {nbytes} bytes requested, "
                     f"{self.gpu.capacity(device) - self.gpu.used(device)} free and nothing can move "
                     "down (leased or in flight); check objects in, free some, or raise gpu_bytes"))

    def _pick_gpu_victim(self, device: int | None = None) -> ObjectMeta | None:
        """(under _cv) The least recently used GPU-tier object that may move; marks it moving."""
        for oid in self._gpu_lru:
            m = self._objects.get(oid)
            if m is None or m.gpu_loc is None or (device is not None and loc_device(m.gpu_loc) != device):
                continue
            if m.moving or m.pins or m.readers or m.writer or m.freeing:
                continue
            m.moving = True
            return m
        return None

    def _demote_gpu(self) -> None:
        """Bring every device's GPU tier under the low watermark (moving objects to host)."""
        for device in self.gpu.over(self.config.high_watermark):
            while not self._closed and self.gpu.used(device) > self.config.low_watermark * self.gpu.capacity(device):
                with self._cv:
                    victim = self._pick_gpu_victim(device)
                if victim is None:
                    break
                try:
                    self._promote(victim, wait_s=self.config.lease_wait_s)
                except TierstoreError as e:
                    log.error("moving %s from the GPU tier to host failed: %s", victim.handle, e)
                    break

    # ------------------------------------------------------------------ background demotion
    def _maybe_demote(self) -> None:
        if self.host.used_bytes > self.config.high_watermark * self.host.capacity or (
                self.gpu is not None and self.gpu.over(self.config.high_watermark)):
            self._demoter_wake.set()

    def _drain_spill(self) -> None:
        with self._cv:
            spill, self._spill = self._spill, []
        for oid in spill:
            with self._cv:
                m = self._objects.get(oid)
                if (m is None or not m.host_valid or m.host_off is None or m.moving or m.pins or m.readers
                        or m.writer or m.freeing or self.prefetcher.is_protected(oid)):
                    continue
                m.moving = True
                self.prefetcher.forget(oid)
            try:
                self._demote(m)
            except TierstoreError as e:
                log.error("returning %s to NVMe failed: %s", m.handle, e)

    def _demote_loop(self) -> None:
        log.debug("demoter started")
        while True:
            self._demoter_wake.wait(timeout=1.0)
            self._demoter_wake.clear()
            if self._closed:
                break
            self._drain_spill()
            if self.gpu is not None:
                self._demote_gpu()
            low = self.config.low_watermark * self.host.capacity
            if self.host.used_bytes <= self.config.high_watermark * self.host.capacity:
                continue
            while not self._closed and self.host.used_bytes > low:
                with self._cv:
                    victim = self._pick_victim()
                if victim is None:
                    break
                try:
                    self._demote(victim)
                except TierstoreError as e:
                    # one failed object (NVMe full, I/O error) must not stop the worker
                    log.error("background demotion of %s failed: %s", victim.handle, e)
                    break
        log.info("demoter stopped")

