"""Request handlers: validate each request's fields and call the store.

One function per op, run on the event loop, which never waits and never touches the
disk. Each returns its reply; or ``Later`` (``tierstore.waits``): the rest of the
request, which the server runs on an op worker (decided up front for an op that always
needs one, or what a store ``try_*`` call answered); or, for a durable put, a
``Deferred`` reply: the group committer makes it durable and the server answers then.

Length: one short method per op of the protocol (``protocol.OPS`` builds the table),
each a few lines of field checks and one store call; split by op family, the table
and the shared field checks would be spread over several files.
"""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

from tierstore._version import __version__
from tierstore.errors import InvalidArgument, ProtocolError
from tierstore.groupcommit import Pending
from tierstore.index import Handle, validate_key
from tierstore.names import validate_new_namespace
from tierstore.batch import MAX_EACH
from tierstore.leasebatches import INLINE_BATCH
from tierstore.leases import MAX_BATCH
from tierstore.objectindex import INFO_FIELDS
from tierstore.protocol import OPS, PAGE_BYTES, PROTOCOL_VERSION, field
from tierstore.store import Store
from tierstore.streams import Stream
from tierstore.tensors import TensorSpec
from tierstore.trace import MAX_STREAM_CHARS
from tierstore.waits import Later

if TYPE_CHECKING:
    from .session import Session

__all__ = ["Deferred", "Handlers", "ITEMSIZE"]

ITEMSIZE = {
    "bool": 1, "int8": 1, "uint8": 1, "int16": 2, "uint16": 2, "int32": 4, "uint32": 4, "int64": 8, "uint64": 8,
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "complex64": 8, "complex128": 16, "complex32": 4,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,
}
"""Element sizes of the dtypes the daemon accepts (torch and NumPy names)."""

_MAX_NBYTES = 1 << 50
_MAX_DIMS = 64

ACTIVATION_FIELDS = frozenset({
    "bytes_in_flight", "peak_bytes_in_flight", "held_bytes", "peak_held_bytes", "offloaded_bytes",
    "fetched_bytes", "hits", "late", "misses", "backward_stall_s", "forward_stall_s"})
"""The activation-offload counters a client may report (``client_info``); ``stat`` sums them."""

_STAGING_MAX = 1 << 20
"""The largest staging area a connection may ask for (the client asks for 320 KiB)."""
_INLINE_KEYS = 4096
_INLINE_LS = 256
"""An unpaged ``ls`` of a namespace with more keys than this, and an ``ls`` page of more
rows, runs on a worker thread (an ``ls`` row costs the loop about what 16 keys do: at most
about one ``keys`` page's time either way); ``_INLINE_KEYS`` is the same for an unpaged
``keys``."""
PAGE_KEYS = 1024
PAGE_LS = 256
PAGE_ROWS = 4096
PAGE_NAMESPACES = 1024
"""Most entries in one page of ``keys``, ``ls``, ``namespaces`` (and at most about PAGE_BYTES)."""

_KEY_COLUMN = INFO_FIELDS.index("key")


def _columns(cols: list[list[Any]]) -> list[Any]:
    """An ``ls`` page's columns (``ObjectIndex.ls_columns``) for the wire: a column whose
    every row holds the same value sent once as ``{"all": value}`` (namespace, kind,
    dtype, shape and the lease columns nearly always are: a third of the bytes of rows,
    and a fraction of the objects for the client to decode). A column's values are all
    of one type, so equal means the same."""
    return [{"all": col[0]} if col and col.count(col[0]) == len(col) else col for col in cols]


def _handle(msg: dict[str, Any], name: str = "handle") -> Handle:
    return Handle.parse(field(msg, name, (int, str)))


def _spec(msg: dict[str, Any]) -> TensorSpec:
    kind = field(msg, "kind", str)
    if kind not in ("torch", "numpy"):
        raise InvalidArgument("field 'kind' must be 'torch' or 'numpy'")
    dtype = field(msg, "dtype", str)
    if dtype not in ITEMSIZE:
        raise InvalidArgument(f"unsupported dtype {dtype[:40]!r}")
    shape = field(msg, "shape", list)
    if len(shape) > _MAX_DIMS or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < _MAX_NBYTES
                                         for d in shape):
        raise InvalidArgument("field 'shape' must be a list of at most 64 non-negative ints")
    nbytes = field(msg, "nbytes", int, min_value=0, max_value=_MAX_NBYTES)
    if math.prod(shape) * ITEMSIZE[dtype] != nbytes:
        raise InvalidArgument(f"nbytes {nbytes} does not match shape {shape} of {dtype}")
    key = (kind, dtype, tuple(shape), nbytes)
    spec = _SPECS.get(key)
    if spec is None:
        if len(_SPECS) >= _MAX_SPECS:
            _SPECS.clear()
        spec = _SPECS[key] = TensorSpec(sys.intern(kind), sys.intern(dtype), key[2], nbytes)
    return spec


