"""The store: one pool of tiers (host arena + NVMe), an object index, leases and placement.

The store owns the invariants: where each object lives, who holds it, what may move.
Bytes move through ``Arena`` (memory) and ``NvmeTier`` (disk); the eviction order
comes from a policy object. The daemon serves this same class over a socket; the
in-process API below is the same contract as ``tierstore.client.Client``.

Locking: one condition variable (``_cv``) guards every index field. Disk I/O and
large copies run with it released; an object being moved is flagged ``moving`` and
an object being copied holds a ``pin``, and whoever waits on those waits on ``_cv``.
The journal lock is always taken before ``_cv``, never the other way around.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from ._version import __version__
from .allocator import ExtentAllocator
from .arena import Arena
from .config import Config
from .engine import select_engine
from .errors import (Busy, CapacityExceeded, Closed, InvalidArgument, KeyExists, NotFound,
                     StaleHandle, TierstoreError)
from .index import Handle, ObjectMeta, validate_key, validate_namespace
from .hostindex import HostIndexLog
from .journal import Journal
from .nvme import NvmeTier
from .policy import make_policy
from .prefetch import Prefetcher
from .tensors import TensorSpec, aligned_empty, from_bytes, out_bytes, to_bytes
from .units import PAGE, align_up

__all__ = ["Store", "Lease", "Reservation", "LeaseInfo", "WouldBlock"]

log = logging.getLogger(__name__)

_TIERS = (None, "host", "nvme", "gpu")
_LOCAL = "local"  # owner of leases taken through the in-process API
_PREFETCH_WAIT_S = 1.0


class WouldBlock(Exception):
    """Internal: a ``nowait=True`` call would have to wait or touch the disk.

    The daemon's event loop calls the store with ``nowait=True`` and, on this,
    hands the request to a worker thread instead; it never reaches a client.
    """


@dataclass(slots=True)
class Reservation:
    """First phase of a two-phase put: a host block the writer fills, then commits."""

    rid: int
    owner: Any
    host_off: int
    meta: ObjectMeta
    tier: str | None
    replace: bool


@dataclass(slots=True)
class LeaseInfo:
    lid: int
    owner: Any
    oid: int
    gen: int
    mode: str
    host_off: int
    spec: TensorSpec
    since: float


class Lease:
    """A check-out: ``tensor`` is a zero-copy view into the host arena, valid until release.

    Use as a context manager; leaving the block checks the object back in. After a
    ``rw`` lease the object is dirty (and, if durable, written back before release
    returns).
    """

    def __init__(self, store: "Store", info: LeaseInfo, tensor: Any) -> None:
        self._store = store
        self._info = info
        self.tensor = tensor
        self.handle = Handle(info.oid, info.gen)
        self.mode = info.mode

    def release(self) -> None:
        if self._info is not None:
            info, self._info = self._info, None
            self.tensor = None
            self._store.release(info.lid)

    def __enter__(self) -> Any:
        return self.tensor

    def __exit__(self, *exc: Any) -> None:
        self.release()


class _NamespaceView:
    """The store's API bound to one namespace (what snapshot/restore talk to)."""

    def __init__(self, store: "Store", namespace: str) -> None:
        self._s, self._ns = store, namespace

    def ls(self, prefix: str = "") -> list[dict[str, Any]]:
        return self._s.ls(prefix, namespace=self._ns)

    def keys(self, prefix: str = "") -> list[str]:
        return self._s.keys(prefix, namespace=self._ns)

    def get(self, handle: Any) -> Any:
        return self._s.get(handle, namespace=self._ns)

    def put(self, tensor: Any, key: str | None = None, **kw: Any) -> Handle:
        return self._s.put(tensor, key, namespace=self._ns, **kw)

    def free(self, handle: Any) -> None:
        self._s.free(handle, namespace=self._ns)


