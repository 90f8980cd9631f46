"""Leases and namespace ownership: the store's bookkeeping of who holds what, and
what goes when a holder goes. Part of ``Store`` (a mixin); puts are reserved and
committed in ``puts``, bytes move in ``movement``, state is recovered in ``recovery``.

Length: one concept (who holds what, and the waits for it) whose acquire, release,
revoke and wait paths share their checks; splitting waits from leases would put one
lock's invariants in two files. The component split is planned in docs/architecture.md.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from .batch import check_each
from .gpu import loc_device
from .errors import Busy, CapacityExceeded, Closed, InvalidArgument, NotFound, PermissionDenied, TierstoreError
from .index import Handle, ObjectMeta, validate_namespace
from .tensors import TensorSpec
from .units import PAGE, align_up

__all__ = ["Leasing", "WouldBlock", "WouldWait", "wait_context", "Reservation", "LeaseInfo", "LOCAL"]

log = logging.getLogger(__name__)

LOCAL = "local"  # owner of leases taken through the in-process API


class WouldBlock(Exception):
    """Internal: a ``nowait=True`` call would have to wait or touch the disk.

    The daemon's event loop calls the store with ``nowait=True`` and, on this,
    hands the request to a worker thread instead; it never reaches a client.
    """


class WouldWait(WouldBlock):
    """Internal: a call made under ``wait_context(park=True)`` would wait for another
    holder to let go (a lease, host room, an object in flight). Nothing was taken or
    changed (but what a batch had taken: its ``progress``); the daemon's op worker hands
    the request to a wait thread and goes on with the next."""


@dataclass(slots=True)
class WaitContext:
    """How the calls of one daemon request wait (``wait_context``)."""

    park: bool
    abandoned: Callable[[], bool] | None


_waiting = threading.local()


@contextmanager
def wait_context(*, park: bool, abandoned: Callable[[], bool] | None = None) -> Iterator[WaitContext]:
    """(the daemon) The store calls this thread makes inside wait this way: ``park``: a
    wait for another holder raises ``WouldWait`` instead (the thread is one other
    requests need; the request runs again on a thread that may wait, its timeouts
    counted from then); ``abandoned``: polled while waiting — once true (the requester
    went away) the wait ends in ``Closed``."""
    prev = getattr(_waiting, "ctx", None)
    ctx = _waiting.ctx = WaitContext(park, abandoned)
    try:
        yield ctx
    finally:
        _waiting.ctx = prev


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
    """Set for a lease on a GPU-tier object (``acquire(device=True)``): the bytes are there."""
    durable: bool = False
    blank: bool = False
    """A ``w`` lease given host memory without a read: until check-in, the host bytes are
    not the object's (its NVMe copy still is)."""
    revoked: bool = False
    """Being revoked (``revoke``): a second revocation leaves it alone."""
    sourced: bool = False
    """A ``w`` lease from a source (``acquire_from``): its bytes are the source's, not the
    object's own, so giving it back unwritten still changes the object (``give_back``)."""


MAX_BATCH = 4096
"""Most objects one ``acquire_many`` / ``release_many`` takes."""