_SPECS: dict[tuple, TensorSpec] = {}
"""The specs of recent requests (frozen, so shared): a hundred thousand objects of a few
shapes hold a few specs, not a hundred thousand (each with its own strings and shape
tuple: ~200 bytes an object), as a replay's objects do (``ObjectMeta.from_record``)."""
_MAX_SPECS = 4096


class Deferred(NamedTuple):
    """A reply to come: a durable put's, once the group commit has made it durable; a
    streamed get's ``get_part``, once its bytes are read. The server answers with
    ``reply(result of done)`` then."""

    done: Pending
    reply: Callable[[Any], Any]
    acquires: bool = True
    """Whether the request may take something its connection holds (a commit may publish
    an ephemeral object), to release should the connection go before the reply: a
    ``get_part``, settled on an I/O worker, takes nothing."""


def _answer(result: Any, reply: Callable[[Any], Any]) -> Any:
    """The answer to a request whose store call returned ``result``: ``reply(result)``
    now; a ``Deferred`` of it for a durable commit's ``Pending``; for ``Later``, the rest,
    replying with ``reply`` of what it returns."""
    if isinstance(result, Later):
        return Later(lambda: reply(result.run()), result.give_back)
    if isinstance(result, Pending):
        return Deferred(result, reply)
    return reply(result)


def _staged_reply(spec: TensorSpec) -> dict[str, Any]:
    return {"staged": True, "kind": spec.kind, "dtype": spec.dtype, "shape": list(spec.shape), "nbytes": spec.nbytes}


def _handle_reply(h: Handle) -> dict[str, Any]:
    return {"handle": int(h)}


def _empty_reply(_: Any) -> dict[str, Any]:
    return {}


def _leases_reply(infos: list[Any]) -> dict[str, Any]:
    return {"leases": [_lease_reply(i) for i in infos]}


def _lease_reply(info) -> dict[str, Any]:
    s = info.spec
    return {"lid": info.lid, "offset": info.host_off, "handle": int(Handle(info.oid, info.gen)), "kind": s.kind,
            "dtype": s.dtype, "shape": list(s.shape), "nbytes": s.nbytes, "gpu_loc": info.gpu_loc,
            "durable": info.durable}


def _landed_reply(landed: int) -> dict[str, Any]:
    return {"landed": landed}


def _get_reply(got) -> dict[str, Any]:
    """A get's answer: a lease's, or a streamed get's (``sid``: ask ``get_part``, then ``get_end``)."""
    if not isinstance(got, Stream):
        return _lease_reply(got)
    s = got.meta.spec
    return {"sid": got.sid, "offset": got.offset, "handle": int(got.meta.handle), "kind": s.kind, "dtype": s.dtype,
            "shape": list(s.shape), "nbytes": s.nbytes, "durable": got.meta.durable}


def _stream(msg: dict[str, Any]) -> str:
    """The access stream a get or check-out is recorded under (a short name)."""
    stream = msg.get("stream", "default")
    if type(stream) is str and len(stream) <= MAX_STREAM_CHARS:
        return stream  # (the common case; the checks below say what is wrong otherwise)
    stream = field(msg, "stream", str, "default")
    if len(stream) > MAX_STREAM_CHARS:
        raise InvalidArgument(f"field 'stream' is {len(stream)} characters; at most {MAX_STREAM_CHARS}")
    return stream


