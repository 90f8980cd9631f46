"""The names a caller gives the store: handles, keys and namespaces, and their checks.

A leaf module (it imports only the errors), so the client names objects without loading
the object index's structures.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass
from typing import Any

from .errors import InvalidArgument, InvalidKey

__all__ = ["Handle", "validate_key", "validate_namespace"]

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
            # ASCII decimal digits only ("²" is a digit to str.isdigit, not to int), and few
            # enough of them that int() neither fails nor takes long (an id has 48 bits)
            if len(parts) == 2 and all(0 < len(p) <= 20 and p.isascii() and p.isdecimal() for p in parts):
                oid, gen = int(parts[0]), int(parts[1])
                if oid < 1 << _ID_BITS and gen <= _GEN_MASK:
                    return cls(oid, gen)
            raise InvalidArgument(f"{value[:64]!r} is not a handle ('id.gen')")
        raise InvalidArgument(f"a handle is a Handle, an int or an 'id.gen' string, not {type(value).__name__}")


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


def validate_new_namespace(ns: Any) -> str:
    """``validate_namespace``, and printable: a name a client gives at hello is shown in
    listings and ``tierstore stat`` (controls, escapes and line separators are refused, as
    in keys). Names already in a journal are read back by ``validate_namespace`` alone."""
    ns = validate_namespace(ns)
    if not ns.isprintable() and any(unicodedata.category(ch) in _BAD_KEY_CHARS for ch in ns):
        raise InvalidArgument(f"invalid namespace {ns[:80]!r}: control characters and line separators would break "
                              "listings; use printable characters (e.g. 'job-42/rank3')")
    return ns


def validate_namespace(ns: Any) -> str:
    if not isinstance(ns, str) or not ns or len(ns) > 255:
        raise InvalidArgument("a namespace is a non-empty str of at most 255 characters")
    if "\0" in ns or any(p in ("", ".", "..") for p in ns.split("/")):
        raise InvalidArgument(f"invalid namespace {ns!r}: use names like 'job-42' or 'job-42/rank3'")
    return ns
