"""Replay rules: the durable index as the journal's records describe it, losing only
what is damaged (``Replay``), and the check of each record (``_check_record``). Used
by ``Durability`` at start, seeded from the index checkpoint when one is usable
(``checkpoint.py``). Knows nothing of the store: records in, objects out.
"""

from __future__ import annotations

import bisect
import logging
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from .checksum import BLOCK_BYTES
from .errors import InvalidArgument
from .index import ObjectMeta, validate_key, validate_namespace
from .journal import pack as pack_record
from .tensors import TensorSpec
from .units import PAGE, align_up

if TYPE_CHECKING:
    from . import checkpoint

__all__ = ["Replay"]

log = logging.getLogger("tierstore.durability")  # (its messages are recovery's, as before)


_ID_LIMIT = 1 << 48
_BEYOND = "outside the configured NVMe tier"
_MAX_DIMS = 64


class Replay:
    """The durable index as the journal's records describe it, losing only what is damaged.

    Records are applied in journal order (the order they were appended). Every field of
    every record is checked; a record that does not hold together is skipped and counted
    (``malformed``), alone. Conflicts are resolved by order:

    - a put whose extents overlap a live object's: that object was freed (or rewritten
      elsewhere) before the space was reused, whatever its own records say (counted:
      ``superseded``, as its free, or its newer record, was lost);
    - a put binding a key another live object holds: the higher order is the newer (a
      replace), the other goes (``ObjectMeta.order``: the id, or the ``ord`` a record
      carries when its object was published after one with a higher id);
    - a free, or a free repeated (``fr``) by a later record, removes the object;
    - namespace ownership: the first claim in order (``ns``, repeated as ``own``, and the
      owner's uid in each put, ``nsuid``) holds; a later disagreeing one is ignored.
    """

    def __init__(self, *, ndrives: int, drive_bytes: int) -> None:
        self.ndrives, self.drive_bytes = ndrives, drive_bytes
        self.live: dict[int, ObjectMeta] = {}
        """The live objects, built as their records come (``record``: the put record as
        found, packed)."""
        self.owners: dict[str, int] = {}
        self.epoch, self.next_id = 0, 1
        self.malformed = self.superseded = self.owner_conflicts = 0
        self.beyond: dict[int, str] = {}
        """Objects whose latest record is whole but names space past this start's NVMe
        tier (fewer directories, or smaller ones, than wrote it): id -> why. The store
        refuses to start on them rather than lose them."""
        self._space = [_Extents() for _ in range(ndrives)]
        self._key = _Keys()
        self._ns_ok: set[str] = set()  # namespaces already validated (each is checked once)
        self._specs: dict[tuple, TensorSpec] = {}
        """Validated (kind, dtype, shape, nbytes) -> the one TensorSpec the objects share."""

    def seed(self, ck: "checkpoint.Checkpoint") -> None:
        """Start from an index checkpoint's state (``tierstore.checkpoint``: its objects, their
        space per drive and their keys, validated as these rules would) instead of from
        nothing: the journal records after the point it covers are then applied on top."""
        self.live = ck.live
        self._space = [_SeededExtents(*cols) for cols in ck.space]
        self._key = _Keys(ck.keys)
        self.owners, self.epoch, self.next_id = dict(ck.owners), ck.epoch, ck.next_id
        self._specs.update(ck.specs)
        self._ns_ok.update(ck.namespaces)

    def settle(self) -> None:
        """Every record is applied: let go of what only resolving conflicts needed (the
        space and key maps)."""
        self._space = [_Extents() for _ in range(self.ndrives)]
        self._key = _Keys()

    def apply(self, r: dict[str, Any], payload: bytes | None = None) -> None:
        """Apply one record; ``payload``: its packed form as found (kept as the live
        object's record, when it holds nothing but the object)."""
        why = _check_record(r, self.ndrives, self.drive_bytes, self._ns_ok, self._specs)
        if why is not None:
            if why.endswith(_BEYOND) and _check_record(r, 1 << 16, 1 << 62) is None:
                # whole, but on a tier larger than this start's: not damage, another configuration
                self.beyond[r["id"]] = why
            self.malformed += 1
            log.error("journal record skipped (%s): %.200r", why, r)
            return
        if "fr" in r:
            for oid in r["fr"] or ():
                self._free(oid)
        if "own" in r:
            for name, uid in r["own"] or ():
                self._claim(name, uid)
        op = r["op"]
        if op == "put":
            self._put(r, payload)
        elif op == "open":
            self.epoch = max(self.epoch, r["epoch"])
            self.next_id = max(self.next_id, r["next_id"])
        elif op == "ns":
            self._claim(r["name"], r["uid"])
        elif op == "free":
            self._free(r["id"])

    def _claim(self, name: str, uid: int) -> None:
        have = self.owners.setdefault(name, uid)
        if have != uid:
            self.owner_conflicts += 1
            log.error("journal: namespace %r claimed by uid %d, a later record names uid %d; uid %d keeps it",
                      name, have, uid, have)

    def _free(self, oid: int) -> None:
        if oid >= self.next_id:
            self.next_id = oid + 1
        self.beyond.pop(oid, None)
        m = self.live.pop(oid, None)
        if m is None:
            return
        for e in m.nvme:
            self._space[e.dev].remove(e.file_offset)
        if m.key is not None and self._key.get(m.namespace, m.key) == oid:
            self._key.pop(m.namespace, m.key)

    def _put(self, r: dict[str, Any], payload: bytes | None = None) -> None:
        oid = r["id"]
        order = r.get("ord", oid)
        if max(oid, order) >= self.next_id:
            self.next_id = max(oid, order) + 1
        if r["gen"] > self.epoch:
            self.epoch = r["gen"]
        if r.get("nsuid") is not None:
            self._claim(r["ns"].split("/")[0], r["nsuid"])
        self.beyond.pop(oid, None)  # (a newer record of it, inside the tier)
        if oid in self.live:
            self._free(oid)  # an earlier record of the same object (a write-back): this one is newer
        ext = r["ext"]
        for dev, off, _, n in ext:
            for other in self._space[dev].overlapping(off, align_up(max(n, 1), PAGE)):
                if other != oid and other in self.live:
                    log.warning("journal: object %d's space was reused by object %d; it was freed", other, oid)
                    self.superseded += 1
                    self._free(other)
        key = r.get("key")
        if key is not None:
            # (a replace journals the new object's put before the old one's free: no damage needed)
            other = self._key.get(r["ns"], key)
            holder = None if other is None else self.live.get(other)
            if holder is not None and holder.order > order:
                return  # a late record of an object already replaced: it was on its way out
            if other is not None:
                self._free(other)
            self._key.set(r["ns"], key, oid)
        for dev, off, _, n in ext:
            self._space[dev].add(off, align_up(max(n, 1), PAGE), oid)
        if "fr" in r or "own" in r:  # (echoes are not its own)
            r = {k: v for k, v in r.items() if k not in ("fr", "own")}
            payload = None
        meta = ObjectMeta.from_record(r, self._specs)
        meta.record = payload if payload is not None else pack_record(r)
        self.live[oid] = meta


