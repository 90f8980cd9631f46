"""The lease table: who holds what, the check-out and check-in paths, and what goes when
a holder goes (revocation, expiry, a closed connection's leases).

``LeaseTable`` owns the leases and their ids (kept by owner too: a closed connection's
are found without a scan, and one connection holds at most ``MAX_LEASES_PER_OWNER``). It is given the object index (the lock,
the objects and the waits), placement (bringing an object into the host tier, handing a
block over, moving a revoked lease's bytes off the holder's block, giving space back),
durability (a durable check-in is journaled) and the prefetcher (each check-out is an
access it learns from).

Batches of check-outs and check-ins are built on this table in ``leasebatches``.

Length: each check-out and check-in path is here twice over one set of steps (``_take``,
``_hand_over_now``, ``_check_in``): the form that may wait and the daemon event loop's
``try_*`` form, which does the same now or returns the rest as ``Later``; split, the
two forms of one path would sit in two files.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from .errors import Busy, CapacityExceeded, InvalidArgument, NotFound, StaleHandle, TierstoreError
from .index import Handle, ObjectMeta
from .placement import Placement
from .objectindex import ObjectIndex
from .prefetch import Prefetcher
from .durability import Durability
from .tensors import TensorSpec
from .waits import Later, waits_since

__all__ = ["LeaseTable", "LeaseInfo", "LOCAL", "MAX_BATCH", "check_mode"]

log = logging.getLogger(__name__)

LOCAL = "local"  # owner of leases taken through the in-process API
_WRITES_BACK = object()  # what ``_check_in(now=True)`` returns for a check-in it left to a thread that may sync


@dataclass(slots=True)
class LeaseInfo:
    lid: int
    owner: Any
    oid: int
    gen: int
    mode: str
    host_off: int
    spec: TensorSpec
    since: float
    gpu_loc: int | None = None
    """Set for a lease on a GPU-tier object (``checkout(device=True)``): the bytes are there."""
    durable: bool = False
    blank: bool = False
    """A ``w`` lease given host memory without a read: until check-in, the host bytes are
    not the object's (its NVMe copy still is)."""
    revoked: bool = False
    """Being revoked (``revoke``): a second revocation leaves it alone."""
    sourced: bool = False
    """A ``w`` lease from a source (``checkout_from``): its bytes are the source's, not the
    object's own, so giving it back unwritten still changes the object (``give_back``)."""


MAX_BATCH = 4096
"""Most objects one ``checkout_many`` / ``release_many`` takes."""


MAX_LEASES_PER_OWNER = 1 << 17
"""Leases one connection may hold at once (each costs the daemon memory and its
connection's clean-up time); the in-process store's own are not counted."""
MAX_LEASES_PER_GROUP = 1 << 18
"""... one group of owners together (the daemon's: one uid's connections), so that many
connections cannot hold a connection's most each (about 400 bytes of the daemon's
memory a lease)."""
MAX_LEASES = 1 << 20
"""... every owner together (but the in-process store's own)."""

_MISSING = object()


class _Leases(dict):
    """lid -> LeaseInfo, and each owner's lids: a closed connection's leases are found
    without a scan over everyone's, and counted."""

    def __init__(self) -> None:
        super().__init__()
        self.by_owner: dict[Any, dict[int, None]] = {}
        self.group_of: Callable[[Any], Any] = _itself
        """Whose share an owner's leases count against (``LeaseTable.group_owners``)."""
        self.groups: dict[Any, set[Any]] = {}
        """Each group's owners that hold leases (changed only as an owner takes its first
        lease or checks in its last: the check-out path pays nothing for it)."""

    def __setitem__(self, lid: int, info: LeaseInfo) -> None:
        super().__setitem__(lid, info)
        mine = self.by_owner.get(info.owner)
        if mine is None:
            mine = self.by_owner[info.owner] = {}
            if info.owner is not LOCAL:
                self.groups.setdefault(self.group_of(info.owner), set()).add(info.owner)
        mine[lid] = None

    def __delitem__(self, lid: int) -> None:
        self._off(super().pop(lid))

    def pop(self, lid: int, *default: Any) -> Any:
        info = super().pop(lid, _MISSING)
        if info is _MISSING:
            if default:
                return default[0]
            raise KeyError(lid)
        self._off(info)
        return info

    def _off(self, info: LeaseInfo) -> None:
        mine = self.by_owner.get(info.owner)
        if mine is not None:
            mine.pop(info.lid, None)
            if not mine:
                del self.by_owner[info.owner]
                if info.owner is not LOCAL:
                    group = self.group_of(info.owner)
                    owners = self.groups.get(group)
                    if owners is not None:
                        owners.discard(info.owner)
                        if not owners:
                            del self.groups[group]

    def of(self, owner: Any) -> list[int]:
        return list(self.by_owner.get(owner, ()))

    def count(self, owner: Any) -> int:
        return len(self.by_owner.get(owner, ()))

    def group_count(self, owner: Any) -> int:
        """Leases held by ``owner``'s group (O(owners in the group))."""
        by_owner = self.by_owner
        return sum(len(by_owner.get(o, ())) for o in self.groups.get(self.group_of(owner), ()))

    def counted(self) -> int:
        """Leases of every owner but the in-process store itself."""
        return len(self) - self.count(LOCAL)


