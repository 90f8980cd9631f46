"""The client library: ``Client.connect(...)``, the daemon's side of the contract
``tierstore.contract.Pool`` (the same methods and signatures as ``tierstore.Store``),
plus what only a daemon connection has: ``put_async`` / ``get_async``, paged
listings (``iter_keys``, ``iter_ls``, ``iter_namespaces``), ``ping`` and
``report_activations``.

Tensor bytes never cross the socket. At hello the daemon passes the host arena's
memfd; the client maps it once and copies straight into (put) or out of (get) the
block the daemon names, or hands out a view of it (checkout).

Length: one class, one method per request of the contract over the socket; every
CUDA call is in ``gpu``, read-only views in ``readonly``, the connection in
``connection``.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import logging
import os
import threading
import subprocess
import sys
import time
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from tierstore.arena import detach_mapping, map_arena_fd
from tierstore.batch import LeaseGroup, check_each
from tierstore._version import __version__
from tierstore.errors import CapacityExceeded, Closed, DaemonUnavailable, InvalidArgument, ProtocolError, TierstoreError
from tierstore.names import Handle, validate_key, validate_new_namespace
from tierstore.paths import client_socket_path
from tierstore.tensors import TensorSpec, aligned_empty, from_bytes, out_bytes, to_bytes

from .connection import Connection
from .gpu import cuda_usable, current_device, is_cuda, on_callers_stream, wait_on

__all__ = ["Client", "ClientLease"]

_STAGED_MAX = 64 << 10
"""Objects up to this size are put in one round trip through a per-connection staging area."""
_SLOT_BYTES = 4096
_SLOTS = 64
"""``put_async`` of an object up to ``_SLOT_BYTES`` copies it into one of ``_SLOTS`` slots
after the staging area and sends it without waiting: that many small puts in flight on
one connection, no thread each."""

_PART_MIN = 64 << 20
"""A put at least this large, whose commit writes to NVMe, is copied into the arena in
pieces the daemon begins writing as they land (``put_part``)."""
_PART_BYTES = 8 << 20
"""The size of those pieces. (Beside DeepSpeed's aio in one run, 8 MiB pieces put 64 and
256 MiB at 0.99 and 1.02x its speed, against 0.94x for one copy at 64 MiB and 1.01x for
32 MiB pieces at 256 MiB; 4 MiB chunks on the daemon's side did not help:
docs/benchmarks.md.)"""
_GET_PIECE_BYTES = 8 << 20
_MAX_PIECES = 32
"""A streamed get (``get_part``) is copied in at most this many pieces of at least
``_GET_PIECE_BYTES`` (the daemon's read chunk: 4 MiB pieces and 16 MiB ones copied out
slower, docs/benchmarks.md)."""

_NEEDS = frozenset({"ephemeral", "batch", "source", "unused", "each", "activations", "pages", "columns"})
"""What this client asks of the daemon beyond the protocol version (``hello``'s
``features``): a daemon without one of them is refused at connect, so no call has to
fall back for it."""

log = logging.getLogger(__name__)


def _wire(h: Handle | int | str) -> int:
    return int(Handle.parse(h))


_HINT_CHUNK = 8192
"""Handles per prefetch message (a message must fit the socket's send buffer)."""


class ClientLease:
    """A check-out through the daemon; ``tensor`` views the shared arena until release."""

    def __init__(self, client: "Client", reply: dict[str, Any]) -> None:
        self._client = client
        self._lid: int | None = reply["lid"]
        self.mode = reply["mode"]
        self._durable = reply["durable"]
        self.handle = Handle.parse(reply["handle"])
        spec = _spec_of(reply)
        client._pin_view(reply["offset"], spec.nbytes, read_only=self.mode == "r")
        if self.mode == "r":  # over the read-only mapping: a write through it never reaches the object
            self.tensor = _read_only_view(client._view(reply["offset"], spec.nbytes, read_only=True), spec)
        else:
            self.tensor = from_bytes(client._view(reply["offset"], spec.nbytes), spec)

    def release(self) -> None:
        """Check the object back in. Read leases and leases on volatile objects are
        released without waiting for the reply: the daemon handles such a check-in on
        its event loop as it arrives, so the connection's next request already sees the
        object checked in. A durable object's write check-in waits until its bytes are
        on NVMe."""
        token = self._take()
        if token is not None:
            lid, sync = token
            if sync:
                self._client._conn.request("release", lid=lid)
            else:
                self._client._conn.submit("release", lid=lid).add_done_callback(_log_release_error)

    def give_back(self) -> None:
        """Check the object back in as never written (``PoolLease.give_back``), without
        waiting for the reply."""
        token = self._take()
        if token is not None:
            self._client._conn.submit("release", lid=token[0], unused=True).add_done_callback(_log_release_error)

    def _take(self) -> tuple[int, bool] | None:
        """End this object's hold on the lease: (lease id, whether its check-in must wait
        for the write-back), or None if it was released already."""
        if self._lid is None:
            return None
        lid, self._lid = self._lid, None
        self.tensor = None
        return lid, self.mode != "r" and self._durable

    def __enter__(self) -> Any:
        return self.tensor

    def __exit__(self, *exc: Any) -> None:
        self.release()


_quiet_from_numpy = False


def _read_only_view(u8: np.ndarray, spec: TensorSpec) -> Any:
    """An ``r`` check-out's tensor over the read-only mapping (see ``readonly``)."""
    global _quiet_from_numpy
    if spec.kind != "torch":
        return from_bytes(u8, spec)  # NumPy: a view of read-only memory is not writeable
    from .readonly import read_only

    if not _quiet_from_numpy:
        # torch warns (once a process) that a non-writeable array makes a tensor whose
        # writes are undefined; ReadOnlyTensor refuses them, so the warning would mislead
        import warnings

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "The given NumPy array is not writable")
            t = from_bytes(u8, spec)
        _quiet_from_numpy = True
        return read_only(t)
    return read_only(from_bytes(u8, spec))


