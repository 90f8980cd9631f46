"""The daemon's surface of the store: the calls only the daemon makes, on behalf of its
connections (``owner``: the connection) — two-phase puts, staging-area transfers,
streamed gets,
leases by owner, revocation and expiry, a closed connection's cleanup, namespace
claims, GPU-tier attachment.

``Store`` makes one (``Store.daemon``), given the components it reaches; the store's own
methods are the user-facing contract (``tierstore.contract.Pool``), the same as
``tierstore.client.Client``'s. Each method here hands the call to the one component
that does it. The ``try_*`` calls are the daemon's event loop's: each does its work
now or returns ``Later``, the rest of the call for an op worker (``waits.py``).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from .durability import Durability
from .names import Handle
from .hints import Hints
from .leasebatches import LeaseBatches
from .leases import LOCAL, LeaseInfo, LeaseTable
from .objectindex import ObjectIndex
from .placement import Placement
from .staging import StagingAreas
from .streams import Stream, StreamedGets
from .groupcommit import Pending
from .puts import Puts, Reservation
from .tensors import TensorSpec
from .waits import Later

__all__ = ["DaemonSurface"]

log = logging.getLogger(__name__)


class DaemonSurface:
    """The calls the daemon makes on the store for its connections; see the module docstring."""

    def __init__(self, index: ObjectIndex, durability: Durability, placement: Placement, leases: LeaseTable,
                 batches: LeaseBatches, puts: Puts, staging: StagingAreas, hints: Hints,
                 streams: StreamedGets) -> None:
        self.index, self.durability, self.placement = index, durability, placement
        self.streams = streams
        self.leases, self.batches, self.puts, self.hints = leases, batches, puts, hints
        self.try_step = hints.try_step
        """``Hints.try_step``: an iteration boundary of ``owner``'s loop (``Later`` when long)."""
        self.ls_columns = index.ls_columns
        """``ObjectIndex.ls_columns``: a page of ``ls`` by column of ``objectindex.INFO_FIELDS``."""
        self.staging = staging
        # the event loop's most frequent calls are the components' own methods, bound here:
        # no frame of this class (nor a keyword dict passed through) on every small op
        self.try_put_staged = puts.try_put_staged
        """``Puts.try_put_staged``: a small put from ``owner``'s staging area."""
        self.try_get_staged = puts.try_get_staged
        """``Puts.try_get_staged``: a small object copied into ``owner``'s staging area."""
        self.try_checkout = leases.try_checkout
        """``LeaseTable.try_checkout``: a check-out for ``owner``."""
        self.try_release = leases.try_release
        """``LeaseTable.try_release``: a check-in for ``owner``."""
        self.try_give_back = leases.try_give_back
        """``LeaseTable.try_give_back``: a check-in for ``owner`` as never written."""
        self.lookup = index.lookup
        """``ObjectIndex.lookup(key, namespace)``: the handle of ``key``, or None."""

    def reserve_put(self, spec: TensorSpec, **kw: Any) -> Reservation:
        """First phase of a two-phase put: a block the client fills (``Puts.reserve``)."""
        return self.puts.reserve(spec, **kw)

    def try_reserve_put(self, spec: TensorSpec, **kw: Any) -> Reservation | Later:
        return self.puts.try_reserve(spec, **kw)

    def commit_put(self, rid: int, *, owner: Any = LOCAL) -> Handle:
        """Second phase: the reserved object becomes visible (``Puts.commit``)."""
        return self.puts.commit(rid, owner=owner)

    def try_commit_put(self, rid: int, *, owner: Any) -> Handle | Pending | Later:
        """``Puts.try_commit``: durable, a ``Pending`` handle."""
        return self.puts.try_commit(rid, owner=owner)

    def finish_commits(self) -> None:
        """Commit the durable puts already handed to the group committer, and take no more
        (the daemon is stopping; ``Store.close`` would do it too, after the replies are gone)."""
        self.puts.close()

    def fill_put(self, rid: int, upto: int, *, owner: Any) -> Later | None:
        """``Puts.fill``: the reservation's first ``upto`` bytes are there to write early."""
        return self.puts.fill(rid, upto, owner=owner)

    def abort_put(self, rid: int, *, owner: Any = LOCAL) -> Later:
        """``Puts.abort`` of the caller's open reservation ``rid`` (``NotFound``: it has
        none of that number; ``InvalidArgument``: a commit has taken it up), as a ``Later``: the writes ``put_part`` began for it are
        ended and waited for on a worker, never on the event loop."""
        self.puts.owned(rid, owner)
        return Later(lambda: self.puts.abort(rid, owner=owner, asked=True))

    def try_get_streamed(self, handle: Handle | int | str, *, owner: Any, namespace: str | None, stream: str,
                         device: bool) -> LeaseInfo | Stream | Later:
        """``StreamedGets.try_get``: a get that streams a large NVMe-only object, else a read lease."""
        return self.streams.try_get(handle, owner=owner, namespace=namespace, stream=stream, device=device)

    def get_part(self, sid: int, upto: int, *, owner: Any) -> int | Pending:
        """``StreamedGets.wait``: the checked bytes of a streamed get, once ``upto`` are."""
        return self.streams.wait(sid, upto, owner=owner)

    def get_end(self, sid: int, *, owner: Any) -> None:
        """``StreamedGets.end``: the client is done copying a streamed get."""
        self.streams.end(sid, owner=owner)

    def stat_namespaces_of(self, uid: int, after: str | None = None, limit: int | None = None
                           ) -> dict[str, dict[str, int]] | None:
        """``Store.stat_namespaces`` as ``uid`` may see it: the namespaces its uid owns
        (root: every one, then None: the caller's table stands)."""
        if uid == 0:
            return None
        return self.index.stat_namespaces(after, limit, lambda: self.durability.roots_owned_by(uid))

    def namespace_count_of(self, uid: int) -> int:
        """How many namespaces holding objects ``uid`` owns (root: every one)."""
        if uid == 0:
            return self.index.namespace_count()
        return self.index.count_namespaces(lambda: self.durability.roots_owned_by(uid))

    def group_lease_owners(self, group_of: Callable[[Any], Any]) -> None:
        """Count each owner's leases against ``group_of(owner)``'s share as well (the
        daemon: a connection's uid; ``LeaseTable.group_owners``)."""
        self.leases.group_owners(group_of)

    def namespace_count(self) -> int:
        """Namespaces holding objects, every uid's (O(1))."""
        return self.index.namespace_count()

    def staging_area(self, owner: Any, nbytes: int, group: Any = None) -> tuple[int, int]:
        """``owner``'s staging area in the host arena, (offset, nbytes): small puts and gets
        through the daemon pass through it in one round trip. ``group``: whose share it
        counts against (the connection's uid; ``StagingAreas``)."""
        return self.staging.area(owner, nbytes, group)

    def put_staged(self, owner: Any, src: int, spec: TensorSpec, **kw: Any) -> Handle:
        """A put of bytes at ``src`` in ``owner``'s staging area (``Puts.put_staged``)."""
        return self.puts.put_staged(owner, src, spec, **kw)

    def checkout(self, handle: Handle | int | str, mode: str, **kw: Any) -> LeaseInfo:
        """A check-out for ``owner`` (``LeaseTable.checkout``)."""
        return self.leases.checkout(handle, mode, **kw)

    def checkout_from(self, handle: Handle | int | str, source: Handle | int | str, **kw: Any) -> LeaseInfo:
        return self.leases.checkout_from(handle, source, **kw)

    def try_checkout_from(self, handle: Handle | int | str, source: Handle | int | str, **kw: Any) -> LeaseInfo | Later:
        return self.leases.try_checkout_from(handle, source, **kw)

    def try_checkout_many(self, handles: list[Handle | int | str], modes: list[str],
                          **kw: Any) -> list[LeaseInfo] | Later:
        return self.batches.try_checkout_many(handles, modes, **kw)

    def try_checkout_each(self, requests: list[tuple[Any, str, Any]], **kw: Any) -> list[LeaseInfo] | Later:
        return self.batches.try_checkout_each(requests, **kw)

    def try_release_many(self, lids: list[int], *, owner: Any) -> Later | None:
        return self.batches.try_release_many(lids, owner=owner)

    def revoke(self, lid: int, *, owner: Any) -> bool:
        return self.leases.revoke(lid, owner=owner)

    def expire_leases(self, max_age_s: float) -> int:
        """Revoke leases older than ``max_age_s`` (``LeaseTable.expire``)."""
        return self.leases.expire(max_age_s)

    def expire_reservations(self, max_age_s: float) -> int:
        """Drop reservations left uncommitted longer than ``max_age_s`` (``Puts.expire``), and
        end streamed gets open as long (``StreamedGets.expire``)."""
        return self.puts.expire(max_age_s) + self.streams.expire(max_age_s)

    def drop_owner(self, owner: Any) -> tuple[int, int]:
        """``owner`` (a connection) went away: its leases are checked in, its reservations
        aborted, its streamed gets ended, its staging area and fenced blocks freed, its
        ephemeral objects freed. Returns (leases, reservations) ended."""
        nleases = self.leases.drop_owner(owner)
        self.streams.drop_owner(owner)
        nres = self.puts.drop_owner(owner)
        self.placement.drop_owner(owner)
        if owner is not LOCAL:
            self._free_ephemeral(owner)
        return nleases, nres

    def _free_ephemeral(self, owner: Any) -> None:
        """``owner`` went away: its ephemeral objects go too — now, or at the end of the
        last lease another connection holds on one (its key is unbound at once)."""
        mine = self.index.unbind_ephemeral(owner)
        for m in mine:
            self.placement.discard_replaced(m)  # waits out copies and moves; a leased one goes at its check-in
        if mine:
            log.debug("freed %d ephemeral objects of a closed connection", len(mine))

    def cancel_waits(self) -> None:
        """End every wait for another holder now and from now on with ``Closed`` (the
        daemon is stopping: SIGTERM must not wait out anyone's ``timeout_s``)."""
        self.index.cancel_waits()

    def claim_namespace(self, namespace: str, uid: int) -> None:
        """Bind a namespace to the uid that first uses it (journaled); others are refused."""
        self.durability.claim_namespace(namespace, uid)

    def check_namespace(self, namespace: str, uid: int) -> None:
        """``PermissionDenied`` if another uid owns the namespace (root may enter any)."""
        self.durability.check_namespace(namespace, uid)

    def namespace_owner(self, namespace: str) -> int | None:
        return self.durability.namespace_owner(namespace)

    def free(self, handle: Handle | int | str, namespace: str, owner: Any) -> None:
        """``Store.free`` for a connection: a lease ``owner`` holds on the object is ``Busy``
        at once; one another holder has is waited for, up to ``lease_wait_s``."""
        self.leases.free(Handle.parse(handle), self.index.ns(namespace), owner)

    def prefetch(self, handles: list[Handle | int | str], namespace: str, owner: Any) -> None:
        """``Store.prefetch`` for a connection's loop (``owner``'s trace)."""
        self.hints.hint(handles, self.index.ns(namespace), owner)

    def key_count(self, namespace: str) -> int:
        """Keys in ``namespace`` (O(1)): whether an unpaged listing is worth a worker thread."""
        return self.index.key_count(namespace)

    @property
    def gpu_reason(self) -> str:
        """Why the store has no GPU tier (when it has none)."""
        return self.placement.gpu_reason

    def gpu_attach(self, owner: Any) -> list[dict[str, Any]]:
        """``owner`` is about to open the GPU slabs (``Placement.gpu_attach``)."""
        return self.placement.gpu_attach(owner)

    def enable_host_index(self) -> None:
        """Start recording host residency in the index log (``Durability.enable_host_index``)."""
        self.durability.enable_host_index()
