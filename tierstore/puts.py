"""Puts: the two-phase put (reserve a block, fill it, commit it), the one-call puts of
the in-process API, and the staging-area transfers of the daemon's one-round-trip
puts and gets.

``Puts`` owns the open reservations. It is given the object index (checks a key,
publishes the object), placement (the block to fill, the write-down to NVMe, the
object's place once published), durability (the put record, group commit) and the
prefetcher (a staged get is an access it learns from). A commit passes through them
once, in order, and never comes back: placement (``land``: the write-down; it hands
back a ``Landing``, its part of the publish), durability (``record_put``: the record,
then the publish it is given), and, inside that, under the index's lock, the index
(``publish``) and the landing (``placed``: the object joins its tier's eviction order,
the object it replaced goes to its discard). A durable commit takes these steps a batch
at a time on the group committer (``groupcommit.py``); ``commit`` waits for it.

The ``try_*`` methods are for the daemon's event loop, which never waits: each does its
work now when it can, else returns ``Later`` (``tierstore.waits``), the rest of the
call, for a thread that may wait.

Length: the in-process puts, the two phases and the daemon's staged puts are one set of
steps (check, open, fill, take up, commit) over one table of reservations.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from .errors import CapacityExceeded, Closed, InvalidArgument, NotFound
from .index import Handle, ObjectMeta
from .leases import LOCAL
from .placement import Landing, Placement
from .objectindex import ObjectIndex
from .prefetch import Prefetcher
from .staging import StagingAreas
from .durability import Durability
from .groupcommit import GroupCommit, Pending
from .tensors import TensorSpec, cuda_source, to_bytes
from .units import PAGE, align_up
from .waits import Later

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
                 prefetcher: Prefetcher, staging: StagingAreas) -> None:
        self.index, self.placement, self.durability, self.prefetcher = index, placement, durability, prefetcher
        self.staging = staging
        self.cv = index.cv
        self.counters = index.counters
        self.reservations: dict[int, Reservation] = {}
        self._empty_open = 0
        """Reservations of objects of no bytes: they count against ``room_for_empty`` as the
        objects they will be (else reserving without committing made them without bound)."""
        self.committer = GroupCommit(placement, durability)
        """Durable commits go through it, a batch at a time."""

    def put(self, tensor: Any, key: str | None, tier: str | None, durable: bool, replace: bool, ns: str,
            wait_s: float, ephemeral: bool) -> Handle:
        """An in-process put (``Store.put``; its key and namespace checked there): each
        check once, then a host block (a reservation filled and committed) or NVMe."""
        tier = self.placement.check_tier(tier)
        self._check_ephemeral(ephemeral, durable)
        if tier == "gpu":
            return self._put_gpu(tensor, key, durable, replace, ns, wait_s, ephemeral)
        u8, spec = to_bytes(tensor)
        self.placement.check_fits(spec.nbytes, tier)
        if tier == "host" or (tier is None and self.placement.host_has_room(spec.nbytes)):
            self._check_room(spec, key, tier, replace, ns)
            res = self._open(spec, self._alloc(spec, tier, 0, wait_s), key, tier, durable, replace, ns, LOCAL,
                             ephemeral)
            try:
                if spec.nbytes:
                    # the reservation keeps this block ours until commit; no lock needed to fill it
                    self.placement.host_view(res.host_off, spec.nbytes)[:] = u8
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
        self._check_gpu(spec, durable)
        self._check_room(spec, key, "gpu", replace, ns)
        res = self._open(spec, self._alloc(spec, "gpu", device, wait_s), key, "gpu", durable, replace, ns, LOCAL,
                         ephemeral)
        try:
            if spec.nbytes:
                self.placement.gpu_write(res.gpu_loc, addr, spec.nbytes)
        except BaseException:
            self.abort(res.rid)
            raise
        return self.commit(res.rid)

    def reserve(self, spec: TensorSpec, *, key: str | None, tier: str | None, durable: bool, replace: bool,
                namespace: str, owner: Any, wait_s: float = 0.0, device: int = 0,
                ephemeral: bool = False) -> Reservation:
        """Allocate a host block (``tier="gpu"``: a GPU-tier block on ``device``) for a new
        object, demoting others to make room (waiting up to ``wait_s``); the caller fills
        it, then ``commit``. ``ephemeral``: the object is freed when ``owner`` goes
        (``DaemonSurface.drop_owner``)."""
        tier = self._check_reserve(spec, key, tier, durable, replace, namespace, ephemeral)
        return self._open(spec, self._alloc(spec, tier, device, wait_s), key, tier, durable, replace, namespace,
                          owner, ephemeral)

    def try_reserve(self, spec: TensorSpec, *, key: str | None, tier: str | None, durable: bool, replace: bool,
                    namespace: str, owner: Any, wait_s: float = 0.0, device: int = 0,
                    ephemeral: bool = False) -> Reservation | Later:
        """``reserve`` for a caller that must not wait: the block when the tier has room now;
        otherwise ``Later`` (nothing taken) of the allocation that makes room."""
        tier = self._check_reserve(spec, key, tier, durable, replace, namespace, ephemeral)
        with self.cv:
            if tier == "gpu":
                loc = self.placement.gpu_take(spec.nbytes, device)
            else:
                loc = self.placement.host_take(spec.nbytes) if spec.nbytes else -1
        if loc is None:
            return Later(lambda: self._open(spec, self._alloc(spec, tier, device, wait_s), key, tier, durable, replace,
                                            namespace, owner, ephemeral))
        return self._open(spec, loc, key, tier, durable, replace, namespace, owner, ephemeral)

    def _alloc(self, spec: TensorSpec, tier: str | None, device: int, wait_s: float) -> int:
        """The block of a reservation, making room (up to ``wait_s``); -1 for no bytes."""
        if tier == "gpu":
            return self.placement.alloc_gpu(spec.nbytes, device, wait_s=wait_s)
        return self.placement.alloc_host(spec.nbytes, wait_s=wait_s) if spec.nbytes else -1

    def _check_reserve(self, spec: TensorSpec, key: str | None, tier: str | None, durable: bool, replace: bool,
                       namespace: str, ephemeral: bool) -> str | None:
        """The checks of a reservation, before anything is taken; its tier."""
        tier = self.placement.check_tier(tier)
        self._check_ephemeral(ephemeral, durable)
        if tier == "gpu":
            self._check_gpu(spec, durable)
        else:
            self.placement.check_fits(spec.nbytes, tier)
        self._check_room(spec, key, tier, replace, namespace)
        return tier

    def _check_gpu(self, spec: TensorSpec, durable: bool) -> None:
        self.placement.check_fits(spec.nbytes, "gpu")
        if durable:
            raise InvalidArgument("the gpu tier is volatile: put durable objects to 'host' or 'nvme'")

    def _check_room(self, spec: TensorSpec, key: str | None, tier: str | None, replace: bool,
                    namespace: str) -> None:
        """A reservation's checks of what the store holds now: the host tier's usable
        bytes, the key, the count of objects of no bytes."""
        if tier != "gpu":
            usable = self.placement.host_usable()
            if align_up(max(spec.nbytes, 1), PAGE) > usable:
                raise CapacityExceeded(
                    f"{spec.nbytes} bytes exceed the host tier's usable {usable} bytes: a put through the daemon "
                    "stages the whole object in the host tier (the shared arena), whatever its tier; raise "
                    "host_bytes (an in-process Store writes larger objects to NVMe directly)")
        if key is not None or not spec.nbytes:
            with self.cv:
                if key is not None:
                    self.index.check_key(namespace, key, replace)
                if not spec.nbytes and not self.placement.room_for_empty(self._empty_open):
                    raise CapacityExceeded(f"the store holds {self.index.object_count()} objects, as many as its "
                                           "tiers have pages: an object of no bytes counts as one page; free some")

    def _open(self, spec: TensorSpec, loc: int, key: str | None, tier: str | None, durable: bool, replace: bool,
              namespace: str, owner: Any, ephemeral: bool) -> Reservation:
        """Record the reservation of block ``loc`` (a GPU-tier location for ``tier="gpu"``; -1: none)."""
        with self.cv:
            oid = self.index.new_id()
            if tier == "gpu":
                meta = ObjectMeta(id=oid, gen=self.index.epoch, namespace=namespace, key=key, spec=spec,
                                  durable=False, ephemeral=owner if ephemeral else None)
                res = Reservation(rid=oid, owner=owner, host_off=0, meta=meta, tier="gpu", replace=replace,
                                  gpu_loc=loc, since=time.monotonic())
            else:
                meta = ObjectMeta(id=oid, gen=self.index.epoch, namespace=namespace, key=key, spec=spec,
                                  durable=durable, home="nvme" if tier == "nvme" else None,
                                  ephemeral=owner if ephemeral else None)
                meta.host_off = None if loc < 0 else loc
                res = Reservation(rid=oid, owner=owner, host_off=max(loc, 0), meta=meta, tier=tier,
                                  replace=replace, since=time.monotonic())
            self.reservations[oid] = res
            self._empty_open += not spec.nbytes
            return res

    def commit(self, rid: int, *, owner: Any = LOCAL) -> Handle:
        """Second phase: make the reserved object visible (and durable, if asked: through
        the group committer, waited for)."""
        res = self._take_up(rid, owner)
        if res.meta.durable:
            return self._submit(res).result()
        return self._record(res, self._land(res))

    def try_commit(self, rid: int, *, owner: Any) -> Handle | Pending | Later:
        """``commit`` for a caller that must not wait (the daemon's event loop): a durable
        commit is handed to the group committer and its ``Pending`` returned; a volatile
        one is published now, but ``Later`` (the commit is taken up, the rest done there)
        when it writes to NVMe (``tier="nvme"``) or a durable op holds the journal lock."""
        res = self._take_up(rid, owner)
        if res.meta.durable:
            return self._submit(res)
        # (a rest that ends unrun gives the reservation up: nothing else would, once taken up)
        give_back = partial(self._give_up, res.rid, res.owner)
        if res.tier == "nvme":
            return Later(lambda: self._record(res, self._land(res)), give_back)
        landing = self._land(res)  # (nothing to write for a host or GPU-tier object)
        try:
            done = self.durability.try_record_put(res.meta, replace=res.replace,
                                                  publish=lambda: self._publish(res, landing))
        except BaseException:
            self._give_up(res.rid, res.owner)
            raise
        return self._count(res.meta) if done else Later(lambda: self._record(res, landing), give_back)

    def _take_up(self, rid: int, owner: Any) -> Reservation:
        """The commit of reservation ``rid`` owns it from here: only it may still abort it."""
        with self.cv:
            res = self.reservations.get(rid)
            if res is None or res.owner != owner:
                raise NotFound(f"no open reservation {rid} for this connection (one left uncommitted for "
                               "reservation_timeout_s is dropped); put the object again")
            if res.committing:
                raise InvalidArgument(f"reservation {rid} is already being committed")
            res.meta.moving = True  # nobody sees it yet; blocks a concurrent demotion once visible
            # a client that dies now (its connection's cleanup aborts what it left open) cannot
            # pull the block and the extents from under the write-down and publish an object
            # without its bytes
            res.committing = True
            return res

    def _publish(self, res: Reservation, landing: Landing) -> None:
        """(under cv, run by durability) The object becomes visible; placement places it and
        takes what it replaced (``Landing.placed``)."""
        if self.reservations.pop(res.rid, None) is not None:
            self._empty_open -= not res.meta.spec.nbytes
        landing.placed(self.index.publish(res.meta))

    def _submit(self, res: Reservation) -> Pending:
        """A durable commit, to the group committer; its outcome."""
        try:
            return self.committer.submit(res.meta, tier=res.tier, replace=res.replace,
                                         publish=lambda landing: self._publish(res, landing),
                                         finish=lambda: self._count(res.meta),
                                         failed=lambda: self._give_up(res.rid, res.owner))
        except BaseException:
            self._give_up(res.rid, res.owner)
            raise

    def _land(self, res: Reservation) -> Landing:
        try:
            return self.placement.land(res.meta, tier=res.tier, gpu_loc=res.gpu_loc)
        except BaseException:
            self._give_up(res.rid, res.owner)
            raise

    def _record(self, res: Reservation, landing: Landing) -> Handle:
        try:
            self.durability.record_put(res.meta, replace=res.replace, publish=lambda: self._publish(res, landing))
        except BaseException:
            self._give_up(res.rid, res.owner)
            raise
        return self._count(res.meta)

    def _count(self, meta: ObjectMeta) -> Handle:
        """(no lock held) The commit is done (durable, if asked): count it; the put's handle."""
        with self.cv:
            self.counters["puts"] += 1
            self.counters["put_bytes"] += meta.nbytes
        return meta.handle

    def close(self) -> None:
        """Commit the durable commits queued, then stop the group committer."""
        self.committer.close()

    def put_staged(self, owner: Any, src: int, spec: TensorSpec, *, key: str | None, tier: str | None,
                   durable: bool, replace: bool, namespace: str, wait_s: float = 0.0,
                   ephemeral: bool = False) -> Handle:
        """One-round-trip put: the bytes are at ``src`` in ``owner``'s staging area."""
        _check_staged_tier(tier)
        self._staged_bytes(owner, src, spec)
        res = self.reserve(spec, key=key, tier=tier, durable=durable, replace=replace, namespace=namespace,
                           owner=owner, wait_s=wait_s, ephemeral=ephemeral)
        return self._fill_commit(res, owner, src, spec)

    def try_put_staged(self, owner: Any, src: int, spec: TensorSpec, *, key: str | None, tier: str | None,
                       durable: bool, replace: bool, namespace: str, wait_s: float = 0.0,
                       ephemeral: bool = False) -> Handle | Pending | Later:
        """``put_staged`` for a caller that must not wait: ``try_reserve``, the copy, then
        ``try_commit``; where one of them answers ``Later``, so does this (the rest from there)."""
        _check_staged_tier(tier)
        area = self._staged_bytes(owner, src, spec)
        res = self.try_reserve(spec, key=key, tier=tier, durable=durable, replace=replace, namespace=namespace,
                               owner=owner, wait_s=wait_s, ephemeral=ephemeral)
        if isinstance(res, Later):
            return Later(lambda: self._fill_commit(res.run(), owner, src, spec))
        self._fill(res, area, src)
        return self.try_commit(res.rid, owner=owner)

    def _staged_bytes(self, owner: Any, src: int, spec: TensorSpec) -> tuple[int, int]:
        with self.cv:
            area = self.staging.of(owner)
        if area is None or src < 0 or src + spec.nbytes > area[1]:
            raise InvalidArgument("staged bytes lie outside this connection's staging area")
        return area

    def _fill(self, res: Reservation, area: tuple[int, int], src: int) -> None:
        """Copy the staged bytes into the reserved block (the reservation keeps it ours)."""
        self.placement.host_copy(res.host_off, area[0] + src, res.meta.nbytes)

    def _fill_commit(self, res: Reservation, owner: Any, src: int, spec: TensorSpec) -> Handle:
        """The staged bytes copied into the reserved block, then the commit; the staging
        area is looked up again first (the connection may have gone while the block was
        made: its area is then no longer its own)."""
        try:
            self._fill(res, self._staged_bytes(owner, src, spec), src)
        except BaseException:
            self.abort(res.rid, owner=owner)
            raise
        return self.commit(res.rid, owner=owner)

    def try_get_staged(self, owner: Any, handle: Handle | int | str, *, namespace: str | None = None,
                       stream: str = "default") -> TensorSpec | None | Later:
        """Copy a small object into ``owner``'s staging area (one round trip, no lease).

        Returns its spec, or None when it does not fit there (use a lease instead). The
        copy is made now when the object is in the host tier and nobody writes or moves it;
        otherwise it is ``Later`` (a copy from wherever it is, through a pin; it returns the
        spec), with nothing done.
        """
        h = Handle.parse(handle)
        with self.cv:
            area = self.staging.of(owner)
            meta = self.index.get_meta(h, self.index.ns(namespace))
            if area is None or meta.nbytes > area[1]:
                return None
            if meta.nbytes == 0:
                return meta.spec
            if meta.host_valid and not meta.writer and not meta.moving:
                # small (<= staging size) copy under the lock: cheaper than pinning around it
                self.placement.host_copy(area[0], meta.host_off, meta.nbytes)
                self.placement.touch(meta)
                self.prefetcher.record(owner, stream, meta.id, "hit", 0.0)
                self.counters["gets"] += 1
                self.counters["host_hits"] += 1
                self.counters["get_bytes"] += meta.nbytes
                return meta.spec
        return Later(lambda: self._get_pinned(owner, h, namespace, stream))

    def _get_pinned(self, owner: Any, h: Handle, namespace: str | None, stream: str) -> TensorSpec:
        """The copy of ``try_get_staged`` through a pin, from whichever tier holds the object."""
        with self.cv:
            area = self.staging.of(owner)  # (again: the connection may have gone meanwhile)
        if area is None:
            raise Closed("the connection that asked went away")
        view = self.placement.host_view
        return self.placement.read_pinned(h, self.index.ns(namespace), owner, stream,
                                          lambda spec: (view(area[0], spec.nbytes), False))

    def fill(self, rid: int, upto: int, *, owner: Any) -> Later | None:
        """The first ``upto`` bytes of reservation ``rid``'s block are filled: for an object
        its commit writes to NVMe (``tier="nvme"``, or durable), the ``Later`` that begins
        writing them now (``Placement.write_early``), so the commit has only the rest to
        write; None where there is nothing to begin (another tier, no bytes). A hint: the
        commit writes whatever this did not."""
        with self.cv:
            res = self.reservations.get(rid)
            if res is None or res.owner != owner:
                raise NotFound(f"no open reservation {rid} for this connection")
            if res.committing:
                raise InvalidArgument(f"reservation {rid} is already being committed")
            n = res.meta.nbytes
            if not 0 < upto <= n:
                raise InvalidArgument(f"upto {upto} is outside reservation {rid}'s 1..{n} bytes")
            if res.tier == "gpu" or not n or not (res.tier == "nvme" or res.meta.durable):
                return None

        def still_open() -> bool:  # (under cv)
            return self.reservations.get(rid) is res and not res.committing

        return Later(lambda: self.placement.write_early(res.meta, upto, still_open))

    def owned(self, rid: int, owner: Any) -> None:
        """``NotFound`` unless ``rid`` is a reservation of ``owner``'s, open or committing."""
        with self.cv:
            res = self.reservations.get(rid)
            if res is None or res.owner != owner:
                raise NotFound(f"no open reservation {rid} for this connection")

    def abort(self, rid: int, *, owner: Any = LOCAL, asked: bool = False) -> bool:
        """Drop an open reservation; one a commit has taken up is left to it. Whether it was
        dropped here. ``asked``: the owner's own abort, which must not be answered as done
        when it was not — ``InvalidArgument`` if a commit has taken it up, ``NotFound`` if
        there is none (committed, or given up, since)."""
        state = self._drop(rid, owner, committing=False)
        if asked and state == "committing":
            raise InvalidArgument(f"put {rid} is being committed and can no longer be aborted; its commit's "
                                  "reply says whether it was stored")
        if asked and state == "none":
            raise NotFound(f"no open reservation {rid} for this connection")
        return state == "dropped"

    def _give_up(self, rid: int, owner: Any) -> None:
        """The commit under way failed before the publish: its reservation goes (after the
        publish there is none left, and this does nothing)."""
        self._drop(rid, owner, committing=True)

    def _drop(self, rid: int, owner: Any, *, committing: bool) -> str:
        """Drop ``owner``'s reservation ``rid`` if a commit has (``committing``) or has not
        taken it up: ``"dropped"``, else ``"committing"`` (a commit has it) or ``"none"``."""
        with self.cv:
            res = self.reservations.get(rid)
            if res is None or res.owner != owner:
                return "none"
            if res.committing != committing:
                return "committing" if res.committing else "open"
            del self.reservations[rid]
            self._empty_open -= not res.meta.spec.nbytes
            meta = res.meta
            meta.gpu_loc = res.gpu_loc
            extents = self.placement.free_space(meta)
            self.cv.notify_all()
        self.placement.cancel_early(meta)
        if extents:
            self.placement.nvme_free(extents)
        return "dropped"

    def open_count(self) -> int:
        """Reservations open now."""
        return len(self.reservations)

    def expire(self, max_age_s: float) -> int:
        """Drop reservations older than ``max_age_s`` that no commit has taken up (a client
        that reserved and went idle must not pin the tier for its connection's life); their
        memory is reused at once. A late commit gets ``NotFound``. Returns how many."""
        now = time.monotonic()
        with self.cv:
            old = [(r.rid, r.owner, r.meta.nbytes) for r in self.reservations.values()
                   if now - r.since > max_age_s and not r.committing]
        if old:
            log.warning("dropping %d reservation(s) (%d bytes) left uncommitted for more than %.0f s: %s", len(old),
                        sum(n for _, _, n in old), max_age_s, ", ".join(str(rid) for rid, _, _ in old[:8]) +
                        (", ..." if len(old) > 8 else ""))
        for rid, owner, _ in old:
            self.abort(rid, owner=owner)
        if old:
            with self.cv:
                self.counters["reservations_expired"] += len(old)
        return len(old)

    def drop_owner(self, owner: Any) -> int:
        """Abort every reservation of ``owner`` (a connection that went away); how many."""
        with self.cv:
            rids = [rid for rid, r in self.reservations.items() if r.owner == owner]
        # (a connection's clean-up may run on two threads at once: each counts what it dropped)
        return sum(self.abort(rid, owner=owner) for rid in rids)

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
            crcs = placement.nvme_write(extents, u8, sync=durable) if spec.nbytes else []
            with self.cv:
                meta = ObjectMeta(id=ix.new_id(), gen=ix.epoch, namespace=ns, key=key, spec=spec,
                                  durable=durable, nvme=extents, crcs=crcs, nvme_valid=True, home=home,
                                  ephemeral=LOCAL if ephemeral else None)
            def publish() -> None:  # (under cv, run by durability)
                nonlocal published
                published = True
                old = ix.publish(meta)
                if old is not None:
                    placement.drop_replaced(old)

            self.durability.record_put(meta, replace=replace, publish=publish)
        except BaseException:
            if not published:
                placement.nvme_free(extents)
            raise
        return self._count(meta)

    @staticmethod
    def _check_ephemeral(ephemeral: bool, durable: bool) -> None:
        if ephemeral and durable:
            raise InvalidArgument("an ephemeral object is freed when its connection ends: it cannot be durable")


def _check_staged_tier(tier: str | None) -> None:
    """A staged put is copied from the staging area into a host block, never into a
    GPU-tier one (a GPU-tier object's bytes come through a two-phase put)."""
    if tier == "gpu":
        raise InvalidArgument("a staged put cannot go to the gpu tier: put a GPU-tier object with a two-phase "
                              "put (put_reserve, put_commit)")