class LeaseTable:
    """Who holds what: the leases, their ids, and the check-out and check-in paths."""

    def __init__(self, index: ObjectIndex, placement: Placement, durability: Durability,
                 prefetcher: Prefetcher, lease_wait_s: float) -> None:
        self.index, self.placement, self.durability, self.prefetcher = index, placement, durability, prefetcher
        self.cv = index.cv
        self.counters = index.counters
        self.lease_wait_s = lease_wait_s
        self.leases = _Leases()
        self._ids = itertools.count(1)
        self._dropping: set[int] = set()
        """(under cv) Leases a ``drop_owner`` is ending now."""

    def _add(self, info: LeaseInfo) -> LeaseInfo:
        """(under cv) Record a new lease; gives it its id."""
        info.lid = next(self._ids) + (1 << 40)
        self.leases[info.lid] = info
        return info

    def group_owners(self, group_of: Callable[[Any], Any]) -> None:
        """Count each owner's leases against ``group_of(owner)``'s share too (the daemon:
        its connection's uid). Set before any lease is taken."""
        self.leases.group_of = group_of

    def holds(self, meta: ObjectMeta, owner: Any) -> bool:
        """(under cv) Whether ``owner`` holds a lease on ``meta``."""
        leases = self.leases
        return any(leases[lid].oid == meta.id for lid in leases.by_owner.get(owner, ()))

    def __len__(self) -> int:
        return len(self.leases)

    def free(self, h: Handle, ns: str, owner: Any) -> None:
        """Free an object once nothing holds it (``wait_unheld``): its key is unbound at
        once and placement discards it (the free journaled for a durable one). A discard
        that fails leaves the object exactly as it was, key and all."""
        ix = self.index
        with self.cv:
            meta = ix.get_meta(h, ns)
            self.wait_unheld(meta, owner)
            meta.freeing = True
            ix.unbind(meta)
        try:
            self.placement.discard(meta)
        except TierstoreError as e:
            # the free was not journaled: the object stays exactly as it was (a restart would
            # bring it back, so it must not vanish now)
            with self.cv:
                meta.freeing = False
                ix.rebind(meta)
                self.cv.notify_all()
            raise type(e)(f"free of {h} failed, the object is unchanged: {e.message}") from None
        with self.cv:
            self.counters["frees"] += 1

    def wait_unheld(self, meta: ObjectMeta, owner: Any) -> None:
        """(under cv) Wait until nothing holds ``meta`` (before a free): copies and moves in
        flight, and other owners' leases (up to ``lease_wait_s``; a check-in another
        connection sent without waiting may still be on its way). The caller's own lease:
        Busy at once."""
        deadline = waits_since() + self.lease_wait_s
        while True:
            if meta.readers or meta.writer:
                remaining = deadline - time.monotonic()
                if owner is LOCAL or self.holds(meta, owner) or remaining <= 0:
                    raise Busy(f"object {meta.handle} is checked out; check it in before freeing it")
                self.index.wait(remaining)
            elif meta.pins or meta.moving:
                self.cv.wait()
            else:
                return
            if meta.freeing:
                raise StaleHandle(f"handle {meta.handle} names a freed object")

    def checkout(self, handle: Handle | int | str, mode: str, *, owner: Any, namespace: str | None = None,
                 timeout_s: float | None = None, stream: str = "default", device: bool = False,
                 counted: bool = True) -> LeaseInfo:
        """Lease an object in the host tier (promoting it first if needed).

        ``device=True`` (a CUDA caller): an object in the GPU tier is leased where it is
        (``LeaseInfo.gpu_loc``); otherwise, and for every other object, the host tier.

        ``mode``: ``"r"`` shared, ``"rw"`` exclusive, ``"w"`` exclusive for a caller that
        overwrites every byte (an NVMe-only object is given host memory without being
        read; its previous bytes are not visible through the lease).

        A ``w`` lease given back (``give_back``, or a failed batch's) leaves the object as
        it was, so it never discards the only other copy: a GPU-tier object is read down.
        ``counted=False``: the access is not counted nor recorded with the prefetcher (it
        was, by an earlier attempt of the same request).
        """
        h, ns = Handle.parse(handle), self.index.ns(namespace)
        check_mode(mode)
        t0 = time.monotonic()
        deadline = waits_since() + (self.lease_wait_s if timeout_s is None else timeout_s)
        late = promoted = blank = False
        while True:
            with self.cv:
                meta = self.index.get_meta(h, ns)
                info = self._take(meta, mode, owner, stream, device, t0, hit=not promoted, late=late, blank=blank,
                                  counted=counted)
                if info is not None:
                    return info
                late = late or meta.prefetching
                if not meta.host_valid and not meta.moving:
                    meta.moving = True
                    promote = True
                    self.counters["nvme_reads"] += mode != "w" and meta.gpu_loc is None
                else:
                    promote = False
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise Busy(f"object {h} is leased in a conflicting mode (readers={meta.readers}, "
                                   f"writer={meta.writer}); check it in elsewhere or wait longer")
                    self.index.wait(remaining)
                    continue
            if promote:
                read = mode != "w" or meta.gpu_loc is not None
                promoted, blank = mode != "w", not read
                self.placement.to_host(meta, wait_s=max(0.0, deadline - time.monotonic()), read=read)

    def try_checkout(self, handle: Handle | int | str, mode: str, *, owner: Any, namespace: str | None = None,
                     timeout_s: float | None = None, stream: str = "default",
                     device: bool = False) -> LeaseInfo | Later:
        """``checkout`` for a caller that must not wait (the daemon's event loop): the lease
        when the object is where it is wanted and no holder is in the way; otherwise
        ``Later`` of ``checkout`` (nothing taken or recorded)."""
        h, ns = Handle.parse(handle), self.index.ns(namespace)
        check_mode(mode)
        with self.cv:
            info = self._take(self.index.get_meta(h, ns), mode, owner, stream, device, time.monotonic(),
                              True, False, False)  # (hit, late, blank)
        if info is not None:
            return info
        return Later(lambda: self.checkout(h, mode, owner=owner, namespace=ns, timeout_s=timeout_s, stream=stream,
                                           device=device))

    def _take(self, meta: ObjectMeta, mode: str, owner: Any, stream: str, device: bool, t0: float,
              hit: bool, late: bool, blank: bool, counted: bool = True) -> LeaseInfo | None:
        """(under cv) The lease, if ``meta`` is in the tier it is wanted in, not moving, and
        no other lease is in the way; else None."""
        on_gpu = device and meta.gpu_loc is not None
        if not ((meta.host_valid or on_gpu) and not meta.moving and _lease_ok(meta, mode)):
            return None
        if owner is not LOCAL:
            leases = self.leases
            n = leases.count(owner)
            if n >= MAX_LEASES_PER_OWNER:
                raise CapacityExceeded(f"this connection holds {MAX_LEASES_PER_OWNER} leases, the most one may "
                                       "hold; check some in first")
            # (a group's total is summed over its owners only for an owner holding many: with
            # the default 128 connections a uid, those holding fewer stay below the group's bound;
            # the bound on all leases holds whatever max_clients_per_uid is)
            if n >= MAX_LEASES_PER_GROUP >> 8 and leases.group_count(owner) >= MAX_LEASES_PER_GROUP:
                raise CapacityExceeded(f"this uid's connections hold {MAX_LEASES_PER_GROUP} leases together, the "
                                       "most they may; check some in first")
            if leases.counted() >= MAX_LEASES:
                raise CapacityExceeded(f"the daemon holds {MAX_LEASES} leases, the most it keeps; check some in "
                                       "first")
        if mode != "w" and counted:  # a blind overwrite is no read: nothing to learn or count
            self.prefetcher.access(owner, stream, meta, hit, late, t0)
        if mode == "r":
            meta.readers += 1
        else:
            meta.writer = True
            if meta.durable:  # its block stops being its durable bytes until the check-in
                self.durability.log_drop(meta)
        if counted:
            self.counters["checkouts"] += 1
            self.counters["gpu_hits" if on_gpu else "host_hits"] += 1
        self.placement.touch(meta)
        return self._add(LeaseInfo(0, owner, meta.id, meta.gen, mode, meta.host_off or 0, meta.spec,
                                   time.monotonic(), meta.gpu_loc if on_gpu else None, meta.durable, blank))

    def checkout_from(self, handle: Handle | int | str, source: Handle | int | str, *, owner: Any,
                      namespace: str | None = None, timeout_s: float | None = None,
                      stream: str = "default") -> LeaseInfo:
        """A ``w`` lease on ``handle`` whose host bytes start as ``source``'s (same size, same
        namespace): a read-modify-write into another object, as a double-buffered update
        makes, without the caller copying. ``source`` is read as by an ``r`` check-out (its
        access recorded for the prefetcher) and stays unchanged. When its host block holds
        the only host copy, nobody else uses it and its NVMe copy is current, the block is
        handed over to ``handle`` (no copy; ``source`` is left on NVMe); otherwise the
        bytes are copied into ``handle``'s own block."""
        dst_h, src_h, ns = Handle.parse(handle), Handle.parse(source), self.index.ns(namespace)
        info = self._hand_over_now(dst_h, src_h, ns, owner, stream)
        return info if info is not None else self._copy_from(dst_h, src_h, ns, owner, timeout_s, stream, [])

    def try_checkout_from(self, handle: Handle | int | str, source: Handle | int | str, *, owner: Any,
                          namespace: str | None = None, timeout_s: float | None = None,
                          stream: str = "default") -> LeaseInfo | Later:
        """``checkout_from`` for a caller that must not wait: only a hand-over of a resident
        ``source`` is done now; anything else (a read, a wait, a copy of the bytes) is
        ``Later``, with nothing taken or recorded."""
        dst_h, src_h, ns = Handle.parse(handle), Handle.parse(source), self.index.ns(namespace)
        info = self._hand_over_now(dst_h, src_h, ns, owner, stream)
        if info is not None:
            return info
        attempts: list[bool] = []  # the rest may run again (after WouldWait): its read is counted once
        return Later(lambda: self._copy_from(dst_h, src_h, ns, owner, timeout_s, stream, attempts))

    def _hand_over_now(self, dst_h: Handle, src_h: Handle, ns: str, owner: Any, stream: str) -> LeaseInfo | None:
        """The check-out from a source when ``source``'s block can be handed over at once; else None."""
        t0 = time.monotonic()
        with self.cv:
            dst, src = self.index.get_meta(dst_h, ns), self.index.get_meta(src_h, ns)
            if dst.id == src.id:
                raise InvalidArgument(f"object {dst_h} cannot be its own source")
            if dst.nbytes != src.nbytes:
                raise InvalidArgument(f"source {src_h} holds {src.nbytes} bytes, object {dst_h} {dst.nbytes}: "
                                      "a check-out from a source needs two objects of the same size")
            if src.host_valid and self._can_hand_over(src, dst, readers=0) and not dst.moving \
                    and _lease_ok(dst, "w"):
                self.prefetcher.access(owner, stream, src, True, False, t0)  # resident: a hit
                self.counters["host_hits"] += 1
                return self._hand_over(None, src, dst, owner)
        return None

    def _copy_from(self, dst_h: Handle, src_h: Handle, ns: str, owner: Any, timeout_s: float | None,
                   stream: str, attempts: list[bool]) -> LeaseInfo:
        """``checkout_from`` once no hand-over could be done at once: ``source`` read-leased
        (brought up if needed), then handed over after all, or copied. ``attempts``: one
        entry per earlier run of this request that read-leased the source (a daemon's op
        worker gives up a run that would wait, and a wait thread runs it again): the
        source's read is counted and recorded by the first only."""
        deadline = waits_since() + (self.lease_wait_s if timeout_s is None else timeout_s)
        rd: LeaseInfo | None = self.checkout(src_h, "r", owner=owner, namespace=ns, timeout_s=timeout_s,
                                             stream=stream, counted=not attempts)
        attempts.append(True)
        try:
            with self.cv:
                while True:
                    dst = self.index.get_meta(dst_h, ns)
                    src = self.index.holder(rd.oid)
                    if not self._can_hand_over(src, dst, readers=1):
                        break
                    if not dst.moving and _lease_ok(dst, "w"):
                        info = self._hand_over(rd, src, dst, owner)
                        rd = None
                        return info
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break  # the copy below waits (or says Busy) as a plain check-out does
                    self.index.wait(remaining)
            info = self.checkout(dst_h, "w", owner=owner, namespace=ns,
                                 timeout_s=max(0.0, deadline - time.monotonic()), stream=stream)
            try:
                self.placement.host_copy(info.host_off, rd.host_off, src.nbytes)
            except BaseException:
                self.release(info.lid, owner=owner)
                raise
            with self.cv:
                self.counters["source_copies"] += 1
                info.sourced = True
            return info
        finally:
            if rd is not None:
                self.release(rd.lid, owner=owner)

    @staticmethod
    def _can_hand_over(src: ObjectMeta, dst: ObjectMeta, readers: int) -> bool:
        """(under cv) Whether ``src``'s host block (read by ``readers`` leases, the caller's)
        may become ``dst``'s: ``src`` keeps a current NVMe copy and neither object is in
        another tier (``dst`` may still have to be waited for: moving, or leased)."""
        return (src.readers == readers and not src.writer and not src.moving and src.pins == 0
                and not src.freeing and src.nvme_valid and src.host_off is not None and src.gpu_loc is None
                and dst.gpu_loc is None and not dst.freeing and src.nbytes > 0)

    def _hand_over(self, rd: LeaseInfo | None, src: ObjectMeta, dst: ObjectMeta, owner: Any) -> LeaseInfo:
        """(under cv) End the caller's read lease ``rd`` on ``src`` (if any) and give ``src``'s
        host block to ``dst`` under a new ``w`` lease. ``src`` is left with its NVMe copy."""
        if rd is not None:
            del self.leases[rd.lid]
            src.readers -= 1
        off = self.placement.hand_over(src, dst)
        dst.writer = True
        self.durability.log_host(dst)  # (a durable one's is not: the block is not its bytes until the check-in)
        self.placement.admit(dst)
        self.counters["checkouts"] += 1
        self.counters["source_handovers"] += 1
        info = self._add(LeaseInfo(0, owner, dst.id, dst.gen, "w", off, dst.spec, time.monotonic(), None,
                                   dst.durable, sourced=True))
        self.cv.notify_all()
        return info

    def give_back_lease(self, info: LeaseInfo) -> None:
        """Give back a lease (its holder's give-back, or a lease of a failed batch) as if it
        had never been taken: nothing is marked dirty, and a blank ``w`` lease's host block
        is dropped (the object's bytes are still its NVMe copy)."""
        with self.cv:
            if self.leases.pop(info.lid, None) is None:
                return
            meta = self.index.holder(info.oid)
            if meta is None:
                return
            if info.mode == "r":
                meta.readers -= 1
            else:
                meta.writer = False
            if info.blank and meta.host_valid and meta.nvme_valid and meta.host_off is not None \
                    and not meta.moving and not meta.readers:
                self.placement.drop_host(meta)
            else:
                if info.mode != "r" and meta.durable and not info.blank:
                    self.durability.log_host(meta)  # nothing was written: the block is still its bytes
                self.placement.demote_if_home_nvme(meta)
            self.cv.notify_all()
            drop = self.index.droppable(meta)
        if drop:
            # a durable discard journals (syncs): off the caller's path
            self.placement.discard_later(meta)

    def give_back(self, lid: int, *, owner: Any = LOCAL) -> None:
        """End a lease its holder never wrote through (a check-out it could not use): as if
        it had never been taken — nothing dirtied, a blank ``w`` lease's block dropped (the
        object keeps its NVMe copy). A lease from a source is checked in instead: its bytes
        are the source's, which the object's own block may already have taken."""
        rest = self.try_give_back(lid, owner=owner)
        if rest is not None:
            rest.run()

    def try_give_back(self, lid: int, *, owner: Any) -> Later | None:
        """``give_back`` for a caller that must not wait: a lease from a source is checked in
        as ``try_release`` does it (``Later`` when that writes a durable object back)."""
        with self.cv:
            info = self.leases.get(lid)
            if info is None or info.owner != owner:
                raise NotFound(f"no lease {lid} held by this connection")
        if info.sourced:
            return self.try_release(lid, owner=owner)
        self.give_back_lease(info)
        return None

    def release(self, lid: int, *, owner: Any = LOCAL) -> None:
        """End a lease. After ``rw`` the object is dirty; a durable one is written back first."""
        drop = self._check_in(lid, owner)
        if drop is not None:
            self.placement.discard(drop)  # a replaced object's last check-out ended: it goes now

    def try_release(self, lid: int, *, owner: Any) -> Later | None:
        """``release`` for a caller that must not wait: the check-in of a durable object's
        write lease (its write-back syncs) is ``Later``; any other is done now, and a durable
        object it lets go (its free journals and syncs) is discarded on the discard thread."""
        drop = self._check_in(lid, owner, now=True)
        if drop is None:
            return None
        if drop is _WRITES_BACK:
            return Later(lambda: self.release(lid, owner=owner))
        self._discard_soon(drop)
        return None

    def writes_back_any(self, lids: list[int], owner: Any) -> bool:
        """Whether checking in any of ``owner``'s leases ``lids`` writes a durable object
        back (syncs)."""
        with self.cv:
            for lid in lids:
                info = self.leases.get(lid)
                if info is not None and info.owner == owner and _writes_back(info):
                    return True
        return False

    def check_in_now(self, lid: int, owner: Any) -> None:
        """(the caller knows it writes nothing back: ``writes_back_any``) ``try_release``'s check-in."""
        self._discard_soon(self._check_in(lid, owner))

    def _discard_soon(self, drop: ObjectMeta | None) -> None:
        if drop is not None:
            if drop.durable:
                self.placement.discard_later(drop)
            else:
                self.placement.discard(drop)

    def _check_in(self, lid: int, owner: Any, *, now: bool = False) -> Any:
        """End lease ``lid`` (a durable object written through it is written back and
        journaled first); the object to discard now, if this was a replaced object's last
        check-out. ``now``: a check-in that would write back is left undone, and
        ``_WRITES_BACK`` returned instead."""
        with self.cv:
            info = self.leases.get(lid)
            if info is None or info.owner != owner:
                raise NotFound(f"no lease {lid} held by this connection")
            if now and _writes_back(info):
                return _WRITES_BACK
            meta = self.index.holder(info.oid)
            del self.leases[lid]
            if meta is None:
                return None
            written = False  # a check-in of new bytes: they become the object's (below)
            if info.mode == "r":
                meta.readers -= 1
                self.placement.demote_if_home_nvme(meta)
                self.cv.notify_all()
                drop = self.index.droppable(meta)
            elif meta.freeing:
                # replaced while checked out: what was written is discarded with the object
                meta.writer = False
                self.cv.notify_all()
                drop = self.index.droppable(meta)
            else:
                meta.nvme_valid = False
                stale = meta.nvme
                meta.nvme, meta.crcs = None, None
                if meta.durable:
                    meta.moving = True  # write-back below; holds off other movers, keeps the writer flag
                else:
                    meta.writer = False
                    self.cv.notify_all()
                drop, written = False, True
        if written:
            if meta.durable:
                failed = True
                try:
                    # durable: the new bytes reach NVMe and the journal before the check-in returns
                    self.placement.write_down(meta, sync=True)
                    self.durability.record_write_back(meta)
                    failed = False
                except BaseException:
                    with self.cv:
                        if meta.nvme is None and stale:
                            # the write failed: the old copy stays the journal's (and is freed with
                            # the object or at its next write-down), the new bytes dirty in host
                            meta.nvme, stale = stale, None
                    raise
                finally:
                    with self.cv:
                        meta.moving = False
                        meta.writer = False
                        self.cv.notify_all()
                        replaced = failed and self.index.droppable(meta)
                    if replaced:  # (the write-back failed, and a put replaced the object meanwhile)
                        self._discard_soon(meta)
            if stale:
                self.placement.nvme_free(stale)  # (durable) only after the journal names the new copy
            with self.cv:
                if meta.durable:
                    self.durability.log_host(meta)  # the block is its bytes again: a restart may adopt it
                self.placement.demote_if_home_nvme(meta)
                # replaced while its write-back ran (the replacing put left it to this check-in)
                drop = self.index.droppable(meta)
        return meta if drop else None

    def revoke(self, lid: int, *, owner: Any) -> bool:
        """End a lease whose holder stopped answering (``lease_timeout_s``). It ends as a
        check-in (a writer's bytes so far become the object's, as when its connection
        dies), but the holder still maps the lease's memory and may write into it later:
        that block is fenced for ``owner`` (not handed out again until its connection
        ends), and a written object is first copied to a block the holder does not map.
        False if there is no such lease."""
        with self.cv:
            info = self.leases.get(lid)
            if info is None or info.owner != owner or info.revoked:
                return False
            info.revoked = True
            meta = self.index.holder(info.oid)
            if owner is not LOCAL:  # in-process, the holder is this process: nothing to fence
                self.placement.fence(owner, info.host_off, info.gpu_loc, info.spec.nbytes)
            self.counters["leases_revoked"] += 1
            move = owner is not LOCAL and info.mode != "r" and meta is not None and not meta.freeing \
                and meta.nbytes > 0
        if move:
            def moved(host_off: int | None, gpu_loc: Any) -> None:
                info.host_off, info.gpu_loc = host_off, gpu_loc

            self.placement.move_off(meta, lid, info.host_off, info.gpu_loc, lambda: self.leases.get(lid) is info,
                                    moved)
        try:
            self.release(lid, owner=owner)
        except NotFound:
            pass  # its connection ended meanwhile
        return True

    def drop_owner(self, owner: Any) -> int:
        """End every lease of ``owner`` (a connection that went away) as check-ins; the
        prefetcher forgets it. Returns how many."""
        with self.cv:
            # (a connection's clean-up may run on two threads at once: each lease is ended by one)
            lids = [lid for lid in self.leases.of(owner) if lid not in self._dropping]
            self._dropping.update(lids)
            if owner is not LOCAL:
                self.prefetcher.drop_owner(owner)
        try:
            for lid in lids:
                try:
                    self.release(lid, owner=owner)
                except TierstoreError as e:
                    log.error("releasing lease %d of a closed connection failed: %s", lid, e)
        finally:
            with self.cv:
                self._dropping.difference_update(lids)
        return len(lids)

    def expire(self, max_age_s: float) -> int:
        """Revoke leases older than ``max_age_s`` (a client that stopped answering); see
        ``revoke``: the memory a revoked holder maps is not reused while it is connected."""
        now = time.monotonic()
        with self.cv:
            old = [(i.lid, i.owner) for i in self.leases.values() if now - i.since > max_age_s and not i.revoked]
        for lid, owner in old:
            log.warning("revoking lease %d held for more than %.0f s", lid, max_age_s)
            try:
                self.revoke(lid, owner=owner)
            except TierstoreError as e:
                log.error("revoking lease %d failed: %s", lid, e)
        return len(old)


def check_mode(mode: str) -> None:
    """``InvalidArgument`` unless ``mode`` is a check-out's mode."""
    if mode not in ("r", "rw", "w"):
        raise InvalidArgument(f"mode must be 'r', 'rw' or 'w', got {mode!r}")


def _lease_ok(meta: ObjectMeta, mode: str) -> bool:
    """(under cv) Whether a lease in ``mode`` may be taken on ``meta`` now."""
    if mode == "r":
        return not meta.writer
    return not meta.writer and meta.readers == 0 and meta.pins == 0


def _writes_back(info: LeaseInfo) -> bool:
    """Whether checking in this lease writes a durable object back (syncs): a write lease
    on a durable object."""
    return info.mode != "r" and info.durable


def _itself(owner: Any) -> Any:
    return owner