class Leasing:
    """Store methods for leases and namespaces (mixed into ``Store``)."""

    _waits_cancelled = False

    # ------------------------------------------------------------ waiting
    def _wait_for_others(self, remaining: float) -> None:
        """(under _cv, ``remaining`` > 0) Wait for another holder to let go: a lease, host
        room, an object in flight. On a daemon op worker, ``WouldWait`` instead; once the
        daemon is stopping (``cancel_waits``) or the requester is gone, ``Closed``."""
        ctx = getattr(_waiting, "ctx", None)
        if ctx is not None:
            if ctx.park:
                raise WouldWait()
            if ctx.abandoned is not None and ctx.abandoned():
                raise Closed("the connection that asked went away")
        if self._waits_cancelled:
            raise Closed("the daemon is stopping; reconnect once it is back")
        # a notify_all wakes it at any change; the 1 s cap re-checks the requester and the
        # stop flag
        self._cv.wait(min(remaining, 1.0))

    def cancel_waits(self) -> None:
        """End every wait for another holder now and from now on with ``Closed`` (the
        daemon is stopping: SIGTERM must not wait out anyone's ``timeout_s``)."""
        with self._cv:
            self._waits_cancelled = True
            self._cv.notify_all()

    # ------------------------------------------------------------ leases
    def acquire(self, handle: Handle | int | str, mode: str, *, owner: Any, namespace: str | None = None,
                timeout_s: float | None = None, nowait: bool = False, stream: str = "default",
                device: bool = False, undoable: bool = False) -> LeaseInfo:
        """Lease an object in the host tier (promoting it first if needed).

        ``device=True`` (a CUDA caller): an object in the GPU tier is leased where it is
        (``LeaseInfo.gpu_loc``); otherwise, and for every other object, the host tier.

        ``mode``: ``"r"`` shared, ``"rw"`` exclusive, ``"w"`` exclusive for a caller that
        overwrites every byte (an NVMe-only object is given host memory without being
        read; its previous bytes are not visible through the lease).

        ``undoable``: the lease may be taken back by ``_undo_lease`` (a failed batch), so a
        ``w`` lease never discards the only other copy: a GPU-tier object is read up.
        """
        if mode not in ("r", "rw", "w"):
            raise InvalidArgument(f"mode must be 'r', 'rw' or 'w', got {mode!r}")
        h = Handle.parse(handle)
        ns = self._ns(namespace)
        t0 = time.monotonic()
        deadline = t0 + (self.config.lease_wait_s if timeout_s is None else timeout_s)
        late = promoted = blank = False
        while True:
            with self._cv:
                meta = self._get_meta(h, ns)
                on_gpu = device and meta.gpu_loc is not None
                if (meta.host_valid or on_gpu) and not meta.moving and self._lease_ok(meta, mode):
                    if mode != "w":  # a blind overwrite is no read: nothing to learn or count
                        self._record(owner, stream, meta, not promoted, late, t0, locked=True)
                    if mode == "r":
                        meta.readers += 1
                    else:
                        meta.writer = True
                        if meta.durable:  # its block stops being its durable bytes until the check-in
                            self._log_drop(meta)
                    self.counters["checkouts"] += 1
                    if on_gpu:
                        self._gpu_lru.pop(meta.id, None)
                        self._gpu_lru[meta.id] = None
                        self.counters["gpu_hits"] += 1
                    else:
                        self.policy.touch(meta.id)
                        self.counters["host_hits"] += 1
                    lid = next(self._ids) + (1 << 40)
                    info = LeaseInfo(lid, owner, meta.id, meta.gen, mode, meta.host_off or 0, meta.spec,
                                     time.monotonic(), meta.gpu_loc if on_gpu else None, meta.durable, blank)
                    self._leases[lid] = info
                    return info
                if nowait:
                    raise WouldBlock()
                late = late or meta.prefetching
                if not meta.host_valid and not meta.moving:
                    meta.moving = True
                    promote = True
                else:
                    promote = False
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise Busy(f"object {h} is leased in a conflicting mode (readers={meta.readers}, "
                                   f"writer={meta.writer}); check it in elsewhere or wait longer")
                    self._wait_for_others(remaining)
                    continue
            if promote:
                read = mode != "w" or (undoable and meta.gpu_loc is not None)
                promoted, blank = mode != "w", not read
                self.counters["nvme_reads"] += promoted and meta.gpu_loc is None
                self._promote(meta, wait_s=max(0.0, deadline - time.monotonic()), read=read)

    def acquire_from(self, handle: Handle | int | str, source: Handle | int | str, *, owner: Any,
                     namespace: str | None = None, timeout_s: float | None = None, nowait: bool = False,
                     stream: str = "default") -> LeaseInfo:
        """A ``w`` lease on ``handle`` whose host bytes start as ``source``'s (same size, same
        namespace): a read-modify-write into another object, as a double-buffered update
        makes, without the caller copying. ``source`` is read as by an ``r`` check-out (its
        access recorded for the prefetcher) and stays unchanged. When its host block holds
        the only host copy, nobody else uses it and its NVMe copy is current, the block is
        handed over to ``handle`` (no copy; ``source`` is left on NVMe); otherwise the
        bytes are copied into ``handle``'s own block.

        ``nowait``: only a hand-over of a resident ``source`` is done; anything else is
        ``WouldBlock`` with nothing taken or recorded (the daemon's worker does it).
        """
        dst_h, src_h = Handle.parse(handle), Handle.parse(source)
        ns = self._ns(namespace)
        t0 = time.monotonic()
        with self._cv:
            dst, src = self._get_meta(dst_h, ns), self._get_meta(src_h, ns)
            if dst.id == src.id:
                raise InvalidArgument(f"object {dst_h} cannot be its own source")
            if dst.nbytes != src.nbytes:
                raise InvalidArgument(f"source {src_h} holds {src.nbytes} bytes, object {dst_h} {dst.nbytes}: "
                                      "a check-out from a source needs two objects of the same size")
            if src.host_valid and self._can_hand_over(src, dst, readers=0) and not dst.moving \
                    and self._lease_ok(dst, "w"):
                self._record(owner, stream, src, True, False, t0, locked=True)  # resident: a hit
                self.counters["host_hits"] += 1
                return self._hand_over(None, src, dst, owner)
        if nowait:
            raise WouldBlock()  # a read, a wait or a copy of the bytes: not on the event loop
        deadline = t0 + (self.config.lease_wait_s if timeout_s is None else timeout_s)
        rd: LeaseInfo | None = self.acquire(src_h, "r", owner=owner, namespace=ns, timeout_s=timeout_s,
                                            stream=stream)
        try:
            with self._cv:
                while True:
                    dst = self._get_meta(dst_h, ns)
                    src = self._objects[rd.oid]
                    if not self._can_hand_over(src, dst, readers=1):
                        break
                    if not dst.moving and self._lease_ok(dst, "w"):
                        info = self._hand_over(rd, src, dst, owner)
                        rd = None
                        return info
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break  # the copy below waits (or says Busy) as a plain check-out does
                    self._wait_for_others(remaining)
            info = self.acquire(dst_h, "w", owner=owner, namespace=ns,
                                timeout_s=max(0.0, deadline - time.monotonic()), stream=stream)
            try:
                n = src.nbytes
                if n:
                    self.arena.view(info.host_off, n)[:] = self.arena.view(rd.host_off, n)
            except BaseException:
                self.release(info.lid, owner=owner)
                raise
            with self._cv:
                self.counters["source_copies"] += 1
                info.sourced = True
            return info
        finally:
            if rd is not None:
                self.release(rd.lid, owner=owner)

    @staticmethod
    def _can_hand_over(src: ObjectMeta, dst: ObjectMeta, readers: int) -> bool:
        """(under _cv) Whether ``src``'s host block (read by ``readers`` leases, the caller's)
        may become ``dst``'s: ``src`` keeps a current NVMe copy and neither object is in
        another tier (``dst`` may still have to be waited for: moving, or leased)."""
        return (src.readers == readers and not src.writer and not src.moving and src.pins == 0
                and not src.freeing and src.nvme_valid and src.host_off is not None and src.gpu_loc is None
                and dst.gpu_loc is None and not dst.freeing and src.nbytes > 0)

    def _hand_over(self, rd: LeaseInfo | None, src: ObjectMeta, dst: ObjectMeta, owner: Any) -> LeaseInfo:
        """(under _cv) End the caller's read lease ``rd`` on ``src`` (if any) and give ``src``'s
        host block to ``dst`` under a new ``w`` lease. ``src`` is left with its NVMe copy."""
        if rd is not None:
            del self._leases[rd.lid]
            src.readers -= 1
        off = src.host_off
        self.policy.remove(src.id)
        self._log_drop(src)
        src.host_off, src.host_valid = None, False
        self.prefetcher.demoted(src.id)
        if dst.host_valid and dst.host_off is not None:  # overwritten whole by the lease: its block goes
            self.policy.remove(dst.id)
            self._log_drop(dst)
            self.host.free(dst.host_off, dst.nbytes)
            self.prefetcher.demoted(dst.id)
        dst.host_off, dst.host_valid = off, True
        dst.writer = True
        self._log_host(dst)  # (a durable one's is not: the block is not its bytes until the check-in)
        self.policy.insert(dst.id)
        self.counters["checkouts"] += 1
        self.counters["source_handovers"] += 1
        lid = next(self._ids) + (1 << 40)
        info = LeaseInfo(lid, owner, dst.id, dst.gen, "w", off, dst.spec, time.monotonic(), None, dst.durable,
                         sourced=True)
        self._leases[lid] = info
        self._cv.notify_all()
        return info

    def acquire_many(self, handles: list[Handle | int | str], modes: list[str], *, owner: Any,
                     namespace: str | None = None, timeout_s: float | None = None, nowait: bool = False,
                     stream: str = "default", progress: list[LeaseInfo] | None = None) -> list[LeaseInfo]:
        """Lease several objects at once, in order (accesses recorded in that order): all of
        them, or, on any error, none (those already leased are given back unchanged and the
        error names the object that failed). ``timeout_s`` bounds the whole batch.

        ``progress`` (a list the caller keeps): the leases taken so far. With ``nowait``, a
        ``WouldBlock`` leaves them there and a second call with the same list, without
        ``nowait``, goes on from where the first stopped (the daemon's event loop takes
        what is resident, its thread pool the rest).
        """
        if not 1 <= len(handles) <= MAX_BATCH:
            raise InvalidArgument(f"a batch check-out takes 1 to {MAX_BATCH} objects, got {len(handles)}")
        if len(modes) != len(handles):
            raise InvalidArgument(f"{len(modes)} modes for {len(handles)} objects")
        for m in modes:
            if m not in ("r", "rw", "w"):
                raise InvalidArgument(f"mode must be 'r', 'rw' or 'w', got {m!r}")
        hs = [Handle.parse(h) for h in handles]
        done = progress if progress is not None else []
        if not done:
            self._check_batch(hs, modes, self._ns(namespace))
        deadline = time.monotonic() + (self.config.lease_wait_s if timeout_s is None else timeout_s)
        i = len(done)
        try:
            while i < len(hs):
                done.append(self.acquire(hs[i], modes[i], owner=owner, namespace=namespace, nowait=nowait,
                                         timeout_s=max(0.0, deadline - time.monotonic()), stream=stream,
                                         undoable=True))
                i += 1
        except WouldBlock:
            raise
        except BaseException as e:
            for info in reversed(done):
                self._undo_lease(info)
            done.clear()
            if isinstance(e, TierstoreError):
                raise type(e)(f"object #{i} of the batch ({hs[i]}): {e.message}; no object was checked out") \
                    from None
            raise
        return list(done)

    def acquire_each(self, requests: list[tuple[Any, str, Any]], *, owner: Any, namespace: str | None = None,
                     timeout_s: float | None = None, nowait: bool = False, stream: str = "default",
                     progress: list[LeaseInfo] | None = None) -> list[LeaseInfo]:
        """Several independent check-outs, ``(handle, mode, source)`` each (``source`` None
        for none; with one, an ``acquire_from``), taken in order (accesses recorded in that
        order). Unlike ``acquire_many`` each stands alone: a check-out from a source may
        hand a block over, which cannot be undone. If one fails, those taken are given back
        unused (``give_back``) and its error is raised. ``timeout_s`` bounds the whole list.

        ``progress``: as for ``acquire_many`` (the event loop takes what needs no wait, a
        worker the rest, from where the first call stopped)."""
        done = progress if progress is not None else []
        ns = self._ns(namespace)
        if not done:
            check_each(requests)
            with self._cv:
                total = sum(align_up(max(self._get_meta(h, ns).nbytes, 1), PAGE)
                            for h in {Handle.parse(r[0]) for r in requests})
            usable = self._host_usable()
            if total > usable:  # they could never all be checked out at once: the caller would wait on itself
                raise CapacityExceeded(f"the {len(requests)} check-outs need {total} bytes at once: the host tier "
                                       f"holds {usable} usable bytes; check out fewer objects at a time")
        deadline = time.monotonic() + (self.config.lease_wait_s if timeout_s is None else timeout_s)
        i = len(done)
        try:
            while i < len(requests):
                h, mode, source = requests[i]
                left = max(0.0, deadline - time.monotonic())
                if source is None:
                    info = self.acquire(h, mode, owner=owner, namespace=ns, nowait=nowait, timeout_s=left,
                                        stream=stream, undoable=True)
                else:
                    info = self.acquire_from(h, source, owner=owner, namespace=ns, nowait=nowait, timeout_s=left,
                                             stream=stream)
                done.append(info)
                i += 1
        except WouldBlock:
            raise
        except BaseException as e:
            for info in reversed(done):  # never used: as if not taken (a sourced one keeps the source's bytes)
                try:
                    self.give_back(info.lid, owner=owner)
                except TierstoreError as e2:
                    log.warning("giving back check-out %d after another failed: %s", info.lid, e2)
            done.clear()
            if isinstance(e, TierstoreError):
                raise type(e)(f"check-out #{i} of the list ({requests[i][0]}): {e.message}; the others were given "
                              "back") from None
            raise
        return list(done)

    def _check_batch(self, hs: list[Handle], modes: list[str], ns: str) -> None:
        """A batch that could only wait on itself is refused before anything is leased: an
        object twice with a write mode, or more bytes than the host tier can ever hold."""
        seen: dict[int, str] = {}
        total = 0
        with self._cv:
            for h, m in zip(hs, modes):
                prev = seen.get(h.id)
                if prev is not None and (m != "r" or prev != "r"):
                    raise InvalidArgument(f"object {h} is in the batch twice, once to write: a write lease "
                                          "excludes every other lease, so the batch would wait on itself")
                seen[h.id] = m
                if prev is None:
                    total += align_up(max(self._get_meta(h, ns).nbytes, 1), PAGE)
        usable = self._host_usable()
        if total > usable:
            raise CapacityExceeded(f"the batch's {total} bytes cannot all be checked out at once: the host tier "
                                   f"holds {usable} usable bytes; check out fewer objects at a time")

    def _undo_lease(self, info: LeaseInfo) -> None:
        """Give back a lease of a failed batch as if it had never been taken: nothing is
        marked dirty, and a blank ``w`` lease's host block is dropped (the object's bytes
        are still its NVMe copy)."""
        with self._cv:
            if self._leases.pop(info.lid, None) is None:
                return
            meta = self._objects.get(info.oid)
            if meta is None:
                return
            if info.mode == "r":
                meta.readers -= 1
            else:
                meta.writer = False
            if info.blank and meta.host_valid and meta.nvme_valid and meta.host_off is not None \
                    and not meta.moving and not meta.readers:
                self.policy.remove(meta.id)
                self._log_drop(meta)
                self.host.free(meta.host_off, meta.nbytes)
                meta.host_off, meta.host_valid = None, False
                self.prefetcher.demoted(meta.id)
            else:
                if info.mode != "r" and meta.durable and not info.blank:
                    self._log_host(meta)  # nothing was written: the block is still its bytes
                self._spill_if_home_nvme(meta)
            self._cv.notify_all()
            drop = self._drop_if_released(meta)
        if drop:
            self._pool.submit(self._drop, meta)  # a durable drop journals (syncs): off the caller's path

    def give_back(self, lid: int, *, owner: Any = LOCAL) -> None:
        """End a lease its holder never wrote through (a check-out it could not use): as if
        it had never been taken — nothing dirtied, a blank ``w`` lease's block dropped (the
        object keeps its NVMe copy). A lease from a source is checked in instead: its bytes
        are the source's, which the object's own block may already have taken."""
        with self._cv:
            info = self._leases.get(lid)
            if info is None or info.owner != owner:
                raise NotFound(f"no lease {lid} held by this connection")
        if info.sourced:
            self.release(lid, owner=owner)
        else:
            self._undo_lease(info)

    def release(self, lid: int, *, owner: Any = LOCAL, nowait: bool = False) -> None:
        """End a lease. After ``rw`` the object is dirty; a durable one is written back first."""
        with self._cv:
            info = self._leases.get(lid)
            if info is None or info.owner != owner:
                raise NotFound(f"no lease {lid} held by this connection")
            meta = self._objects.get(info.oid)
            if nowait and info.mode != "r" and meta is not None and meta.durable:
                raise WouldBlock()  # the write-back below syncs: not on the event loop
            del self._leases[lid]
            if meta is None:
                return
            written = False  # a check-in of new bytes: they become the object's (below)
            if info.mode == "r":
                meta.readers -= 1
                self._spill_if_home_nvme(meta)
                self._cv.notify_all()
                drop = self._drop_if_released(meta)
            elif meta.freeing:
                # replaced while checked out: what was written is discarded with the object
                meta.writer = False
                self._cv.notify_all()
                drop = self._drop_if_released(meta)
            else:
                meta.version += 1
                meta.nvme_valid = False
                stale = meta.nvme
                meta.nvme, meta.crcs = None, None
                if meta.durable:
                    meta.moving = True  # write-back below; holds off other movers, keeps the writer flag
                else:
                    meta.writer = False
                    self._cv.notify_all()
                drop, written = False, True
        if written:
            if meta.durable:
                try:
                    # durable: the new bytes reach NVMe and the journal before the check-in returns
                    self._write_down(meta, sync=True)
                    with self.journal.lock:
                        self._journal_put(meta)
                except BaseException:
                    with self._cv:
                        if meta.nvme is None and stale:
                            # the write failed: the old copy stays the journal's (and is freed with
                            # the object or at its next write-down), the new bytes dirty in host
                            meta.nvme, stale = stale, None
                    raise
                finally:
                    with self._cv:
                        meta.moving = False
                        meta.writer = False
                        self._cv.notify_all()
            if stale:
                self.nvme.free(stale)  # (durable) only after the journal names the new copy
            with self._cv:
                if meta.durable:
                    self._log_host(meta)  # the block is its bytes again: a restart may adopt it
                self._spill_if_home_nvme(meta)
        if drop:
            # a replaced object's last check-out ended: it goes now (a durable one journals
            # its free, which syncs: off the event loop)
            if nowait and meta.durable:
                self._pool.submit(self._drop, meta)
            else:
                self._drop(meta)

    def _spill_if_home_nvme(self, meta: ObjectMeta) -> None:
        """(under _cv) An object that lives on NVMe goes back down once nobody uses it."""
        if meta.home == "nvme" and meta.readers == 0 and not meta.writer and meta.host_valid and not meta.freeing:
            self._spill.append(meta.id)
            self._demoter_wake.set()

    def release_many(self, lids: list[int], *, owner: Any = LOCAL, nowait: bool = False) -> None:
        """End several leases (``release`` each). Every lease named is ended even if some
        are unknown or one's check-in fails; the first failure, or else the unknown ones
        (``NotFound``), is raised after the others are in."""
        if not 1 <= len(lids) <= MAX_BATCH:
            raise InvalidArgument(f"a batch check-in takes 1 to {MAX_BATCH} leases, got {len(lids)}")
        if nowait:
            with self._cv:
                for lid in lids:
                    info = self._leases.get(lid)
                    meta = self._objects.get(info.oid) if info is not None else None
                    if info is not None and info.owner == owner and info.mode != "r" and meta is not None \
                            and meta.durable:
                        raise WouldBlock()  # a durable write-back syncs: the whole batch off the event loop
        unknown, failed = [], None
        for lid in lids:
            try:
                self.release(lid, owner=owner, nowait=nowait)
            except NotFound:
                unknown.append(lid)
            except TierstoreError as e:  # e.g. a durable write-back that failed: the others still go in
                failed = failed or e
        if failed is not None:
            raise failed
        if unknown:
            raise NotFound(f"no lease {', '.join(map(str, unknown[:8]))}{' ...' if len(unknown) > 8 else ''} "
                           "held by this connection; the others were checked in")

    def revoke(self, lid: int, *, owner: Any) -> bool:
        """End a lease whose holder stopped answering (``lease_timeout_s``). It ends as a
        check-in (a writer's bytes so far become the object's, as when its connection
        dies), but the holder still maps the lease's memory and may write into it later:
        that block is fenced for ``owner`` (not handed out again until its connection
        ends), and a written object is first copied to a block the holder does not map.
        False if there is no such lease."""
        with self._cv:
            info = self._leases.get(lid)
            if info is None or info.owner != owner or info.revoked:
                return False
            info.revoked = True
            meta = self._objects.get(info.oid)
            if owner is not LOCAL:  # in-process, the holder is this process: nothing to fence
                if info.gpu_loc is not None:
                    self.gpu.fence(owner, info.gpu_loc, info.spec.nbytes)
                elif info.spec.nbytes:
                    self.host.fence(owner, info.host_off, info.spec.nbytes)
            self.counters["leases_revoked"] += 1
            move = owner is not LOCAL and info.mode != "r" and meta is not None and not meta.freeing \
                and meta.nbytes > 0
        if move:
            self._move_off(info, meta)
        try:
            self.release(lid, owner=owner)
        except NotFound:
            pass  # its connection ended meanwhile
        return True

    def _move_off(self, info: LeaseInfo, meta: ObjectMeta) -> None:
        """Copy a revoked write lease's bytes into a new block and make that the object's
        (the lease is exclusive: nobody else touches the object's block meanwhile). Without
        room the object stays where it is, still exposed to the holder: logged."""
        n = meta.nbytes
        if info.gpu_loc is not None:
            device = loc_device(info.gpu_loc)
            with self._cv:
                new = self.gpu.alloc(n, device)
            if new is None:
                log.error("revoked lease %d: no GPU-tier room to move object %d off the holder's block",
                          info.lid, meta.id)
                return
            self.gpu.backend.copy(device, self.gpu.ptr(new), self.gpu.ptr(info.gpu_loc), n)
            with self._cv:
                if self._leases.get(info.lid) is not info or meta.gpu_loc != info.gpu_loc:
                    self.gpu.free(new, n)  # checked in meanwhile: the object is not ours to move
                    return
                old, meta.gpu_loc, info.gpu_loc = info.gpu_loc, new, new
                self.gpu.free(old, n)  # fenced: held back until the holder's connection ends
            return
        try:
            new = self._alloc_host(n, wait_s=self.config.lease_wait_s, evict=True)
        except CapacityExceeded:
            log.error("revoked lease %d: no host room to move object %d off the holder's block; "
                      "it stays there", info.lid, meta.id)
            return
        self.arena.view(new, n)[:] = self.arena.view(info.host_off, n)
        with self._cv:
            if self._leases.get(info.lid) is not info or meta.host_off != info.host_off:
                self.host.free(new, n)  # checked in meanwhile: the object is not ours to move
                self._cv.notify_all()
                return
            old = info.host_off
            meta.host_off = info.host_off = new
            self._log_host(meta)  # (not a durable one's: its check-in below logs it)
            self.host.free(old, n)  # fenced: held back until the holder's connection ends

    def release_owner(self, owner: Any) -> tuple[int, int]:
        """End every lease and reservation of ``owner`` (a connection that went away)."""
        with self._cv:
            lids = [lid for lid, i in self._leases.items() if i.owner == owner]
            rids = [rid for rid, r in self._reservations.items() if r.owner == owner]
            if owner is not LOCAL:
                self.prefetcher.drop_owner(owner)
        for lid in lids:
            try:
                self.release(lid, owner=owner)
            except TierstoreError as e:
                log.error("releasing lease %d of a closed connection failed: %s", lid, e)
        for rid in rids:
            self.abort_put(rid, owner=owner)
        with self._cv:
            area = self._scratch.pop(owner, None)
            if area is not None:
                self.host.free(*area)
                self._cv.notify_all()
            if self.gpu is not None:
                self.gpu.detach(owner)  # its mappings of the slabs died with it
                self.gpu.unfence(owner)
            if self.host.unfence(owner):  # blocks of revoked leases: nobody maps them now
                self._cv.notify_all()
        if owner is not LOCAL:
            self._free_ephemeral(owner)
        return len(lids), len(rids)


    def _free_ephemeral(self, owner: Any) -> None:
        """``owner`` went away: its ephemeral objects go too — now, or at the end of the
        last lease another connection holds on one (its key is unbound at once)."""
        with self._cv:
            mine = [m for m in self._objects.ephemeral_of(owner) if not m.freeing]
            for m in mine:
                m.freeing = True
                if m.key is not None and self._keys.get((m.namespace, m.key)) == m.id:
                    del self._keys[(m.namespace, m.key)]
        for m in mine:
            self._drop_replaced(m)  # waits out copies and moves; a leased one goes at its check-in
        if mine:
            self.counters["frees"] += len(mine)
            log.debug("freed %d ephemeral objects of a closed connection", len(mine))

    def gpu_attach(self, owner: Any) -> list[dict[str, Any]]:
        """``owner`` is about to open the GPU slabs: they stay allocated until it goes
        (``release_owner``). Returns what it needs to open them."""
        if self.gpu is None:
            raise InvalidArgument(f"this store has no GPU tier: {self.gpu_reason}")
        with self._cv:
            self.gpu.attach(owner)
            return self.gpu.export()

    def claim_namespace(self, namespace: str, uid: int) -> None:
        """Bind a namespace to the uid that first uses it (journaled); others are refused."""
        ns = validate_namespace(namespace)
        root = ns.split("/")[0]
        with self.journal.lock:
            with self._cv:
                owner = self._ns_owner.get(root)
                if owner is not None:
                    if owner != uid and uid != 0:
                        raise PermissionDenied(f"namespace {root!r} belongs to uid {owner}; use another namespace")
                    return
            self.journal.append({"op": "ns", "name": root, "uid": uid})
            with self._cv:
                self._ns_owner[root] = uid

    def check_namespace(self, namespace: str, uid: int) -> None:
        """``PermissionDenied`` if another uid owns the namespace (root may enter any)."""
        owner = self.namespace_owner(validate_namespace(namespace))
        if owner is not None and owner != uid and uid != 0:
            raise PermissionDenied(f"namespace {namespace.split('/')[0]!r} belongs to uid {owner}; "
                                   "use another namespace")

    def namespace_owner(self, namespace: str) -> int | None:
        with self._cv:
            return self._ns_owner.get(namespace.split("/")[0])

