"""Object index records: per-object metadata, the key index and the object table (handles,
keys and namespaces are ``names``'s, re-exported here). Bookkeeping only."""

from __future__ import annotations

import itertools
import sys
from collections import OrderedDict
from dataclasses import InitVar, dataclass, field
from operator import attrgetter
from typing import Any, Sequence

from sortedcontainers import SortedDict

from .extent import Extent
from .names import Handle, validate_key, validate_namespace
from .tensors import TensorSpec

__all__ = ["Handle", "ObjectMeta", "KeyIndex", "ObjectTable", "sorted_from", "validate_key", "validate_namespace"]

_MISSING = object()

@dataclass(slots=True, eq=False)
class ObjectMeta:
    id: int
    gen: int
    namespace: str
    key: str | None
    spec: TensorSpec
    durable: bool
    host_off: int | None = None
    """Offset of the host-arena block, when one is allocated."""
    host_valid: InitVar[bool] = False
    """The host block holds the current bytes (a property: the object table counts them)."""
    nvme: Sequence[Extent] | None = None
    crcs: Sequence[int] | None = None
    # (a replayed object's are tuples, which cost less than lists: they are never changed in place)
    nvme_valid: InitVar[bool] = False
    readers: int = 0
    """Shared leases (user check-outs in mode 'r')."""
    writer: bool = False
    """An exclusive lease (mode 'rw') is out."""
    pins: int = 0
    """Internal transient holds (a copy in progress); a free waits for them."""
    moving: bool = False
    """A tier move (promotion/demotion/write-back) is in flight."""
    freeing: bool = False
    dropped: bool = False
    """``Placement.discard`` has run (or is running): it runs once."""
    home: str | None = None
    """``"nvme"``: the object lives on NVMe and goes back down after each use (put with tier="nvme")."""
    prefetching: bool = False
    """The move in flight is a prefetch (whoever waits for it is a 'late' hit)."""
    ephemeral: Any = None
    """The connection that put it with ``ephemeral=True``: the object goes when it does."""
    gpu_loc: int | None = None
    """Location of the GPU-tier block holding the bytes (then the only copy; see gpu.py)."""
    record: bytes | None = None
    """The last journal record written for this (durable) object, packed (``journal.pack``);
    compaction rewrites it."""
    order: int | None = None
    """(durable) Where its first put record stands among the journal's puts: of two
    objects a replay finds under one key, the higher order holds it. The id itself while
    objects are journaled in id order (the usual); a later number when an object with a
    higher id was journaled first (a put reserved earlier, committed later), and then in
    its records (``ord``)."""
    _hv: bool = field(default=False, init=False, repr=False)
    _nv: bool = field(default=False, init=False, repr=False)
    _table: Any = field(default=None, init=False, repr=False)
    """The ObjectTable holding this object, which counts host- and NVMe-resident objects."""

    def __post_init__(self, host_valid: bool, nvme_valid: bool) -> None:
        self._hv, self._nv = bool(host_valid), bool(nvme_valid)

    @property
    def handle(self) -> Handle:
        return Handle(self.id, self.gen)

    @property
    def nbytes(self) -> int:
        return self.spec.nbytes

    def residency(self) -> list[str]:
        tiers = ["gpu"] if self.gpu_loc is not None else []
        if self.host_valid:
            tiers.append("host")
        if self.nvme_valid:
            tiers.append("nvme")
        return tiers

    def to_record(self) -> dict[str, Any]:
        """The journal form of a durable object."""
        return {"op": "put", "id": self.id, "gen": self.gen, "ns": self.namespace, "key": self.key,
                "kind": self.spec.kind, "dtype": self.spec.dtype, "shape": list(self.spec.shape),
                "nbytes": self.spec.nbytes, "ext": [e.to_wire() for e in self.nvme or []],
                "crc": list(self.crcs or []), "home": self.home,
                **({} if self.order is None or self.order == self.id else {"ord": self.order})}

    @classmethod
    def from_record(cls, r: dict[str, Any], specs: dict[tuple, TensorSpec] | None = None) -> "ObjectMeta":
        """The object a journal record describes. ``specs``: TensorSpecs (frozen) already
        made, shared by the objects of one replay, as are their names: a million objects of
        a few shapes hold a few specs, not a million."""
        sk = (r["kind"], r["dtype"], tuple(r["shape"]), int(r["nbytes"]))
        spec = None if specs is None else specs.get(sk)
        if spec is None:
            spec = TensorSpec(sys.intern(sk[0]), sys.intern(sk[1]), sk[2], sk[3])
            if specs is not None:
                specs[sk] = spec
        oid = int(r["id"])
        return cls(id=oid, gen=int(r["gen"]), namespace=sys.intern(r["ns"]), key=r.get("key"), spec=spec,
                   durable=True, nvme=tuple([Extent.from_wire(e) for e in r["ext"]]), crcs=tuple(r["crc"]),
                   nvme_valid=True, home=r.get("home"), order=r.get("ord", oid))