class Store:
    """An in-process tiered tensor store (host arena + NVMe), usable without a daemon."""

    def __init__(self, config: Config | None = None, *, namespace: str = "default",
                 inherited_fds: dict[str, int] | None = None, **overrides: Any) -> None:
        """``inherited_fds`` (``{"arena": fd, "index": fd}``, from systemd's fd store) hands
        back the host arena and its index of a previous daemon: its host-resident objects,
        volatile ones included, are adopted instead of lost."""
        cfg = config or Config()
        if overrides:
            cfg = dataclasses.replace(cfg, **overrides)
        self.config = cfg = cfg.resolved()
        self.namespace = validate_namespace(namespace)
        self._started = time.monotonic()
        self._cv = threading.Condition(threading.Lock())
        self._closed = False
        self._objects: dict[int, ObjectMeta] = {}
        self._keys: dict[tuple[str, str], int] = {}
        self._ns_owner: dict[str, int] = {}
        self._reservations: dict[int, Reservation] = {}
        self._scratch: dict[Any, tuple[int, int]] = {}
        self._spill: list[int] = []  # home-NVMe objects released from use, to go back down
        self._leases: dict[int, LeaseInfo] = {}
        self._ids = itertools.count(1)
        self._next_id = 1
        self._epoch = 1
        self.counters: dict[str, float] = dict.fromkeys(
            ("puts", "gets", "checkouts", "frees", "host_hits", "nvme_reads", "promotions", "demotions",
             "put_bytes", "get_bytes", "demoted_bytes", "promoted_bytes", "capacity_errors",
             "prefetches", "prefetched_bytes", "steps"), 0)
        self.engine = select_engine(cfg.engine, cfg.io_threads)
        try:
            inherited = inherited_fds or {}
            adopt = "arena" in inherited and "index" in inherited
            self.arena = Arena(cfg.host_bytes, fd=inherited["arena"] if adopt else None)
            self.hostlog = HostIndexLog(inherited["index"] if adopt else None)
            self.host = ExtentAllocator(self.arena.size)
            self.nvme = NvmeTier(cfg.nvme_dirs, cfg.nvme_bytes, self.engine, direct_io=cfg.direct_io,
                                 chunk_bytes=cfg.io_chunk_bytes, grow_bytes=cfg.nvme_grow_bytes)
        except BaseException:
            self.engine.close()
            raise
        self.prefetcher = Prefetcher(self, cfg)
        self.policy = make_policy(cfg.policy, self.prefetcher.book, self.prefetcher.protected)
        self.journal = Journal(cfg.nvme_dirs[0])
        self._hostlog_on = False
        self.replay_info = self._replay()
        self.replay_info["adopted"] = self._adopt_host_objects() if adopt else 0
        if not adopt:
            self.hostlog.start_empty()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tierstore-prefetch")
        self._demoter_wake = threading.Event()
        self._demoter = threading.Thread(target=self._demote_loop, name="tierstore-demoter", daemon=True)
        self._demoter.start()
        log.info("store open: host %d B, nvme %d B in %s, engine %s (%s); %d durable objects recovered",
                 self.arena.size, self.nvme.capacity_bytes, cfg.nvme_dirs, self.engine.name,
                 self.engine.reason, len(self._objects))

    # ------------------------------------------------------------------ public API
    def put(self, tensor: Any, key: str | None = None, tier: str | None = None, durable: bool = False, *,
            replace: bool = False, namespace: str | None = None, wait_s: float = 0.0) -> Handle:
        """Store a copy of ``tensor``; returns its handle.

        ``tier``: ``None`` (host if it has room, else NVMe), ``"host"`` (demote others
        to make room, waiting up to ``wait_s``), ``"nvme"``. ``durable=True`` returns
        only once the bytes and the index record are on NVMe.
        """
        u8, spec = to_bytes(tensor)
        ns = self._ns(namespace)
        key = validate_key(key)
        tier = self._check_tier(tier)
        self._check_fits(spec.nbytes, tier)
        use_host = tier == "host" or (tier is None and self._host_has_room(spec.nbytes))
        if use_host:
            res = self.reserve_put(spec, key=key, tier=tier, durable=durable, replace=replace,
                                   namespace=ns, owner=_LOCAL, wait_s=wait_s)
            try:
                if spec.nbytes:
                    # the reservation keeps this block ours until commit; no lock needed to fill it
                    self.arena.view(res.host_off, spec.nbytes)[:] = u8
            except BaseException:
                self.abort_put(res.rid)
                raise
            return self.commit_put(res.rid)
        return self._put_nvme(u8, spec, key, durable, replace, ns)

    def get(self, handle: Handle | int | str, out: Any = None, *, namespace: str | None = None,
            stream: str = "default", owner: Any = _LOCAL) -> Any:
        """A new CPU tensor with the object's bytes, or the bytes copied into ``out``.

        ``stream`` names the access sequence this get belongs to (e.g. "params",
        "optim"), so interleaved loops are learned separately.
        """
        t0 = time.monotonic()
        meta, late = self._pin(handle, namespace)
        try:
            spec = meta.spec
            dst = out_bytes(out, spec) if out is not None else aligned_empty(spec.nbytes)
            hit = True
            if spec.nbytes:
                hit = self._read_pinned(meta, dst)
            self._record(owner, stream, meta, hit, late, t0)
            self.counters["gets"] += 1
            self.counters["get_bytes"] += spec.nbytes
        finally:
            self._unpin(meta)
        return out if out is not None else from_bytes(dst, spec)

    def checkout(self, handle: Handle | int | str, mode: str = "r", *, namespace: str | None = None,
                 timeout_s: float | None = None, stream: str = "default") -> Lease:
        """Lease the object and return a ``Lease`` whose tensor views the host arena (zero copy)."""
        info = self.acquire(handle, mode, owner=_LOCAL, namespace=namespace, timeout_s=timeout_s, stream=stream)
        view = self.arena.view(info.host_off, info.spec.nbytes) if info.spec.nbytes else np.empty(0, np.uint8)
        return Lease(self, info, from_bytes(view, info.spec))

    def free(self, handle: Handle | int | str, *, namespace: str | None = None) -> None:
        """Delete the object. Once this returns, the object is gone for good (also after a crash)."""
        h = Handle.parse(handle)
        with self._cv:
            meta = self._get_meta(h, self._ns(namespace))
            self._wait_free_to_go(meta)
            meta.freeing = True
            if meta.key is not None:
                self._keys.pop((meta.namespace, meta.key), None)
        self._drop(meta)
        self.counters["frees"] += 1

    def lookup(self, key: str, *, namespace: str | None = None) -> Handle | None:
        key = validate_key(key)
        with self._cv:
            oid = self._keys.get((self._ns(namespace), key))
            return None if oid is None else self._objects[oid].handle

    def keys(self, prefix: str = "", *, namespace: str | None = None) -> list[str]:
        if not isinstance(prefix, str):
            raise InvalidArgument("prefix must be a str")
        ns = self._ns(namespace)
        with self._cv:
            return sorted(k for (n, k) in self._keys if n == ns and k.startswith(prefix))

    def info(self, handle: Handle | int | str, *, namespace: str | None = None) -> dict[str, Any]:
        """Metadata of one object: key, dtype, shape, nbytes, residency, leases, durability."""
        h = Handle.parse(handle)
        with self._cv:
            m = self._get_meta(h, self._ns(namespace))
            return {"handle": str(m.handle), "key": m.key, "namespace": m.namespace, "kind": m.spec.kind,
                    "dtype": m.spec.dtype, "shape": list(m.spec.shape), "nbytes": m.nbytes,
                    "residency": m.residency(), "dirty": m.host_valid and not m.nvme_valid,
                    "readers": m.readers, "writer": m.writer, "durable": m.durable}

    def ls(self, prefix: str = "", *, namespace: str | None = None) -> list[dict[str, Any]]:
        """``info`` of every keyed object in the namespace whose key starts with ``prefix``."""
        ns = self._ns(namespace)
        with self._cv:
            hs = sorted((k, self._objects[oid].handle) for (n, k), oid in self._keys.items()
                        if n == ns and k.startswith(prefix))
        out = []
        for _, h in hs:
            try:
                out.append(self.info(h, namespace=ns))
            except NotFound:  # freed meanwhile
                continue
        return out

    def snapshot(self, dest: str, *, prefix: str = "", namespace: str | None = None,
                 progress: bool | None = None) -> dict[str, Any]:
        """Export the namespace (keys under ``prefix``) as a Zarr v3 store; see ``tierstore.snapshot``."""
        from .snapshot import snapshot

        return snapshot(_NamespaceView(self, self._ns(namespace)), dest, namespace=self._ns(namespace),
                        prefix=prefix, progress=progress)

    def restore(self, src: str, *, namespace: str | None = None, overwrite: bool = False,
                progress: bool | None = None) -> dict[str, Any]:
        """Import a snapshot into the namespace; refuses incomplete or corrupted snapshots."""
        from .snapshot import restore

        return restore(_NamespaceView(self, self._ns(namespace)), src, overwrite=overwrite, progress=progress)

    def expire_leases(self, max_age_s: float) -> int:
        """Revoke leases older than ``max_age_s`` (a client that stopped answering)."""
        now = time.monotonic()
        with self._cv:
            old = [(i.lid, i.owner) for i in self._leases.values() if now - i.since > max_age_s]
        for lid, owner in old:
            log.warning("revoking lease %d held for more than %.0f s", lid, max_age_s)
            try:
                self.release(lid, owner=owner)
            except TierstoreError as e:
                log.error("revoking lease %d failed: %s", lid, e)
        return len(old)

    def prefetch(self, handles: Iterable[Handle | int | str], *, namespace: str | None = None,
                 owner: Any = _LOCAL) -> Future:
        """Hint: bring these objects into the host tier now, through the prefetch queue
        (and within its byte budget). The future resolves, once the fetches issued
        for this hint are done, to how many of the objects are host-resident."""
        hs = [Handle.parse(h) for h in handles]
        ns = self._ns(namespace)
        with self._cv:
            oids = [self._get_meta(h, ns).id for h in hs]
            self.prefetcher.hint(owner, oids)
        return self._pool.submit(self._await_prefetch, oids)

    def wait_prefetch(self, timeout_s: float | None = None) -> bool:
        """Block until no prefetch is queued or in flight (benchmarks, tests). False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: not self.prefetcher.queued or self._closed, timeout=timeout_s)

    def step(self, *, owner: Any = _LOCAL) -> None:
        """Iteration boundary of ``owner``'s loop: the prefetcher compares it with the last."""
        with self._cv:
            self.counters["steps"] += 1
            self.prefetcher.step(owner)

    def stat(self) -> dict[str, Any]:
        with self._cv:
            host_objs = sum(1 for m in self._objects.values() if m.host_valid)
            nvme_objs = sum(1 for m in self._objects.values() if m.nvme_valid)
            namespaces: dict[str, dict[str, int]] = {}
            for m in self._objects.values():
                d = namespaces.setdefault(m.namespace, {"objects": 0, "bytes": 0})
                d["objects"] += 1
                d["bytes"] += m.nbytes
            return {
                "tiers": {
                    "host": {"capacity_bytes": self.host.capacity, "used_bytes": self.host.used_bytes,
                             "free_bytes": self.host.free_bytes, "objects": host_objs,
                             "pinned": False, "pinned_reason": "no CUDA device: host memory is not page-locked"},
                    "nvme": {"capacity_bytes": self.nvme.capacity_bytes, "used_bytes": self.nvme.used_bytes,
                             "free_bytes": self.nvme.free_bytes, "objects": nvme_objs,
                             "engine": self.engine.name, "engine_reason": self.engine.reason,
                             "direct_io": self.nvme.direct, "direct_io_reason": self.nvme.direct_reason,
                             "bytes_read": self.nvme.bytes_read, "bytes_written": self.nvme.bytes_written,
                             "drives": self.nvme.describe()},
                },
                "prefetch": self.prefetcher.stat(),
                "namespaces": namespaces,
                "leases": len(self._leases),
                "reservations": len(self._reservations),
                "policy": self.policy.name,
                "counters": dict(self.counters),
                "journal": {"bytes": self.journal.size(), "torn_bytes": self.replay_info["torn_bytes"],
                            "corrupt_records": self.replay_info["corrupt_records"]},
                "uptime_s": time.monotonic() - self._started,
                "version": __version__,
            }

    def close(self) -> None:
        """Stop background work, drain in-flight I/O, flush the journal, release memory."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._cv.notify_all()
        self._demoter_wake.set()
        self._demoter.join()
        self._pool.shutdown(wait=True)
        self.prefetcher.close()
        self.engine.close()
        self.journal.close()
        self.nvme.close()
        self.arena.close()
        self.hostlog.close()
        log.info("store closed")

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------ two-phase put / leases
    def reserve_put(self, spec: TensorSpec, *, key: str | None, tier: str | None, durable: bool, replace: bool,
                    namespace: str, owner: Any, wait_s: float = 0.0, owner_uid: int | None = None,
                    nowait: bool = False) -> Reservation:
        """Allocate a host block for a new object; the caller fills it, then ``commit_put``."""
        tier = self._check_tier(tier)
        self._check_fits(spec.nbytes, tier if tier != "nvme" else "host")
        if key is not None:
            with self._cv:
                if (namespace, key) in self._keys and not replace:
                    raise KeyExists(f"key {key!r} already exists in namespace {namespace!r}; "
                                    "pass replace=True to overwrite it or free it first")
        if nowait and spec.nbytes:
            with self._cv:
                off = self.host.alloc(spec.nbytes)
            if off is None:
                raise WouldBlock()
        else:
            off = self._alloc_host(spec.nbytes, wait_s=wait_s, evict=True) if spec.nbytes else -1
        with self._cv:
            oid = self._new_id()
            meta = ObjectMeta(id=oid, gen=self._epoch, namespace=namespace, key=key, spec=spec,
                              durable=durable, owner_uid=owner_uid, home="nvme" if tier == "nvme" else None)
            meta.host_off = None if off < 0 else off
            res = Reservation(rid=oid, owner=owner, host_off=max(off, 0), meta=meta, tier=tier, replace=replace)
            self._reservations[oid] = res
            return res

    def commit_put(self, rid: int, *, owner: Any = _LOCAL, nowait: bool = False) -> Handle:
        """Second phase: make the reserved object visible (and durable, if asked)."""
        with self._cv:
            res = self._reservations.get(rid)
            if res is None or res.owner != owner:
                raise NotFound(f"no open reservation {rid} for this connection")
            meta = res.meta
            if nowait and (meta.durable or res.tier == "nvme"):
                raise WouldBlock()
            meta.moving = True  # nobody sees it yet; blocks a concurrent demotion once visible
        if nowait and not self.journal.lock.acquire(blocking=False):
            with self._cv:
                meta.moving = False
            raise WouldBlock()  # a durable op is syncing the journal; do not wait on the event loop
        try:
            if meta.durable or res.tier == "nvme":
                self._write_down(meta, sync=meta.durable)
            # journal lock held across check, append and publish: no other put can bind
            # the same key in between, and compaction sees either both or neither
            with self.journal.lock:
                with self._cv:
                    self._check_key(meta, res.replace)
                if meta.durable:
                    self._journal_put(meta)
                with self._cv:
                    self._reservations.pop(rid, None)
                    old = self._bind(meta, res.replace)
                    meta.host_valid = meta.host_off is not None or meta.nbytes == 0
                    if res.tier == "nvme" and meta.host_off is not None:
                        self.host.free(meta.host_off, meta.nbytes)
                        meta.host_off, meta.host_valid = None, False
                    if meta.host_valid:
                        self._log_host(meta)
                    self._objects[meta.id] = meta
                    if meta.host_valid and meta.host_off is not None:
                        self.policy.insert(meta.id)
                    meta.moving = False
                    self._cv.notify_all()
        except BaseException:
            self.abort_put(rid, owner=owner)
            raise
        finally:
            if nowait:
                self.journal.lock.release()
        self.counters["puts"] += 1
        self.counters["put_bytes"] += meta.nbytes
        if old is not None:
            self._drop_replaced(old)
        self._maybe_demote()
        return meta.handle

    def scratch(self, owner: Any, nbytes: int) -> tuple[int, int]:
        """A host block private to ``owner`` (a connection's staging area); (offset, nbytes).

        Small puts through the daemon are copied here by the client and moved into
        place by the daemon in one round trip. Freed by ``release_owner``.
        """
        with self._cv:
            if owner in self._scratch:
                return self._scratch[owner]
            off = self.host.alloc(nbytes)
            if off is None:
                raise CapacityExceeded("host tier full: no room for a staging area; use the two-phase put")
            self._scratch[owner] = (off, nbytes)
            return off, nbytes

    def put_from_scratch(self, owner: Any, src: int, spec: TensorSpec, *, key: str | None, tier: str | None,
                         durable: bool, replace: bool, namespace: str, wait_s: float = 0.0,
                         owner_uid: int | None = None, nowait: bool = False) -> Handle:
        """One-round-trip put: the bytes are at ``src`` in ``owner``'s staging area."""
        with self._cv:
            area = self._scratch.get(owner)
        if area is None or src < 0 or src + spec.nbytes > area[1]:
            raise InvalidArgument("staged bytes lie outside this connection's staging area")
        if nowait and (durable or tier == "nvme"):
            raise WouldBlock()
        res = self.reserve_put(spec, key=key, tier=tier, durable=durable, replace=replace, namespace=namespace,
                               owner=owner, wait_s=wait_s, owner_uid=owner_uid, nowait=nowait)
        if spec.nbytes:
            self.arena.view(res.host_off, spec.nbytes)[:] = self.arena.view(area[0] + src, spec.nbytes)
        try:
            return self.commit_put(res.rid, owner=owner, nowait=nowait)
        except WouldBlock:
            self.abort_put(res.rid, owner=owner)
            raise

    def get_to_scratch(self, owner: Any, handle: Handle | int | str, *, namespace: str | None = None,
                       nowait: bool = False, stream: str = "default") -> TensorSpec | None:
        """Copy a small object into ``owner``'s staging area (one round trip, no lease).

        Returns its spec, or None when it does not fit there (use a lease instead).
        """
        with self._cv:
            area = self._scratch.get(owner)
            meta = self._get_meta(Handle.parse(handle), self._ns(namespace))
            if area is None or meta.nbytes > area[1]:
                return None
            if meta.nbytes == 0:
                return meta.spec
            if meta.host_valid and not meta.writer and not meta.moving:
                # small (<= staging size) copy under the lock: cheaper than pinning around it
                self.arena.view(area[0], meta.nbytes)[:] = self.arena.view(meta.host_off, meta.nbytes)
                self.policy.touch(meta.id)
                self._record(owner, stream, meta, True, False, time.monotonic(), locked=True)
                self.counters["gets"] += 1
                self.counters["host_hits"] += 1
                self.counters["get_bytes"] += meta.nbytes
                return meta.spec
            if nowait:
                raise WouldBlock()
        t0 = time.monotonic()
        meta, late = self._pin(handle, namespace)
        try:
            hit = self._read_pinned(meta, self.arena.view(area[0], meta.nbytes))
            self._record(owner, stream, meta, hit, late, t0)
        finally:
            self._unpin(meta)
        return meta.spec

    def abort_put(self, rid: int, *, owner: Any = _LOCAL) -> None:
        with self._cv:
            res = self._reservations.get(rid)
            if res is None or res.owner != owner:
                return
            del self._reservations[rid]
            meta = res.meta
            if meta.host_off is not None:
                self.host.free(meta.host_off, meta.nbytes)
                meta.host_off = None
            extents, meta.nvme = meta.nvme, None
            self._cv.notify_all()
        if extents:
            self.nvme.free(extents)

    def acquire(self, handle: Handle | int | str, mode: str, *, owner: Any, namespace: str | None = None,
                timeout_s: float | None = None, nowait: bool = False, stream: str = "default") -> LeaseInfo:
        """Lease an object in the host tier (promoting it first if needed).

        ``mode``: ``"r"`` shared, ``"rw"`` exclusive, ``"w"`` exclusive for a caller that
        overwrites every byte (an NVMe-only object is given host memory without being
        read; its previous bytes are not visible through the lease).
        """
        if mode not in ("r", "rw", "w"):
            raise InvalidArgument(f"mode must be 'r', 'rw' or 'w', got {mode!r}")
        h = Handle.parse(handle)
        ns = self._ns(namespace)
        t0 = time.monotonic()
        deadline = t0 + (self.config.lease_wait_s if timeout_s is None else timeout_s)
        late = promoted = False
        while True:
            with self._cv:
                meta = self._get_meta(h, ns)
                if meta.host_valid and not meta.moving and self._lease_ok(meta, mode):
                    if mode != "w":  # a blind overwrite is no read: nothing to learn or count
                        self._record(owner, stream, meta, not promoted, late, t0, locked=True)
                    if mode == "r":
                        meta.readers += 1
                    else:
                        meta.writer = True
                    self.policy.touch(meta.id)
                    self.counters["checkouts"] += 1
                    self.counters["host_hits"] += 1
                    lid = next(self._ids) + (1 << 40)
                    info = LeaseInfo(lid, owner, meta.id, meta.gen, mode, meta.host_off or 0, meta.spec, time.monotonic())
                    self._leases[lid] = info
                    return info
                if nowait:
                    raise WouldBlock()
                late = late or meta.prefetching
                if not meta.host_valid and not meta.moving:
                    meta.moving = True
                    promote = True
                else:
                    promote = False
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise Busy(f"object {h} is leased in a conflicting mode (readers={meta.readers}, "
                                   f"writer={meta.writer}); check it in elsewhere or wait longer")
                    self._cv.wait(min(remaining, 1.0))
                    continue
            if promote:
                promoted = mode != "w"
                self.counters["nvme_reads"] += promoted
                self._promote(meta, wait_s=max(0.0, deadline - time.monotonic()), read=promoted)

    def release(self, lid: int, *, owner: Any = _LOCAL, nowait: bool = False) -> None:
        """End a lease. After ``rw`` the object is dirty; a durable one is written back first."""
        with self._cv:
            info = self._leases.get(lid)
            if info is None or info.owner != owner:
                raise NotFound(f"no lease {lid} held by this connection")
            meta = self._objects.get(info.oid)
            if nowait and info.mode == "rw" and meta is not None and meta.durable:
                raise WouldBlock()
            del self._leases[lid]
            if meta is None:
                return
            if info.mode == "r":
                meta.readers -= 1
                self._spill_if_home_nvme(meta)
                self._cv.notify_all()
                return
            meta.version += 1
            meta.nvme_valid = False
            stale = meta.nvme
            meta.nvme, meta.crcs = None, None
            if meta.durable:
                meta.moving = True  # write-back below; holds off other movers, keeps the writer flag
            else:
                meta.writer = False
                self._cv.notify_all()
        if not meta.durable:
            if stale:
                self.nvme.free(stale)
            with self._cv:
                self._spill_if_home_nvme(meta)
            return
        try:
            # durable: the new bytes reach NVMe and the journal before the check-in returns
            self._write_down(meta, sync=True)
            with self.journal.lock:
                self._journal_put(meta)
        finally:
            with self._cv:
                meta.moving = False
                meta.writer = False
                self._cv.notify_all()
        if stale:
            self.nvme.free(stale)  # only after the journal names the new copy
        with self._cv:
            self._spill_if_home_nvme(meta)

    def _spill_if_home_nvme(self, meta: ObjectMeta) -> None:
        """(under _cv) An object that lives on NVMe goes back down once nobody uses it."""
        if meta.home == "nvme" and meta.readers == 0 and not meta.writer and meta.host_valid:
            self._spill.append(meta.id)
            self._demoter_wake.set()

    def release_owner(self, owner: Any) -> tuple[int, int]:
        """End every lease and reservation of ``owner`` (a connection that went away)."""
        with self._cv:
            lids = [lid for lid, i in self._leases.items() if i.owner == owner]
            rids = [rid for rid, r in self._reservations.items() if r.owner == owner]
            if owner is not _LOCAL:
                self.prefetcher.drop_owner(owner)
        for lid in lids:
            try:
                self.release(lid, owner=owner)
            except TierstoreError as e:
                log.error("releasing lease %d of a closed connection failed: %s", lid, e)
        for rid in rids:
            self.abort_put(rid, owner=owner)
        with self._cv:
            area = self._scratch.pop(owner, None)
            if area is not None:
                self.host.free(*area)
                self._cv.notify_all()
        return len(lids), len(rids)

    def claim_namespace(self, namespace: str, uid: int) -> None:
        """Bind a namespace to the uid that first uses it (journaled); others are refused."""
        from .errors import PermissionDenied

        ns = validate_namespace(namespace)
        root = ns.split("/")[0]
        with self.journal.lock:
            with self._cv:
                owner = self._ns_owner.get(root)
                if owner is not None:
                    if owner != uid and uid != 0:
                        raise PermissionDenied(f"namespace {root!r} belongs to uid {owner}; use another namespace")
                    return
            self.journal.append({"op": "ns", "name": root, "uid": uid})
            with self._cv:
                self._ns_owner[root] = uid

    def check_namespace(self, namespace: str, uid: int) -> None:
        """``PermissionDenied`` if another uid owns the namespace (root may enter any)."""
        from .errors import PermissionDenied

        owner = self.namespace_owner(validate_namespace(namespace))
        if owner is not None and owner != uid and uid != 0:
            raise PermissionDenied(f"namespace {namespace.split('/')[0]!r} belongs to uid {owner}; "
                                   "use another namespace")

    def namespace_owner(self, namespace: str) -> int | None:
        with self._cv:
            return self._ns_owner.get(namespace.split("/")[0])

    # ------------------------------------------------------------------ internals: index
    def _ns(self, namespace: str | None) -> str:
        return self.namespace if namespace is None else validate_namespace(namespace)

    def _check_open(self) -> None:
        if self._closed:
            raise Closed("the store is closed")

    def _check_tier(self, tier: str | None) -> str | None:
        if tier not in _TIERS:
            raise InvalidArgument(f"tier must be one of None, 'host', 'nvme', 'gpu'; got {tier!r}")
        if tier == "gpu":
            raise InvalidArgument("the gpu tier is not available in this store (no CUDA device / gpu_bytes=0)")
        return tier

    def _check_fits(self, nbytes: int, tier: str | None) -> None:
        host_ok = align_up(max(nbytes, 1), PAGE) <= self.host.capacity
        nvme_ok = self.nvme.fits(nbytes)
        if tier == "host" and not host_ok:
            raise CapacityExceeded(f"{nbytes} bytes exceed the host tier ({self.host.capacity} bytes); "
                                   "use tier='nvme' or raise host_bytes")
        if tier == "nvme" and not nvme_ok:
            raise CapacityExceeded(f"{nbytes} bytes exceed the NVMe tier ({self.nvme.capacity_bytes} bytes); "
                                   "raise nvme_bytes")
        if not host_ok and not nvme_ok:
            raise CapacityExceeded(f"{nbytes} bytes exceed every tier (host {self.host.capacity}, "
                                   f"nvme {self.nvme.capacity_bytes})")

    def _new_id(self) -> int:
        oid = self._next_id
        self._next_id += 1
        return oid

    def _get_meta(self, h: Handle, ns: str) -> ObjectMeta:
        self._check_open()
        meta = self._objects.get(h.id)
        if meta is None or meta.freeing:
            if h.id < self._next_id:
                raise StaleHandle(f"handle {h} names a freed object; look the key up again")
            raise NotFound(f"no object with handle {h}")
        if meta.gen != h.gen:
            raise StaleHandle(f"handle {h} is stale (the object now has generation {meta.gen})")
        if meta.namespace != ns:
            raise NotFound(f"no object with handle {h} in namespace {ns!r}")
        return meta

    def _bind(self, meta: ObjectMeta, replace: bool) -> ObjectMeta | None:
        """Bind meta's key (under _cv, after ``_check_key``); returns the object it replaced."""
        if meta.key is None:
            return None
        k = (meta.namespace, meta.key)
        old_id = self._keys.get(k)
        self._keys[k] = meta.id
        if old_id is None:
            return None
        old = self._objects[old_id]
        old.freeing = True
        return old

    def _journal_put(self, meta: ObjectMeta) -> None:
        """Append meta's put record (caller holds the journal lock)."""
        rec = meta.to_record()
        self.journal.append(rec)
        meta.record = rec

    def _check_key(self, meta: ObjectMeta, replace: bool) -> None:
        if meta.key is not None and (meta.namespace, meta.key) in self._keys and not replace:
            raise KeyExists(f"key {meta.key!r} already exists in namespace {meta.namespace!r}; "
                            "pass replace=True to overwrite it or free it first")

    def _drop_replaced(self, old: ObjectMeta) -> None:
        with self._cv:
            while old.pins or old.moving or old.readers or old.writer:
                # a replaced object may still be leased; it goes when its leases end
                if not self._cv.wait(timeout=self.config.lease_wait_s):
                    log.warning("replaced object %s still leased; freed when released", old.handle)
                    return
        self._drop(old)

    def _wait_free_to_go(self, meta: ObjectMeta) -> None:
        if meta.readers or meta.writer:
            raise Busy(f"object {meta.handle} is checked out; check it in before freeing it")
        while meta.pins or meta.moving:
            self._cv.wait()
            if meta.freeing:
                raise StaleHandle(f"handle {meta.handle} names a freed object")

    def _drop(self, meta: ObjectMeta) -> None:
        """Remove a ``freeing`` object: journal first (a returned free is never undone)."""
        if meta.durable:
            with self.journal.lock:
                self.journal.append({"op": "free", "id": meta.id})
        with self._cv:
            self._objects.pop(meta.id, None)
            self.prefetcher.forget(meta.id)
            if meta.key is not None and self._keys.get((meta.namespace, meta.key)) == meta.id:
                del self._keys[(meta.namespace, meta.key)]
            self.policy.remove(meta.id)
            if meta.host_off is not None:
                self._log_drop(meta)
                self.host.free(meta.host_off, meta.nbytes)
                meta.host_off, meta.host_valid = None, False
            extents, meta.nvme = meta.nvme, None
            meta.nvme_valid = False
            self._cv.notify_all()
        if extents:
            self.nvme.free(extents)
        if meta.durable:
            self._maybe_compact()

    def _pin(self, handle: Handle | int | str, namespace: str | None) -> tuple[ObjectMeta, bool]:
        """Hold the object against moves and writers; (meta, waited for a prefetch)."""
        h = Handle.parse(handle)
        ns = self._ns(namespace)
        late = False
        with self._cv:
            while True:
                meta = self._get_meta(h, ns)
                if not meta.writer and not meta.moving:
                    meta.pins += 1
                    return meta, late
                late = late or meta.prefetching
                if not self._cv.wait(timeout=self.config.lease_wait_s):
                    raise Busy(f"object {h} is checked out for writing; try again after it is checked in")

    def _unpin(self, meta: ObjectMeta) -> None:
        with self._cv:
            meta.pins -= 1
            self._cv.notify_all()

    def _lease_ok(self, meta: ObjectMeta, mode: str) -> bool:
        if mode == "r":
            return not meta.writer
        return not meta.writer and meta.readers == 0 and meta.pins == 0

    # ------------------------------------------------------------------ internals: data
    def _host_has_room(self, nbytes: int) -> bool:
        with self._cv:
            need = align_up(max(nbytes, 1), PAGE)
            return (self.host.largest_free >= need
                    and self.host.used_bytes + need <= self.config.high_watermark * self.host.capacity)

    def _alloc_host(self, nbytes: int, *, wait_s: float, evict: bool, admit_distance: int | None = None) -> int:
        """A host block, demoting cold objects synchronously if needed; CapacityExceeded otherwise."""
        deadline = time.monotonic() + wait_s
        while True:
            victim = None
            with self._cv:
                self._check_open()
                off = self.host.alloc(nbytes)
                if off is not None:
                    return off
                if evict:
                    victim = self._pick_victim(admit_distance)
                if victim is None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        self.counters["capacity_errors"] += 1
                        raise CapacityExceeded(
                            f"host tier full: {nbytes} bytes requested, {self.host.free_bytes} free of "
                            f"{self.host.capacity} and nothing can be demoted (leased or in flight); "
                            "check objects in, free some, or pass a longer wait")
                    self._cv.wait(min(remaining, 0.5))
                    continue
            self._demote(victim)

    def _pick_victim(self, admit_distance: int | None = None) -> ObjectMeta | None:
        """Best victim that may move now (under _cv); marks it moving.

        ``admit_distance`` (a prefetch of an object needed in that many accesses)
        admits only victims needed later than that, and never another prefetch.
        """
        for oid in self.policy.candidates():
            m = self._objects.get(oid)
            if m is None or not m.host_valid or m.host_off is None:
                continue
            if m.moving or m.pins or m.readers or m.writer or m.freeing:
                continue
            if admit_distance is not None:
                if oid in self.prefetcher.protected:
                    continue
                d = self.policy.distance(oid)
                if d is not None and d <= admit_distance:
                    continue
            m.moving = True
            self.prefetcher.forget(oid)  # evicted before its predicted use: wasted
            return m
        return None

    def _demote(self, meta: ObjectMeta) -> None:
        """Move a host-resident object (flagged moving) down to NVMe and free its host block."""
        try:
            if not meta.nvme_valid:
                self._write_down(meta, sync=meta.durable)
                if meta.durable:
                    with self.journal.lock:
                        self._journal_put(meta)
            with self._cv:
                self.policy.remove(meta.id)
                if meta.host_off is not None:
                    self._log_drop(meta)
                    self.host.free(meta.host_off, meta.nbytes)
                meta.host_off, meta.host_valid = None, False
                self.counters["demotions"] += 1
                self.counters["demoted_bytes"] += meta.nbytes
        finally:
            with self._cv:
                meta.moving = False
                self._cv.notify_all()

    def _write_down(self, meta: ObjectMeta, *, sync: bool) -> None:
        """Write the host copy of ``meta`` to fresh NVMe extents (meta.moving is set by the caller)."""
        n = meta.nbytes
        extents = self.nvme.alloc(n)
        try:
            if n:
                src = self.arena.view(meta.host_off, n)
                padded = self.arena.view(meta.host_off, align_up(n, PAGE))
                crcs = self.nvme.write(extents, src, src_padded=padded, sync=sync)
            else:
                crcs = []
        except BaseException:
            self.nvme.free(extents)
            raise
        with self._cv:
            old = meta.nvme
            meta.nvme, meta.crcs, meta.nvme_valid = extents, crcs, True
        if old:
            self.nvme.free(old)

    def _put_nvme(self, u8: np.ndarray, spec: TensorSpec, key: str | None, durable: bool, replace: bool,
                  ns: str) -> Handle:
        if key is not None:
            with self._cv:
                if (ns, key) in self._keys and not replace:
                    raise KeyExists(f"key {key!r} already exists in namespace {ns!r}; "
                                    "pass replace=True to overwrite it or free it first")
        extents = self.nvme.alloc(spec.nbytes)
        try:
            crcs = self.nvme.write(extents, u8, sync=durable) if spec.nbytes else []
            with self._cv:
                meta = ObjectMeta(id=self._new_id(), gen=self._epoch, namespace=ns, key=key, spec=spec,
                                  durable=durable, nvme=extents, crcs=crcs, nvme_valid=True, home="nvme")
            with self.journal.lock:
                with self._cv:
                    self._check_key(meta, replace)
                if durable:
                    self._journal_put(meta)
                with self._cv:
                    old = self._bind(meta, replace)
                    self._objects[meta.id] = meta
        except BaseException:
            self.nvme.free(extents)
            raise
        self.counters["puts"] += 1
        self.counters["put_bytes"] += spec.nbytes
        if old is not None:
            self._drop_replaced(old)
        return meta.handle

    def _read_pinned(self, meta: ObjectMeta, dst: np.ndarray) -> bool:
        """Copy a pinned object's bytes into ``dst`` from the fastest tier holding them.

        Returns True when they came from the host tier (a hit)."""
        n = meta.nbytes
        with self._cv:
            host_off = meta.host_off if meta.host_valid else None
            if host_off is not None:
                self.policy.touch(meta.id)
        if host_off is not None:
            self.counters["host_hits"] += 1
            dst[:] = self.arena.view(host_off, n)
            return True
        self.counters["nvme_reads"] += 1
        if self.config.promote_on_get and meta.home != "nvme" and self._host_has_room(n):
            with self._cv:
                off = self.host.alloc(n) if not meta.moving else None
                if off is not None:
                    meta.moving = True
            if off is not None:
                try:
                    self.nvme.read(meta.nvme, self.arena.view(off, n), meta.crcs,
                                   dst_padded=self.arena.view(off, align_up(n, PAGE)))
                except BaseException:
                    with self._cv:
                        self.host.free(off, n)
                        meta.moving = False
                        self._cv.notify_all()
                    raise
                with self._cv:
                    meta.host_off, meta.host_valid, meta.moving = off, True, False
                    self._log_host(meta)
                    self.policy.insert(meta.id)
                    self.counters["promotions"] += 1
                    self.counters["promoted_bytes"] += n
                    self._cv.notify_all()
                dst[:] = self.arena.view(off, n)
                return False
        padded = dst if (dst.ctypes.data % PAGE == 0 and n % PAGE == 0) else None
        self.nvme.read(meta.nvme, dst, meta.crcs, dst_padded=padded)
        return False

    def _promote(self, meta: ObjectMeta, *, wait_s: float, priority: int = 0,
                 admit_distance: int | None = None, read: bool = True, block: int | None = None) -> None:
        """Bring an NVMe-only object (flagged moving by the caller) into the host tier
        (``read=False``: only give it host memory; the caller overwrites it; ``block``: a
        host block the caller already allocated)."""
        n = meta.nbytes
        try:
            if block is not None:
                off = block
            else:
                off = self._alloc_host(n, wait_s=wait_s, evict=True, admit_distance=admit_distance) if n else -1
            try:
                if n and read:
                    self.nvme.read(meta.nvme, self.arena.view(off, n), meta.crcs,
                                   dst_padded=self.arena.view(off, align_up(n, PAGE)), priority=priority)
            except BaseException:
                with self._cv:
                    self.host.free(off, n)
                raise
            with self._cv:
                meta.host_off = None if off < 0 else off
                meta.host_valid = True
                if off >= 0:
                    self._log_host(meta)
                    self.policy.insert(meta.id)
                self.counters["promotions"] += 1
                self.counters["promoted_bytes"] += n
        finally:
            with self._cv:
                meta.moving = False
                meta.prefetching = False
                self._cv.notify_all()

    # ------------------------------------------------------------------ prefetch
    def _record(self, owner: Any, stream: str, meta: ObjectMeta, hit: bool, late: bool, t0: float,
                locked: bool = False) -> None:
        outcome = "miss" if not hit else ("late" if late else "hit")
        stall = time.monotonic() - t0 if outcome != "hit" else 0.0
        if locked:
            self.prefetcher.record(owner, stream, meta.id, meta.nbytes, outcome, stall)
        else:
            with self._cv:
                self.prefetcher.record(owner, stream, meta.id, meta.nbytes, outcome, stall)

    def _prefetch_fetch(self, oid: int) -> None:
        """Worker side of a queued prefetch: promote ``oid`` at prefetch priority."""
        with self._cv:
            q = self.prefetcher.queued.get(oid)
            meta = self._objects.get(oid)
            if q is None or meta is None or meta.freeing or meta.host_valid or meta.moving or self._closed:
                if q is not None:
                    self.prefetcher.done(oid, q[0], 0, fetched=False)
                return
            d = self.policy.distance(oid)
        fetched = False
        try:
            # room first, without claiming the object: a full tier is often only waiting for
            # write-backs, and a demand access must never wait behind a prefetch that waits
            off = self._alloc_host(meta.nbytes, wait_s=_PREFETCH_WAIT_S, evict=True, admit_distance=d) \
                if meta.nbytes else None
            with self._cv:
                wanted = not (meta.freeing or meta.host_valid or meta.moving or self._closed)
                if wanted:
                    meta.moving = meta.prefetching = True
                elif off is not None:
                    self.host.free(off, meta.nbytes)  # demand got there first
            if wanted:
                self._promote(meta, wait_s=0.0, priority=1, block=off)
                fetched = True
        except TierstoreError as e:
            log.debug("prefetch of %s skipped: %s", meta.handle, e)
        finally:
            with self._cv:
                self.prefetcher.done(oid, q[0], meta.nbytes, fetched)
                self._cv.notify_all()

    def _await_prefetch(self, oids: list[int]) -> int:
        with self._cv:
            self._cv.wait_for(lambda: self._closed or not any(o in self.prefetcher.queued for o in oids))
            return sum(1 for o in oids if o in self._objects and self._objects[o].host_valid)

    # ------------------------------------------------------------------ background demotion
    def _maybe_demote(self) -> None:
        if self.host.used_bytes > self.config.high_watermark * self.host.capacity:
            self._demoter_wake.set()

    def _drain_spill(self) -> None:
        with self._cv:
            spill, self._spill = self._spill, []
        for oid in spill:
            with self._cv:
                m = self._objects.get(oid)
                if (m is None or not m.host_valid or m.host_off is None or m.moving or m.pins or m.readers
                        or m.writer or m.freeing or oid in self.prefetcher.protected):
                    continue
                m.moving = True
                self.prefetcher.forget(oid)
            try:
                self._demote(m)
            except TierstoreError as e:
                log.error("returning %s to NVMe failed: %s", m.handle, e)

    def _demote_loop(self) -> None:
        log.debug("demoter started")
        while True:
            self._demoter_wake.wait(timeout=1.0)
            self._demoter_wake.clear()
            if self._closed:
                break
            self._drain_spill()
            low = self.config.low_watermark * self.host.capacity
            if self.host.used_bytes <= self.config.high_watermark * self.host.capacity:
                continue
            while not self._closed and self.host.used_bytes > low:
                with self._cv:
                    victim = self._pick_victim()
                if victim is None:
                    break
                try:
                    self._demote(victim)
                except TierstoreError as e:
                    # one failed object (NVMe full, I/O error) must not stop the worker
                    log.error("background demotion of %s failed: %s", victim.handle, e)
                    break
        log.info("demoter stopped")

    # ------------------------------------------------------------------ host index log
    @staticmethod
    def _host_rec(m: ObjectMeta) -> list[Any]:
        # a list, not a map: this is on the path of every put
        return [m.id, m.gen, m.namespace, m.key, m.spec.kind, m.spec.dtype, list(m.spec.shape), m.nbytes,
                m.host_off, m.durable, m.home]

    def enable_host_index(self) -> None:
        """Start recording host residency in the index log (the daemon calls this once the
        arena and the log are in systemd's fd store; without a keeper it is not worth it)."""
        with self._cv:
            if not self._hostlog_on:
                self.hostlog.rewrite(self._host_live())
                self._hostlog_on = True

    def _host_live(self) -> list[list[Any]]:
        return [self._host_rec(m) for m in self._objects.values()
                if m.host_valid and m.host_off is not None and not m.freeing]

    def _log_host(self, meta: ObjectMeta) -> None:
        """(under _cv) meta's bytes are valid in its host block: recorded before it is published."""
        if self._hostlog_on and meta.host_off is not None:
            self.hostlog.append_host(self._host_rec(meta), self._host_live)

    def _log_drop(self, meta: ObjectMeta) -> None:
        """(under _cv) meta's host block is about to go back to the allocator."""
        if self._hostlog_on and meta.host_off is not None:
            self.hostlog.append_drop(meta.id, self._host_live)

    def _adopt_host_objects(self) -> int:
        """Take over the host-resident objects of the daemon that handed us its arena."""
        adopted = 0
        for rec in sorted(self.hostlog.replay(), key=lambda r: r[0]):
            keys = ("id", "gen", "ns", "key", "kind", "dtype", "shape", "nbytes", "off", "durable", "home")
            r = dict(zip(keys, rec))
            n, off = int(r["nbytes"]), r["off"]
            if off is None or n <= 0 or off < 0 or off + n > self.host.capacity:
                continue
            meta = self._objects.get(r["id"])
            if r["durable"] and (meta is None or meta.gen != r["gen"]):
                continue  # freed in the journal (the free's host record never made it): not revived
            try:
                self.host.reserve(off, n)
            except ValueError:
                log.error("host index names overlapping blocks for object %s; not adopted", r["id"])
                continue
            if meta is None:
                spec = TensorSpec(r["kind"], r["dtype"], tuple(r["shape"]), n)
                meta = ObjectMeta(id=r["id"], gen=r["gen"], namespace=r["ns"], key=r["key"], spec=spec,
                                  durable=False, home=r.get("home"))
                if meta.key is not None:
                    k = (meta.namespace, meta.key)
                    prev = self._keys.get(k)
                    if prev is not None and prev > meta.id:
                        self.host.free(off, n)
                        continue
                    if prev is not None:  # replaced by this newer object just before the restart
                        gone = self._objects.pop(prev)
                        if gone.nvme:
                            self.nvme.free(gone.nvme)
                    self._keys[k] = meta.id
                self._objects[meta.id] = meta
            meta.host_off, meta.host_valid = off, True
            self.policy.insert(meta.id)
            self._next_id = max(self._next_id, meta.id + 1)
            adopted += 1
        self.hostlog.rewrite(self._host_live())
        self._hostlog_on = True  # whoever handed it back keeps it: go on recording
        log.info("adopted %d host-resident objects from the previous daemon's arena", adopted)
        return adopted

    # ------------------------------------------------------------------ journal
    def _replay(self) -> dict[str, int]:
        res = self.journal.replay()
        objs: dict[int, dict] = {}
        epoch, next_id = 0, 1
        for r in res.records:
            op = r.get("op")
            if op == "open":
                epoch = max(epoch, int(r.get("epoch", 0)))
                next_id = max(next_id, int(r.get("next_id", 1)))
            elif op == "put":
                objs[int(r["id"])] = r
                next_id = max(next_id, int(r["id"]) + 1)
            elif op == "free":
                objs.pop(int(r["id"]), None)
            elif op == "ns":
                self._ns_owner[str(r["name"])] = int(r["uid"])
        by_key: dict[tuple[str, str], int] = {}
        for oid in sorted(objs):
            r = objs[oid]
            meta = ObjectMeta.from_record(r)
            meta.record = r
            try:
                self.nvme.reserve(meta.nvme)
            except (ValueError, TierstoreError) as e:
                log.error("journal names object %s with extents that overlap another; dropped: %s", oid, e)
                continue
            if meta.key is not None:
                k = (meta.namespace, meta.key)
                prev = by_key.get(k)
                if prev is not None:  # crash between a replace's put and its free: the newer wins
                    old = self._objects.pop(prev)
                    self.nvme.free(old.nvme)
                by_key[k] = oid
            self._objects[oid] = meta
        self._keys = by_key
        self._epoch = (epoch % 0xFFFF) + 1
        self._next_id = next_id
        self.journal.open_for_append()
        self.journal.append({"op": "open", "epoch": self._epoch, "next_id": self._next_id})
        self._maybe_compact(force=res.torn_bytes > 0 or res.corrupt_records > 0)
        return {"torn_bytes": res.torn_bytes, "corrupt_records": res.corrupt_records, "objects": len(self._objects)}

    def _maybe_compact(self, force: bool = False) -> None:
        size = self.journal.size()
        if not force and size < self.config.journal_compact_bytes:
            return
        with self.journal.lock:
            with self._cv:
                records = [{"op": "open", "epoch": self._epoch, "next_id": self._next_id}]
                records += [{"op": "ns", "name": n, "uid": u} for n, u in self._ns_owner.items()]
                records += [m.record for m in self._objects.values() if m.durable and m.record is not None]
            est = sum(len(str(r)) for r in records)
            if not force and size < 2 * est:
                return
            self.journal.rewrite(iter(records))
