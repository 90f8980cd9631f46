"""The object index: the store's one lock, its objects, their keys, ids and counters.

``ObjectIndex`` is the component every other one is given: it owns the condition
variable (``cv``) that guards every object's fields, the object table, the key index,
id and generation allocation, the store's counters, and the waits for another holder
to let go (``wait``; the daemon's rules for them are in ``tierstore.waits``). It reads
and changes bookkeeping only: no bytes move here, nothing is journaled.

Rules: a method documented "(under cv)" is called with ``cv`` held; every other one
takes it itself. Disk I/O and large copies run with it released; an object being
moved is flagged ``moving``, one being copied holds a ``pin``, and whoever waits for
those waits on ``cv``.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from operator import attrgetter
from typing import Any, Callable, Iterator

from .errors import Busy, Closed, InvalidArgument, KeyExists, NotFound, PermissionDenied, StaleHandle
from .index import Handle, KeyIndex, ObjectMeta, ObjectTable, sorted_from, validate_key, validate_namespace
from .waits import wait_for_others, waits_since

__all__ = ["ObjectIndex", "COUNTERS", "acting_for"]

_by_id = attrgetter("id")

COUNTERS = ("puts", "gets", "checkouts", "frees", "host_hits", "nvme_reads", "promotions", "demotions",
            "put_bytes", "get_bytes", "demoted_bytes", "promoted_bytes", "capacity_errors",
            "steps", "gpu_hits", "gpu_demotions", "gpu_demoted_bytes",
            "source_handovers", "source_copies", "leases_revoked", "reservations_expired", "put_early_bytes",
            "streamed_gets", "streams_expired")
"""The store's counters (``stat()["counters"]``)."""


_acting = threading.local()


class acting_for:  # noqa: N801 (used as a function: ``with acting_for(uid):``)
    """The calls made on this thread meanwhile act for a daemon connection of ``uid`` whose
    namespace no uid had claimed when it was last asked: a namespace another uid owns by
    the time an object, a key or a listing of it is looked up (under the lock, so a claim
    cannot come between) is ``PermissionDenied``. (A class, not a generator: the daemon
    enters one per request of such a connection.)"""

    __slots__ = ("uid", "before")

    def __init__(self, uid: int) -> None:
        self.uid = uid

    def __enter__(self) -> None:
        self.before = getattr(_acting, "uid", None)
        _acting.uid = self.uid
        with _acting_lock:
            _acting_threads[0] += 1

    def __exit__(self, *exc: Any) -> None:
        _acting.uid = self.before
        with _acting_lock:
            _acting_threads[0] -= 1


_acting_threads = [0]
"""How many ``acting_for`` blocks are open, on any thread: while none is, the lookups skip
the check (the common case: every connection owns its namespace)."""
_acting_lock = threading.Lock()


def _nobody(namespace: str) -> int | None:
    return None


