"""Batch check-outs and check-ins over the lease table.

``LeaseBatches`` takes several leases in one call: all of a batch or none
(``checkout_many``), or a list of independent check-outs (``checkout_each``), and checks
several in (``release_many``). It owns no state: it is given the lease table (every
lease is taken and ended there), the object index and placement (a batch that could
never fit in the host tier is refused before anything is taken).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from .batch import check_each
from .errors import CapacityExceeded, InvalidArgument, NotFound, TierstoreError
from .names import Handle
from .leases import LOCAL, MAX_BATCH, LeaseInfo, LeaseTable, check_mode
from .placement import Placement
from .objectindex import ObjectIndex
from .units import PAGE, align_up
from .waits import Later, WouldWait, waits_since

__all__ = ["INLINE_BATCH", "LeaseBatches"]

INLINE_BATCH = 256
"""The most objects a batch the daemon's event loop takes or checks in itself; a larger
one runs on an op worker (its thousands of leases would hold every other client up)."""

log = logging.getLogger(__name__)


class LeaseBatches:
    """Several check-outs or check-ins in one call; see the module docstring."""

    def __init__(self, leases: LeaseTable, index: ObjectIndex, placement: Placement) -> None:
        self.leases, self.index, self.placement = leases, index, placement
        self.cv = index.cv

    def checkout_many(self, handles: list[Handle | int | str], modes: list[str], *, owner: Any,
                      namespace: str | None = None, timeout_s: float | None = None,
                      stream: str = "default") -> list[LeaseInfo]:
        """Lease several objects at once, in order (accesses recorded in that order): all of
        them, or, on any error, none (those already leased are given back unchanged and the
        error names the object that failed). ``timeout_s`` bounds the whole batch."""
        hs = self._check_many(handles, modes, namespace)
        return self._take_many(hs, modes, [], owner, namespace, timeout_s, stream, self.leases.checkout)

    def try_checkout_many(self, handles: list[Handle | int | str], modes: list[str], *, owner: Any,
                          namespace: str | None = None, timeout_s: float | None = None,
                          stream: str = "default") -> list[LeaseInfo] | Later:
        """``checkout_many`` for a caller that must not wait: the leases that need no wait are
        taken now, in order, up to the first that does; the rest of the batch, from there,
        is ``Later`` (the daemon's event loop takes what is resident, an op worker the rest).
        A batch of more than ``INLINE_BATCH`` is ``Later`` whole (the loop is not held up)."""
        if len(handles) > INLINE_BATCH:  # (each run goes on from the leases taken so far, as below)
            done: list[LeaseInfo] = []

            def rest() -> list[LeaseInfo]:
                hs = self._checked(lambda: self._check_many(handles, modes, namespace), done, self._give_back_all)
                return self._take_many(hs, modes, done, owner, namespace, timeout_s, stream, self.leases.checkout)
            return Later(rest, lambda: self._give_back_all(done))
        hs = self._check_many(handles, modes, namespace)
        return self._take_many(hs, modes, [], owner, namespace, timeout_s, stream, self.leases.try_checkout)

    def _check_many(self, handles: list[Handle | int | str], modes: list[str], namespace: str | None) -> list[Handle]:
        if not 1 <= len(handles) <= MAX_BATCH:
            raise InvalidArgument(f"a batch check-out takes 1 to {MAX_BATCH} objects, got {len(handles)}")
        if len(modes) != len(handles):
            raise InvalidArgument(f"{len(modes)} modes for {len(handles)} objects")
        for m in modes:
            check_mode(m)
        hs = [Handle.parse(h) for h in handles]
        self._check_batch(hs, modes, self.index.ns(namespace))
        return hs

    def _take_many(self, hs: list[Handle], modes: list[str], done: list[LeaseInfo], owner: Any,
                   namespace: str | None, timeout_s: float | None, stream: str,
                   checkout: Callable[..., LeaseInfo | Later]) -> list[LeaseInfo] | Later:
        """The batch from lease ``len(done)`` on, each taken by ``checkout`` (``done``: those
        taken so far). When ``checkout`` answers ``Later``, so does this: the rest, from that
        lease, by ``LeaseTable.checkout``."""
        deadline = waits_since() + (self.leases.lease_wait_s if timeout_s is None else timeout_s)
        i = len(done)
        try:
            while i < len(hs):
                info = checkout(hs[i], modes[i], owner=owner, namespace=namespace,
                                timeout_s=max(0.0, deadline - time.monotonic()), stream=stream)
                if isinstance(info, Later):
                    return Later(lambda: self._take_many(hs, modes, done, owner, namespace, timeout_s, stream,
                                                         self.leases.checkout), lambda: self._give_back_all(done))
                done.append(info)
                i += 1
        except WouldWait:
            raise  # (the rest goes on, from ``done``, on a thread that may wait)
        except BaseException as e:
            self._give_back_all(done)
            if isinstance(e, TierstoreError):
                raise type(e)(f"object #{i} of the batch ({hs[i]}): {e.message}; no object was checked out") \
                    from None
            raise
        return list(done)

    @staticmethod
    def _checked(check: Callable[[], Any], done: list[LeaseInfo], give_back: Callable[[list], None]) -> Any:
        """``check()``; if it fails on a run after the first (what the batch took so far is
        in ``done``), that is given back first."""
        try:
            return check()
        except BaseException:
            give_back(done)
            raise

    def _give_back_all(self, done: list[LeaseInfo]) -> None:
        """A batch's leases taken so far, given back as if never taken (``LeaseTable.give_back_lease``)."""
        for info in reversed(done):
            self.leases.give_back_lease(info)
        done.clear()

    def _give_back_each(self, done: list[LeaseInfo], owner: Any) -> None:
        """A list's check-outs taken so far, never used: as if not taken (a sourced one
        keeps the source's bytes)."""
        for info in reversed(done):
            try:
                self.leases.give_back(info.lid, owner=owner)
            except TierstoreError as e2:
                log.warning("giving back check-out %d after another failed: %s", info.lid, e2)
        done.clear()

    def checkout_each(self, requests: list[tuple[Any, str, Any]], *, owner: Any, namespace: str | None = None,
                      timeout_s: float | None = None, stream: str = "default") -> list[LeaseInfo]:
        """Several independent check-outs, ``(handle, mode, source)`` each (``source`` None
        for none; with one, an ``checkout_from``), taken in order (accesses recorded in that
        order). Unlike ``checkout_many`` each stands alone: a check-out from a source may
        hand a block over, which cannot be undone. If one fails, those taken are given back
        unused (``give_back``) and its error is raised. ``timeout_s`` bounds the whole list."""
        ns = self._check_each(requests, namespace)
        return self._take_each(requests, [], owner, ns, timeout_s, stream, self.leases.checkout,
                               self.leases.checkout_from)

    def try_checkout_each(self, requests: list[tuple[Any, str, Any]], *, owner: Any, namespace: str | None = None,
                          timeout_s: float | None = None, stream: str = "default") -> list[LeaseInfo] | Later:
        """``checkout_each`` for a caller that must not wait: as ``try_checkout_many`` (what
        needs no wait now, the rest ``Later``, from where this stopped; more than
        ``INLINE_BATCH``, ``Later`` whole)."""
        if len(requests) > INLINE_BATCH:
            done: list[LeaseInfo] = []

            def rest() -> list[LeaseInfo]:
                ns = self._checked(lambda: self._check_each(requests, namespace), done,
                                   lambda d: self._give_back_each(d, owner))
                return self._take_each(requests, done, owner, ns, timeout_s, stream, self.leases.checkout,
                                       self.leases.checkout_from)
            return Later(rest, lambda: self._give_back_each(done, owner))
        ns = self._check_each(requests, namespace)
        return self._take_each(requests, [], owner, ns, timeout_s, stream, self.leases.try_checkout,
                               self.leases.try_checkout_from)

    def _check_each(self, requests: list[tuple[Any, str, Any]], namespace: str | None) -> str:
        ns = self.index.ns(namespace)
        check_each(requests)
        with self.cv:
            total = sum(align_up(max(self.index.get_meta(h, ns).nbytes, 1), PAGE)
                        for h in {Handle.parse(r[0]) for r in requests})
        usable = self.placement.host_usable()
        if total > usable:  # they could never all be checked out at once: the caller would wait on itself
            raise CapacityExceeded(f"the {len(requests)} check-outs need {total} bytes at once: the host tier "
                                   f"holds {usable} usable bytes; check out fewer objects at a time")
        return ns

    def _take_each(self, requests: list[tuple[Any, str, Any]], done: list[LeaseInfo], owner: Any, ns: str,
                   timeout_s: float | None, stream: str, checkout: Callable[..., LeaseInfo | Later],
                   checkout_from: Callable[..., LeaseInfo | Later]) -> list[LeaseInfo] | Later:
        """The list from check-out ``len(done)`` on (see ``_take_many``)."""
        deadline = waits_since() + (self.leases.lease_wait_s if timeout_s is None else timeout_s)
        i = len(done)
        try:
            while i < len(requests):
                h, mode, source = requests[i]
                left = max(0.0, deadline - time.monotonic())
                if source is None:
                    info = checkout(h, mode, owner=owner, namespace=ns, timeout_s=left, stream=stream)
                else:
                    info = checkout_from(h, source, owner=owner, namespace=ns, timeout_s=left, stream=stream)
                if isinstance(info, Later):
                    return Later(lambda: self._take_each(requests, done, owner, ns, timeout_s, stream,
                                                         self.leases.checkout, self.leases.checkout_from),
                                 lambda: self._give_back_each(done, owner))
                done.append(info)
                i += 1
        except WouldWait:
            raise  # (the rest goes on, from ``done``, on a thread that may wait)
        except BaseException as e:
            self._give_back_each(done, owner)
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

    def release_many(self, lids: list[int], *, owner: Any = LOCAL) -> None:
        """End several leases (``release`` each). Every lease named is ended even if some
        are unknown or one's check-in fails; the first failure, or else the unknown ones
        (``NotFound``), is raised after the others are in."""
        self._check_count(lids)
        self._release_each(lids, owner, self.leases.release)

    def try_release_many(self, lids: list[int], *, owner: Any) -> Later | None:
        """``release_many`` for a caller that must not wait: a batch with a durable object's
        write lease in it (a write-back syncs) or more than ``INLINE_BATCH`` leases is
        ``Later``, whole; any other is checked in now (``LeaseTable.check_in_now``)."""
        self._check_count(lids)
        if len(lids) > INLINE_BATCH or self.leases.writes_back_any(lids, owner):
            return Later(lambda: self.release_many(lids, owner=owner))
        self._release_each(lids, owner, self.leases.check_in_now)
        return None

    @staticmethod
    def _check_count(lids: list[int]) -> None:
        if not 1 <= len(lids) <= MAX_BATCH:
            raise InvalidArgument(f"a batch check-in takes 1 to {MAX_BATCH} leases, got {len(lids)}")

    @staticmethod
    def _release_each(lids: list[int], owner: Any, release: Callable[..., None]) -> None:
        unknown, failed = [], None
        for lid in lids:
            try:
                release(lid, owner=owner)
            except NotFound:
                unknown.append(lid)
            except TierstoreError as e:  # e.g. a durable write-back that failed: the others still go in
                failed = failed or e
        if failed is not None:
            raise failed
        if unknown:
            raise NotFound(f"no lease {', '.join(map(str, unknown[:8]))}{' ...' if len(unknown) > 8 else ''} "
                           "held by this connection; the others were checked in")