_ACT_GAUGES = frozenset({"bytes_in_flight", "held_bytes"})
"""Activation counters that are a state now, not a total (an offload that is done holds none)."""


def _log_hint_error(fut: Future) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.debug("prefetch hint failed: %s", fut.exception())


def _log_release_error(fut: Future) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.warning("check-in failed: %s", fut.exception())


def _log_part_error(fut: Future) -> None:
    # (put_part is a hint: the commit writes whatever it did not, and reports its own errors;
    # get_end after a get that failed: the stream may be gone already, with its connection)
    if not fut.cancelled() and fut.exception() is not None:
        log.debug("put_part / get_end failed: %s", fut.exception())


def _spec_of(r: dict[str, Any]) -> TensorSpec:
    return TensorSpec(r["kind"], r["dtype"], tuple(r["shape"]), int(r["nbytes"]))


class Client:
    """A connection to the node daemon, bound to one namespace."""

    def __init__(self, conn: Connection, namespace: str, hello: dict[str, Any], arena_fd: int, *,
                 prefault: bool = True) -> None:
        self._conn = conn
        self.namespace = namespace
        self.server = hello
        self._parts = {"parts": True} if "streams" in hello.get("features", ()) else {}
        """A get's field asking for a streamed get of a large object only on NVMe, where the daemon streams."""
        self._arena_fd = arena_fd
        huge = bool(hello.get("arena_huge"))
        self._mm, self._arena = map_arena_fd(arena_fd, int(hello["arena_bytes"]), huge=huge)
        # a second, read-only mapping of the same pages for the views of 'r' check-outs
        self._mm_ro, self._arena_ro = map_arena_fd(arena_fd, int(hello["arena_bytes"]), read_only=True, huge=huge)
        # page tables filled in the background, so connecting costs O(1), not O(arena)
        self._closing = False
        self._closed_why = "this client is closed: connect again"
        self._prefault_stop = threading.Event()
        self._prefault = threading.Thread(target=self._prefault_mappings, name="tierstore-prefault", daemon=True)
        if prefault:
            self._prefault.start()
        self._executor: ThreadPoolExecutor | None = None
        # both mappings are page-locked piece by piece on the first CUDA copy through them,
        # never here: connecting touches no CUDA (fork-safe, no context on GPU 0)
        from .gpu import ArenaPinning

        self._pinning = ArenaPinning(self._arena.ctypes.data, self._arena.nbytes)
        self._pinning_ro = ArenaPinning(self._arena_ro.ctypes.data, self._arena_ro.nbytes, read_only=True)
        if "torch" in sys.modules:  # tell `tierstore stat` (no reply awaited)
            self._report_pinning()
        self._staging: tuple[int, int] | None = None
        self._staging_retry_at = 0.0
        """Until when no staging area is asked for again (the last ask found no room)."""
        self._staging_lock = threading.Lock()  # one staged put at a time owns the staging area
        self._act_lock = threading.Lock()  # the activation offloads' counters (``report_activations``)
        self._acts: dict[int, dict[str, Any]] = {}
        self._acts_done: dict[str, Any] = {}
        self._slots: deque[int] = deque(range(_SLOTS))  # free put_async slots (deque ops are atomic)
        self._in_flight: deque[Future] = deque()  # put_async futures sent from slots, oldest first
        self._slabmap: Any = None  # the GPU tier's slabs, opened on the first GPU-tier transfer
        self._side: Any = None  # per-device copy streams
        self._gpu_lock = threading.Lock()
        self._gpu_ok: bool | None = None
        conn.on_abandon = weakref.WeakMethod(self._abandon)
        self._detached = [False]
        """Whether the mappings were turned private already (``_abandon``): done once, or a
        second remap would drop what was written through the views since."""
        self._collected = weakref.finalize(self, _collected, conn, [(self._mm, self._arena, False),
                                                                    (self._mm_ro, self._arena_ro, True)], arena_fd,
                                           (self._pinning, self._pinning_ro), self._detached)
        self._collected.atexit = False  # (at exit the process's end gives all of it back)
        """A client collected without ``close()``: its check-outs' views turn private before its
        connection (and with it every lease) ends, as at ``close()``."""

    def _own(self) -> None:
        """Before a call touches the arena or a thread of this client: refuse it in a forked
        child (``InvalidArgument``: it would overwrite the parent's staging area, or wait on
        threads the child does not have) and after ``close()`` (``Closed``)."""
        self._conn.check_own()
        if self._closing:
            raise Closed(self._closed_why)

    def _abandon(self, why: str) -> None:
        """The connection is being given up (a granting request was interrupted): views of
        check-outs turn private first, so nothing written through one reaches a block the
        daemon hands out again once the session ends."""
        self._closing = True
        self._closed_why = f"this client's connection was given up: {why}; connect again"
        self._prefault_stop.set()
        self._pinning.close()  # (no CUDA copy may reach the shared pages past here either)
        self._pinning_ro.close()
        if not self._detached[0]:
            self._detached[0] = True
            for view, read_only in ((self._arena, False), (self._arena_ro, True)):
                detach_mapping(view, self._arena_fd, read_only=read_only)

    @property
    def pinned(self) -> bool:
        """Every piece of the arena a CUDA copy went through is page-locked (see ``pinned_reason``)."""
        return self._pinning.pinned

    @property
    def pinned_reason(self) -> str:
        """Why ``pinned`` is what it is; the read-only mapping's reason too where it differs."""
        rw, ro = self._pinning.reason, self._pinning_ro.reason
        return rw if ro == rw else f"{rw}; read-only mapping: {ro}"

    def _report_pinning(self) -> None:
        self._conn.submit("client_info", pinned=self.pinned, pinned_reason=self.pinned_reason)

    def _pin_view(self, offset: int, nbytes: int, *, read_only: bool) -> None:
        """A check-out view's pieces, page-locked where this process already uses CUDA
        (its holder may copy it to a GPU: the optimizer's GPU update does)."""
        if (self._pinning_ro if read_only else self._pinning).ensure_if_cuda(offset, nbytes):
            self._report_pinning()

    # ------------------------------------------------------------------ connecting
    @classmethod
    def connect(cls, socket: str | None = None, namespace: str = "default", autostart: bool = False,
                timeout_s: float = 30.0, *, prefault: bool = True) -> "Client":
        """Connect to the daemon on ``socket`` (default: $TIERSTORE_SOCKET, else the standard
        path, else the machine's daemon at /run/tierstore/tierstore.sock where only it listens:
        ``tierstore.paths.client_socket_path``).

        ``autostart=True`` starts a daemon with the defaults in the background when
        none is listening (its log goes to ``~/.cache/tierstore/daemon.log``).
        ``prefault=False`` leaves the arena mapping's page tables to fill on first touch
        instead of on a background thread (O(arena) of kernel work): for short-lived
        processes that move little data, such as the CLI.
        """
        path = socket or os.environ.get("TIERSTORE_SOCKET") or client_socket_path()
        ns = validate_new_namespace(namespace)
        try:
            conn = Connection(path, timeout_s=timeout_s)
        except DaemonUnavailable:
            if not autostart:
                raise
            conn = _autostart(path, timeout_s)
        try:
            hello, fd = conn.hello(ns)
        except BaseException:
            conn.close()
            raise
        missing = _NEEDS - set(hello.get("features", ()))
        if missing:
            conn.close()
            os.close(fd)
            raise ProtocolError(f"the daemon on {path} (tierstore {hello.get('server_version', '?')}) lacks "
                                f"{', '.join(sorted(missing))}, which this client (tierstore {__version__}) uses; "
                                "install matching tierstore versions and restart the daemon")
        return cls(conn, ns, hello, fd, prefault=prefault)

    # ------------------------------------------------------------------ data
    def put(self, tensor: Any, key: str | None = None, tier: str | None = None, durable: bool = False, *,
            replace: bool = False, wait_s: float = 0.0, ephemeral: bool = False) -> Handle:
        """Store a copy of ``tensor``; returns its handle. ``ephemeral=True``: the daemon
        frees the object when this connection ends, however it ends (not with ``durable``)."""
        if tier == "gpu" and not self.server.get("gpu_tier"):
            raise InvalidArgument(f"the daemon has no GPU tier: {self.server.get('gpu_reason', 'not configured')}")
        eph = {"ephemeral": True} if ephemeral else {}  # the field only when set: most puts stay one field shorter
        self._own()  # (a put copies into the arena before its first message: say why here)
        if is_cuda(tensor) or tier == "gpu":
            return self._put_cuda(tensor, key, tier, durable, replace, wait_s, eph)
        u8, spec = to_bytes(tensor)
        key = validate_key(key)
        if spec.nbytes <= _STAGED_MAX and self._staging_lock.acquire(blocking=False):
            try:
                # small object: copy into this connection's staging area, one round trip
                area = self._staging_area()
                if area is not None:  # (else no room for one: the two-phase put below)
                    off = area[0]
                    if spec.nbytes:
                        self._arena[off:off + spec.nbytes] = u8
                    r = self._conn.request("put_staged", src=0, kind=spec.kind, dtype=spec.dtype,
                                           shape=list(spec.shape), nbytes=spec.nbytes, key=key, tier=tier,
                                           durable=durable, replace=replace, wait_s=float(wait_s), **eph)
                    return Handle.parse(r["handle"])
            finally:
                self._staging_lock.release()
        r = self._conn.request("put_reserve", kind=spec.kind, dtype=spec.dtype, shape=list(spec.shape),
                               nbytes=spec.nbytes, key=key, tier=tier, durable=durable, replace=replace,
                               wait_s=float(wait_s), **eph)
        try:
            if spec.nbytes:
                # the reservation makes this block ours until commit
                self._fill(r, u8, early=(tier == "nvme" or durable) and "parts" in self.server.get("features", ()))
        except BaseException:
            self._conn.submit("put_abort", rid=r["rid"])
            raise
        return Handle.parse(self._conn.request("put_commit", rid=r["rid"])["handle"])

    def _fill(self, r: dict[str, Any], u8: np.ndarray, *, early: bool) -> None:
        """Copy a put's bytes into its reserved block. With ``early`` (an object its commit
        writes to NVMe) and a large one, piece by piece, each piece announced with
        ``put_part`` (not waited for): the daemon writes what is there to NVMe while the
        rest is copied, so the commit has only the last piece to write."""
        off, n = r["offset"], u8.nbytes
        if not early or n < _PART_MIN:
            self._arena[off:off + n] = u8
            return
        for start in range(0, n, _PART_BYTES):
            end = min(start + _PART_BYTES, n)
            self._arena[off + start:off + end] = u8[start:end]
            if end < n:
                self._conn.submit("put_part", rid=r["rid"], upto=end).add_done_callback(_log_part_error)

    def get(self, handle: Handle | int | str, out: Any = None, *, stream: str = "default") -> Any:
        """A new CPU tensor (copy), or the bytes copied into ``out`` (CPU or CUDA).
        ``stream`` tags the access sequence for the prefetcher (e.g. "params" vs "optim")."""
        self._own()
        if is_cuda(out):
            return self._get_cuda(handle, out, stream)
        dev = self._gpu_readable()  # then a GPU-tier object is read where it is, not moved down
        r = None
        if self._staging_lock.acquire(blocking=False):
            try:
                area = self._staging_area()
                if area is not None:  # (else no room for one: a lease below)
                    r = self._conn.request("get", handle=_wire(handle), staged=True, stream=stream, device=dev,
                                           **self._parts)
                    if r.get("staged"):
                        # a small object: the daemon copied it into our staging area, no lease held
                        spec = _spec_of(r)
                        dst = out_bytes(out, spec) if out is not None else aligned_empty(spec.nbytes)
                        if spec.nbytes:
                            dst[:] = self._arena[area[0]:area[0] + spec.nbytes]
                        return out if out is not None else from_bytes(dst, spec)
            finally:
                self._staging_lock.release()
        if r is None:
            r = self._conn.request("get", handle=_wire(handle), stream=stream, device=dev, **self._parts)
        if "sid" in r:
            return self._get_streamed(r, out)
        try:
            spec = _spec_of(r)
            dst = out_bytes(out, spec) if out is not None else aligned_empty(spec.nbytes)
            if spec.nbytes and r.get("gpu_loc") is not None:
                import torch

                torch.from_numpy(dst).copy_(self._slabs().tensor(r["gpu_loc"], spec.nbytes))  # D2H, synchronous
            elif spec.nbytes:
                dst[:] = self._arena[r["offset"]:r["offset"] + spec.nbytes]
        finally:
            # the read lease only guards the copy above; its release needs no answer
            self._conn.submit("release", lid=r["lid"])
        return out if out is not None else from_bytes(dst, spec)

    def _get_streamed(self, r: dict[str, Any], out: Any) -> Any:
        """Copy a streamed get's object out piece by piece as the daemon reads it: one
        ``get_part`` per piece sent at once, each piece copied once its answer says its
        bytes are in and checked; then ``get_end`` gives the block back (its answer waited
        for: ``NotFound`` there, a stream the daemon ended as too old, fails the get)."""
        spec = _spec_of(r)
        off, n = r["offset"], spec.nbytes
        try:
            dst = out_bytes(out, spec) if out is not None else aligned_empty(n)
            piece = max(_GET_PIECE_BYTES, -(-n // _MAX_PIECES))
            ends = list(range(piece, n, piece)) + [n]
            parts = [self._conn.submit("get_part", sid=r["sid"], upto=end) for end in ends]
            start = 0
            for end, part in zip(ends, parts):
                self._conn.wait(part)
                dst[start:end] = self._arena[off + start:off + end]
                start = end
        except BaseException:
            self._conn.submit("get_end", sid=r["sid"]).add_done_callback(_log_part_error)
            raise
        # waited for: a stream the daemon ended meanwhile (it was open too long) may have had
        # its block reused under the copy, and then the get fails rather than return those bytes
        self._conn.request("get_end", sid=r["sid"])
        return out if out is not None else from_bytes(dst, spec)

    def checkout(self, handle: Handle | int | str, mode: str = "r", *, timeout_s: float | None = None,
                 stream: str = "default", source: Handle | int | str | None = None) -> ClientLease:
        """Lease an object (see ``Store.checkout``; ``source``: a ``w`` lease that starts with
        that object's bytes)."""
        r = self._conn.request("checkout", **self._checkout_fields(handle, mode, timeout_s, stream, source))
        r["mode"] = mode
        return ClientLease(self, r)

    def _checkout_fields(self, handle: Handle | int | str, mode: str, timeout_s: float | None, stream: str,
                         source: Handle | int | str | None) -> dict[str, Any]:
        if mode not in ("r", "rw", "w"):
            raise InvalidArgument(f"mode must be 'r', 'rw' or 'w', got {mode!r}")
        fields: dict[str, Any] = {"handle": _wire(handle), "mode": mode, "timeout_s": timeout_s, "stream": stream}
        if source is not None:
            if mode != "w":
                raise InvalidArgument(f"a check-out from a source is a 'w' check-out, got mode {mode!r}")
            fields["source"] = _wire(source)
        return fields

    def checkout_each(self, requests: Iterable[tuple[Handle | int | str, str, Handle | int | str | None]], *,
                      timeout_s: float | None = None, stream: str = "default") -> LeaseGroup:
        """Several independent check-outs in one message: one round trip instead of one
        per object. Each request is ``(handle, mode, source)`` as ``checkout`` takes them
        (``source`` None for none); each is a check-out of its own, recorded in the order
        given. If any fails, the daemon gives the others back unused (unchanged, as
        ``checkout_many`` gives back a failed batch, but for a check-out from a source:
        that object then holds the source's bytes) and the first error is raised.
        Returns a ``LeaseGroup`` (``release()`` checks every lease still held in with one
        message)."""
        reqs = list(requests)
        check_each(reqs)
        fields = [self._checkout_fields(h, m, timeout_s, stream, src) for h, m, src in reqs]
        r = self._conn.request("checkout_each", requests=[[f["handle"], f["mode"], f.get("source")] for f in fields],
                               timeout_s=timeout_s, stream=stream)
        leases = []
        for (_, mode, _), one in zip(reqs, r["leases"]):
            one["mode"] = mode
            leases.append(ClientLease(self, one))
        return LeaseGroup(leases, self._release_many)

    def checkout_many(self, handles: Sequence[Handle | int | str], mode: str | Sequence[str] = "r", *,
                      timeout_s: float | None = None, stream: str = "default") -> LeaseGroup:
        """Check out several objects in one round trip (``mode``: one for all, or one per
        object): all of them or, on an error, none. Returns a ``LeaseGroup`` whose
        ``release()`` checks in every lease still held with one message."""
        hs = [_wire(h) for h in handles]
        modes = mode if isinstance(mode, str) else list(mode)
        for m in [modes] if isinstance(modes, str) else modes:
            if m not in ("r", "rw", "w"):
                raise InvalidArgument(f"mode must be 'r', 'rw' or 'w', got {m!r}")
        r = self._conn.request("checkout_many", handles=hs, modes=modes, timeout_s=timeout_s, stream=stream)
        leases = []
        for i, one in enumerate(r["leases"]):
            one["mode"] = modes if isinstance(modes, str) else modes[i]
            leases.append(ClientLease(self, one))
        return LeaseGroup(leases, self._release_many)

    def _release_many(self, tokens: list[tuple[int, bool]]) -> None:
        lids = [lid for lid, _ in tokens]
        if any(sync for _, sync in tokens):
            self._conn.request("release_many", lids=lids)  # a durable write-back: wait until it is on NVMe
        else:
            self._conn.submit("release_many", lids=lids).add_done_callback(_log_release_error)

    def put_async(self, tensor: Any, key: str | None = None, tier: str | None = None, durable: bool = False,
                  **kw: Any) -> Future:
        """``put`` without waiting; the future's result is the handle. A small CPU tensor (up
        to 4 KiB) is copied and sent at once (up to 64 in flight on the connection, a 65th
        first waits for the oldest; the daemon serves them concurrently, so they may
        complete in any order); anything
        else is put on a background thread and must not change until the future completes.
        A CUDA tensor is copied after the work queued so far on the caller's current stream."""
        self._own()
        fut = self._put_pipelined(tensor, key, tier, durable, kw)
        if fut is not None:
            return fut
        return self._pool().submit(on_callers_stream(tensor), self.put, tensor, key, tier, durable, **kw)

    def _put_pipelined(self, tensor: Any, key: str | None, tier: str | None, durable: bool,
                       kw: dict[str, Any]) -> Future | None:
        """A small put sent from a staging slot without waiting, or None (no slot free, or
        not such a put)."""
        if is_cuda(tensor) or tier == "gpu" or kw.get("ephemeral") or set(kw) - {"replace", "wait_s", "ephemeral"}:
            return None
        u8, spec = to_bytes(tensor)
        if spec.nbytes > _SLOT_BYTES:
            return None
        key = validate_key(key)
        while not self._slots and self._in_flight:  # all slots in flight: wait for the oldest
            self._in_flight.popleft().exception()
        try:
            slot = self._slots.pop()
        except IndexError:  # other threads took them
            return None
        try:
            area = self._staging_area()
            if area is None:  # no room for one: the caller's other path
                self._slots.append(slot)
                return None
            off = area[0]
            src = _STAGED_MAX + slot * _SLOT_BYTES
            if spec.nbytes:
                self._arena[off + src:off + src + spec.nbytes] = u8
            out = _ReadsReplies(self._conn)
            self._conn.send_with("put_staged", _StagedPut(self._slots, slot, out), src=src, kind=spec.kind,
                                 dtype=spec.dtype, shape=list(spec.shape), nbytes=spec.nbytes, key=key, tier=tier,
                                 durable=durable, replace=bool(kw.get("replace", False)),
                                 wait_s=float(kw.get("wait_s", 0.0)))
        except BaseException:
            self._slots.append(slot)
            raise
        self._in_flight.append(out)
        while self._in_flight and self._in_flight[0].done():
            self._in_flight.popleft()
        return out

    def get_async(self, handle: Handle | int | str, out: Any = None, *, stream: str = "default") -> Future:
        """``get`` on a background thread; a CUDA ``out`` is written after the work queued so
        far on the caller's current stream (which may still be reading it), and under the
        caller's grad mode (``torch.no_grad()`` holds for the copy, as for ``get``)."""
        self._own()
        return self._pool().submit(on_callers_stream(out), _in_callers_grad_mode(self.get), handle, out, stream=stream)

    # ------------------------------------------------------------------ index
    def free(self, handle: Handle | int | str) -> None:
        self._conn.request("free", handle=_wire(handle))

    def lookup(self, key: str) -> Handle | None:
        h = self._conn.request("lookup", key=validate_key(key))
        return None if h is None else Handle.parse(h)

    def keys(self, prefix: str = "") -> list[str]:
        """Every key in this namespace starting with ``prefix``, sorted (fetched in pages)."""
        with _gc_paused():
            return list(self.iter_keys(prefix))

    def ls(self, prefix: str = "") -> list[dict[str, Any]]:
        """``info`` of every keyed object starting with ``prefix``, by key (fetched in pages)."""
        with _gc_paused():
            return list(self.iter_ls(prefix))

    def iter_keys(self, prefix: str = "", *, page: int | None = None) -> Iterator[str]:
        """The keys starting with ``prefix`` in key order, fetched a page (``page`` keys at
        most; default: the daemon's page) at a time, so millions need not be in memory at once.
        A key put or freed during the walk may or may not be seen; none is seen twice."""
        return self._pages("keys", "keys", prefix, page)

    def iter_ls(self, prefix: str = "", *, page: int | None = None) -> Iterator[dict[str, Any]]:
        """``ls`` a page at a time, as ``iter_keys``."""
        return self._pages("ls", "objects", prefix, page)

    def _pages(self, op: str, name: str, prefix: str, page: int | None) -> Iterator[Any]:
        # the next page is asked for as soon as this one's cursor is known, so the daemon
        # builds it while this one is turned into entries
        fields: dict[str, Any] = {"prefix": prefix, "page": True}
        if page is not None:
            fields["limit"] = page
        if op == "ls":
            fields["columns"] = True  # by column, not maps: a fraction of the bytes and the work
        pending = self._conn.submit(op, after=None, **fields)
        while pending is not None:
            r = self._conn.wait(pending)
            after = r["next"]
            pending = None if after is None else self._conn.submit(op, after=after, **fields)
            if op == "ls":
                yield from _entries(r)
            else:
                yield from r[name]

    def iter_namespaces(self) -> Iterator[tuple[str, dict[str, int]]]:
        """(namespace, {"objects", "bytes"}) of every namespace with objects, by name, a page at a time."""
        after = None
        while True:
            r = self._conn.request("namespaces", after=after)
            yield from r["namespaces"].items()
            after = r["next"]
            if after is None:
                return

    def info(self, handle: Handle | int | str) -> dict[str, Any]:
        return self._conn.request("info", handle=_wire(handle))

    def prefetch(self, handles: Iterable[Handle | int | str], *, wait: bool = True) -> None:
        """Hint: bring these up now. Returns once the daemon has queued them; ``wait=False``
        sends the hint without waiting for its answer (the connection's next request
        still comes after it; an error, such as an unknown handle, is only logged)."""
        hs = [_wire(h) for h in handles]
        # in messages of _HINT_CHUNK handles: one of 65 536 would not fit a socket's message
        futs = [self._conn.submit("prefetch", handles=hs[i:i + _HINT_CHUNK]) for i in range(0, len(hs), _HINT_CHUNK)]
        for f in futs:
            if wait:
                self._conn.wait(f)
            else:
                f.add_done_callback(_log_hint_error)

    def step(self) -> None:
        self._conn.request("step")

    def report_activations(self, counters: dict[str, Any], *, source: int = 0, final: bool = False) -> None:
        """Tell the daemon this process's activation-offload counters, for ``stat`` and the
        metrics (no reply awaited): those of ``source`` (one offload) added to the others'
        this client reported. ``final``: that offload is done; its totals stay counted, its
        bytes in flight and held no longer (and its peaks as the largest of any)."""
        with self._act_lock:
            if final:
                self._acts.pop(source, None)
                done = self._acts_done
                for k, v in counters.items():
                    if k in _ACT_GAUGES or not isinstance(v, (int, float)):
                        continue
                    done[k] = max(done.get(k, 0), v) if k.startswith("peak_") else done.get(k, 0) + v
            else:
                self._acts[source] = counters
            live: dict[str, Any] = {}
            for c in self._acts.values():
                for k, v in c.items():
                    if isinstance(v, (int, float)):
                        live[k] = live.get(k, 0) + v
            total = dict(self._acts_done)
            for k, v in live.items():  # a peak: the larger of a finished offload's and the live ones' together
                total[k] = max(total.get(k, 0), v) if k.startswith("peak_") else total.get(k, 0) + v
        self._conn.submit("client_info", activations=total).add_done_callback(_log_hint_error)

    def stat(self, *, ops: bool = False) -> dict[str, Any]:
        """The daemon's state (see DESIGN.md); ``ops=True`` adds per-op counts and latency histograms."""
        st = self._conn.request("stat", ops=ops)
        after = st.pop("namespaces_next", None)
        while after is not None:  # the table of namespaces comes a page at a time
            r = self._conn.request("namespaces", after=after)
            st["namespaces"].update(r["namespaces"])
            after = r["next"]
        return st

    def ping(self) -> None:
        self._conn.request("ping")

    def snapshot(self, dest: str, *, prefix: str = "", progress: bool | None = None) -> dict[str, Any]:
        """Export this namespace (keys under ``prefix``) to a Zarr v3 store (directory, .zip or URL)."""
        from tierstore.snapshot import snapshot

        return snapshot(self, dest, namespace=self.namespace, prefix=prefix, progress=progress)

    def restore(self, src: str, *, overwrite: bool = False, progress: bool | None = None) -> dict[str, Any]:
        """Import a snapshot into this namespace (``overwrite`` replaces existing keys)."""
        from tierstore.snapshot import restore

        return restore(self, src, overwrite=overwrite, progress=progress)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        # in this order: async puts and gets copy through the mappings below, and a copy may
        # still run on a side stream after its call returned; only then do the mappings go
        self._collected.detach()
        self._closing = True
        self._prefault_stop.set()
        forked = self._conn._parent is not None  # (a forked child: the replies, the threads are the parent's)
        while self._in_flight and not forked:  # pipelined puts: their replies
            self._in_flight.popleft().exception()
        self._in_flight.clear()
        if self._executor is not None and forked:
            self._executor = None
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self._side is not None:
            self._side.synchronize()
        if self._slabmap is not None:
            self._slabmap.close()
            self._slabmap = None
        self._pinning.close()
        self._pinning_ro.close()
        self._conn.drain()
        self._conn.close()
        if self._prefault.is_alive():
            self._prefault.join()  # it stops within one chunk; the mappings must outlive it
        views = ((self._mm, self._arena, False), (self._mm_ro, self._arena_ro, True))
        self._arena = self._arena_ro = np.empty(0, np.uint8)
        for mm, view, read_only in views:
            try:
                mm.close()
            except BufferError:
                # views of check-outs outlive the client: they keep private copy-on-write
                # pages from now on, so a write through one cannot reach the pool, whose
                # leases ended with the connection (once: an abandon may have done it)
                if not self._detached[0]:
                    detach_mapping(view, self._arena_fd, read_only=read_only)
                log.debug("arena still referenced by checked-out views; unmapped when they are collected")
        if self._arena_fd >= 0:
            os.close(self._arena_fd)
            self._arena_fd = -1

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _prefault_mappings(self) -> None:
        from tierstore.arena import prefault_mapping

        prefault_mapping(self._arena, self._prefault_stop)
        prefault_mapping(self._arena_ro, self._prefault_stop, read_only=True)

    def _view(self, offset: int, nbytes: int, *, read_only: bool = False) -> np.ndarray:
        if nbytes == 0:
            return np.empty(0, np.uint8)
        if offset < 0 or offset + nbytes > self._arena.nbytes:
            raise TierstoreError(f"daemon named arena bytes [{offset}, {offset + nbytes}) outside the arena")
        return (self._arena_ro if read_only else self._arena)[offset:offset + nbytes]

    def _gpu_readable(self) -> bool:
        """Can this process read the daemon's GPU tier (it has one, and CUDA works here)?"""
        if self._gpu_ok is None:
            self._gpu_ok = bool(self.server.get("gpu_tier")) and cuda_usable()
        return self._gpu_ok

    def _streams(self) -> Any:
        with self._gpu_lock:
            if self._side is None:
                from .gpu import SideStreams

                self._side = SideStreams()
            return self._side

    def _slabs(self) -> Any:
        """The daemon's GPU slabs, opened on the first GPU-tier transfer (never for host-tier traffic)."""
        with self._gpu_lock:
            if self._slabmap is None:
                from .gpu import SlabMap

                # attach first: the daemon keeps the slabs while this connection lives
                self._slabmap = SlabMap(self._conn.request("gpu_attach")["slabs"])
            return self._slabmap

    def _arena_pairs(self, dev: Any, offset: int, nbytes: int, to_arena: bool) -> list[tuple[Any, Any]]:
        """(dst, src) copies between the uint8 CUDA tensor ``dev`` and arena bytes
        ``[offset, offset + nbytes)``: one per registered piece, each piece page-locked first."""
        import torch

        view = torch.from_numpy(self._view(offset, nbytes))
        if self._pinning.ensure(offset, nbytes):
            self._report_pinning()
        pairs = []
        for off, n in self._pinning.spans(offset, nbytes):
            h, d = view[off - offset:off - offset + n], dev[off - offset:off - offset + n]
            pairs.append((h, d) if to_arena else (d, h))
        return pairs

    def _put_cuda(self, t: Any, key: str | None, tier: str | None, durable: bool, replace: bool,
                  wait_s: float, eph: dict[str, bool]) -> Handle:
        """A CUDA tensor goes device-to-device into the GPU tier (``tier="gpu"``) or
        device-to-host straight into its reserved arena block (pinned where registered),
        on a side stream after the caller's stream; never through a pageable staging copy."""
        import torch

        if isinstance(t, np.ndarray):
            t = torch.from_numpy(np.ascontiguousarray(t))
        elif not isinstance(t, torch.Tensor):
            raise InvalidArgument(f"expected a torch.Tensor or numpy.ndarray, got {type(t).__name__}")
        t = t.detach().contiguous()  # on the current stream: the caller's (put_async runs under it)
        dtype = str(t.dtype).removeprefix("torch.")
        nbytes = t.numel() * t.element_size()
        device = (t.device.index or 0) if t.is_cuda else current_device()
        where = {"device": self._slabs().devices.daemon(device)} if tier == "gpu" else {}
        side = self._streams()
        r = self._conn.request("put_reserve", kind="torch", dtype=dtype, shape=list(t.shape), nbytes=nbytes,
                               key=validate_key(key), tier=tier, durable=durable, replace=replace,
                               wait_s=float(wait_s), **where, **eph)
        try:
            if nbytes:
                src = t.reshape(-1).view(torch.uint8)
                if r.get("gpu_loc") is not None:
                    pairs = [(self._slabs().tensor(r["gpu_loc"], nbytes), src)]
                else:
                    pairs = self._arena_pairs(src, r["offset"], nbytes, to_arena=True)
                side.copy(pairs, f"cuda:{device}").synchronize()  # the bytes are there before commit
        except BaseException:
            self._conn.submit("put_abort", rid=r["rid"])
            raise
        return Handle.parse(self._conn.request("put_commit", rid=r["rid"])["handle"])

    def _get_cuda(self, handle: Handle | int | str, out: Any, stream: str) -> Any:
        import torch

        side = self._streams()
        r = self._conn.request("get", handle=_wire(handle), stream=stream, device=self._gpu_readable())
        try:
            spec = _spec_of(r)
            if str(out.dtype).removeprefix("torch.") != spec.dtype or out.numel() * out.element_size() != spec.nbytes:
                raise InvalidArgument(f"out must be {spec.dtype} with {spec.nbytes} bytes (shape {list(spec.shape)})")
            if not out.is_contiguous():
                raise InvalidArgument("out must be contiguous")
            if spec.nbytes:
                dst = out.reshape(-1).view(torch.uint8)
                if r.get("gpu_loc") is not None:
                    pairs = [(dst, self._slabs().tensor(r["gpu_loc"], spec.nbytes))]
                else:
                    pairs = self._arena_pairs(dst, r["offset"], spec.nbytes, to_arena=False)
                ev = side.copy(pairs, out.device)
                wait_on(out.device, ev)  # later work on out sees the bytes
                ev.synchronize()  # the read lease covers the copy: wait for it before releasing
        finally:
            self._conn.submit("release", lid=r["lid"])
        return out

    def _staging_area(self) -> tuple[int, int] | None:
        """This connection's staging area in the arena, asked for on first use; None while
        the host tier has no room for one: small puts and gets then take the two-phase put
        and a lease, as larger ones do (asked again at most once a second)."""
        if self._staging is None:
            if time.monotonic() < self._staging_retry_at:
                return None
            try:
                r = self._conn.request("staging", nbytes=_STAGED_MAX + _SLOTS * _SLOT_BYTES)
            except CapacityExceeded as e:
                log.debug("no staging area for now (%s): small puts and gets take the longer path", e)
                self._staging_retry_at = time.monotonic() + 1.0
                return None
            self._staging = (int(r["offset"]), int(r["nbytes"]))
        return self._staging

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="tierstore-client")
        return self._executor


class _StagedPut:
    """What a pipelined small put's reply goes to (``Connection.send_with``): its staging
    slot is free again (the daemon has copied the bytes out), and its future gets the handle."""

    __slots__ = ("slots", "slot", "out")

    def __init__(self, slots: list[int], slot: int, out: Future) -> None:
        self.slots, self.slot, self.out = slots, slot, out

    def done(self) -> bool:
        return self.out.done()

    def set_result(self, reply: Any) -> None:
        self.slots.append(self.slot)
        try:
            h = Handle.parse(reply["handle"])
        except Exception as e:  # a malformed reply fails this put, not the reader
            self.out.set_exception(ProtocolError(f"malformed put reply from the daemon: {e}"))
            return
        self.out.set_result(h)

    def set_exception(self, err: BaseException) -> None:
        self.slots.append(self.slot)
        self.out.set_exception(err)


class _ReadsReplies(Future):
    """The future of a request sent without waiting: ``result``/``exception`` read the
    connection's replies until it is done (nobody else may be reading them)."""

    def __init__(self, conn: Any) -> None:
        super().__init__()
        self._conn = conn

    def result(self, timeout: float | None = None) -> Any:
        if not self.done():
            self._conn.wait(self, timeout)
        return super().result(0)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self.done():
            try:
                self._conn.wait(self, timeout)
            except TimeoutError:
                raise
            except Exception:  # the failure is the future's own (an interrupt is the caller's)
                pass
        return super().exception(0)


def _in_callers_grad_mode(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, to run on another thread under the grad mode of the thread calling this
    (a per-thread setting: a pool thread's is on)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return fn
    enabled = torch.is_grad_enabled()

    def run(*args: Any, **kw: Any) -> Any:
        with torch.set_grad_enabled(enabled):
            return fn(*args, **kw)
    return run


def _collected(conn: Connection, mappings: list[tuple[Any, np.ndarray, bool]], fd: int, pinnings: tuple[Any, ...],
               detached: list[bool]) -> None:
    """What ``close()`` leaves behind, for a client garbage-collected without it: the replies
    of requests in flight read (a pipelined put's future gets its handle), the arena's
    page-locking released, each mapping unmapped or (views of check-outs still hold it)
    turned private copy-on-write, before the connection ends and the daemon takes the
    leases back."""
    conn.drain()
    for pinning in pinnings:
        pinning.close()
    for mm, view, read_only in mappings:
        try:
            mm.close()
        except BufferError:
            if not detached[0]:
                detach_mapping(view, fd, read_only=read_only)
    conn.close()
    try:
        os.close(fd)
    except OSError:
        pass


def _entries(page: dict[str, Any]) -> list[dict[str, Any]]:
    """An ``ls`` page's entries from its columns (a ``{"all": v}`` column holds one value
    for every row)."""
    try:
        n, names = page["n"], tuple(page["fields"])
        # a list held by every row is copied for each (shape, residency: each entry's own)
        cols = [(map(list, itertools.repeat(c["all"], n)) if type(c["all"]) is list else itertools.repeat(c["all"], n))
                if type(c) is dict else c for c in page["columns"]]
        if len(cols) != len(names) or not all(type(f) is str for f in names):
            raise ValueError
        return _entry_maker(names)(zip(*cols))
    except (KeyError, TypeError, ValueError):
        raise ProtocolError("malformed ls page from the daemon") from None


@functools.lru_cache(maxsize=8)
def _entry_maker(names: tuple[str, ...]) -> Callable[[Iterable[tuple]], list[dict[str, Any]]]:
    """A function turning rows into maps with ``names`` as keys: a map display with
    constant keys builds each entry in one step, about twice as fast as ``dict(zip(...))``.
    The source holds only ``repr``s of the names and integer subscripts."""
    items = ", ".join(f"{name!r}: r[{i}]" for i, name in enumerate(names))
    return eval(f"lambda rows: [{{{items}}} for r in rows]", {})  # noqa: S307 (no caller input)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """No cyclic garbage collection while a whole listing is built: a million new maps
    and lists would set off collection after collection, each walking every one so far
    (they hold no cycles; reference counting frees them)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _last_error(log_path: Path) -> str:
    """The last ERROR line of a daemon log (the reason it stopped), without its timestamp."""
    lines = log_path.read_text(errors="replace").splitlines()[-200:]
    errors = [ln for ln in lines if " ERROR " in ln]
    line = errors[-1] if errors else next((ln for ln in reversed(lines) if ln.strip()), "no log output")
    return line.split(": ", 1)[-1].strip() if " ERROR " in line else line.strip()


def _autostart(path: str, timeout_s: float) -> Connection:
    log_dir = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tierstore"
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / "daemon.log"
    with open(log_path, "ab") as logf:
        proc = subprocess.Popen([sys.executable, "-m", "tierstore.daemon", "--socket", path],
                                stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, start_new_session=True)
    log.info("started a tierstore daemon (pid %d) on %s; log in %s", proc.pid, path, log_path)
    deadline = time.monotonic() + timeout_s
    lost_race = False
    while time.monotonic() < deadline:
        exited = not lost_race and proc.poll() is not None
        try:
            return Connection(path, timeout_s=timeout_s)
        except DaemonUnavailable:
            pass
        if exited:
            why = _last_error(log_path)
            # another process started one at the same moment (the ranks of a job, each with
            # autostart): it holds the directories or the socket; connect to that one as it opens
            lost_race = " is in use by pid " in why or " is already serving " in why
            if not lost_race:
                raise DaemonUnavailable(f"the daemon started for you on {path} exited with status "
                                        f"{proc.returncode}: {why}; its log is {log_path}")
            log.info("the daemon started for %s found another starting (%s): connecting to that one", path, why)
        time.sleep(0.05)
    raise DaemonUnavailable(f"autostarted daemon (pid {proc.pid}) did not open {path} within {timeout_s} s; "
                            f"see {log_path}")
