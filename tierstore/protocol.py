"""The wire protocol shared by daemon and client: framing, message shapes, validation.

Control messages are msgpack maps over a Unix ``SOCK_SEQPACKET`` socket (one
message per packet, boundaries kept by the kernel). Every request carries an
integer ``id`` and a string ``op``; every reply carries the same ``id`` and either
``ok`` (the result) or ``err`` (``{code, message}``). The first request on a
connection must be ``hello``; its reply carries the host arena's memfd via
``SCM_RIGHTS``. Tensor bytes never travel on the socket.

A reply larger than ``PACKET_BYTES`` travels as consecutive fragment packets
(``{"frag": bytes, "more": bool}``; the client joins them and decodes the whole), for
clients that said ``fragments: true`` in hello: one SEQPACKET message can be no bigger
than the socket's send buffer. Listings are paged besides (``keys``/``ls`` with
``after``, ``namespaces``), so no caller needs a reply of unbounded size.

A client that said ``joined: true`` in hello may get several small replies in one packet:
a msgpack array of reply maps, in the order they were made (the replies to a burst of
requests read together leave together, one send instead of one each).
"""

from __future__ import annotations

from typing import Any

import msgpack

from .errors import InvalidArgument, ProtocolError, TierstoreError

__all__ = ["PROTOCOL_VERSION", "OPS", "encode", "decode", "reply_ok", "reply_err", "field", "MAX_REPLY_BYTES",
           "PACKET_BYTES", "PAGE_BYTES", "fragments"]

PROTOCOL_VERSION = 2
"""Bumped with every change a peer of the previous version would misread (2: the `staging`
op, `ls` pages by column)."""
MAX_REPLY_BYTES = 16 << 20
"""The largest reply the daemon builds (fragmented on the wire); larger: an error reply."""
PACKET_BYTES = 64 << 10
"""The largest single packet the daemon sends: well under any socket send buffer."""
PAGE_BYTES = 256 << 10
"""About how much one page of a listing (``keys``, ``ls``, ``namespaces``) holds."""

OPS = frozenset({
    "hello", "put_reserve", "put_part", "put_commit", "put_abort", "get", "get_part", "get_end", "checkout",
    "checkout_many", "checkout_each", "release",
    "release_many", "free", "lookup",
    "keys", "ls", "namespaces", "info", "prefetch", "step", "stat", "ping", "staging", "put_staged", "gpu_attach", "client_info",
})


def encode(msg: dict[str, Any]) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def decode(data: bytes, max_bytes: int) -> dict[str, Any]:
    """Parse one request; ``ProtocolError`` for anything that is not a well-formed map."""
    if len(data) > max_bytes:
        raise ProtocolError(f"message of {len(data)} bytes exceeds the limit of {max_bytes}")
    try:
        msg = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types for garbage
        raise ProtocolError(f"undecodable message: {type(e).__name__}") from None
    if not isinstance(msg, dict):
        raise ProtocolError("a message must be a msgpack map")
    return msg


def reply_ok(rid: int, result: Any) -> bytes:
    return encode({"id": rid, "ok": result})


def fragments(blob: bytes, size: int = PACKET_BYTES) -> list[bytes]:
    """A reply too big for one packet as fragment packets, in order."""
    n = len(blob)
    return [encode({"frag": blob[i:i + size], "more": i + size < n}) for i in range(0, n, size)]


def reply_err(rid: int | None, err: TierstoreError) -> bytes:
    return encode({"id": rid, "err": {"code": err.code, "message": err.message}})


_MISSING = object()


def field(msg: dict[str, Any], name: str, types: type | tuple[type, ...], default: Any = _MISSING, *,
          min_value: int | float | None = None, max_value: int | float | None = None) -> Any:
    """Fetch and type-check one field of a request; ``InvalidArgument`` when wrong."""
    v = msg.get(name, _MISSING)
    if v is _MISSING:
        if default is _MISSING:
            raise InvalidArgument(f"field {name!r} is required")
        return default
    if v is None and default is None:
        return None
    t = type(v)
    if (t is types or (type(types) is tuple and t in types)) and t is not float and min_value is None \
            and max_value is None:
        return v  # the common case, checked in full below: exactly a type asked for, no NaN, no bounds
    bad_bool = isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,))
    if not isinstance(v, types) or bad_bool:
        tn = "/".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
        raise InvalidArgument(f"field {name!r} must be {tn}, got {type(v).__name__}")
    if isinstance(v, float) and v != v:  # NaN passes every bound check: a timeout of NaN would never end
        raise InvalidArgument(f"field {name!r} must be a number, got NaN")
    if min_value is not None and v < min_value:
        raise InvalidArgument(f"field {name!r} must be >= {min_value}")
    if max_value is not None and v > max_value:
        raise InvalidArgument(f"field {name!r} must be <= {max_value}")
    return v
