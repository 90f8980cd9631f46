"""Batch check-outs and check-ins over the lease table.

``LeaseBatches`` takes several leases in one call: all of a batch or none
(``acquire_many``), or a list of independent check-outs (``acquire_each``), and checks
several in (``release_many``). It owns no state: it is given the lease table (every
lease is taken and ended there), the object index and placement (a batch that could
never fit in the host tier is refused before anything is taken).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from .batch import check_each
from .errors import CapacityExceeded, InvalidArgument, NotFound, TierstoreError
from .index import Handle
from .leases import LOCAL, MAX_BATCH, LeaseInfo, LeaseTable
from .placement import Placement
from .objectindex import ObjectIndex
from .units import PAGE, align_up
from .waits import WouldBlock

__all__ = ["LeaseBatches"]

log = logging.getLogger(__name__)


class LeaseBatches:
    """Several check-outs or check-ins in one call; see the module docstring."""

    def __init__(self, leases: LeaseTable, index: ObjectIndex, placement: Placement) -> None:
        self.leases, self.index, self.placement = leases, index, placement
        self.cv = index.cv

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
            self._check_batch(hs, modes, self.index.ns(namespace))
        deadline = time.monotonic() + (self.leases.lease_wait_s if timeout_s is None else timeout_s)
        i = len(done)
        try:
            while i < len(hs):
                done.append(self.leases.acquire(hs[i], modes[i], owner=owner, namespace=namespace, nowait=nowait,
                                         timeout_s=max(0.0, deadline - time.monotonic()), stream=stream,
                                         undoable=True))
                i += 1
        except WouldBlock:
            raise
        except BaseException as e:
            for info in reversed(done):
                self.leases.undo(info)
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
        ns = self.index.ns(namespace)
        if not done:
            check_each(requests)
            with self.cv:
                total = sum(align_up(max(self.index.get_meta(h, ns).nbytes, 1), PAGE)
                            for h in {Handle.parse(r[0]) for r in requests})
            usable = self.placement.host_usable()
            if total > usable:  # they could never all be checked out at once: the caller would wait on itself
                raise CapacityExceeded(f"the {len(requests)} check-outs need {total} bytes at once: the host tier "
                                       f"holds {usable} usable bytes; check out fewer objects at a time")
        deadline = time.monotonic() + (self.leases.lease_wait_s if timeout_s is None else timeout_s)
        i = len(done)
        try:
            while i < len(requests):
                h, mode, source = requests[i]
                left = max(0.0, deadline - time.monotonic())
                if source is None:
                    info = self.leases.acquire(h, mode, owner=owner, namespace=ns, nowait=nowait, timeout_s=left,
                                        stream=stream, undoable=True)
                else:
                    info = self.leases.acquire_from(h, source, owner=owner, namespace=ns, nowait=nowait, timeout_s=left,
                                             stream=stream)
                done.append(info)
                i += 1
        except WouldBlock:
            raise
        except BaseException as e:
            for info in reversed(done):  # never used: as if not taken (a sourced one keeps the source's bytes)
                try:
                    self.leases.give_back(info.lid, owner=owner)
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
        with self.cv:
            for h, m in zip(hs, modes):
                prev = seen.get(h.id)
                if prev is not None and (m != "r" or prev != "r"):
                    raise InvalidArgument(f"object {h} is in the batch twice, once to write: a write lease "
                                          "excludes every other lease, so the batch would wait on itself")
                seen[h.id] = m
                if prev is None:
                    total += align_up(max(self.index.get_meta(h, ns).nbytes, 1), PAGE)
        usable = self.placement.host_usable()
        if total > usable:
            raise CapacityExceeded(f"the batch's {total} bytes cannot all be checked out at once: the host tier "
                                   f"holds {usable} usable bytes; check out fewer objects at a time")

    def release_many(self, lids: list[int], *, owner: Any = LOCAL, nowait: bool = False) -> None:
        """End several leases (``release`` each). Every lease named is ended even if some
        are unknown or one's check-in fails; the first failure, or else the unknown ones
        (``NotFound``), is raised after the others are in."""
        if not 1 <= len(lids) <= MAX_BATCH:
            raise InvalidArgument(f"a batch check-in takes 1 to {MAX_BATCH} leases, got {len(lids)}")
        if nowait:
            with self.cv:
                for lid in lids:
                    info = self.leases.leases.get(lid)
                    meta = self.index.objects.get(info.oid) if info is not None else None
                    if info is not None and info.owner == owner and info.mode != "r" and meta is not None \
                            and meta.durable:
                        raise WouldBlock()  # a durable write-back syncs: the whole batch off the event loop
        unknown, failed = [], None
        for lid in lids:
            try:
                self.leases.release(lid, owner=owner, nowait=nowait)
            except NotFound:
                unknown.append(lid)
            except TierstoreError as e:  # e.g. a durable write-back that failed: the others still go in
                failed = failed or e
        if failed is not None:
            raise failed
        if unknown:
            raise NotFound(f"no lease {', '.join(map(str, unknown[:8]))}{' ...' if len(unknown) > 8 else ''} "
                           "held by this connection; the others were checked in")