class _Extents:
    """Disjoint byte ranges of one drive and the object each belongs to (replay only).

    Per range it keeps only objects the live index holds anyway (the start, the id, a
    size shared by every range of that size): what a replay builds and lets go of at
    its end is then a few large tables, not a million small objects whose freed slots
    would stay behind in the heap between the live ones."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._size: dict[int, int] = {}  # start -> size
        self._oid: dict[int, int] = {}  # start -> object id
        self._sizes: dict[int, int] = {}  # each size once

    def overlapping(self, start: int, size: int) -> list[int]:
        end = start + size
        i = max(bisect.bisect_right(self._starts, start) - 1, 0)
        out = []
        while i < len(self._starts) and self._starts[i] < end:
            s = self._starts[i]
            if s + self._size[s] > start:
                out.append(self._oid[s])
            i += 1
        return out

    def add(self, start: int, size: int, oid: int) -> None:
        bisect.insort(self._starts, start)
        self._size[start] = self._sizes.setdefault(size, size)
        self._oid[start] = oid

    def remove(self, start: int) -> None:
        if self._oid.pop(start, None) is not None:
            del self._size[start]
            del self._starts[bisect.bisect_left(self._starts, start)]


class _SeededExtents(_Extents):
    """``_Extents`` started from a checkpoint's sorted, disjoint columns of one drive
    (starts, ends, ids): nothing is built per checkpointed object; what the journal tail
    adds is kept as in ``_Extents``, a checkpointed range it removes is marked gone."""

    def __init__(self, starts: np.ndarray, ends: np.ndarray, oids: np.ndarray) -> None:
        super().__init__()
        self._s, self._e, self._o = starts, ends, oids
        self._gone: set[int] = set()

    def overlapping(self, start: int, size: int) -> list[int]:
        # disjoint and sorted by start: their ends are sorted too
        lo = int(np.searchsorted(self._e, start, side="right"))
        hi = int(np.searchsorted(self._s, start + size, side="left"))
        return [int(self._o[i]) for i in range(lo, hi) if int(self._s[i]) not in self._gone] + \
            super().overlapping(start, size)

    def remove(self, start: int) -> None:
        if start in self._oid:
            super().remove(start)
            return
        i = int(np.searchsorted(self._s, start))
        if i < len(self._s) and int(self._s[i]) == start:
            self._gone.add(start)


class _Keys:
    """``Replay``'s key map, (namespace, key) -> the object holding it, as one dict per
    namespace (no tuple made per object: see ``_Extents``). ``build``: the map started
    from a checkpoint, built on first use (a tail of nothing but an ``open`` record never
    needs it)."""

    def __init__(self, build: Callable[[], dict[str, dict[str, int]]] | None = None) -> None:
        self._build = build
        self._d: dict[str, dict[str, int]] = {}

    def _map(self) -> dict[str, dict[str, int]]:
        if self._build is not None:
            self._d, self._build = self._build(), None
        return self._d

    def get(self, ns: str, key: str) -> int | None:
        d = self._map().get(ns)
        return None if d is None else d.get(key)

    def set(self, ns: str, key: str, oid: int) -> None:
        self._map().setdefault(ns, {})[key] = oid

    def pop(self, ns: str, key: str) -> None:
        d = self._map().get(ns)
        if d is not None:
            d.pop(key, None)


def _is_int(v: Any, lo: int = 0, hi: int = 1 << 63) -> bool:
    # (records are decoded msgpack: an integer is exactly an int, a bool is not one)
    return type(v) is int and lo <= v < hi


def _ints(vs: list[Any], lo: int = 0, hi: int = 1 << 63) -> bool:
    """Every item of ``vs`` is an int in [lo, hi) (a loop: replay checks a million of these)."""
    for v in vs:
        if type(v) is not int or not lo <= v < hi:
            return False
    return True


def _check_record(r: dict[str, Any], ndrives: int, drive_bytes: int, ns_ok: set[str] | None = None,
                  specs: dict[tuple, Any] | None = None) -> str | None:
    """Why the record cannot be applied, or None. Every field a replay reads is checked.
    ``ns_ok``, ``specs``: namespaces and (kind, dtype, shape, nbytes) already found valid,
    which are not checked again."""
    op = r.get("op")
    fr, own = r.get("fr"), r.get("own")
    if fr is not None and not (isinstance(fr, list) and _ints(fr, 1, _ID_LIMIT)):
        return "bad 'fr'"
    if own is not None and not (isinstance(own, list) and all(
            isinstance(x, list) and len(x) == 2 and _ns_root_ok(x[0]) and _is_int(x[1], 0, 1 << 32)
            for x in own)):
        return "bad 'own'"
    if op == "open":
        if not (_is_int(r.get("epoch")) and _is_int(r.get("next_id"), 1, _ID_LIMIT + 1)):
            return "open: bad 'epoch' or 'next_id'"
        return None
    if op == "close":
        return None
    if op == "ns":
        if not (_ns_root_ok(r.get("name")) and _is_int(r.get("uid"), 0, 1 << 32)):
            return "ns: bad 'name' or 'uid'"
        return None
    if op == "free":
        return None if _is_int(r.get("id"), 1, _ID_LIMIT) else "free: bad 'id'"
    if op != "put":
        return f"unknown op {op!r}"
    if not _is_int(r.get("id"), 1, _ID_LIMIT) or not _is_int(r.get("gen"), 0, 0x10000):
        return "put: bad 'id' or 'gen'"
    if "ord" in r and not _is_int(r["ord"], 1, _ID_LIMIT):
        return "put: bad 'ord'"
    try:
        ns = r.get("ns")
        if ns_ok is None or type(ns) is not str or ns not in ns_ok:
            validate_namespace(ns)
            if ns_ok is not None:
                ns_ok.add(ns)
        validate_key(r.get("key"))
    except InvalidArgument:
        return "put: bad 'ns' or 'key'"
    if r.get("nsuid") is not None and not _is_int(r["nsuid"], 0, 1 << 32):
        return "put: bad 'nsuid'"
    shape, nbytes = r.get("shape"), r.get("nbytes")
    known = False
    if specs is not None and type(shape) is list and type(nbytes) is int and _ints(shape):
        try:
            known = (r.get("kind"), r.get("dtype"), tuple(shape), nbytes) in specs
        except TypeError:  # (an unhashable kind or dtype: checked below, and refused)
            pass
    if not known:
        if r.get("kind") not in ("torch", "numpy") or not isinstance(r.get("dtype"), str) \
                or not 0 < len(r["dtype"]) <= 32:
            return "put: bad 'kind' or 'dtype'"
        if not (isinstance(shape, list) and len(shape) <= _MAX_DIMS and _ints(shape)) \
                or not _is_int(nbytes):
            return "put: bad 'shape' or 'nbytes'"
        if nbytes and not all(shape):
            return "put: 'nbytes' disagrees with 'shape'"
    ext, crc = r.get("ext"), r.get("crc")
    if not isinstance(ext, list) or not ext and nbytes:
        return "put: bad 'ext'"
    covered = 0
    for e in ext:
        if not (isinstance(e, list) and len(e) == 4 and _ints(e)):
            return "put: bad extent"
        dev, off, obj_off, n = e
        if off % PAGE:
            return f"put: extent {e} is not page-aligned"
        if dev >= ndrives or off + (n + PAGE - 1 if n else PAGE) // PAGE * PAGE > drive_bytes:
            return f"put: extent {e} is {_BEYOND}"
        if obj_off != covered:
            return "put: extents do not tile the object"
        covered += n
    if covered != nbytes:
        return "put: extents do not add up to 'nbytes'"
    if not (isinstance(crc, list) and len(crc) == -(-nbytes // BLOCK_BYTES)
            and _ints(crc, 0, 1 << 32)):
        return "put: bad 'crc'"
    if r.get("extra") is not None and not isinstance(r["extra"], dict):  # (written by earlier versions; unused)
        return "put: bad 'extra'"
    if r.get("home") not in (None, "nvme"):
        return "put: bad 'home'"
    return None


def _ns_root_ok(name: Any) -> bool:
    try:
        return "/" not in validate_namespace(name)
    except InvalidArgument:
        return False