class Handlers:
    def __init__(self, store: Store, stats: Callable[[int], dict[str, Any]]) -> None:
        self.store = store
        self._server_stats = stats
        # one registry of ops, the protocol's: each is the method of its name
        self.table: dict[str, Callable[["Session", dict[str, Any]], Any]] = {op: getattr(self, op) for op in OPS}

    # -- session ---------------------------------------------------------------------------
    def hello(self, sess: "Session", msg: dict[str, Any]) -> Any:
        version = field(msg, "version", int)
        if version != PROTOCOL_VERSION:
            raise ProtocolError(f"client speaks protocol {version}, this daemon speaks {PROTOCOL_VERSION}; "
                                "install matching tierstore versions")
        ns = validate_new_namespace(field(msg, "namespace", str))
        # a namespace is claimed by its first put, so `tierstore stat` claims nothing
        self.store.daemon.check_namespace(ns, sess.cred.uid)
        fragments, joined = field(msg, "fragments", bool, False), field(msg, "joined", bool, False)
        # (bound only once every field is good: a refused hello leaves the connection without one)
        sess.namespace, sess.fragments, sess.joined = ns, fragments, joined
        return {"version": PROTOCOL_VERSION, "server_version": __version__, "arena_bytes": self.store.arena.size,
                "arena_huge": self.store.arena.advises_huge,
                "session": sess.cid, "pid": sess.server_pid, "gpu_tier": self.store.gpu is not None,
                "gpu_reason": self.store.daemon.gpu_reason,
                "features": ["ephemeral", "batch", "source", "unused", "each", "activations", "pages", "columns",
                             "parts", "streams"]}

    def client_info(self, sess: "Session", msg: dict[str, Any]) -> Any:
        """What the client reports about itself for ``stat``: whether its mapping of the
        arena is page-locked, and why not; its activation-offload counters."""
        if "pinned" in msg:
            sess.pinned = field(msg, "pinned", bool)
            sess.pinned_reason = field(msg, "pinned_reason", str, "")[:300]
        acts = field(msg, "activations", dict, None)
        if acts is not None:
            sess.activations = {k: float(v) for k, v in acts.items()
                                if k in ACTIVATION_FIELDS and isinstance(v, (int, float)) and not isinstance(v, bool)}
        return {}

    def gpu_attach(self, sess: "Session", msg: dict[str, Any]) -> Any:
        """The client opens the GPU tier's slabs (CUDA IPC); they stay allocated until it disconnects."""
        return {"slabs": self.store.daemon.gpu_attach(sess)}

    # -- puts ------------------------------------------------------------------------------
    def _put_args(self, sess: "Session", msg: dict[str, Any]) -> dict[str, Any]:
        return {"key": validate_key(field(msg, "key", str, None)), "tier": field(msg, "tier", str, None),
                "durable": field(msg, "durable", bool, False), "replace": field(msg, "replace", bool, False),
                "ephemeral": field(msg, "ephemeral", bool, False),
                "wait_s": float(field(msg, "wait_s", (int, float), 0.0, min_value=0, max_value=3600)),
                "namespace": sess.namespace}

    def _put(self, sess: "Session", now: Callable[[], Any], later: Callable[[], Any],
             reply: Callable[[Any], Any]) -> Any:
        """A put: ``now()`` (a store ``try_*`` call); but the namespace's first put claims it,
        which appends to the journal: that one is ``later()`` on an op worker, after the claim."""
        if self.store.daemon.namespace_owner(sess.namespace) is None:
            def first() -> Any:
                self.store.daemon.claim_namespace(sess.namespace, sess.cred.uid)
                return reply(later())
            return Later(first)
        return _answer(now(), reply)

    def put_reserve(self, sess: "Session", msg: dict[str, Any]) -> Any:
        spec = _spec(msg)
        args = {**self._put_args(sess, msg), "owner": sess,
                "device": field(msg, "device", int, 0, min_value=0, max_value=255)}
        d = self.store.daemon
        return self._put(sess, lambda: d.try_reserve_put(spec, **args), lambda: d.reserve_put(spec, **args),
                         lambda res: {"rid": res.rid, "offset": res.host_off, "gpu_loc": res.gpu_loc})

    def staging(self, sess: "Session", msg: dict[str, Any]) -> Any:
        nbytes = field(msg, "nbytes", int, min_value=4096, max_value=_STAGING_MAX)
        off, n = self.store.daemon.staging_area(sess, nbytes, sess.cred.uid)
        return {"offset": off, "nbytes": n}

    def put_staged(self, sess: "Session", msg: dict[str, Any]) -> Any:
        spec = _spec(msg)
        src = field(msg, "src", int, min_value=0)
        args = self._put_args(sess, msg)
        d = self.store.daemon
        return self._put(sess, lambda: d.try_put_staged(sess, src, spec, **args),
                         lambda: d.put_staged(sess, src, spec, **args), _handle_reply)

    def put_commit(self, sess: "Session", msg: dict[str, Any]) -> Any:
        rid = field(msg, "rid", int, min_value=0)
        return _answer(self.store.daemon.try_commit_put(rid, owner=sess), _handle_reply)

    def put_part(self, sess: "Session", msg: dict[str, Any]) -> Any:
        rid = field(msg, "rid", int, min_value=0)
        upto = field(msg, "upto", int, min_value=1)
        return _answer(self.store.daemon.fill_put(rid, upto, owner=sess), lambda sent: {"sent": sent or 0})

    def put_abort(self, sess: "Session", msg: dict[str, Any]) -> Any:
        return _answer(self.store.daemon.abort_put(field(msg, "rid", int, min_value=0), owner=sess), lambda _: {})

    # -- leases ----------------------------------------------------------------------------
    def get(self, sess: "Session", msg: dict[str, Any]) -> Any:
        h = _handle(msg)
        stream = _stream(msg)
        d = self.store.daemon
        if field(msg, "staged", bool, False):
            staged = d.try_get_staged(sess, h, namespace=sess.namespace, stream=stream)
            if type(staged) is TensorSpec:  # the bytes wait in the staging area; no lease to release
                return _staged_reply(staged)
            if staged is not None:  # (not None: too big for the staging area, so a lease)
                return _answer(staged, _staged_reply)
        device = field(msg, "device", bool, False)
        if field(msg, "parts", bool, False):  # a large object only on NVMe streams; any other: a lease
            return _answer(d.try_get_streamed(h, owner=sess, namespace=sess.namespace, stream=stream, device=device),
                           _get_reply)
        return _answer(d.try_checkout(h, "r", owner=sess, namespace=sess.namespace, stream=stream, device=device),
                       _lease_reply)

    def get_part(self, sess: "Session", msg: dict[str, Any]) -> Any:
        sid = field(msg, "sid", int, min_value=0)
        upto = field(msg, "upto", int, min_value=1)
        landed = self.store.daemon.get_part(sid, upto, owner=sess)
        if isinstance(landed, Pending):
            return Deferred(landed, _landed_reply, acquires=False)
        return _landed_reply(landed)

    def get_end(self, sess: "Session", msg: dict[str, Any]) -> Any:
        self.store.daemon.get_end(field(msg, "sid", int, min_value=0), owner=sess)
        return {}

    def checkout(self, sess: "Session", msg: dict[str, Any]) -> Any:
        mode = field(msg, "mode", str, "r")
        timeout_s = field(msg, "timeout_s", (int, float), None, min_value=0, max_value=86400)
        d = self.store.daemon
        if msg.get("source") is not None:
            if mode != "w":
                raise InvalidArgument(f"a check-out from a source is a 'w' check-out, got mode {mode!r}")
            return _answer(d.try_checkout_from(_handle(msg), _handle(msg, "source"), owner=sess,
                                               namespace=sess.namespace, timeout_s=timeout_s, stream=_stream(msg)),
                           _lease_reply)
        return _answer(d.try_checkout(_handle(msg), mode, owner=sess, namespace=sess.namespace, timeout_s=timeout_s,
                                      stream=_stream(msg), device=field(msg, "device", bool, False)), _lease_reply)

    def checkout_many(self, sess: "Session", msg: dict[str, Any]) -> Any:
        hs = field(msg, "handles", list)
        most = _batch_most(sess, MAX_BATCH)
        if not 1 <= len(hs) <= most:
            raise InvalidArgument(f"a batch check-out takes 1 to {most} objects, got {len(hs)}{_no_fragments(sess)}")
        modes = field(msg, "modes", (str, list), "r")
        if isinstance(modes, str):
            modes = [modes] * len(hs)
        if not all(isinstance(m, str) for m in modes):
            raise InvalidArgument("field 'modes' must be a str or a list of str")
        timeout_s = field(msg, "timeout_s", (int, float), None, min_value=0, max_value=86400)
        return _answer(self.store.daemon.try_checkout_many([Handle.parse(h) for h in hs], modes, owner=sess,
                                                           namespace=sess.namespace, timeout_s=timeout_s,
                                                           stream=_stream(msg)), _leases_reply)

    def checkout_each(self, sess: "Session", msg: dict[str, Any]) -> Any:
        reqs = field(msg, "requests", list)
        most = _batch_most(sess, MAX_EACH)
        if not 1 <= len(reqs) <= most:
            raise InvalidArgument(f"checkout_each takes 1 to {most} check-outs, got {len(reqs)}{_no_fragments(sess)}")
        parsed = []
        for i, r in enumerate(reqs):
            if not isinstance(r, list) or len(r) != 3 or not isinstance(r[1], str) \
                    or not all(x is None or (isinstance(x, (int, str)) and not isinstance(x, bool))
                               for x in (r[0], r[2])) or r[0] is None:
                raise InvalidArgument(f"check-out #{i}: expected [handle, mode, source or nil]")
            parsed.append((Handle.parse(r[0]), r[1], None if r[2] is None else Handle.parse(r[2])))
        timeout_s = field(msg, "timeout_s", (int, float), None, min_value=0, max_value=86400)
        return _answer(self.store.daemon.try_checkout_each(parsed, owner=sess, namespace=sess.namespace,
                                                           timeout_s=timeout_s, stream=_stream(msg)), _leases_reply)

    def release(self, sess: "Session", msg: dict[str, Any]) -> Any:
        lid = field(msg, "lid", int, min_value=0)
        if field(msg, "unused", bool, False):  # never written: as if not taken
            rest = self.store.daemon.try_give_back(lid, owner=sess)
        else:
            rest = self.store.daemon.try_release(lid, owner=sess)
        return {} if rest is None else _answer(rest, _empty_reply)

    def release_many(self, sess: "Session", msg: dict[str, Any]) -> Any:
        lids = field(msg, "lids", list)
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in lids):
            raise InvalidArgument("field 'lids' must be a list of lease ids (non-negative ints)")
        return _answer(self.store.daemon.try_release_many(lids, owner=sess), _empty_reply)

    # -- index -----------------------------------------------------------------------------
    def free(self, sess: "Session", msg: dict[str, Any]) -> Any:
        h = _handle(msg)
        # always on an op worker: it may append to the journal or wait for a copy in flight
        return Later(lambda: _empty_reply(self.store.daemon.free(h, sess.namespace, sess)))

    def lookup(self, sess: "Session", msg: dict[str, Any]) -> Any:
        h = self.store.daemon.lookup(field(msg, "key", str), sess.namespace)
        return None if h is None else int(h)

    # A listing with ``page: true`` answers one page, ``{"keys"|"objects": [...], "next": cursor}``:
    # the entries after the key ``after``, at most ``limit`` and about PAGE_BYTES; ``next``
    # (the last key, or nil at the end) is the next request's ``after``. Each page costs
    # O(log n + page) on the event loop. Without ``page``: the whole list, as one reply.
    def _page_args(self, msg: dict[str, Any], most: int) -> tuple[str, str | None, int]:
        return (field(msg, "prefix", str, ""), field(msg, "after", str, None),
                field(msg, "limit", int, most, min_value=1, max_value=most))

    def _whole_list(self, sess: "Session", listing: Callable[[], Any], inline: int) -> Any:
        """An unpaged listing: on an op worker when the namespace is big enough to hold up the event loop."""
        if self.store.daemon.key_count(sess.namespace) > inline:
            return Later(listing)
        return listing()

    def keys(self, sess: "Session", msg: dict[str, Any]) -> Any:
        if not field(msg, "page", bool, False):
            prefix = field(msg, "prefix", str, "")
            return self._whole_list(sess, lambda: self.store.keys(prefix, namespace=sess.namespace), _INLINE_KEYS)
        prefix, after, limit = self._page_args(msg, PAGE_KEYS)
        keys = self.store.key_names(prefix, after, limit, namespace=sess.namespace)
        size = 0
        for i, k in enumerate(keys):
            size += len(k) + 5
            if size >= PAGE_BYTES:
                del keys[i + 1:]
                break
        return {"keys": keys, "next": keys[-1] if keys and (len(keys) == limit or size >= PAGE_BYTES) else None}

    def ls(self, sess: "Session", msg: dict[str, Any]) -> Any:
        if not field(msg, "page", bool, False):
            prefix = field(msg, "prefix", str, "")
            return self._whole_list(sess, lambda: self.store.ls(prefix, namespace=sess.namespace), _INLINE_LS)
        if field(msg, "columns", bool, False):
            prefix, after, limit = self._page_args(msg, PAGE_ROWS)

            def page() -> dict[str, Any]:
                cols = self.store.daemon.ls_columns(prefix, after, limit, sess.namespace)
                keys = cols[_KEY_COLUMN]
                return {"fields": INFO_FIELDS, "n": len(keys), "columns": _columns(cols),
                        "next": keys[-1] if len(keys) == limit else None}
            return page() if min(limit, self.store.daemon.key_count(sess.namespace)) <= _INLINE_LS else Later(page)
        prefix, after, limit = self._page_args(msg, PAGE_LS)
        rows = self.store.ls_page(prefix, after, limit, namespace=sess.namespace)
        return {"objects": rows, "next": rows[-1]["key"] if len(rows) == limit else None}

    def namespaces(self, sess: "Session", msg: dict[str, Any]) -> Any:
        """One page of the per-namespace table of ``stat``, in name order after ``after``."""
        after = field(msg, "after", str, None)

        def page() -> dict[str, Any]:
            mine = self.store.daemon.stat_namespaces_of(sess.cred.uid, after, PAGE_NAMESPACES + 1)
            return _namespace_page(self.store.stat_namespaces(after, PAGE_NAMESPACES + 1) if mine is None else mine)
        return self._off_loop_if_walking(sess, page)

    def info(self, sess: "Session", msg: dict[str, Any]) -> Any:
        return self.store.info(_handle(msg), namespace=sess.namespace)

    def prefetch(self, sess: "Session", msg: dict[str, Any]) -> Any:
        hs = field(msg, "handles", list)
        if len(hs) > 65536:
            raise InvalidArgument("at most 65536 handles per prefetch")

        def hint() -> dict:
            self.store.daemon.prefetch([Handle.parse(h) for h in hs], sess.namespace, sess)
            return {}
        # a long hint is looked up on an op worker: tens of thousands of handles would hold the loop up
        return Later(hint) if len(hs) > INLINE_BATCH else hint()

    def step(self, sess: "Session", msg: dict[str, Any]) -> Any:
        return _answer(self.store.daemon.try_step(sess), lambda _: {})

    def stat(self, sess: "Session", msg: dict[str, Any]) -> Any:
        return self._off_loop_if_walking(sess, lambda: self._stat(sess, msg))

    def _off_loop_if_walking(self, sess: "Session", answer: Callable[[], Any]) -> Any:
        """``answer()``, on an op worker when there are more than a page of namespaces: a
        client not running as root sees its uid's, found by one range of the table for each
        root namespace its uid owns (which may be many)."""
        if sess.cred.uid != 0 and self.store.daemon.namespace_count() > PAGE_NAMESPACES:
            return Later(answer)
        return answer()

    def _stat(self, sess: "Session", msg: dict[str, Any]) -> Any:
        st = self.store.stat(namespace_limit=PAGE_NAMESPACES + 1)
        st.update(self._server_stats(sess.cred.uid))
        mine = self.store.daemon.stat_namespaces_of(sess.cred.uid, None, PAGE_NAMESPACES + 1)
        if mine is not None:  # another uid's namespaces are not this client's to see, nor their number
            st["namespaces"] = mine
            st["namespaces_total"] = self.store.daemon.namespace_count_of(sess.cred.uid)
        # the table of namespaces is one page: the rest through ``namespaces`` from "namespaces_next"
        page = _namespace_page(st["namespaces"])
        st["namespaces"], st["namespaces_next"] = page["namespaces"], page["next"]
        if not field(msg, "ops", bool, False):  # the latency histograms only when asked for
            st.pop("ops", None)
        return st

    def ping(self, sess: "Session", msg: dict[str, Any]) -> Any:
        return {}


_UNFRAGMENTED_BATCH = 256
"""The most check-outs in one batch for a client that takes no fragmented replies: their
reply must fit one message (a lease's entry is at most a few hundred bytes), or the
leases would be taken and the reply that names them could not be sent."""


def _batch_most(sess: "Session", most: int) -> int:
    return most if sess.fragments else min(most, _UNFRAGMENTED_BATCH)


def _no_fragments(sess: "Session") -> str:
    return "" if sess.fragments else " (a client that takes no fragmented replies; say fragments: true at hello)"


def _namespace_page(table: dict[str, Any]) -> dict[str, Any]:
    """A page of the namespace table from up to PAGE_NAMESPACES + 1 entries in name order:
    the first PAGE_NAMESPACES, and the cursor when there are more."""
    names = list(table)[:PAGE_NAMESPACES]
    return {"namespaces": {n: table[n] for n in names}, "next": names[-1] if len(table) > len(names) else None}