class ObjectIndex:
    """Objects by id and by key, under one lock; see the module docstring."""

    def __init__(self, namespace: str, lease_wait_s: float) -> None:
        self.namespace = validate_namespace(namespace)
        """The namespace calls that name none use."""
        self.lease_wait_s = lease_wait_s
        self.cv = threading.Condition(threading.Lock())
        self.closed = False
        self.waits_cancelled = False
        self.objects = ObjectTable()
        self.keys = KeyIndex()
        """(namespace, key) -> object id, sorted per namespace."""
        self.next_id = 1
        self.epoch = 1
        """The generation new objects get (one per start of the store)."""
        self.counters: dict[str, float] = dict.fromkeys(COUNTERS, 0)
        self.owner_of: Callable[[str], int | None] = _nobody
        """(under cv) The uid that owns a namespace (``Durability.owner_of``), for ``acting_for``."""

    def _guard(self, ns: str) -> None:
        """(under cv) ``PermissionDenied`` if this thread acts for a uid (``acting_for``)
        and another uid owns ``ns`` now. (Callers skip it while no thread acts for one.)"""
        uid = getattr(_acting, "uid", None)
        if uid is not None:
            owner = self.owner_of(ns)
            if owner is not None and owner != uid:
                raise PermissionDenied(f"namespace {ns.split('/')[0]!r} now belongs to uid {owner}; "
                                       "use another namespace")

    # ------------------------------------------------------------ names and ids
    def ns(self, namespace: str | None) -> str:
        return self.namespace if namespace is None else validate_namespace(namespace)

    def check_open(self) -> None:
        if self.closed:
            raise Closed("the store is closed")

    def new_id(self) -> int:
        """(under cv) A fresh object id."""
        oid = self.next_id
        self.next_id += 1
        return oid

    def get_meta(self, h: Handle, ns: str) -> ObjectMeta:
        """(under cv) The live object ``h`` names in ``ns``; NotFound or StaleHandle otherwise."""
        self.check_open()
        if _acting_threads[0]:
            self._guard(ns)
        meta = self.objects.get(h.id)
        # nothing outside the caller's namespace is told apart from nothing at all: an id
        # another namespace holds (or held) is NotFound, whatever its generation
        if meta is None or meta.freeing:
            if (meta.namespace if meta is not None else self.objects.gone_namespace(h.id)) == ns:
                raise StaleHandle(f"handle {h} names a freed object; look the key up again")
            raise NotFound(f"no object with handle {h} in namespace {ns!r}")
        if meta.namespace != ns:
            raise NotFound(f"no object with handle {h} in namespace {ns!r}")
        if meta.gen != h.gen:
            raise StaleHandle(f"handle {h} is stale (the object now has generation {meta.gen})")
        return meta

    # ------------------------------------------------------------ keys
    def check_key(self, namespace: str, key: str | None, replace: bool) -> None:
        """(under cv) KeyExists unless ``key`` is free in ``namespace`` or may be replaced."""
        if key is not None and (namespace, key) in self.keys and not replace:
            raise KeyExists(f"key {key!r} already exists in namespace {namespace!r}; "
                            "pass replace=True to overwrite it or free it first")

    def publish(self, meta: ObjectMeta) -> ObjectMeta | None:
        """(under cv, after ``check_key``) Make ``meta`` visible by id and key; returns the
        object it replaced (now ``freeing``), which the caller drops."""
        old = None
        if meta.key is not None:
            k = (meta.namespace, meta.key)
            old_id = self.keys.get(k)
            self.keys[k] = meta.id
            if old_id is not None:
                old = self.objects[old_id]
                old.freeing = True
        self.objects[meta.id] = meta
        return old

    # ------------------------------------------------------------ at start, before serving
    def load(self, live: dict[int, ObjectMeta], epoch: int, next_id: int) -> None:
        """The durable objects a replay found (``live``, by id): the table, the key index,
        the generation epoch and the next id, all at once."""
        self.objects.load(live)
        self.keys = KeyIndex({(m.namespace, m.key): m.id for m in self.objects.values() if m.key is not None})
        self.epoch, self.next_id = epoch, next_id

    def durable_records(self, freed: set[int] = frozenset()) -> tuple[int, int, list[bytes]]:
        """(under cv) The epoch, the next id and the journal records of the durable objects
        the journal holds live, in id order (the index checkpoint's columns are; objects
        are published in the order their puts commit, not the order their ids were given).
        Left out: ``freed`` (their frees are journaled; they have not left the index yet)
        and objects being freed whose key another object took (its put record, journaled
        after theirs, supersedes them, as a replay would decide)."""
        recs = [m.record for m in sorted(self.objects.values(), key=_by_id)
                if m.durable and m.record is not None and m.id not in freed and not (m.freeing and self._superseded(m))]
        return self.epoch, self.next_id, recs

    def _superseded(self, m: ObjectMeta) -> bool:
        """(under cv) A durable object whose key names another durable object now."""
        if m.key is None:
            return False
        other = self.objects.get(self.keys.get((m.namespace, m.key), m.id))
        return other is not None and other is not m and other.durable

    def object_count(self) -> int:
        """Objects in the index."""
        return len(self.objects)

    def resident_counts(self) -> tuple[int, int]:
        """(under cv) Objects whose bytes are in the host tier, and on NVMe (O(1))."""
        return self.objects.host_objects, self.objects.nvme_objects

    def close(self) -> bool:
        """Mark the index closed and wake every wait; False if it already was."""
        with self.cv:
            if self.closed:
                return False
            self.closed = True
            self.cv.notify_all()
            return True

    def namespace_count(self) -> int:
        """Namespaces holding objects, every uid's (O(1))."""
        return len(self.objects.namespaces)

    def all_objects(self) -> Iterator[ObjectMeta]:
        """(under cv) Every object in the index (the caller reads them, not the table)."""
        return iter(self.objects.values())

    def nbytes_of(self, oid: int) -> int:
        """(under cv) Bytes of object ``oid`` (0 once freed): the eviction policy's sizes."""
        meta = self.objects.get(oid)
        return meta.nbytes if meta is not None else 0

    def holder(self, oid: int) -> ObjectMeta | None:
        """The object with id ``oid``, if the index has it."""
        return self.objects.get(oid)

    def key_id(self, namespace: str, key: str) -> int | None:
        """The id ``key`` names in ``namespace``, if any."""
        return self.keys.get((namespace, key))

    def adopt(self, meta: ObjectMeta) -> ObjectMeta | None:
        """A volatile object found in an adopted arena joins the index by id and key;
        returns the object its key named before, which leaves the index."""
        gone = None
        if meta.key is not None:
            k = (meta.namespace, meta.key)
            prev = self.keys.get(k)
            if prev is not None:
                gone = self.objects.pop(prev)
            self.keys[k] = meta.id
        self.objects[meta.id] = meta
        self.note_id(meta.id)
        return gone

    def note_id(self, oid: int) -> None:
        """Ids from here on are past ``oid``."""
        self.next_id = max(self.next_id, oid + 1)

    def unbind_ephemeral(self, owner: Any) -> list[ObjectMeta]:
        """``owner``'s ephemeral objects not already being freed, now ``freeing`` and with
        their keys unbound (the caller discards them); their frees are counted."""
        with self.cv:
            mine = [m for m in self.objects.ephemeral_of(owner) if not m.freeing]
            for m in mine:
                m.freeing = True
                self.unbind(m)
            self.counters["frees"] += len(mine)
        return mine

    def unbind(self, meta: ObjectMeta) -> None:
        """(under cv) ``meta``'s key no longer names it."""
        if meta.key is not None and self.keys.get((meta.namespace, meta.key)) == meta.id:
            del self.keys[(meta.namespace, meta.key)]

    def rebind(self, meta: ObjectMeta) -> None:
        """(under cv) A free that failed: ``meta``'s key names it again (unless taken meanwhile)."""
        if meta.key is not None and (meta.namespace, meta.key) not in self.keys:
            self.keys[(meta.namespace, meta.key)] = meta.id

    def remove(self, meta: ObjectMeta) -> None:
        """(under cv) ``meta`` leaves the index (its key, if it still names it, too)."""
        self.objects.pop(meta.id, None)
        self.unbind(meta)

    # ------------------------------------------------------------ holds
    def wait(self, remaining: float) -> None:
        """(under cv, ``remaining`` > 0) Wait for another holder to let go; see ``tierstore.waits``."""
        wait_for_others(self.cv, remaining, self.waits_cancelled)

    def cancel_waits(self) -> None:
        """End every wait for another holder now and from now on with ``Closed``."""
        with self.cv:
            self.waits_cancelled = True
            self.cv.notify_all()

    def pin(self, h: Handle, ns: str) -> tuple[ObjectMeta, bool]:
        """Hold the object against moves and writers; (meta, waited for a prefetch)."""
        late = False
        deadline = waits_since() + self.lease_wait_s
        with self.cv:
            while True:
                meta = self.get_meta(h, ns)
                if not meta.writer and not meta.moving:
                    meta.pins += 1
                    return meta, late
                late = late or meta.prefetching
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise Busy(f"object {h} is checked out for writing; try again after it is checked in")
                self.wait(remaining)

    def unpin(self, meta: ObjectMeta) -> bool:
        """Let go of a ``pin``; True when the object is now to be dropped (``droppable``)."""
        with self.cv:
            meta.pins -= 1
            self.cv.notify_all()
            return self.droppable(meta)

    def droppable(self, meta: ObjectMeta) -> bool:
        """(under cv) Whether a replaced (``freeing``) object nobody holds any more is to be dropped now."""
        return (meta.freeing and not meta.dropped and not (meta.readers or meta.writer or meta.pins or meta.moving)
                and self.objects.get(meta.id) is meta)

    # ------------------------------------------------------------ reading the index
    def lookup(self, key: str, namespace: str | None = None) -> Handle | None:
        key = validate_key(key)
        ns = self.ns(namespace)
        with self.cv:
            if _acting_threads[0]:
                self._guard(ns)
            oid = self.keys.get((ns, key))
            return None if oid is None else self.objects[oid].handle

    def info(self, h: Handle, namespace: str | None = None) -> dict[str, Any]:
        with self.cv:
            return describe(self.get_meta(h, self.ns(namespace)))

    def key_names(self, prefix: str, after: str | None, limit: int | None, namespace: str | None) -> list[str]:
        _check_page(prefix, after)
        ns = self.ns(namespace)
        with self.cv:
            if _acting_threads[0]:
                self._guard(ns)
            return self.keys.scan_keys(ns, prefix, after, limit)

    def ls_page(self, prefix: str, after: str | None, limit: int | None, namespace: str | None) -> list[dict[str, Any]]:
        _check_page(prefix, after)
        ns = self.ns(namespace)
        with self.cv:
            if _acting_threads[0]:
                self._guard(ns)
            return [describe(self.objects[oid]) for _, oid in self.keys.scan(ns, prefix, after, limit)]

    def ls_columns(self, prefix: str, after: str | None, limit: int | None,
                   namespace: str | None) -> list[list[Any]]:
        """``ls_page`` by column, for the wire: one list per ``INFO_FIELDS`` field, each a
        value per object in key order (a listing of a million objects builds, sends and
        decodes thirteen lists a page, not a million maps). ``shape`` and ``residency``
        are tuples, shared between objects: packed, they are lists like ``info``'s."""
        _check_page(prefix, after)
        ns = self.ns(namespace)
        objects = self.objects
        with self.cv:
            if _acting_threads[0]:
                self._guard(ns)
            keys, ids = self.keys.scan_ids(ns, prefix, after, limit)
            ms = list(map(objects.__getitem__, ids))
            hv = [m.host_valid for m in ms]
            nv = [m.nvme_valid for m in ms]
            gpu = [m.gpu_loc is not None for m in ms]
            specs = [m.spec for m in ms]
            return [[f"{m.id}.{m.gen}" for m in ms], keys, [ns] * len(ms),
                    [sp.kind for sp in specs], [sp.dtype for sp in specs], [sp.shape for sp in specs],
                    [sp.nbytes for sp in specs], [_RESIDENCY[f] for f in zip(gpu, hv, nv)],
                    [(h or g) and not v for g, h, v in zip(gpu, hv, nv)], [m.readers for m in ms],
                    [m.writer for m in ms], [m.durable for m in ms], [m.ephemeral is not None for m in ms]]

    def key_count(self, namespace: str) -> int:
        """Keys in ``namespace`` (O(1))."""
        return self.keys.count(namespace)

    def stat_namespaces(self, after: str | None = None, limit: int | None = None,
                        roots: Callable[[], list[str]] | None = None) -> dict[str, dict[str, int]]:
        """``roots`` (called under cv): only the namespaces under the root namespaces it
        names, in name order (found by a range of the table each, not a walk over it)."""
        with self.cv:
            table = self.objects.namespaces
            names = sorted_from(table, "", after) if roots is None else _under(table, roots(), after)
            return {ns: {"objects": table[ns][0], "bytes": table[ns][1]}
                    for ns in (names if limit is None else itertools.islice(names, limit))}

    def count_namespaces(self, roots: Callable[[], list[str]]) -> int:
        """How many namespaces holding objects are under the root namespaces ``roots()``
        (called under cv) names: O(roots × log namespaces)."""
        with self.cv:
            table = self.objects.namespaces
            return sum((r in table) + table.bisect_left(r + "0") - table.bisect_left(r + "/") for r in roots())


