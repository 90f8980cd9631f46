"""Two-phase puts and scratch staging: a writer reserves a host block, fills it and
commits it (or aborts); a client's scratch area stages the bytes of one-call puts and
gets. Part of ``Store`` (a mixin); leases are in ``leases``, bytes move in ``movement``."""

from __future__ import annotations

import logging
import time
from typing import Any

from .errors import CapacityExceeded, InvalidArgument, KeyExists, NotFound
from .index import Handle, ObjectMeta
from .leases import LOCAL, Reservation, WouldBlock
from .tensors import TensorSpec
from .units import PAGE, align_up

__all__ = ["Puts"]

log = logging.getLogger(__name__)


class Puts:
    """Store methods for two-phase puts and scratch staging (mixed into ``Store``)."""

    def reserve_put(self, spec: TensorSpec, *, key: str | None, tier: str | None, durable: bool, replace: bool,
                    namespace: str, owner: Any, wait_s: float = 0.0,
                    nowait: bool = False, device: int = 0, ephemeral: bool = False) -> Reservation:
        """Allocate a host block (``tier="gpu"``: a GPU-tier block on ``device``) for a new
        object; the caller fills it, then ``commit_put``. ``ephemeral``: the object is
        freed when ``owner`` goes (``release_owner``)."""
        tier = self._check_tier(tier)
        self._check_ephemeral(ephemeral, durable)
        self._check_fits(spec.nbytes, tier)
        if tier != "gpu":
            usable = self._host_usable()
            if align_up(max(spec.nbytes, 1), PAGE) > usable:
                raise CapacityExceeded(
                    f"{spec.nbytes} bytes exceed the host tier's usable {usable} bytes: a put through the daemon "
                    "stages the whole object in the host tier (the shared arena), whatever its tier; raise "
                    "host_bytes (an in-process Store writes larger objects to NVMe directly)")
        if key is not None:
            with self._cv:
                if (namespace, key) in self._keys and not replace:
                    raise KeyExists(f"key {key!r} already exists in namespace {namespace!r}; "
                                    "pass replace=True to overwrite it or free it first")
        if tier == "gpu":
            res = self._reserve_gpu(spec, key=key, durable=durable, replace=replace, namespace=namespace,
                                    owner=owner, wait_s=wait_s, nowait=nowait, device=device)
            res.meta.ephemeral = owner if ephemeral else None
            return res
        if nowait and spec.nbytes:
            with self._cv:
                off = self._host_take(spec.nbytes)
            if off is None:
                raise WouldBlock()
        else:
            off = self._alloc_host(spec.nbytes, wait_s=wait_s, evict=True) if spec.nbytes else -1
        with self._cv:
            oid = self._new_id()
            meta = ObjectMeta(id=oid, gen=self._epoch, namespace=namespace, key=key, spec=spec,
                              durable=durable, home="nvme" if tier == "nvme" else None,
                              ephemeral=owner if ephemeral else None)
            meta.host_off = None if off < 0 else off
            res = Reservation(rid=oid, owner=owner, host_off=max(off, 0), meta=meta, tier=tier, replace=replace,
                              since=time.monotonic())
            self._reservations[oid] = res
            return res

    def _reserve_gpu(self, spec: TensorSpec, *, key: str | None, durable: bool, replace: bool, namespace: str,
                     owner: Any, wait_s: float, nowait: bool, device: int) -> Reservation:
        if durable:
            raise InvalidArgument("the gpu tier is volatile: put durable objects to 'host' or 'nvme'")
        if nowait:
            with self._cv:
                loc = self.gpu.alloc(spec.nbytes, device)
            if loc is None:
                raise WouldBlock()
        else:
            loc = self._alloc_gpu(spec.nbytes, device, wait_s=wait_s)
        with self._cv:
            oid = self._new_id()
            meta = ObjectMeta(id=oid, gen=self._epoch, namespace=namespace, key=key, spec=spec,
                              durable=False)
            res = Reservation(rid=oid, owner=owner, host_off=0, meta=meta, tier="gpu", replace=replace, gpu_loc=loc,
                              since=time.monotonic())
            self._reservations[oid] = res
            return res

    def commit_put(self, rid: int, *, owner: Any = LOCAL, nowait: bool = False) -> Handle:
        """Second phase: make the reserved object visible (and durable, if asked)."""
        with self._cv:
            res = self._reservations.get(rid)
            if res is None or res.owner != owner:
                raise NotFound(f"no open reservation {rid} for this connection (one left uncommitted for "
                               "reservation_timeout_s is dropped); put the object again")
            meta = res.meta
            if res.committing:
                raise InvalidArgument(f"reservation {rid} is already being committed")
            if nowait and (meta.durable or res.tier == "nvme"):
                raise WouldBlock()
            meta.moving = True  # nobody sees it yet; blocks a concurrent demotion once visible
            # from here the commit owns the reservation: a client that dies now (its
            # connection's cleanup aborts what it left open) cannot pull the block and the
            # extents from under the write-down and publish an object without its bytes
            res.committing = True
        if nowait and not self.journal.lock.acquire(blocking=False):
            with self._cv:
                meta.moving = res.committing = False
            raise WouldBlock()  # a durable op is syncing the journal; do not wait on the event loop
        try:
            if meta.durable or res.tier == "nvme":
                self._write_down(meta, sync=meta.durable)
            # journal lock held across check, append and publish: no other put can bind
            # the same key in between, and compaction sees either both or neither
            with self.journal.lock:
                with self._cv:
                    self._check_key(meta, res.replace)
                if meta.durable:
                    self._journal_put(meta, sync=False)  # made durable by the commit below
                with self._cv:
                    self._reservations.pop(rid, None)
                    old = self._bind(meta)
                    meta.host_valid = res.gpu_loc is None and (meta.host_off is not None or meta.nbytes == 0)
                    if res.gpu_loc is not None:
                        meta.gpu_loc = res.gpu_loc
                        self._gpu_lru[meta.id] = None
                    if res.tier == "nvme" and meta.host_off is not None:
                        self.host.free(meta.host_off, meta.nbytes)
                        meta.host_off, meta.host_valid = None, False
                    if meta.host_valid:
                        self._log_host(meta)
                    self._objects[meta.id] = meta
                    if meta.host_valid and meta.host_off is not None:
                        self.policy.insert(meta.id)
                    meta.moving = False
                    self._cv.notify_all()
        except BaseException:
            self.abort_put(rid, owner=owner, committing=True)
            raise
        finally:
            if nowait:
                self.journal.lock.release()
        if meta.durable:
            # group commit, outside the lock: the record is visible from here, but the put is
            # acknowledged only once an fdatasync that covers it has completed
            self.journal.commit()
        self.counters["puts"] += 1
        self.counters["put_bytes"] += meta.nbytes
        if old is not None:
            if nowait:
                # the replaced object may still be leased, or durable (a journal fsync): its
                # removal must not hold up the daemon's event loop
                self._pool.submit(self._drop_replaced, old)
            else:
                self._drop_replaced(old)
        self._maybe_demote()
        return meta.handle

    def scratch(self, owner: Any, nbytes: int) -> tuple[int, int]:
        """A host block private to ``owner`` (a connection's staging area); (offset, nbytes).

        Small puts through the daemon are copied here by the client and moved into
        place by the daemon in one round trip. Freed by ``release_owner``.
        """
        with self._cv:
            if owner in self._scratch:
                return self._scratch[owner]
            off = self.host.alloc(nbytes)
            if off is None:
                raise CapacityExceeded("host tier full: no room for a staging area; use the two-phase put")
            self._scratch[owner] = (off, nbytes)
            return off, nbytes

    def put_from_scratch(self, owner: Any, src: int, spec: TensorSpec, *, key: str | None, tier: str | None,
                         durable: bool, replace: bool, namespace: str, wait_s: float = 0.0,
                         nowait: bool = False, ephemeral: bool = False) -> Handle:
        """One-round-trip put: the bytes are at ``src`` in ``owner``'s staging area."""
        with self._cv:
            area = self._scratch.get(owner)
        if area is None or src < 0 or src + spec.nbytes > area[1]:
            raise InvalidArgument("staged bytes lie outside this connection's staging area")
        if nowait and (durable or tier == "nvme"):
            raise WouldBlock()
        res = self.reserve_put(spec, key=key, tier=tier, durable=durable, replace=replace, namespace=namespace,
                               owner=owner, wait_s=wait_s, nowait=nowait, ephemeral=ephemeral)
        if spec.nbytes:
            self.arena.view(res.host_off, spec.nbytes)[:] = self.arena.view(area[0] + src, spec.nbytes)
        try:
            return self.commit_put(res.rid, owner=owner, nowait=nowait)
        except WouldBlock:
            self.abort_put(res.rid, owner=owner)
            raise

    def get_to_scratch(self, owner: Any, handle: Handle | int | str, *, namespace: str | None = None,
                       nowait: bool = False, stream: str = "default") -> TensorSpec | None:
        """Copy a small object into ``owner``'s staging area (one round trip, no lease).

        Returns its spec, or None when it does not fit there (use a lease instead).
        """
        with self._cv:
            area = self._scratch.get(owner)
            meta = self._get_meta(Handle.parse(handle), self._ns(namespace))
            if area is None or meta.nbytes > area[1]:
                return None
            if meta.nbytes == 0:
                return meta.spec
            if meta.host_valid and not meta.writer and not meta.moving:
                # small (<= staging size) copy under the lock: cheaper than pinning around it
                self.arena.view(area[0], meta.nbytes)[:] = self.arena.view(meta.host_off, meta.nbytes)
                self.policy.touch(meta.id)
                self._record(owner, stream, meta, True, False, time.monotonic(), locked=True)
                self.counters["gets"] += 1
                self.counters["host_hits"] += 1
                self.counters["get_bytes"] += meta.nbytes
                return meta.spec
            if nowait:
                raise WouldBlock()
        t0 = time.monotonic()
        meta, late = self._pin(handle, namespace)
        try:
            hit = self._read_pinned(meta, self.arena.view(area[0], meta.nbytes))
            self._record(owner, stream, meta, hit, late, t0)
        finally:
            self._unpin(meta)
        return meta.spec

    def abort_put(self, rid: int, *, owner: Any = LOCAL, committing: bool = False) -> None:
        """Drop an open reservation (a commit under way is left to finish, unless it is the
        commit itself that gives up: ``committing=True``)."""
        with self._cv:
            res = self._reservations.get(rid)
            if res is None or res.owner != owner or res.committing != committing:
                return
            del self._reservations[rid]
            meta = res.meta
            if meta.host_off is not None:
                self.host.free(meta.host_off, meta.nbytes)
                meta.host_off = None
            if res.gpu_loc is not None:
                self.gpu.free(res.gpu_loc, meta.nbytes)
            extents, meta.nvme = meta.nvme, None
            self._cv.notify_all()
        if extents:
            self.nvme.free(extents)

    def expire_reservations(self, max_age_s: float) -> int:
        """Drop reservations older than ``max_age_s`` that no commit has taken up (a client
        that reserved and went idle must not pin the tier for its connection's life); their
        memory is reused at once. A late commit gets ``NotFound``. Returns how many."""
        now = time.monotonic()
        with self._cv:
            old = [(r.rid, r.owner, r.meta.nbytes) for r in self._reservations.values()
                   if now - r.since > max_age_s and not r.committing]
        for rid, owner, nbytes in old:
            log.warning("dropping reservation %d (%d bytes) left uncommitted for more than %.0f s", rid, nbytes,
                        max_age_s)
            self.abort_put(rid, owner=owner)
        if old:
            with self._cv:
                self.counters["reservations_expired"] += len(old)
        return len(old)

    @staticmethod
    def _check_ephemeral(ephemeral: bool, durable: bool) -> None:
        if ephemeral and durable:
            raise InvalidArgument("an ephemeral object is freed when its connection ends: it cannot be durable")
