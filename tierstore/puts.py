"""Puts: the two-phase put (reserve a block, fill it, commit it), the one-call puts of
the in-process API, and the staging-area transfers of the daemon's one-round-trip
puts and gets.

``Puts`` owns the open reservations. It is given the object index (checks a key,
publishes the object), placement (the block to fill, the write-down to NVMe, the
replaced object's discard), durability (the put record, group commit) and the
prefetcher (a staged get is an access it learns from). A commit passes through them
once, in order: placement (``land``: the write-down; it hands back a ``Landing``, what
it does after the publish), durability (``record_put``: the record, the publish it is
given, the group commit), the index (``publish``, run inside that call), and last the
landing's own steps (admit the new object, discard the one it replaced). A durable
commit takes the first three steps a batch at a time on the group committer
(``groupcommit.py``); ``commit`` waits for it, or, from the daemon's event loop, hands
back a future.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import CapacityExceeded, InvalidArgument, NotFound
from .index import Handle, ObjectMeta
from .leases import LOCAL
from .placement import Landing, Placement
from .objectindex import ObjectIndex
from .prefetch import Prefetcher
from .durability import Durability
from .groupcommit import GroupCommit, Pending
from .tensors import TensorSpec, cuda_source, to_bytes
from .units import PAGE, align_up
from .waits import WouldBlock

__all__ = ["Puts", "Reservation"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Reservation:
    """First phase of a two-phase put: a host block the writer fills, then commits."""

    rid: int
    owner: Any
    host_off: int
    meta: ObjectMeta
    tier: str | None
    replace: bool
    gpu_loc: int | None = None
    committing: bool = False
    """A commit is under way: only it may still abort the reservation."""
    since: float = 0.0
    """When it was made (``time.monotonic()``): ``expire_reservations`` drops old ones."""


class Puts:
    """Two-phase and one-call puts, and staging-area transfers; see the module docstring."""

    def __init__(self, index: ObjectIndex, placement: Placement, durability: Durability,
                 prefetcher: Prefetcher) -> None:
        self.index, self.placement, self.durability, self.prefetcher = index, placement, durability, prefetcher
        self.cv = index.cv
        self.counters = index.counters
        self.reservations: dict[int, Reservation] = {}
        self.committer = GroupCommit(placement, durability)
        """Durable commits go through it, a batch at a time."""

    def put(self, tensor: Any, key: str | None, tier: str | None, durable: bool, replace: bool, ns: str,
            wait_s: float, ephemeral: bool) -> Handle:
        """An in-process put (``Store.put``; arguments checked there)."""
        if tier == "gpu":
            return self._put_gpu(tensor, key, durable, replace, ns, wait_s, ephemeral)
        u8, spec = to_bytes(tensor)
        self.placement.check_fits(spec.nbytes, tier)
        if tier == "host" or (tier is None and self.placement.host_has_room(spec.nbytes)):
            res = self.reserve(spec, key=key, tier=tier, durable=durable, replace=replace, namespace=ns,
                               owner=LOCAL, wait_s=wait_s, ephemeral=ephemeral)
            try:
                if spec.nbytes:
                    # the reservation keeps this block ours until commit; no lock needed to fill it
                    self.placement.arena.view(res.host_off, spec.nbytes)[:] = u8
            except BaseException:
                self.abort(res.rid)
                raise
            return self.commit(res.rid)
        return self._put_nvme(u8, spec, key, durable, replace, ns, ephemeral,
                              home="nvme" if tier == "nvme" else None)

    def _put_gpu(self, tensor: Any, key: str | None, durable: bool, replace: bool, ns: str, wait_s: float,
                 ephemeral: bool) -> Handle:
        src = cuda_source(tensor)
        if src is not None:
            t, spec = src
            device, addr = t.device.index or 0, t.data_ptr()
        else:
            t, spec = to_bytes(tensor)
            device, addr = 0, t.ctypes.data
        self.placement.check_fits(spec.nbytes, "gpu")
        res = self.reserve(spec, key=key, tier="gpu", durable=durable, replace=replace, namespace=ns,
                           owner=LOCAL, wait_s=wait_s, device=device, ephemeral=ephemeral)
        try:
            if spec.nbytes:
                self.placement.gpu.write(res.gpu_loc, addr, spec.nbytes)
        except BaseException:
            self.abort(res.rid)
            raise
        return self.commit(res.rid)

    def reserve(self, spec: TensorSpec, *, key: str | None, tier: str | None, durable: bool, replace: bool,
                    namespace: str, owner: Any, wait_s: float = 0.0,
                    nowait: bool = False, device: int = 0, ephemeral: bool = False) -> Reservation:
        """Allocate a host block (``tier="gpu"``: a GPU-tier block on ``device``) for a new
        object; the caller fills it, then ``commit``. ``ephemeral``: the object is
        freed when ``owner`` goes (``DaemonSurface.release_owner``)."""
        tier = self.placement.check_tier(tier)
        self._check_ephemeral(ephemeral, durable)
        self.placement.check_fits(spec.nbytes, tier)
        if tier != "gpu":
            usable = self.placement.host_usable()
            if align_up(max(spec.nbytes, 1), PAGE) > usable:
                raise CapacityExceeded(
                    f"{spec.nbytes} bytes exceed the host tier's usable {usable} bytes: a put through the daemon "
                    "stages the whole object in the host tier (the shared arena), whatever its tier; raise "
                    "host_bytes (an in-process Store writes larger objects to NVMe directly)")
        if key is not None:
            with self.cv:
                self.index.check_key(namespace, key, replace)
        if tier == "gpu":
            res = self._reserve_gpu(spec, key=key, durable=durable, replace=replace, namespace=namespace,
                                    owner=owner, wait_s=wait_s, nowait=nowait, device=device)
            res.meta.ephemeral = owner if ephemeral else None
            return res
        if nowait and spec.nbytes:
            with self.cv:
                off = self.placement.host_take(spec.nbytes)
            if off is None:
                raise WouldBlock()
        else:
            off = self.placement.alloc_host(spec.nbytes, wait_s=wait_s) if spec.nbytes else -1
        with self.cv:
            oid = self.index.new_id()
            meta = ObjectMeta(id=oid, gen=self.index.epoch, namespace=namespace, key=key, spec=spec,
                              durable=durable, home="nvme" if tier == "nvme" else None,
                              ephemeral=owner if ephemeral else None)
            meta.host_off = None if off < 0 else off
            res = Reservation(rid=oid, owner=owner, host_off=max(off, 0), meta=meta, tier=tier, replace=replace,
                              since=time.monotonic())
            self.reservations[oid] = res
            return res

    def _reserve_gpu(self, spec: TensorSpec, *, key: str | None, durable: bool, replace: bool, namespace: str,
                     owner: Any, wait_s: float, nowait: bool, device: int) -> Reservation:
        if durable:
            raise InvalidArgument("the gpu tier is volatile: put durable objects to 'host' or 'nvme'")
        if nowait:
            with self.cv:
                loc = self.placement.gpu.alloc(spec.nbytes, device)
            if loc is None:
                raise WouldBlock()
        else:
            loc = self.placement.alloc_gpu(spec.nbytes, device, wait_s=wait_s)
        with self.cv:
            oid = self.index.new_id()
            meta = ObjectMeta(id=oid, gen=self.index.epoch, namespace=namespace, key=key, spec=spec,
                              durable=False)
            res = Reservation(rid=oid, owner=owner, host_off=0, meta=meta, tier="gpu", replace=replace, gpu_loc=loc,
                              since=time.monotonic())
            self.reservations[oid] = res
            return res

    def commit(self, rid: int, *, owner: Any = LOCAL, nowait: bool = False) -> Handle | Pending:
        """Second phase: make the reserved object visible (and durable, if asked). A durable
        commit goes to the group committer; ``nowait`` (the daemon's event loop): it is not
        waited for, and a ``Pending`` handle is returned instead."""
        with self.cv:
            res = self.reservations.get(rid)
            if res is None or res.owner != owner:
                raise NotFound(f"no open reservation {rid} for this connection (one left uncommitted for "
                               "reservation_timeout_s is dropped); put the object again")
            meta = res.meta
            if res.committing:
                raise InvalidArgument(f"reservation {rid} is already being committed")
            if nowait and res.tier == "nvme" and not meta.durable:
                raise WouldBlock()
            meta.moving = True  # nobody sees it yet; blocks a concurrent demotion once visible
            # from here the commit owns the reservation: a client that dies now (its
            # connection's cleanup aborts what it left open) cannot pull the block and the
            # extents from under the write-down and publish an object without its bytes
            res.committing = True

        def publish(landing: Landing) -> ObjectMeta | None:  # (under cv, run by durability)
            self.reservations.pop(rid, None)
            old = self.index.publish(meta)  # (the replaced one is ``freeing`` from here)
            landing.placed()
            return old

        if meta.durable:
            # from the event loop the put finishes on the committer (the replaced object is
            # discarded in the background); a caller that waits finishes it itself
            try:
                done = self.committer.submit(
                    meta, tier=res.tier, gpu_loc=res.gpu_loc, replace=res.replace, publish=publish,
                    finish=(lambda landing, old: self._committed(meta, landing, old, later=True)) if nowait
                    else (lambda landing, old: (landing, old)),
                    failed=lambda: self._give_up(rid, owner))
            except BaseException:
                self._give_up(rid, owner)
                raise
            if nowait:
                return done
            landing, old = done.result()
            return self._committed(meta, landing, old, later=False)
        try:
            landing = self.placement.land(meta, tier=res.tier, gpu_loc=res.gpu_loc)
            old = self.durability.record_put(meta, replace=res.replace, publish=lambda: publish(landing),
                                             nowait=nowait)
        except WouldBlock:
            # a durable op holds the journal lock: nothing was done; the commit runs again
            # off the event loop
            with self.cv:
                meta.moving = res.committing = False
            raise
        except BaseException:
            self._give_up(rid, owner)
            raise
        return self._committed(meta, landing, old, later=nowait)

    def _committed(self, meta: ObjectMeta, landing: Landing, old: ObjectMeta | None, *, later: bool) -> Handle:
        """The commit is done (durable, if asked): count it, discard what it replaced."""
        self.counters["puts"] += 1
        self.counters["put_bytes"] += meta.nbytes
        landing.settle(old, later=later)
        return meta.handle

    def close(self) -> None:
        """Commit the durable commits queued, then stop the group committer."""
        self.committer.close()

    def put_staged(self, owner: Any, src: int, spec: TensorSpec, *, key: str | None, tier: str | None,
                   durable: bool, replace: bool, namespace: str, wait_s: float = 0.0,
                   nowait: bool = False, ephemeral: bool = False) -> Handle | Pending:
        """One-round-trip put: the bytes are at ``src`` in ``owner``'s staging area
        (``nowait`` and durable: a ``Pending`` handle, see ``commit``)."""
        with self.cv:
            area = self.placement.staging_of(owner)
        if area is None or src < 0 or src + spec.nbytes > area[1]:
            raise InvalidArgument("staged bytes lie outside this connection's staging area")
        if nowait and tier == "nvme" and not durable:
            raise WouldBlock()
        res = self.reserve(spec, key=key, tier=tier, durable=durable, replace=replace, namespace=namespace,
                           owner=owner, wait_s=wait_s, nowait=nowait, ephemeral=ephemeral)
        view = self.placement.arena.view
        if spec.nbytes:
            view(res.host_off, spec.nbytes)[:] = view(area[0] + src, spec.nbytes)
        try:
            return self.commit(res.rid, owner=owner, nowait=nowait)  # (nowait, durable: a Pending)
        except WouldBlock:
            self.abort(res.rid, owner=owner)
            raise

    def get_staged(self, owner: Any, handle: Handle | int | str, *, namespace: str | None = None,
                   nowait: bool = False, stream: str = "default") -> TensorSpec | None:
        """Copy a small object into ``owner``'s staging area (one round trip, no lease).

        Returns its spec, or None when it does not fit there (use a lease instead).
        """
        with self.cv:
            area = self.placement.staging_of(owner)
            meta = self.index.get_meta(Handle.parse(handle), self.index.ns(namespace))
            if area is None or meta.nbytes > area[1]:
                return None
            if meta.nbytes == 0:
                return meta.spec
            if meta.host_valid and not meta.writer and not meta.moving:
                # small (<= staging size) copy under the lock: cheaper than pinning around it
                view = self.placement.arena.view
                view(area[0], meta.nbytes)[:] = view(meta.host_off, meta.nbytes)
                self.placement.touch(meta)
                self.prefetcher.access(owner, stream, meta, True, False, time.monotonic())
                self.counters["gets"] += 1
                self.counters["host_hits"] += 1
                self.counters["get_bytes"] += meta.nbytes
                return meta.spec
            if nowait:
                raise WouldBlock()
        t0 = time.monotonic()
        meta, late = self.index.pin(Handle.parse(handle), self.index.ns(namespace))
        try:
            hit = self.placement.read(meta, self.placement.arena.view(area[0], meta.nbytes))
            with self.cv:
                self.prefetcher.access(owner, stream, meta, hit, late, t0)
        finally:
            if self.index.unpin(meta):
                self.placement.discard(meta)
        return meta.spec

    def abort(self, rid: int, *, owner: Any = LOCAL) -> None:
        """Drop an open reservation; one a commit has taken up is left to it."""
        self._drop(rid, owner, committing=False)

    def _give_up(self, rid: int, owner: Any) -> None:
        """The commit under way failed before the publish: its reservation goes (after the
        publish there is none left, and this does nothing)."""
        self._drop(rid, owner, committing=True)

    def _drop(self, rid: int, owner: Any, *, committing: bool) -> None:
        with self.cv:
            res = self.reservations.get(rid)
            if res is None or res.owner != owner or res.committing != committing:
                return
            del self.reservations[rid]
            meta = res.meta
            meta.gpu_loc = res.gpu_loc
            extents = self.placement.free_space(meta)
            self.cv.notify_all()
        if extents:
            self.placement.nvme.free(extents)

    def expire(self, max_age_s: float) -> int:
        """Drop reservations older than ``max_age_s`` that no commit has taken up (a client
        that reserved and went idle must not pin the tier for its connection's life); their
        memory is reused at once. A late commit gets ``NotFound``. Returns how many."""
        now = time.monotonic()
        with self.cv:
            old = [(r.rid, r.owner, r.meta.nbytes) for r in self.reservations.values()
                   if now - r.since > max_age_s and not r.committing]
        for rid, owner, nbytes in old:
            log.warning("dropping reservation %d (%d bytes) left uncommitted for more than %.0f s", rid, nbytes,
                        max_age_s)
            self.abort(rid, owner=owner)
        if old:
            with self.cv:
                self.counters["reservations_expired"] += len(old)
        return len(old)

    def drop_owner(self, owner: Any) -> int:
        """Abort every reservation of ``owner`` (a connection that went away); how many."""
        with self.cv:
            rids = [rid for rid, r in self.reservations.items() if r.owner == owner]
        for rid in rids:
            self.abort(rid, owner=owner)
        return len(rids)

    def _put_nvme(self, u8: np.ndarray, spec: TensorSpec, key: str | None, durable: bool, replace: bool,
                  ns: str, ephemeral: bool, home: str | None) -> Handle:
        """Write a put straight to NVMe. ``home="nvme"`` (``put(tier="nvme")``): the object
        lives there, going back down after each use; None (``tier=None`` finding no room in
        the host tier): it is only placed there, and cached like any other once used."""
        ix, placement = self.index, self.placement
        if key is not None:
            with self.cv:
                ix.check_key(ns, key, replace)
        extents = placement.nvme_take(spec.nbytes, demoting=False)
        published = False
        try:
            crcs = placement.nvme.write(extents, u8, sync=durable) if spec.nbytes else []
            with self.cv:
                meta = ObjectMeta(id=ix.new_id(), gen=ix.epoch, namespace=ns, key=key, spec=spec,
                                  durable=durable, nvme=extents, crcs=crcs, nvme_valid=True, home=home,
                                  ephemeral=LOCAL if ephemeral else None)
            def publish() -> ObjectMeta | None:  # (under cv, run by durability)
                nonlocal published
                published = True
                return ix.publish(meta)

            old = self.durability.record_put(meta, replace=replace, publish=publish)
        except BaseException:
            if not published:
                placement.nvme.free(extents)
            raise
        self.counters["puts"] += 1
        self.counters["put_bytes"] += spec.nbytes
        if old is not None:
            placement.discard_replaced(old)
        return meta.handle

    @staticmethod
    def _check_ephemeral(ephemeral: bool, durable: bool) -> None:
        if ephemeral and durable:
            raise InvalidArgument("an ephemeral object is freed when its connection ends: it cannot be durable")