INFO_FIELDS = ("handle", "key", "namespace", "kind", "dtype", "shape", "nbytes", "residency", "dirty", "readers",
               "writer", "durable", "ephemeral")
"""The fields of ``info``, in order (``describe_row``, the columns of ``ls_columns``)."""


def describe(m: ObjectMeta) -> dict[str, Any]:
    """``info`` of one object: key, dtype, shape, nbytes, residency, leases, durability."""
    return dict(zip(INFO_FIELDS, describe_row(m)))


def describe_row(m: ObjectMeta) -> list[Any]:
    """``info`` as a row of ``INFO_FIELDS``."""
    spec = m.spec
    return [f"{m.id}.{m.gen}", m.key, m.namespace, spec.kind, spec.dtype, list(spec.shape), spec.nbytes,
            m.residency(), (m.host_valid or m.gpu_loc is not None) and not m.nvme_valid, m.readers, m.writer,
            m.durable, m.ephemeral is not None]


_RESIDENCY = {(g, h, v): tuple(t for t, on in (("gpu", g), ("host", h), ("nvme", v)) if on)
              for g in (False, True) for h in (False, True) for v in (False, True)}
"""``ObjectMeta.residency`` by its (gpu, host, nvme) flags."""


def _under(table: Any, roots: list[str], after: str | None) -> Iterator[str]:
    """The names in ``table`` (a SortedDict) that are one of ``roots`` or under one
    (``root/...``: the names from ``root/`` up to ``root0``, as '0' follows '/'), after
    ``after``, in name order: the roots' ranges merged."""
    def one(root: str) -> Iterator[str]:
        if root in table and (after is None or root > after):
            yield root
        low = root + "/" if after is None or after < root + "/" else after
        yield from table.irange(low, root + "0", inclusive=(after is None or low != after, False))
    return heapq.merge(*(one(r) for r in roots))


def _check_page(prefix: Any, after: Any) -> None:
    if not isinstance(prefix, str) or not (after is None or isinstance(after, str)):
        raise InvalidArgument("prefix and after must be str")
