"""Object index records: handles and per-object metadata. Bookkeeping only."""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidArgument, InvalidKey
from .nvme import Extent
from .tensors import TensorSpec

__all__ = ["Handle", "ObjectMeta", "validate_key", "validate_namespace"]

_ID_BITS = 48
_GEN_MASK = 0xFFFF


@dataclass(slots=True, frozen=True, order=True)
class Handle:
    """Names one object: a 48-bit id plus a 16-bit generation.

    A handle is a plain value: ``int(h)`` and ``str(h)`` round-trip through
    ``Handle.parse``. After a free (or a restart that lost a volatile object) the
    id's generation no longer matches and the handle is reported stale.
    """

    id: int
    gen: int

    def __int__(self) -> int:
        return (self.gen << _ID_BITS) | self.id

    def __index__(self) -> int:
        return int(self)

    def __str__(self) -> str:
        return f"{self.id}.{self.gen}"

    @classmethod
    def parse(cls, value: "Handle | int | str") -> "Handle":
        if isinstance(value, Handle):
            return value
        if isinstance(value, bool):
            raise InvalidArgument("a handle is a Handle, an int or an 'id.gen' string, not a bool")
        if isinstance(value, int):
            if value < 0 or value >= 1 << 64:
                raise InvalidArgument(f"handle {value} is out of range")
            return cls(value & ((1 << _ID_BITS) - 1), (value >> _ID_BITS) & _GEN_MASK)
        if isinstance(value, str):
            parts = value.split(".")
            if len(parts) == 2 and all(p.isdigit() for p in parts):
                oid, gen = int(parts[0]), int(parts[1])
                if oid < 1 << _ID_BITS and gen <= _GEN_MASK:
                    return cls(oid, gen)
            raise InvalidArgument(f"{value!r} is not a handle ('id.gen')")
        raise InvalidArgument(f"a handle is a Handle, an int or an 'id.gen' string, not {type(value).__name__}")


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
    host_valid: bool = False
    """The host block holds the current bytes."""
    nvme: list[Extent] | None = None
    crcs: list[int] | None = None
    nvme_valid: bool = False
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
    """``_drop`` has run (or is running): it runs once."""
    home: str | None = None
    """``"nvme"``: the object lives on NVMe and goes back down after each use (put with tier="nvme")."""
    prefetching: bool = False
    """The move in flight is a prefetch (whoever waits for it is a 'late' hit)."""
    version: int = 0
    """Bumped by every rw check-in, so a concurrent demotion of old bytes is discarded."""
    owner_uid: int | None = None
    ephemeral: Any = None
    """The connection that put it with ``ephemeral=True``: the object goes when it does."""
    gpu_loc: int | None = None
    """Location of the GPU-tier block holding the bytes (then the only copy; see gpu.py)."""
    record: dict[str, Any] | None = None
    """The last journal record written for this (durable) object; compaction rewrites it."""
    extra: dict[str, Any] = field(default_factory=dict)

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
                "crc": list(self.crcs or []), "extra": self.extra, "home": self.home}

    @classmethod
    def from_record(cls, r: dict[str, Any]) -> "ObjectMeta":
        spec = TensorSpec(r["kind"], r["dtype"], tuple(r["shape"]), int(r["nbytes"]))
        return cls(id=int(r["id"]), gen=int(r["gen"]), namespace=r["ns"], key=r.get("key"), spec=spec,
                   durable=True, nvme=[Extent.from_wire(e) for e in r["ext"]], crcs=list(r["crc"]),
                   nvme_valid=True, extra=dict(r.get("extra") or {}), home=r.get("home"))


_BAD_KEY_CHARS = frozenset({"Cc", "Cs", "Zl", "Zp"})
"""Controls (newline, tab, NUL, DEL, C1), lone surrogates (not UTF-8) and line/paragraph
separators: characters that break a listing or cannot be encoded."""


def validate_key(key: Any) -> str | None:
    if key is None:
        return None
    if not isinstance(key, str):
        raise InvalidKey(f"a key is a str, not {type(key).__name__}")
    if not key or len(key.encode("utf-8", "surrogatepass")) > 1024:
        raise InvalidKey("a key must be 1 to 1024 bytes long")
    if not key.isprintable():  # fast path: most keys are printable
        bad = next((ch for ch in key if unicodedata.category(ch) in _BAD_KEY_CHARS), None)
        if bad is not None:
            what = {"\0": "NUL", "\n": "a newline", "\r": "a carriage return", "\t": "a tab"}.get(bad) or \
                ("a lone surrogate, not UTF-8" if unicodedata.category(bad) == "Cs" else
                 unicodedata.name(bad, "a control character"))
            raise InvalidKey(f"key {key[:80]!r} contains {what} (U+{ord(bad):04X}), "
                             "which would break listings; use printable characters (e.g. '/' as a separator)")
    return key


def validate_namespace(ns: Any) -> str:
    if not isinstance(ns, str) or not ns or len(ns) > 255:
        raise InvalidArgument("a namespace is a non-empty str of at most 255 characters")
    if "\0" in ns or any(p in ("", ".", "..") for p in ns.split("/")):
        raise InvalidArgument(f"invalid namespace {ns!r}: use names like 'job-42' or 'job-42/rank3'")
    return ns
