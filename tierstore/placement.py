"""Placement: where each object's bytes are, and moving them between tiers.

``Placement`` owns the tiers' space (the host arena and its allocator, the NVMe tier,
the GPU tier where present): it allocates blocks, demoting cold objects to make room, promotes and demotes
objects, reads an object from the fastest tier holding it, runs the prefetch fetches
and the demoter's passes, and gives an object's space back when it goes (``discard``).
Its two background workers are components of their own that it makes: the demoter's
thread (``Demoter``) and the discard thread (``DiscardQueue``); the connections'
staging areas (``StagingAreas``) are host space it is told about. Which object to move
comes from the eviction orders it is given (``policy.py``: the host tier's policy, the
GPU tier's ``GpuOrder``); what is durable is journaled through ``Durability``; its only
lock is the object index's ``cv``.

Words: *promote* moves bytes up (NVMe -> host), *demote* down (host -> NVMe, GPU ->
host); ``to_host`` brings an object into the host tier from whichever tier holds it.

Length: one concept, the tiers' space. The allocation paths share the read reserve
and the eviction loop, and the demoter, the prefetch fetch, the reads, a revoked
lease's move and a put's write begun before its commit all go through them; the small methods through which the later
components reach the tiers' bytes (``host_view``, ``nvme_write``, ``fence``, ...) are
its only doors. Split, one set of space invariants would spread over several files.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import numpy as np

from .allocator import ExtentAllocator
from .demoter import Demoter
from .discards import DiscardQueue
from .arena import Arena
from .config import StoreConfig
from .errors import CapacityExceeded, InvalidArgument, TierstoreError
from .gpu import GpuTier, loc_device
from .index import Handle, ObjectMeta
from .nvme import NvmeTier, PartialWrite, StreamRead
from .objectindex import ObjectIndex
from .waits import waits_since
from .policy import EvictionPolicy, GpuOrder
from .prefetch import Prefetcher
from .staging import StagingAreas
from .durability import Durability
from .engine.base import IOEngine
from .tensors import TensorSpec, aligned_empty
from .units import PAGE, align_up

__all__ = ["Landing", "Placement", "TIERS"]

log = logging.getLogger(__name__)

TIERS = (None, "host", "nvme", "gpu")

DISCARD_WAIT_S = 5.0
"""How long an allocation that finds no room waits, at least, for discards already queued."""

_PREFETCH_WAIT_S = 1.0

_DEMOTE_BATCH = 256
_DEMOTE_BATCH_BYTES = 16 << 20
"""The background demoter moves at most this many objects / bytes in one batch (whoever
waits for one of them waits for the batch's write)."""
READ_RESERVE_BYTES = 64 << 20
"""The last this many bytes of the host tier (at most a sixteenth of it) only take reads
of bytes that are on NVMe: durable objects stay readable when both tiers are full."""


class Placement:
    """The tiers' space and the moves between them; see the module docstring."""

    def __init__(self, config: StoreConfig, index: ObjectIndex, durability: Durability, prefetcher: Prefetcher,
                 policy: EvictionPolicy, gpu_order: GpuOrder, arena: Arena, host: ExtentAllocator, nvme: NvmeTier,
                 gpu: GpuTier | None, engine: IOEngine, staging: StagingAreas,
                 gpu_reason: str = "gpu_bytes is 0: no GPU tier") -> None:
        self.config, self.index, self.durability, self.prefetcher, self.policy = \
            config, index, durability, prefetcher, policy
        self.arena, self.host, self.nvme, self.gpu, self.engine = arena, host, nvme, gpu, engine
        self.gpu_reason = gpu_reason
        """Why there is no GPU tier (when ``gpu`` is None)."""
        self.counters = index.counters
        # kept for reading objects whose bytes are on NVMe when everything else is full
        self.read_reserve = min(READ_RESERVE_BYTES, host.capacity // 16) // PAGE * PAGE
        self.gpu_order = gpu_order
        self.staging = staging
        """The connections' staging areas: host space no object can use, freed at a connection's end."""
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tierstore-prefetch")
        self.discards = DiscardQueue(index)
        self.demoter = Demoter(self, lambda: index.closed)
        self._early: dict[int, PartialWrite] = {}  # object id -> its write begun before its commit
        self._early_lock = threading.Lock()

    def start(self) -> None:
        """Start the background demoter (once the index is recovered)."""
        self.demoter.start()

    def close(self) -> None:
        """Stop the demoter and the background work (the index is already closed)."""
        self.demoter.close()
        self._pool.shutdown(wait=True)
        self.discards.close()

    def later(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run ``fn(*args)`` on the background pool (off the caller's path)."""
        return self._pool.submit(fn, *args)

    def discard_later(self, meta: ObjectMeta) -> None:
        """(no lock held) ``discard`` on the discard thread (``DiscardQueue``)."""
        with self.index.cv:
            self.discards.submit(meta, self.discard)

    # ------------------------------------------------------------------ checks
    def check_tier(self, tier: str | None) -> str | None:
        if tier not in TIERS:
            raise InvalidArgument(f"tier must be one of None, 'host', 'nvme', 'gpu'; got {tier!r}")
        if tier == "gpu" and self.gpu is None:
            raise InvalidArgument(f"the gpu tier is not available in this store: {self.gpu_reason}")
        return tier

    def room_for_empty(self, reserved: int = 0) -> bool:
        """(under cv) Whether one more object of no bytes may be made, beside ``reserved``
        reservations of such objects: they take no block, so they are bounded by count
        instead, at one per page of the host and NVMe tiers together, as many as objects of
        one byte could be (each takes a page): the daemon's memory for them is bounded as
        for any small object."""
        return self.index.object_count() + reserved < (self.host.capacity + self.nvme.capacity_bytes) // PAGE

    def check_fits(self, nbytes: int, tier: str | None) -> None:
        if tier == "gpu":
            if not self.gpu.fits(nbytes):
                raise CapacityExceeded(f"{nbytes} bytes exceed every GPU-tier slab ({self.config.gpu_slab_bytes} "
                                       "bytes); raise gpu_slab_bytes or use tier='host'")
            return
        host_ok = align_up(max(nbytes, 1), PAGE) <= self.host.capacity
        nvme_ok = self.nvme.fits(nbytes)
        if tier == "host" and not host_ok:
            raise CapacityExceeded(f"{nbytes} bytes exceed the host tier ({self.host.capacity} bytes); "
                                   "use tier='nvme' or raise host_bytes")
        if tier == "nvme" and not nvme_ok:
            raise CapacityExceeded(f"{nbytes} bytes exceed the NVMe tier ({self.nvme.capacity_bytes} bytes); "
                                   "raise nvme_bytes")
        if not host_ok and not nvme_ok:
            raise CapacityExceeded(f"{nbytes} bytes exceed every tier (host {self.host.capacity}, "
                                   f"nvme {self.nvme.capacity_bytes})")

    # ------------------------------------------------------------------ host space
    def host_has_room(self, nbytes: int) -> bool:
        with self.index.cv:
            need = align_up(max(nbytes, 1), PAGE)
            return (self.host.largest_free >= need
                    and self.host.used_bytes + need <= self.config.high_watermark * self.host.capacity)

    def host_usable(self) -> int:
        """Host bytes one object can ever get: the tier less the connections' staging areas."""
        with self.index.cv:
            return self.host.capacity - self.staging.total_bytes

    def host_take(self, nbytes: int, *, reading: bool = False) -> int | None:
        """(under cv) A host block now, or None.

        Reads of bytes that are on NVMe must work when everything is full, and making
        host room for one needs NVMe room to demote into. So one of the two is always
        kept: the last ``read_reserve`` bytes of the host tier go to anything else only
        while the NVMe tier has that much free for demotions (``nvme_take`` keeps it so
        while the host reserve is in use)."""
        if not reading and self.host.free_bytes - align_up(max(nbytes, 1), PAGE) < self.read_reserve \
                and self.nvme.free_bytes < self.read_reserve:
            return None
        return self.host.alloc(nbytes)

    def nvme_take(self, nbytes: int, *, demoting: bool) -> list:
        """NVMe extents for ``nbytes``. Unless ``demoting`` (making host room), the last
        ``read_reserve`` bytes of the tier are refused while the host tier's read reserve
        is in use: see ``host_take``."""
        if not demoting and self.nvme.free_bytes - align_up(max(nbytes, 1), PAGE) < self.read_reserve \
                and self.host.free_bytes < self.read_reserve:
            raise CapacityExceeded(
                f"NVMe tier full: {nbytes} bytes requested, {self.nvme.free_bytes} free of "
                f"{self.nvme.capacity_bytes}, the last {self.read_reserve} kept for making host room for "
                "reads while the host tier is full; free objects or raise nvme_bytes")
        return self.nvme.alloc(nbytes)

    def nvme_take_many(self, sizes: list[int]) -> list[list | Exception]:
        """``nvme_take`` (not demoting) for each of ``sizes``: per object its extents or
        the error. Where the whole batch leaves the read reserve alone, one pass
        (``NvmeTier.alloc_many``); otherwise object by object, so each meets the check."""
        need = sum(align_up(max(n, 1), PAGE) for n in sizes)
        if self.nvme.free_bytes - need < self.read_reserve and self.host.free_bytes < self.read_reserve:
            out: list[list | Exception] = []
            for n in sizes:
                try:
                    out.append(self.nvme_take(n, demoting=False))
                except Exception as e:
                    out.append(e)
            return out
        return self.nvme.alloc_many(sizes)

    # ------------------------------------------------------------------ bytes in the tiers
    # (the components after placement reach the tiers' bytes only through these)
    def host_view(self, off: int, nbytes: int) -> np.ndarray:
        """The ``nbytes`` of the host tier at ``off`` (a block the caller holds: reserved, leased or pinned)."""
        return self.arena.view(off, nbytes)

    def host_copy(self, dst_off: int, src_off: int, nbytes: int) -> None:
        """Copy ``nbytes`` between two host blocks the caller holds."""
        if nbytes:
            self.arena.view(dst_off, nbytes)[:] = self.arena.view(src_off, nbytes)

    def nvme_write(self, extents: list, data: np.ndarray, *, sync: bool) -> list[int]:
        """(no lock held) Write ``data`` to the caller's ``extents`` (from ``nvme_take``); its blocks' CRCs."""
        return self.nvme.write(extents, data, sync=sync)

    def nvme_free(self, extents: list) -> None:
        """(no lock held) Give NVMe extents back."""
        self.nvme.free(extents)

    def gpu_take(self, nbytes: int, device: int) -> int | None:
        """(under cv) A GPU-tier block on ``device`` now, or None."""
        return self.gpu.alloc(nbytes, device)

    def gpu_write(self, loc: int, src: int, nbytes: int) -> None:
        """Copy ``nbytes`` at device or host address ``src`` into the GPU-tier block ``loc`` the caller holds."""
        self.gpu.write(loc, src, nbytes)

    def fence(self, owner: Any, host_off: int | None, gpu_loc: int | None, nbytes: int) -> None:
        """(under cv) Hold a block ``owner`` still maps back from reuse until ``owner`` goes
        (``drop_owner``): the GPU-tier block ``gpu_loc``, else the host block ``host_off``."""
        if gpu_loc is not None:
            self.gpu.fence(owner, gpu_loc, nbytes)
        elif nbytes:
            self.host.fence(owner, host_off, nbytes)

    def alloc_host(self, nbytes: int, *, wait_s: float, admit_distance: int | None = None,
                   reading: bool = False) -> int:
        """A host block, demoting cold objects synchronously if needed; CapacityExceeded otherwise.
        ``reading`` (see ``host_take``): may use the read reserve, and when a demotion fails
        for want of NVMe space, only objects that need no write (a current NVMe copy) make room."""
        usable = self.host_usable()
        if align_up(max(nbytes, 1), PAGE) > usable:  # no wait can make room: say so at once
            raise CapacityExceeded(
                f"{nbytes} bytes do not fit in the host tier at all ({usable} bytes usable of "
                f"{self.host.capacity}, the rest are connections' staging areas); an object is checked out "
                "(and, through the daemon, read) in the host tier: raise host_bytes")
        clean_only = False

        def move(victim: ObjectMeta) -> None:
            nonlocal clean_only
            try:
                self.demote(victim)
            except CapacityExceeded:  # NVMe (or its filesystem) full: no dirty object can go down
                if not reading:
                    raise
                clean_only = True

        return self._alloc_evicting(
            lambda: self.host_take(nbytes, reading=reading),
            lambda: self._pick_victim(admit_distance, clean_only=clean_only),
            move, wait_s,
            lambda: self._host_full(nbytes, clean_only))

    def _host_full(self, nbytes: int, clean_only: bool) -> str:
        """(under cv) Why a host block of ``nbytes`` could not be had: the message of ``alloc_host``'s error."""
        if self.host.free_bytes >= align_up(max(nbytes, 1), PAGE) + self.read_reserve:
            return (f"host tier too fragmented: {nbytes} bytes requested, {self.host.free_bytes} free of "
                    f"{self.host.capacity} but no free run of that size, and nothing between the runs can be "
                    f"demoted (connections' staging areas, leased or in-flight objects); raise host_bytes "
                    f"(staging areas take up to a quarter of it) or check objects in")
        return (f"host tier full: {nbytes} bytes requested, {self.host.free_bytes} free of "
                f"{self.host.capacity} and nothing can be demoted (leased or in flight"
                f"{', or no NVMe room to demote into' if clean_only else ''}); "
                "check objects in, free some, or pass a longer wait")

    def _alloc_evicting(self, alloc, pick, move, wait_s: float, full: Callable[[], str]) -> int:
        """``alloc()`` (under cv) until it succeeds, moving ``pick()``'s victims out of the
        way with ``move`` (outside the lock); waiting up to ``wait_s`` while nothing can move."""
        ix = self.index
        now = waits_since()
        deadline = now + wait_s
        # space a replace or a check-in has given up is waited for even past ``wait_s`` (a
        # put right after a replace must not fail for want of it), but not for ever: a
        # discard waits for its object's copies and moves in flight
        discard_deadline = now + max(wait_s, DISCARD_WAIT_S)
        while True:
            with ix.cv:
                ix.check_open()
                got = alloc()
                if got is not None:
                    return got
                victim = pick()
                if victim is None and self.discards.pending and time.monotonic() < discard_deadline:
                    ix.wait(min(1.0, discard_deadline - time.monotonic()))
                    continue
                if victim is None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        self.counters["capacity_errors"] += 1
                        raise CapacityExceeded(full())
                    ix.wait(remaining)
                    continue
            move(victim)

    def _pick_victim(self, admit_distance: int | None = None, *, clean_only: bool = False) -> ObjectMeta | None:
        """Best victim that may move now (under cv); marks it moving.

        ``admit_distance`` (a prefetch of an object needed in that many accesses)
        admits only victims needed later than that, and never another prefetch.
        ``clean_only``: only objects whose NVMe copy is current (they go without a write).
        """
        holder = self.index.holder
        for oid in self.policy.candidates():
            m = holder(oid)
            if not _may_move(m) or (clean_only and not m.nvme_valid):
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

    def _pick_victims(self, nbytes: int) -> list[ObjectMeta]:
        """(under cv) Victims that may move now, best first, marked moving: enough to free
        ``nbytes`` (at least one), at most ``_DEMOTE_BATCH`` objects and
        ``_DEMOTE_BATCH_BYTES``."""
        holder, out, total = self.index.holder, [], 0
        for oid in self.policy.candidates():
            m = holder(oid)
            if not _may_move(m):
                continue
            m.moving = True
            self.prefetcher.forget(oid)
            out.append(m)
            total += align_up(max(m.nbytes, 1), PAGE)
            if total >= min(nbytes, _DEMOTE_BATCH_BYTES) or len(out) >= _DEMOTE_BATCH:
                break
        return out

    def drop_host(self, meta: ObjectMeta) -> None:
        """(under cv) ``meta`` leaves the host tier: its block goes back, the eviction order
        and the prefetcher forget it there."""
        self.policy.remove(meta.id)
        if meta.host_off is not None:
            self.durability.log_drop(meta)
            self.host.free(meta.host_off, meta.nbytes)
        meta.host_off, meta.host_valid = None, False
        self.prefetcher.demoted(meta.id)

    def hand_over(self, src: ObjectMeta, dst: ObjectMeta) -> int:
        """(under cv) Give ``src``'s host block to ``dst`` (whose own block, if any, goes
        back); ``src`` is left with its NVMe copy. Returns the block's offset; the caller
        logs and admits ``dst`` once its lease is set."""
        off = src.host_off
        self.policy.remove(src.id)
        self.durability.log_drop(src)
        src.host_off, src.host_valid = None, False
        self.prefetcher.demoted(src.id)
        if dst.host_valid and dst.host_off is not None:  # overwritten whole by the lease: its block goes
            self.drop_host(dst)
        dst.host_off, dst.host_valid = off, True
        return off

    def admit(self, meta: ObjectMeta) -> None:
        """(under cv) ``meta``'s GPU-tier or host block holds its bytes: it joins that tier's eviction order."""
        if meta.gpu_loc is not None:
            self.gpu_order.insert(meta.id)
        else:
            self.policy.insert(meta.id)

    def touch(self, meta: ObjectMeta) -> None:
        """(under cv) ``meta`` was used where it is: it goes to the back of its tier's eviction order."""
        if meta.gpu_loc is not None:
            self.gpu_order.touch(meta.id)
        else:
            self.policy.touch(meta.id)

    # ------------------------------------------------------------------ a connection's end
    def gpu_attach(self, owner: Any) -> list[dict[str, Any]]:
        """``owner`` is about to open the GPU slabs: they stay allocated until it goes
        (``drop_owner``). Returns what it needs to open them."""
        if self.gpu is None:
            raise InvalidArgument(f"this store has no GPU tier: {self.gpu_reason}")
        with self.index.cv:
            self.gpu.attach(owner)
            return self.gpu.export()

    def drop_owner(self, owner: Any) -> None:
        """``owner`` went away: its staging area, its GPU-slab mappings and the blocks fenced for it go."""
        with self.index.cv:
            if self.staging.drop(owner):
                self.index.cv.notify_all()
            if self.gpu is not None:
                self.gpu.detach(owner)  # its mappings of the slabs died with it
                self.gpu.unfence(owner)
            if self.host.unfence(owner):  # blocks of revoked leases: nobody maps them now
                self.index.cv.notify_all()

    # ------------------------------------------------------------------ moving down
    def demote(self, meta: ObjectMeta) -> None:
        """Move a host-resident object (flagged moving) down to NVMe and free its host block."""
        ix = self.index
        try:
            if not meta.nvme_valid:
                self.write_down(meta, sync=meta.durable, demoting=True)
                if meta.durable:
                    self.durability.record_write_back(meta)
            with ix.cv:
                self.drop_host(meta)
                self.counters["demotions"] += 1
                self.counters["demoted_bytes"] += meta.nbytes
        finally:
            with ix.cv:
                meta.moving = False
                ix.cv.notify_all()

    def demote_many(self, metas: list[ObjectMeta]) -> None:
        """``demote`` for a batch of host-resident objects (each flagged moving): those whose
        NVMe copy is current only give their host block back; the volatile others are
        written in one ``write_many`` (runs of adjacent page-sized objects in one request,
        unsynced, as ``demote`` writes them); a durable one whose host copy is newer goes
        through ``demote`` (synced, journaled). Then every host block goes back in one hold
        of the index lock. A tier of many small objects is brought under its watermark in a
        few requests instead of one write and three lock holds per object."""
        ix = self.index
        metas = list(metas)
        try:
            for m in [m for m in metas if not m.nvme_valid and m.durable]:
                metas.remove(m)
                self.demote(m)  # clears its moving flag itself
            dirty = [m for m in metas if not m.nvme_valid]
            taken: list[tuple[ObjectMeta, list]] = []
            for m in dirty:
                try:
                    taken.append((m, self.nvme_take(m.nbytes, demoting=True)))
                except TierstoreError as e:  # NVMe full: these stay where they are
                    log.error("background demotion of %s failed: %s", m.handle, e)
                    break
            views = self.arena.view
            crcs = self.nvme.write_many([(ext, views(m.host_off, m.nbytes), views(m.host_off, align_up(m.nbytes, PAGE)))
                                         if m.nbytes else (ext, np.empty(0, np.uint8), None) for m, ext in taken])
            stale = []
            for (m, ext), c in zip(taken, crcs):
                if isinstance(c, Exception):
                    log.error("background demotion of %s failed: %s", m.handle, c)
                    self.nvme.free(ext)
            with ix.cv:
                for (m, ext), c in zip(taken, crcs):
                    if not isinstance(c, Exception):
                        if m.nvme:
                            stale.append(m.nvme)
                        m.nvme, m.crcs, m.nvme_valid = ext, c, True
                for m in metas:
                    if m.nvme_valid:
                        self.drop_host(m)
                        self.counters["demotions"] += 1
                        self.counters["demoted_bytes"] += m.nbytes
            for ext in stale:
                self.nvme.free(ext)
        finally:
            with ix.cv:
                for m in metas:
                    m.moving = False
                ix.cv.notify_all()

    # -- writes begun before a commit ----------------------------------------------------
    def write_early(self, meta: ObjectMeta, filled: int, still_open: Callable[[], bool]) -> int:
        """(a worker) The first ``filled`` bytes of a reserved object's host block are there:
        begin writing them to NVMe extents taken for it now (its commit's write then has
        only the rest to do). ``still_open()`` (called under the index lock) says the
        reservation is neither committing nor dropped; otherwise nothing is begun. The
        bytes sent to the drives by this call."""
        with self._early_lock:
            pw = self._early.get(meta.id)
        if pw is None:
            with self.index.cv:
                if not still_open():  # (committed or dropped: its block may be gone or another's)
                    return 0
                off = meta.host_off  # (the open reservation's block: it stays so while it is open)
            extents = self.nvme_take(meta.nbytes, demoting=False)
            fresh = PartialWrite(self.nvme, extents, self.arena.view(off, meta.nbytes),
                                 self.arena.view(off, align_up(meta.nbytes, PAGE)))
            with self.index.cv, self._early_lock:  # (decided here: a commit may take it the moment after)
                pw = self._early.get(meta.id)
                if pw is None and still_open():
                    pw = self._early[meta.id] = fresh
            if pw is not fresh:  # another call began it first, or the reservation is committing or gone
                self.nvme.free(extents)
                if pw is None:
                    return 0
        sent = pw.advance(filled)
        with self.index.cv:
            self.counters["put_early_bytes"] += sent
        return sent

    def _early_take(self, meta: ObjectMeta) -> PartialWrite | None:
        with self._early_lock:
            return self._early.pop(meta.id, None)

    def cancel_early(self, meta: ObjectMeta) -> None:
        """A reservation dropped: its write begun early ends (waited for) and its extents go."""
        pw = self._early_take(meta)
        if pw is not None:
            pw.cancel()
            self.nvme.free(pw.extents)

    def write_down(self, meta: ObjectMeta, *, sync: bool, demoting: bool = False) -> None:
        """Write the host copy of ``meta`` to fresh NVMe extents (meta.moving is set by the
        caller; ``demoting``: to free its host block, see ``nvme_take``); a write begun
        before the commit (``write_early``) is finished instead."""
        n = meta.nbytes
        pw = self._early_take(meta)
        extents = pw.extents if pw is not None else self.nvme_take(n, demoting=demoting)
        try:
            if pw is not None:
                crcs = pw.finish(sync=sync)
            elif n:
                src = self.arena.view(meta.host_off, n)
                padded = self.arena.view(meta.host_off, align_up(n, PAGE))
                crcs = self.nvme.write(extents, src, src_padded=padded, sync=sync)
            else:
                crcs = []
        except BaseException:
            if pw is not None:
                pw.cancel()  # (nothing of it may still land in the extents given back)
            self.nvme.free(extents)
            raise
        with self.index.cv:
            old = meta.nvme
            meta.nvme, meta.crcs, meta.nvme_valid = extents, crcs, True
        if old:
            self.nvme.free(old)

    def land(self, meta: ObjectMeta, *, tier: str | None, gpu_loc: int | None) -> "Landing":
        """A reserved, filled object about to be committed: everything placement does for
        it before it is published (a durable object, or one put to ``tier="nvme"``, is
        written down to NVMe, synced if durable), and, returned, what placement does once
        the index has published it (``Landing``)."""
        if meta.durable or tier == "nvme":
            self.write_down(meta, sync=meta.durable)
        return Landing(self, meta, tier, gpu_loc)

    def land_many(self, puts: list[tuple[ObjectMeta, str | None]]) -> list["Landing | Exception"]:
        """``land`` for a batch of durable commits (``meta, tier`` each; durable objects are
        never in the GPU tier): every
        object's bytes written to fresh NVMe extents, then one sync per drive written to;
        per commit its ``Landing``, or the error that failed it. A failed sync fails every
        commit of the batch (none of them is published; their extents go back)."""
        out: list[Landing | Exception | None] = [None] * len(puts)
        written = []
        rest = []
        for i, (meta, tier) in enumerate(puts):
            pw = self._early_take(meta)
            if pw is None:
                rest.append(i)
                continue
            try:  # begun before its commit (``write_early``): finished here, synced with the batch
                written.append((i, meta, pw.extents, pw.finish(sync=False)))
                out[i] = Landing(self, meta, tier, None)
            except Exception as e:
                pw.cancel()
                self.nvme.free(pw.extents)
                out[i] = e
        taken: list[tuple[int, ObjectMeta, list]] = []
        for i, ext in zip(rest, self.nvme_take_many([puts[i][0].nbytes for i in rest])):
            if isinstance(ext, Exception):  # this commit fails; the others go on
                out[i] = ext
            else:
                taken.append((i, puts[i][0], ext))
                out[i] = Landing(self, puts[i][0], puts[i][1], None)
        views = self.arena.view
        crcs = self.nvme.write_many([(ext, views(m.host_off, m.nbytes), views(m.host_off, align_up(m.nbytes, PAGE)))
                                     if m.nbytes else (ext, np.empty(0, np.uint8), None) for _, m, ext in taken])
        for (i, meta, extents), c in zip(taken, crcs):
            if isinstance(c, Exception):
                out[i] = c
                self.nvme.free(extents)
            else:
                written.append((i, meta, extents, c))
        try:
            # the records that name these bytes are appended only after this
            self.nvme.sync_drives({e.dev for _, _, extents, _ in written for e in extents})
        except Exception as e:
            for i, _, extents, _ in written:
                out[i] = e
                self.nvme.free(extents)
            return out
        with self.index.cv:
            for _, meta, extents, c in written:
                meta.nvme, meta.crcs, meta.nvme_valid = extents, c, True
        return out

    # ------------------------------------------------------------------ reads
    def read_pinned(self, h: Handle, ns: str, owner: Any, stream: str,
                    into: Callable[[TensorSpec], tuple[Any, bool]]) -> TensorSpec:
        """A get's read: pin the object (it cannot move or be freed meanwhile), copy its
        bytes into ``into(spec)`` (a byte array, or with ``True`` a CUDA tensor, read
        straight from NVMe where GPUDirect Storage is on), record the access with the
        prefetcher and count it, unpin (discarding an object freed meanwhile). Returns its
        spec."""
        ix = self.index
        t0 = time.monotonic()
        meta, late = ix.pin(h, ns)
        try:
            spec = meta.spec
            dst, device = into(spec)
            if not spec.nbytes:
                hit = True
            elif device:
                hit = self.read_to_device(meta, dst)
            else:
                hit = self.read(meta, dst)
            with ix.cv:
                self.prefetcher.access(owner, stream, meta, hit, late, t0)
                self.counters["gets"] += 1
                self.counters["get_bytes"] += spec.nbytes
        finally:
            if ix.unpin(meta):
                self.discard(meta)
        return spec

    def read(self, meta: ObjectMeta, dst: np.ndarray) -> bool:
        """Copy a pinned object's bytes into ``dst`` from the fastest tier holding them.

        Returns True when they came from a memory tier (a hit)."""
        ix = self.index
        n = meta.nbytes
        with ix.cv:
            host_off = meta.host_off if meta.host_valid else None
            if host_off is not None:
                self.policy.touch(meta.id)
            gpu_loc = meta.gpu_loc
            self.counters["gpu_hits" if gpu_loc is not None else "host_hits" if host_off is not None
                          else "nvme_reads"] += 1
        if gpu_loc is not None:  # the pin holds it in the GPU tier while we copy
            self.gpu.read(gpu_loc, dst.ctypes.data, n)
            return True
        if host_off is not None:
            dst[:] = self.arena.view(host_off, n)
            return True
        if self.config.promote_on_get and meta.home != "nvme" and self.host_has_room(n):
            with ix.cv:
                # a check-out may have brought it up since (pins keep it there once it is)
                host_off = meta.host_off if meta.host_valid else None
                off = self.host.alloc(n) if host_off is None and not meta.moving else None
                if off is not None:
                    meta.moving = True
            if host_off is not None:
                dst[:] = self.arena.view(host_off, n)
                return False
            if off is not None:
                self.to_host(meta, wait_s=0.0, block=off)
                dst[:] = self.arena.view(off, n)
                return False
        padded = dst if (dst.ctypes.data % PAGE == 0 and n % PAGE == 0) else None
        self.nvme.read(meta.nvme, dst, meta.crcs, dst_padded=padded)
        return False

    def read_stream(self, meta: ObjectMeta, off: int) -> StreamRead:
        """Begin reading a pinned NVMe-only object into the host block at ``off`` (a block
        of its reader's, not the object's place: the object stays where it is), chunk by
        chunk, each checked as it lands; see ``StreamRead``."""
        n = meta.nbytes
        return StreamRead(self.nvme, meta.nvme, self.arena.view(off, n), meta.crcs,
                          self.arena.view(off, align_up(n, PAGE)))

    def host_free(self, off: int, nbytes: int) -> None:
        """(under cv) Give back a host block taken with ``alloc_host`` that no object owns."""
        self.host.free(off, nbytes)
        self.index.cv.notify_all()

    def read_to_device(self, meta: ObjectMeta, out: Any) -> bool:
        """Read a pinned object into a CUDA tensor: an NVMe-only object goes NVMe -> GPU
        through the engine's device I/O when it is GPUDirect Storage (its CRC32C checked
        on the host after the transfer), anything else through host memory. True on a
        memory-tier hit."""
        import torch

        u8 = out.reshape(-1).view(torch.uint8)
        with self.index.cv:
            direct = meta.gpu_loc is None and not meta.host_valid and meta.nvme_valid and self.engine.gds
            self.counters["nvme_reads"] += direct
        if direct:
            self.nvme.read_device(meta.nvme, u8, meta.crcs, lambda v: v.cpu().numpy())
            return False
        tmp = aligned_empty(meta.nbytes)
        hit = self.read(meta, tmp)
        u8.copy_(torch.from_numpy(tmp))
        return hit

    # ------------------------------------------------------------------ moving up
    def to_host(self, meta: ObjectMeta, *, wait_s: float, priority: int = 0, read: bool = True,
                block: int | None = None) -> None:
        """Bring an object (flagged moving by the caller) into the host tier: promoted from
        NVMe, or demoted from the GPU tier (``read=False``: only give it host memory; the
        caller overwrites it; ``block``: a host block the caller already allocated)."""
        ix = self.index
        n = meta.nbytes
        try:
            if block is not None:
                off = block
            else:
                # a read of bytes on NVMe may use the read reserve: it must work when all is full
                reading = read and meta.nvme_valid and meta.gpu_loc is None
                off = self.alloc_host(n, wait_s=wait_s, reading=reading) if n else -1
            try:
                if n and read and meta.gpu_loc is not None:  # down from the GPU tier
                    self.gpu.read(meta.gpu_loc, self.arena.view(off, n).ctypes.data, n)
                elif n and read:
                    self.nvme.read(meta.nvme, self.arena.view(off, n), meta.crcs,
                                   dst_padded=self.arena.view(off, align_up(n, PAGE)), priority=priority)
            except BaseException:
                with ix.cv:
                    self.host.free(off, n)
                raise
            with ix.cv:
                if meta.gpu_loc is not None:
                    self.gpu.free(meta.gpu_loc, n)
                    self.gpu_order.remove(meta.id)
                    meta.gpu_loc = None
                    self.counters["gpu_demotions"] += 1
                    self.counters["gpu_demoted_bytes"] += n
                meta.host_off = None if off < 0 else off
                meta.host_valid = True
                if off >= 0:
                    if read or not meta.durable:  # a durable one's blank block is not its bytes
                        self.durability.log_host(meta)
                    self.policy.insert(meta.id)
                self.counters["promotions"] += 1
                self.counters["promoted_bytes"] += n
        finally:
            with ix.cv:
                meta.moving = False
                meta.prefetching = False
                ix.cv.notify_all()

    # ------------------------------------------------------------------ prefetch
    def fetch(self, oid: int) -> None:
        """The prefetcher's worker side of a queued fetch: promote ``oid`` at prefetch priority."""
        ix = self.index
        with ix.cv:
            meta = ix.holder(oid)
            if not self.prefetcher.wanted(oid):
                return
            if (meta is None or meta.freeing or meta.host_valid or meta.moving or ix.closed
                    or meta.gpu_loc is not None):
                self.prefetcher.done(oid, 0, fetched=False)
                return
            d = self.policy.distance(oid)
        fetched = False
        try:
            # room first, without claiming the object: a full tier is often only waiting for
            # write-backs, and a demand access must never wait behind a prefetch that waits
            off = self.alloc_host(meta.nbytes, wait_s=_PREFETCH_WAIT_S, admit_distance=d) if meta.nbytes else None
            with ix.cv:
                wanted = not (meta.freeing or meta.host_valid or meta.moving or ix.closed)
                if wanted:
                    meta.moving = meta.prefetching = True
                elif off is not None:
                    self.host.free(off, meta.nbytes)  # demand got there first
            if wanted:
                self.to_host(meta, wait_s=0.0, priority=1, block=off)
                fetched = True
        except TierstoreError as e:
            log.debug("prefetch of %s skipped: %s", meta.handle, e)
        finally:
            with ix.cv:
                self.prefetcher.done(oid, meta.nbytes, fetched)
                ix.cv.notify_all()

    # ------------------------------------------------------------------ GPU tier
    def alloc_gpu(self, nbytes: int, device: int, *, wait_s: float) -> int:
        """A GPU-tier block, moving least recently used GPU objects down to the host tier
        synchronously if needed; CapacityExceeded when nothing can move."""
        return self._alloc_evicting(
            lambda: self.gpu.alloc(nbytes, device), lambda: self._pick_gpu_victim(device),
            lambda v: self.to_host(v, wait_s=max(wait_s, self.config.lease_wait_s)), wait_s,
            lambda: (f"GPU tier full on device {device}: {nbytes} bytes requested, "
                     f"{self.gpu.capacity(device) - self.gpu.used(device)} free and nothing can move "
                     "down (leased or in flight); check objects in, free some, or raise gpu_bytes"))

    def _pick_gpu_victim(self, device: int | None = None) -> ObjectMeta | None:
        """(under cv) The least recently used GPU-tier object that may move; marks it moving."""
        holder = self.index.holder
        for oid in self.gpu_order.candidates():
            m = holder(oid)
            if m is None or m.gpu_loc is None or (device is not None and loc_device(m.gpu_loc) != device):
                continue
            if m.moving or m.pins or m.readers or m.writer or m.freeing:
                continue
            m.moving = True
            return m
        return None

    def demote_gpu_tiers(self) -> None:
        """Bring every device's GPU tier under the low watermark, moving objects to host (a demoter pass)."""
        ix = self.index
        if self.gpu is None:
            return
        for device in self.gpu.over(self.config.high_watermark):
            while not ix.closed and self.gpu.used(device) > self.config.low_watermark * self.gpu.capacity(device):
                with ix.cv:
                    victim = self._pick_gpu_victim(device)
                if victim is None:
                    break
                try:
                    self.to_host(victim, wait_s=self.config.lease_wait_s)
                except TierstoreError as e:
                    log.error("moving %s from the GPU tier to host failed: %s", victim.handle, e)
                    break

    def move_off(self, meta: ObjectMeta, lid: int, host_off: int | None, gpu_loc: Any,
                 held: Callable[[], bool], moved: Callable[[int | None, Any], None]) -> None:
        """Copy a revoked write lease's bytes (lease ``lid``, on the host block at ``host_off``
        or the GPU-tier block ``gpu_loc``) into a new block and make that the object's (the
        lease is exclusive: nobody else touches the object's block meanwhile). Without room
        the object stays where it is, still exposed to the holder: logged. ``held()`` (under
        cv): the lease is still out (not checked in meanwhile); ``moved(host_off, gpu_loc)``
        (under cv): the lease table's record of where its bytes are now."""
        n = meta.nbytes
        if gpu_loc is not None:
            device = loc_device(gpu_loc)
            with self.index.cv:
                new = self.gpu.alloc(n, device)
            if new is None:
                log.error("revoked lease %d: no GPU-tier room to move object %d off the holder's block",
                          lid, meta.id)
                return
            self.gpu.copy_block(new, gpu_loc, n)
            with self.index.cv:
                if not held() or meta.gpu_loc != gpu_loc:
                    self.gpu.free(new, n)  # checked in meanwhile: the object is not ours to move
                    return
                meta.gpu_loc = new
                moved(host_off, new)
                self.gpu.free(gpu_loc, n)  # fenced: held back until the holder's connection ends
            return
        try:
            new = self.alloc_host(n, wait_s=self.config.lease_wait_s)
        except CapacityExceeded:
            log.error("revoked lease %d: no host room to move object %d off the holder's block; "
                      "it stays there", lid, meta.id)
            return
        self.arena.view(new, n)[:] = self.arena.view(host_off, n)
        with self.index.cv:
            if not held() or meta.host_off != host_off:
                self.host.free(new, n)  # checked in meanwhile: the object is not ours to move
                self.index.cv.notify_all()
                return
            meta.host_off = new
            moved(new, gpu_loc)
            self.durability.log_host(meta)  # (not a durable one's: the revocation's check-in logs it)
            self.host.free(host_off, n)  # fenced: held back until the holder's connection ends

    # ------------------------------------------------------------------ giving space back
    def free_space(self, meta: ObjectMeta) -> list:
        """(under cv) Give back ``meta``'s host and GPU blocks; returns its NVMe extents,
        which the caller frees with the lock released (``nvme_free``)."""
        if meta.host_off is not None:
            self.host.free(meta.host_off, meta.nbytes)
            meta.host_off, meta.host_valid = None, False
        if meta.gpu_loc is not None:
            self.gpu.free(meta.gpu_loc, meta.nbytes)
            self.gpu_order.remove(meta.id)
            meta.gpu_loc = None
        extents, meta.nvme = meta.nvme, None
        meta.nvme_valid = False
        return extents

    def discard(self, meta: ObjectMeta) -> None:
        """Remove a ``freeing`` object: journal first (a returned free is never undone),
        then the index, then its space in every tier."""
        ix = self.index
        with ix.cv:
            if meta.dropped:
                return
            meta.dropped = True
        if meta.durable:
            try:
                self.durability.journal_free(meta.id)
            except TierstoreError:
                with ix.cv:
                    meta.dropped = False  # not freed: the caller puts it back as it was
                raise
        with ix.cv:
            extents = self._forget(meta)
        if extents:
            self.nvme.free(extents)
        if meta.durable:
            self.durability.maybe_compact()

    def _forget(self, meta: ObjectMeta) -> list:
        """(under cv) ``meta`` leaves the index, the prefetcher, the eviction order and every
        memory tier; returns its NVMe extents (``free_space``)."""
        self.index.remove(meta)
        self.durability.forgotten(meta.id)
        self.prefetcher.forget(meta.id)
        self.policy.remove(meta.id)
        if meta.host_off is not None:
            self.durability.log_drop(meta)
        extents = self.free_space(meta)
        self.index.cv.notify_all()
        return extents

    def drop_replaced(self, old: ObjectMeta) -> None:
        """(under cv, in the publish that replaced ``old``) The replaced object goes: a
        volatile one nobody holds at once (bookkeeping only: no journal record, no I/O); a
        durable one (its free is journaled and synced) or one with a copy or move in flight
        on the discard thread (``discard_replaced``); a checked-out one at its last check-in
        (``ObjectIndex.droppable``)."""
        if old.readers or old.writer:
            return
        if old.durable or old.pins or old.moving:
            self.discards.submit(old, self.discard_replaced)
            return
        old.dropped = True
        extents = self._forget(old)
        if extents:
            self.nvme.free(extents)  # (the NVMe allocator's own lock; no I/O)

    def discard_replaced(self, old: ObjectMeta) -> None:
        """Discard an object a put replaced (or a closed connection's ephemeral one) once
        copies and moves in flight are done; a checked-out one goes at its last check-in."""
        ix = self.index
        with ix.cv:
            while old.pins or old.moving:  # a copy or a move in flight: short
                ix.cv.wait()
            if old.readers or old.writer:
                return  # still checked out: its last check-in discards it (``ObjectIndex.droppable``)
        self.discard(old)

    # ------------------------------------------------------------------ background demotion
    # (the demoter's thread is ``Demoter``; the passes it runs are these)
    def maybe_demote(self) -> None:
        """Wake the demoter if a memory tier is over its high watermark."""
        if self.host.used_bytes > self.config.high_watermark * self.host.capacity or (
                self.gpu is not None and self.gpu.over(self.config.high_watermark)):
            self.demoter.wake()

    def demote_if_home_nvme(self, meta: ObjectMeta) -> None:
        """(under cv) An object that lives on NVMe goes back down once nobody uses it."""
        if meta.home == "nvme" and meta.readers == 0 and not meta.writer and meta.host_valid and not meta.freeing:
            self.demoter.demote_soon(meta.id)

    def demote_home_nvme(self, oids: list[int]) -> None:
        """Move these home-NVMe objects back down where nobody uses them now (a demoter pass)."""
        ix = self.index
        for oid in oids:
            with ix.cv:
                m = ix.holder(oid)
                if (m is None or not m.host_valid or m.host_off is None or m.moving or m.pins or m.readers
                        or m.writer or m.freeing or self.prefetcher.is_protected(oid)):
                    continue
                m.moving = True
                self.prefetcher.forget(oid)
            try:
                self.demote(m)
            except TierstoreError as e:
                log.error("returning %s to NVMe failed: %s", m.handle, e)

    def trim_nvme(self) -> None:
        """Give back the NVMe data files' free tails (a demoter pass; ``NvmeTier.trim``)."""
        try:
            self.nvme.trim(time.monotonic())
        except Exception:  # (a pass must not end the demoter)
            log.exception("trimming the NVMe data files failed")

    def demote_host_tier(self) -> None:
        """Past the high watermark, bring the host tier under the low one (a demoter pass)."""
        ix = self.index
        low = self.config.low_watermark * self.host.capacity
        if self.host.used_bytes <= self.config.high_watermark * self.host.capacity:
            return
        while not ix.closed and self.host.used_bytes > low:
            with ix.cv:
                victims = self._pick_victims(int(self.host.used_bytes - low))
            if not victims:
                break
            try:
                self.demote_many(victims)
            except TierstoreError as e:
                # one failed object (NVMe full, I/O error) must not stop the worker
                log.error("background demotion of %d objects failed: %s", len(victims), e)
                break


def _may_move(m: ObjectMeta | None) -> bool:
    """(under cv) Whether a host-resident object may leave the host tier now: nobody holds
    it, nothing moves it, it is not being freed."""
    return (m is not None and m.host_valid and m.host_off is not None
            and not (m.moving or m.pins or m.readers or m.writer or m.freeing))


class Landing:
    """What placement does for a committed put in the step that publishes it (``placed``,
    under cv, in the same hold as ``ObjectIndex.publish``). Made by ``Placement.land``."""

    __slots__ = ("placement", "meta", "tier", "gpu_loc")

    def __init__(self, placement: Placement, meta: ObjectMeta, tier: str | None, gpu_loc: int | None) -> None:
        self.placement, self.meta, self.tier, self.gpu_loc = placement, meta, tier, gpu_loc

    def placed(self, old: ObjectMeta | None) -> None:
        """(under cv, right after ``ObjectIndex.publish``) The object's bytes are where it
        says; a host block of a ``tier="nvme"`` put goes back; the object joins its tier's
        eviction order and may move from here. ``old``, the object the put replaced, is
        handed to its discard (``Placement.drop_replaced``), and the demoter is woken past
        the high watermark: placement has nothing left to do for the put after this."""
        p, meta = self.placement, self.meta
        meta.host_valid = self.gpu_loc is None and (meta.host_off is not None or meta.nbytes == 0)
        meta.gpu_loc = self.gpu_loc
        if self.tier == "nvme" and meta.host_off is not None:
            p.host.free(meta.host_off, meta.nbytes)
            meta.host_off, meta.host_valid = None, False
        if meta.host_valid:
            p.durability.log_host(meta)
        if meta.gpu_loc is not None or (meta.host_valid and meta.host_off is not None):
            p.admit(meta)
        meta.moving = False
        if old is not None:
            p.drop_replaced(old)
        p.maybe_demote()
        p.index.cv.notify_all()