def _counted_flag(slot: str, counter: str, doc: str) -> property:
    """A bool attribute whose changes keep ``counter`` of the object's ObjectTable."""
    get = attrgetter(slot)

    def set_(self: ObjectMeta, v: bool) -> None:
        v = bool(v)
        if v != get(self):
            setattr(self, slot, v)
            t = self._table
            if t is not None:
                setattr(t, counter, getattr(t, counter) + (1 if v else -1))
    return property(get, set_, doc=doc)


# (set after the dataclass is made: its __init__ takes them as plain arguments)
ObjectMeta.host_valid = _counted_flag("_hv", "host_objects", "The host block holds the current bytes.")
ObjectMeta.nvme_valid = _counted_flag("_nv", "nvme_objects", "The NVMe extents hold the current bytes.")


class KeyIndex:
    """Key -> object id, one sorted map per namespace.

    Addressed like the dict it replaces (``(namespace, key)`` tuples), but a scan of one
    namespace costs O(log n + what it returns) in that namespace alone: nothing another
    namespace holds is walked, and a page that starts after a cursor starts there.
    """

    __slots__ = ("_ns", "_n")

    def __init__(self, items: Any = ()) -> None:
        self._ns: dict[str, SortedDict] = {}
        self._n = 0
        by_ns: dict[str, dict[str, int]] = {}  # (each namespace's map sorted once, not key by key)
        for (ns, key), oid in (items.items() if isinstance(items, dict) else items):
            by_ns.setdefault(ns, {})[key] = oid
        for ns, d in by_ns.items():
            self._ns[ns] = SortedDict(d)
            self._n += len(d)

    def __len__(self) -> int:
        return self._n

    def __contains__(self, k: tuple[str, str]) -> bool:
        d = self._ns.get(k[0])
        return d is not None and k[1] in d

    def __getitem__(self, k: tuple[str, str]) -> int:
        return self._ns[k[0]][k[1]]

    def get(self, k: tuple[str, str], default: Any = None) -> Any:
        d = self._ns.get(k[0])
        return default if d is None else d.get(k[1], default)

    def __setitem__(self, k: tuple[str, str], oid: int) -> None:
        d = self._ns.get(k[0])
        if d is None:
            d = self._ns[k[0]] = SortedDict()
        n = len(d)
        d[k[1]] = oid
        self._n += len(d) - n

    def __delitem__(self, k: tuple[str, str]) -> None:
        d = self._ns[k[0]]
        del d[k[1]]
        self._n -= 1
        if not d:
            del self._ns[k[0]]

    def pop(self, k: tuple[str, str], *default: Any) -> Any:
        d = self._ns.get(k[0])
        if d is None or k[1] not in d:
            if default:
                return default[0]
            raise KeyError(k)
        oid = d[k[1]]
        del self[k]
        return oid

    def count(self, namespace: str) -> int:
        d = self._ns.get(namespace)
        return 0 if d is None else len(d)

    def scan_keys(self, namespace: str, prefix: str = "", after: str | None = None,
                  limit: int | None = None) -> list[str]:
        """The keys alone of ``scan``: O(log n + what it returns), in C but for the page's
        list (the prefix bounds the walk, it is not tested key by key)."""
        d = self._ns.get(namespace)
        if d is None:
            return []
        lo, from_lo = (after, False) if after is not None and after >= prefix else (prefix or None, True)
        it = d.irange(minimum=lo, maximum=_prefix_end(prefix), inclusive=(from_lo, False))
        return list(it if limit is None else itertools.islice(it, limit))

    def scan_ids(self, namespace: str, prefix: str = "", after: str | None = None,
                 limit: int | None = None) -> tuple[list[str], list[int]]:
        """``scan`` as two lists: the keys, and their ids."""
        d = self._ns.get(namespace)
        keys = self.scan_keys(namespace, prefix, after, limit)
        return keys, (list(map(d.__getitem__, keys)) if keys else [])

    def scan(self, namespace: str, prefix: str = "", after: str | None = None,
             limit: int | None = None) -> list[tuple[str, int]]:
        """``(key, id)`` of the namespace's keys that start with ``prefix`` and sort after
        ``after`` (exclusive; None: from the first), in key order, at most ``limit``."""
        return list(zip(*self.scan_ids(namespace, prefix, after, limit)))


def _prefix_end(prefix: str) -> str | None:
    """The least string above every string that starts with ``prefix`` (None: no bound):
    those strings are exactly the ones in [prefix, _prefix_end(prefix))."""
    top = chr(0x10FFFF)
    stem = prefix.rstrip(top)
    return stem[:-1] + chr(ord(stem[-1]) + 1) if stem else None

def sorted_from(d: SortedDict, start: str, after: str | None) -> Any:
    """``d``'s keys from ``start`` (inclusive) or after ``after`` (exclusive), whichever is later."""
    if after is None or after < start:
        return d.irange(minimum=start or None)
    return d.irange(minimum=after, inclusive=(False, True))


class ObjectTable(dict):
    """Object id -> ObjectMeta, keeping per-namespace object and byte counts and the
    numbers of host- and NVMe-resident objects as it changes (callers change an object's
    residency under the object index's lock), so ``stat`` costs O(namespaces), not O(objects),
    and, for a bounded number of recently
    removed ids, the namespace each belonged to (a freed handle is stale in its own
    namespace and simply not found in any other)."""

    GONE_KEPT = 1 << 16

    def __init__(self) -> None:
        super().__init__()
        self.namespaces: SortedDict = SortedDict()
        """namespace -> [objects, bytes], in name order"""
        self._gone: OrderedDict[int, str] = OrderedDict()
        self.host_objects = 0
        self.nvme_objects = 0
        self._ephemeral: dict[Any, dict[int, ObjectMeta]] = {}
        """owner -> its ephemeral objects (an object's ``ephemeral`` is set before it is added)"""

    def __setitem__(self, oid: int, meta: ObjectMeta) -> None:
        old = dict.get(self, oid)
        if old is not None:
            self._count(old, -1)
        dict.__setitem__(self, oid, meta)
        self._count(meta, 1)

    def pop(self, oid: int, *default: Any) -> Any:
        meta = dict.pop(self, oid, _MISSING)
        if meta is _MISSING:
            if default:
                return default[0]
            raise KeyError(oid)
        self._count(meta, -1)
        self._gone[oid] = meta.namespace
        if len(self._gone) > self.GONE_KEPT:
            self._gone.popitem(last=False)
        return meta

    def __delitem__(self, oid: int) -> None:
        self.pop(oid)

    def load(self, objects: dict[int, ObjectMeta]) -> None:
        """Fill an empty table with replayed objects, in id order (a restart: a million of
        them), counting them per namespace in one pass instead of object by object."""
        if self:
            raise ValueError("load fills an empty table")
        metas = sorted(objects.values(), key=attrgetter("id"))
        dict.update(self, zip(map(attrgetter("id"), metas), metas))
        per_ns: dict[str, list[int]] = {}
        host = nvme = 0
        for m in metas:
            m._table = self
            c = per_ns.get(m.namespace)
            if c is None:
                c = per_ns[m.namespace] = [0, 0]
            c[0] += 1
            c[1] += m.spec.nbytes
            host += m._hv
            nvme += m._nv
            if m.ephemeral is not None:
                self._ephemeral.setdefault(m.ephemeral, {})[m.id] = m
        self.host_objects += host
        self.nvme_objects += nvme
        for ns, c in per_ns.items():
            have = self.namespaces.get(ns)
            self.namespaces[ns] = c if have is None else [have[0] + c[0], have[1] + c[1]]

    def ephemeral_of(self, owner: Any) -> list[ObjectMeta]:
        """The objects ``owner`` put with ``ephemeral=True``: O(its own), not O(every object)."""
        return list(self._ephemeral.get(owner, {}).values())

    def gone_namespace(self, oid: int) -> str | None:
        """The namespace of a recently removed id (None: not remembered)."""
        return self._gone.get(oid)

    def _count(self, meta: ObjectMeta, sign: int) -> None:
        meta._table = self if sign > 0 else None
        if meta.ephemeral is not None:
            mine = self._ephemeral.setdefault(meta.ephemeral, {})
            if sign > 0:
                mine[meta.id] = meta
            else:
                mine.pop(meta.id, None)
                if not mine:
                    del self._ephemeral[meta.ephemeral]
        self.host_objects += sign * meta._hv
        self.nvme_objects += sign * meta._nv
        c = self.namespaces.get(meta.namespace)
        if c is None:
            c = self.namespaces[meta.namespace] = [0, 0]
        c[0] += sign
        c[1] += sign * meta.spec.nbytes
        if c[0] <= 0:
            del self.namespaces[meta.namespace]
