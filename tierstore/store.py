"""The store: one pool of tiers (host arena, NVMe, GPU where present), an object index, leases and placement.

The store owns the invariants: where each object lives, who holds it, what may move.
Bytes move through ``Arena`` (memory) and ``NvmeTier`` (disk); the eviction order
comes from a policy object. The daemon serves this same class over a socket; the
in-process API below is the same contract as ``tierstore.client.Client``.

``Store`` is assembled from four mixins, one concern each: ``leases`` (leases, waits,
namespaces), ``puts`` (two-phase puts, reservations, staging areas), ``movement``
(moving bytes between tiers, prefetch worker, demoter) and ``recovery`` (journal
replay, host-index adoption). This module holds
the public API and the index primitives they share.

Locking: one condition variable (``_cv``) guards every index field. Disk I/O and
large copies run with it released; an object being moved is flagged ``moving`` and
an object being copied holds a ``pin``, and whoever waits on those waits on ``_cv``.
The journal lock is always taken before ``_cv``, never the other way around.

Length: the public API of the store (one method per user-facing call, each short)
plus the index primitives the mixins share; docs/architecture.md lists the planned
split into components.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
import itertools
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterable, Sequence

import numpy as np

from ._version import __version__
from .allocator import ExtentAllocator
from .batch import LeaseGroup
from .arena import Arena
from .config import Config, StoreConfig
from .engine import select_engine
from .gpu import GpuTier, detect_backend
from .errors import (Busy, CapacityExceeded, Closed, InvalidArgument, KeyExists, NotFound,
                     StaleHandle, TierstoreError)
from .index import Handle, KeyIndex, ObjectMeta, ObjectTable, sorted_from, validate_key, validate_namespace
from .hostindex import HostIndexLog
from .journal import Journal, pack as pack_record
from .nvme import NvmeTier
from .policy import make_policy
from .leases import LOCAL, LeaseInfo, Leasing, Reservation, WouldBlock
from .movement import Movement
from .prefetch import Prefetcher
from .puts import Puts
from .recovery import Recovery
from .tensors import aligned_empty, cuda_out, cuda_source, from_bytes, out_bytes, to_bytes
from .preflight import check_start
from .units import PAGE, align_up, format_size

__all__ = ["Store", "Lease", "Reservation", "LeaseInfo", "WouldBlock"]

log = logging.getLogger(__name__)

SMALL_BLOCK_BYTES = 1 << 20
"""Host blocks below this size are placed apart from larger ones (less fragmentation)."""

READ_RESERVE_BYTES = 64 << 20
"""The last this many bytes of the host tier (at most a sixteenth of it) only take reads
of bytes that are on NVMe: durable objects stay readable when both tiers are full."""

_TIERS = (None, "host", "nvme", "gpu")
_LOCAL = LOCAL
_LIST_PAGE = 4096
"""Entries a whole-namespace listing takes under the lock at a time."""


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
        lid = self._take()
        if lid is not None:
            self._store.release(lid)

    def _take(self) -> int | None:
        """End this object's hold on the lease; the lease id to check in (None if done)."""
        if self._info is None:
            return None
        info, self._info = self._info, None
        self.tensor = None
        return info.lid

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


class Store(Leasing, Puts, Movement, Recovery):
    """An in-process tiered tensor store (host arena + NVMe), usable without a daemon."""

    def __init__(self, config: Config | StoreConfig | None = None, *, namespace: str = "default",
                 inherited_fds: dict[str, int] | None = None, gpu_backend: Any = None,
                 populate_host: bool = True, **overrides: Any) -> None:
        """Start-up checks (``tierstore.preflight``: directories, their locks, free disk,
        memory) come first, so a start that cannot work fails in milliseconds, before the
        host arena is mapped. ``populate_host=False`` leaves populating the arena's pages
        to ``self.arena.populate()`` (the daemon does it while already serving).
        ``inherited_fds`` (``{"arena": fd, "index": fd}``, from systemd's fd store) hands
        back the host arena and its index of a previous daemon: its host-resident objects,
        volatile ones included, are adopted instead of lost. ``gpu_backend``: the CUDA
        calls of the GPU tier (default: ``tierstore.gpu.detect_backend()``). ``config`` is
        a ``Config`` (the store reads its ``store`` section, kept as ``self.config``) or a
        ``StoreConfig``; ``overrides`` are store settings by name."""
        cfg = (config or Config()).store if not isinstance(config, StoreConfig) else config
        if overrides:
            cfg = dataclasses.replace(cfg, **overrides)
        self.config: StoreConfig = check_start(cfg.resolved())
        cfg = self.config
        self.namespace = validate_namespace(namespace)
        self._started = time.monotonic()
        self._cv = threading.Condition(threading.Lock())
        self._closed = False
        self._objects = ObjectTable()
        self._key_index = KeyIndex()
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
             "prefetches", "prefetched_bytes", "steps", "gpu_hits", "gpu_demotions", "gpu_demoted_bytes",
             "source_handovers", "source_copies", "leases_revoked", "reservations_expired"), 0)
        self._gpu_lru: OrderedDict[int, None] = OrderedDict()
        self.gpu: GpuTier | None = None
        self.host_pinned, self.host_pinned_reason = False, "no GPU tier in this process: host memory is not page-locked"
        self.engine = select_engine(cfg.engine, cfg.io_threads, cfg.io_chunk_bytes)
        try:
            inherited = inherited_fds or {}
            adopt = "arena" in inherited and "index" in inherited
            self.arena = Arena(cfg.host_bytes, fd=inherited["arena"] if adopt else None, populate=populate_host)
            self.hostlog = HostIndexLog(inherited["index"] if adopt else None)
            # small blocks (staging areas, scalars, biases) from the top, big ones from the bottom
            self.host = ExtentAllocator(self.arena.size, small_bytes=SMALL_BLOCK_BYTES)
            # kept for reading objects whose bytes are on NVMe when everything else is full
            self._read_reserve = min(READ_RESERVE_BYTES, self.host.capacity // 16) // PAGE * PAGE
            self.nvme = NvmeTier(cfg.nvme_dirs, cfg.nvme_bytes, self.engine, direct_io=cfg.direct_io,
                                 chunk_bytes=cfg.io_chunk_bytes, grow_bytes=cfg.nvme_grow_bytes)
            self.gpu_reason = "gpu_bytes is 0: no GPU tier"
            if cfg.gpu_bytes:
                backend, self.gpu_reason = (gpu_backend, f"backend {gpu_backend.name}") if gpu_backend is not None \
                    else detect_backend()
                if backend is None:
                    log.warning("GPU tier disabled: %s", self.gpu_reason)
                else:
                    self.gpu = GpuTier(cfg.gpu_bytes, cfg.gpu_slab_bytes, backend)
                    if self.arena.size:
                        self.host_pinned, self.host_pinned_reason = self.gpu.pin_host(
                            self.arena.view(0, self.arena.size).ctypes.data, self.arena.size)
        except BaseException:
            self.engine.close()
            raise
        self.prefetcher = Prefetcher(cfg, self._objects.get, lambda oid: self._prefetch_fetch(oid))
        self.policy = make_policy(cfg.policy, self.prefetcher.book, self.prefetcher.protected,
                                  self.prefetcher.reach, self._nbytes_of, cfg.prefetch_budget_bytes)
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
        log.info("store open: host %s, nvme %s in %s, engine %s (%s); %d durable objects recovered",
                 format_size(self.arena.size), format_size(self.nvme.capacity_bytes), ", ".join(cfg.nvme_dirs),
                 self.engine.name, self.engine.reason, len(self._objects))

    # ------------------------------------------------------------------ public API
    def put(self, tensor: Any, key: str | None = None, tier: str | None = None, durable: bool = False, *,
            replace: bool = False, namespace: str | None = None, wait_s: float = 0.0,
            ephemeral: bool = False) -> Handle:
        """Store a copy of ``tensor``; returns its handle.

        ``tier``: ``None`` (host if it has room, else NVMe), ``"host"`` (demote others
        to make room, waiting up to ``wait_s``), ``"nvme"``, ``"gpu"`` (the GPU tier, on the
        tensor's device; volatile). ``durable=True`` returns only once the bytes and the
        index record are on NVMe. ``ephemeral=True``: freed when the connection that put
        it ends (through a daemon); in-process, it lives as long as the store.
        """
        ns = self._ns(namespace)
        key = validate_key(key)
        tier = self._check_tier(tier)
        self._check_ephemeral(ephemeral, durable)
        if tier == "gpu":
            return self._put_gpu(tensor, key, durable, replace, ns, wait_s, ephemeral)
        u8, spec = to_bytes(tensor)
        self._check_fits(spec.nbytes, tier)
        use_host = tier == "host" or (tier is None and self._host_has_room(spec.nbytes))
        if use_host:
            res = self.reserve_put(spec, key=key, tier=tier, durable=durable, replace=replace,
                                   namespace=ns, owner=_LOCAL, wait_s=wait_s, ephemeral=ephemeral)
            try:
                if spec.nbytes:
                    # the reservation keeps this block ours until commit; no lock needed to fill it
                    self.arena.view(res.host_off, spec.nbytes)[:] = u8
            except BaseException:
                self.abort_put(res.rid)
                raise
            return self.commit_put(res.rid)
        return self._put_nvme(u8, spec, key, durable, replace, ns, ephemeral,
                              home="nvme" if tier == "nvme" else None)

    def _put_gpu(self, tensor: Any, key: str | None, durable: bool, replace: bool, ns: str, wait_s: float,
                 ephemeral: bool = False) -> Handle:
        src = cuda_source(tensor)
        if src is not None:
            t, spec = src
            device, addr = t.device.index or 0, t.data_ptr()
        else:
            t, spec = to_bytes(tensor)
            device, addr = 0, t.ctypes.data
        self._check_fits(spec.nbytes, "gpu")
        res = self.reserve_put(spec, key=key, tier="gpu", durable=durable, replace=replace, namespace=ns,
                               owner=_LOCAL, wait_s=wait_s, device=device, ephemeral=ephemeral)
        try:
            if spec.nbytes:
                self.gpu.write(res.gpu_loc, addr, spec.nbytes)
        except BaseException:
            self.abort_put(res.rid)
            raise
        return self.commit_put(res.rid)

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
            if cuda_out(out, spec):  # a CUDA tensor: straight from NVMe where GPUDirect Storage is on
                hit = self._read_to_device(meta, out) if spec.nbytes else True
                dst = None
            else:
                dst = out_bytes(out, spec) if out is not None else aligned_empty(spec.nbytes)
                hit = True
            if spec.nbytes and dst is not None:
                hit = self._read_pinned(meta, dst)
            self._record(owner, stream, meta, hit, late, t0)
            self.counters["gets"] += 1
            self.counters["get_bytes"] += spec.nbytes
        finally:
            self._unpin(meta)
        return out if out is not None else from_bytes(dst, spec)

    def _read_to_device(self, meta: ObjectMeta, out: Any) -> bool:
        """``get`` into a CUDA tensor: an NVMe-only object goes NVMe -> GPU through the
        engine's device I/O when it is GPUDirect Storage (its CRC32C checked on the host
        after the transfer), anything else through host memory. True on a memory-tier hit."""
        import torch

        u8 = out.reshape(-1).view(torch.uint8)
        with self._cv:
            nvme_only = meta.gpu_loc is None and not meta.host_valid and meta.nvme_valid
        if nvme_only and getattr(self.engine, "gds", False):
            self.counters["nvme_reads"] += 1
            self.nvme.read_device(meta.nvme, u8, meta.crcs, lambda v: v.cpu().numpy())
            return False
        tmp = aligned_empty(meta.nbytes)
        hit = self._read_pinned(meta, tmp)
        u8.copy_(torch.from_numpy(tmp))
        return hit

    def checkout(self, handle: Handle | int | str, mode: str = "r", *, namespace: str | None = None,
                 timeout_s: float | None = None, stream: str = "default",
                 source: Handle | int | str | None = None) -> Lease:
        """Lease the object and return a ``Lease`` whose tensor views the host arena (zero copy).

        ``source`` (with mode ``"w"``): the lease starts with that object's bytes instead of
        its own (same size), and ``source`` is unchanged: a double-buffered update that
        reads one version and writes the other, without copying (``acquire_from``)."""
        if source is not None:
            if mode != "w":
                raise InvalidArgument(f"a check-out from a source is a 'w' check-out, got mode {mode!r}")
            return self._lease(self.acquire_from(handle, source, owner=_LOCAL, namespace=namespace,
                                                 timeout_s=timeout_s, stream=stream))
        return self._lease(self.acquire(handle, mode, owner=_LOCAL, namespace=namespace, timeout_s=timeout_s,
                                        stream=stream))

    def _lease(self, info: LeaseInfo) -> Lease:
        view = self.arena.view(info.host_off, info.spec.nbytes) if info.spec.nbytes else np.empty(0, np.uint8)
        return Lease(self, info, from_bytes(view, info.spec))

    def checkout_each(self, requests: Iterable[tuple[Handle | int | str, str, Handle | int | str | None]], *,
                      namespace: str | None = None, timeout_s: float | None = None,
                      stream: str = "default") -> LeaseGroup:
        """Several independent check-outs, ``(handle, mode, source)`` each (``source`` None
        for none), in order; if one fails, those taken are given back unused
        (``give_back``: unchanged, but for a check-out from a source, which holds the
        source's bytes) and its error is raised. Returns a ``LeaseGroup`` (one ``Lease``
        per request; ``release()`` checks in all still held at once). Through a daemon
        the list is one message."""
        infos = self.acquire_each(list(requests), owner=_LOCAL, namespace=namespace, timeout_s=timeout_s,
                                  stream=stream)
        return LeaseGroup([self._lease(info) for info in infos], self.release_many)

    def checkout_many(self, handles: Sequence[Handle | int | str], mode: str | Sequence[str] = "r", *,
                      namespace: str | None = None, timeout_s: float | None = None,
                      stream: str = "default") -> LeaseGroup:
        """Lease several objects in one call (``mode``: one for all, or one per object):
        all of them or, on an error, none. Returns a ``LeaseGroup`` (one ``Lease`` per
        handle, in order; ``release()`` checks in all that are still held)."""
        hs = list(handles)
        modes = [mode] * len(hs) if isinstance(mode, str) else list(mode)
        infos = self.acquire_many(hs, modes, owner=_LOCAL, namespace=namespace, timeout_s=timeout_s, stream=stream)
        return LeaseGroup([self._lease(info) for info in infos], self.release_many)

    def free(self, handle: Handle | int | str, *, namespace: str | None = None, owner: Any = _LOCAL) -> None:
        """Delete the object. Once this returns, the object is gone for good (also after a crash).

        A lease ``owner`` (the caller: a daemon connection) holds on it is ``Busy`` at once;
        one another owner holds is waited for, up to ``lease_wait_s``, as a check-out waits.
        """
        h = Handle.parse(handle)
        with self._cv:
            meta = self._get_meta(h, self._ns(namespace))
            self._wait_free_to_go(meta, owner)
            meta.freeing = True
            if meta.key is not None:
                self._keys.pop((meta.namespace, meta.key), None)
        try:
            self._drop(meta)
        except TierstoreError as e:
            # the free was not journaled: the object stays exactly as it was (a restart would
            # bring it back, so it must not vanish now)
            with self._cv:
                meta.freeing = False
                if meta.key is not None and (meta.namespace, meta.key) not in self._keys:
                    self._keys[(meta.namespace, meta.key)] = meta.id
                self._cv.notify_all()
            raise type(e)(f"free of {h} failed, the object is unchanged: {e.message}") from None
        self.counters["frees"] += 1

    def lookup(self, key: str, *, namespace: str | None = None) -> Handle | None:
        key = validate_key(key)
        with self._cv:
            oid = self._keys.get((self._ns(namespace), key))
            return None if oid is None else self._objects[oid].handle

    @property
    def _keys(self) -> KeyIndex:
        """(namespace, key) -> object id (a ``KeyIndex``: sorted per namespace)."""
        return self._key_index

    @_keys.setter
    def _keys(self, value: Any) -> None:  # journal replay rebuilds it as a plain dict
        self._key_index = value if isinstance(value, KeyIndex) else KeyIndex(value)

    def keys(self, prefix: str = "", *, namespace: str | None = None) -> list[str]:
        return self._all_pages(self.key_names, prefix, namespace, lambda k: k)

    def key_names(self, prefix: str = "", after: str | None = None, limit: int | None = None, *,
                  namespace: str | None = None) -> list[str]:
        """As ``key_page``, the keys alone."""
        if not isinstance(prefix, str) or not (after is None or isinstance(after, str)):
            raise InvalidArgument("prefix and after must be str")
        ns = self._ns(namespace)
        with self._cv:
            return self._keys.scan_keys(ns, prefix, after, limit)

    @staticmethod
    def _all_pages(page: Any, prefix: str, namespace: str | None, key_of: Any) -> list[Any]:
        """Every entry, a page at a time: the lock is let go between pages."""
        out: list[Any] = []
        after = None
        while True:
            got = page(prefix, after, _LIST_PAGE, namespace=namespace)
            out += got
            if len(got) < _LIST_PAGE:
                return out
            after = key_of(got[-1])

    def key_page(self, prefix: str = "", after: str | None = None, limit: int | None = None, *,
                 namespace: str | None = None) -> list[tuple[str, Handle]]:
        """``(key, handle)`` of the namespace's keys starting with ``prefix``, in key order,
        after the key ``after`` (exclusive), at most ``limit``: one page of a listing, in
        O(log n + limit) of this namespace alone."""
        if not isinstance(prefix, str) or not (after is None or isinstance(after, str)):
            raise InvalidArgument("prefix and after must be str")
        ns = self._ns(namespace)
        with self._cv:
            return [(k, self._objects[oid].handle) for k, oid in self._keys.scan(ns, prefix, after, limit)]

    def info(self, handle: Handle | int | str, *, namespace: str | None = None) -> dict[str, Any]:
        """Metadata of one object: key, dtype, shape, nbytes, residency, leases, durability."""
        h = Handle.parse(handle)
        with self._cv:
            return self._info(self._get_meta(h, self._ns(namespace)))

    @staticmethod
    def _info(m: ObjectMeta) -> dict[str, Any]:
        return {"handle": str(m.handle), "key": m.key, "namespace": m.namespace, "kind": m.spec.kind,
                    "dtype": m.spec.dtype, "shape": list(m.spec.shape), "nbytes": m.nbytes,
                    "residency": m.residency(), "dirty": (m.host_valid or m.gpu_loc is not None) and not m.nvme_valid,
                "readers": m.readers, "writer": m.writer, "durable": m.durable,
                "ephemeral": m.ephemeral is not None}

    def ls(self, prefix: str = "", *, namespace: str | None = None) -> list[dict[str, Any]]:
        """``info`` of every keyed object in the namespace whose key starts with ``prefix``."""
        return self._all_pages(self.ls_page, prefix, namespace, lambda e: e["key"])

    def ls_page(self, prefix: str = "", after: str | None = None, limit: int | None = None, *,
                namespace: str | None = None) -> list[dict[str, Any]]:
        """One page of ``ls``: as ``key_page``, with each object's ``info``."""
        if not isinstance(prefix, str) or not (after is None or isinstance(after, str)):
            raise InvalidArgument("prefix and after must be str")
        ns = self._ns(namespace)
        with self._cv:
            return [self._info(self._objects[oid]) for _, oid in self._keys.scan(ns, prefix, after, limit)]

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
        """Revoke leases older than ``max_age_s`` (a client that stopped answering); see
        ``revoke``: the memory a revoked holder maps is not reused while it is connected."""
        now = time.monotonic()
        with self._cv:
            old = [(i.lid, i.owner) for i in self._leases.values() if now - i.since > max_age_s and not i.revoked]
        for lid, owner in old:
            log.warning("revoking lease %d held for more than %.0f s", lid, max_age_s)
            try:
                self.revoke(lid, owner=owner)
            except TierstoreError as e:
                log.error("revoking lease %d failed: %s", lid, e)
        return len(old)

    def prefetch(self, handles: Iterable[Handle | int | str], *, namespace: str | None = None,
                 owner: Any = _LOCAL, wait: bool = True) -> None:
        """Hint: bring these objects into the host tier now, through the prefetch queue
        (and within its byte budget). In process the hint is queued before this returns,
        ``wait`` or not (the contract's ``wait=False`` matters through a daemon);
        ``prefetch_tracked`` also says when the fetches are done."""
        self._queue_hint(handles, namespace, owner)

    def prefetch_tracked(self, handles: Iterable[Handle | int | str], *, namespace: str | None = None,
                         owner: Any = _LOCAL) -> Future:
        """``prefetch``, with a future that resolves, once the fetches issued for this hint
        are done, to how many of the objects are host-resident (benchmarks, tests)."""
        return self._pool.submit(self._await_prefetch, self._queue_hint(handles, namespace, owner))

    def _queue_hint(self, handles: Iterable[Handle | int | str], namespace: str | None, owner: Any) -> list[int]:
        hs = [Handle.parse(h) for h in handles]
        ns = self._ns(namespace)
        with self._cv:
            oids = [self._get_meta(h, ns).id for h in hs]
            self.prefetcher.hint(owner, oids)
        return oids

    def wait_prefetch(self, timeout_s: float | None = None) -> bool:
        """Block until no prefetch is queued or in flight (benchmarks, tests). False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: self.prefetcher.idle() or self._closed, timeout=timeout_s)

    def step(self, *, owner: Any = _LOCAL) -> None:
        """Iteration boundary of ``owner``'s loop: the prefetcher compares it with the last."""
        with self._cv:
            self.counters["steps"] += 1
            self.prefetcher.step(owner)

    def _nbytes_of(self, oid: int) -> int:
        """Bytes of object ``oid`` (0 once freed), for the eviction policy (under _cv)."""
        meta = self._objects.get(oid)
        return meta.nbytes if meta is not None else 0

    def stat_namespaces(self, after: str | None = None, limit: int | None = None) -> dict[str, dict[str, int]]:
        """Objects and bytes per namespace, in name order, after the name ``after``, at most
        ``limit``: from counters kept as objects come and go, O(log namespaces + what it returns)."""
        with self._cv:
            table = self._objects.namespaces
            names = sorted_from(table, "", after)
            return {ns: {"objects": table[ns][0], "bytes": table[ns][1]}
                    for ns in (names if limit is None else itertools.islice(names, limit))}

    def stat(self, *, namespace_limit: int | None = None) -> dict[str, Any]:
        """The store's state; ``namespace_limit``: the first that many namespaces by name
        (``namespaces_total`` says how many there are; ``stat_namespaces`` gives the rest)."""
        namespaces = self.stat_namespaces(limit=namespace_limit)
        with self._cv:  # every figure from counters kept as objects change: O(1) in objects
            host_objs, nvme_objs = self._objects.host_objects, self._objects.nvme_objects
            return {
                "tiers": {
                    "host": {"capacity_bytes": self.host.capacity, "used_bytes": self.host.used_bytes,
                             "free_bytes": self.host.free_bytes, "fenced_bytes": self.host.held_bytes,
                             "objects": host_objs,
                             "pinned": self.host_pinned, "pinned_reason": self.host_pinned_reason},
                    "nvme": {"capacity_bytes": self.nvme.capacity_bytes, "used_bytes": self.nvme.used_bytes,
                             "free_bytes": self.nvme.free_bytes, "objects": nvme_objs,
                             "engine": self.engine.name, "engine_reason": self.engine.reason,
                             "device_io": getattr(self.engine, "device_reason", "posix engine: host buffers only"),
                             "direct_io": self.nvme.direct, "direct_io_reason": self.nvme.direct_reason,
                             "bytes_read": self.nvme.bytes_read, "bytes_written": self.nvme.bytes_written,
                             "drives": self.nvme.describe()},
                    **({"gpu": {**self.gpu.describe(), "objects": len(self._gpu_lru)}} if self.gpu is not None else {}),
                },
                "prefetch": self.prefetcher.stat(),
                "gpu_reason": self.gpu_reason,
                "namespaces": namespaces,
                "namespaces_total": len(self._objects.namespaces),
                "leases": len(self._leases),
                "reservations": len(self._reservations),
                "policy": self.policy.name,
                "counters": dict(self.counters),
                "journal": {"bytes": self.journal.size(),
                            **{k: v for k, v in self.replay_info.items() if k not in ("objects", "adopted")}},
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
        if self.gpu is not None:
            self.gpu.close()  # unpins the arena before it is unmapped
        self.arena.close()
        self.hostlog.close()
        log.info("store closed")

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ internals: index
    def _ns(self, namespace: str | None) -> str:
        return self.namespace if namespace is None else validate_namespace(namespace)

    def _check_open(self) -> None:
        if self._closed:
            raise Closed("the store is closed")

    def _check_tier(self, tier: str | None) -> str | None:
        if tier not in _TIERS:
            raise InvalidArgument(f"tier must be one of None, 'host', 'nvme', 'gpu'; got {tier!r}")
        if tier == "gpu" and self.gpu is None:
            raise InvalidArgument(f"the gpu tier is not available in this store: {self.gpu_reason}")
        return tier

    def _check_fits(self, nbytes: int, tier: str | None) -> None:
        if tier == "gpu":
            if not self.gpu.fits(nbytes):
                raise CapacityExceeded(f"{nbytes} bytes exceed every GPU-tier slab ({self.config.gpu_slab_bytes} "
                                       "bytes); raise gpu_slab_bytes or use tier='host'")
            return
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
        # nothing outside the caller's namespace is told apart from nothing at all: an id
        # another namespace holds (or held) is NotFound, whatever its generation
        if meta is None or meta.freeing:
            if (meta.namespace if meta is not None else self._objects.gone_namespace(h.id)) == ns:
                raise StaleHandle(f"handle {h} names a freed object; look the key up again")
            raise NotFound(f"no object with handle {h} in namespace {ns!r}")
        if meta.namespace != ns:
            raise NotFound(f"no object with handle {h} in namespace {ns!r}")
        if meta.gen != h.gen:
            raise StaleHandle(f"handle {h} is stale (the object now has generation {meta.gen})")
        return meta

    def _bind(self, meta: ObjectMeta) -> ObjectMeta | None:
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

    def _journal_put(self, meta: ObjectMeta, *, sync: bool = True) -> None:
        """Append meta's put record (caller holds the journal lock). ``sync=False``: the
        caller calls ``journal.commit()`` once it has let go of the lock (group commit)."""
        rec = meta.to_record()
        owner = self._ns_owner.get(meta.namespace.split("/")[0])
        if owner is not None:
            rec["nsuid"] = owner  # ownership in every record: it survives the loss of the claim's
        self.journal.append(rec, sync=sync)
        meta.record = pack_record(rec)

    def _check_key(self, meta: ObjectMeta, replace: bool) -> None:
        if meta.key is not None and (meta.namespace, meta.key) in self._keys and not replace:
            raise KeyExists(f"key {meta.key!r} already exists in namespace {meta.namespace!r}; "
                            "pass replace=True to overwrite it or free it first")

    def _drop_replaced(self, old: ObjectMeta) -> None:
        with self._cv:
            while old.pins or old.moving:  # a copy or a move in flight: short
                self._cv.wait()
            if old.readers or old.writer:
                return  # still checked out: its last check-in drops it (``_drop_if_released``)
        self._drop(old)

    def _drop_if_released(self, meta: ObjectMeta) -> bool:
        """(under _cv) Whether a replaced (``freeing``) object nobody holds any more is to be dropped now."""
        return (meta.freeing and not meta.dropped and not (meta.readers or meta.writer or meta.pins or meta.moving)
                and self._objects.get(meta.id) is meta)

    def _wait_free_to_go(self, meta: ObjectMeta, owner: Any) -> None:
        """(under _cv) Wait until nothing holds ``meta``: copies and moves in flight, and
        other owners' leases (up to ``lease_wait_s``; a check-in another connection sent
        without waiting may still be on its way). The caller's own lease: Busy at once."""
        deadline = time.monotonic() + self.config.lease_wait_s
        while True:
            if meta.readers or meta.writer:
                mine = owner is _LOCAL or any(i.oid == meta.id and i.owner == owner for i in self._leases.values())
                remaining = deadline - time.monotonic()
                if mine or remaining <= 0:
                    raise Busy(f"object {meta.handle} is checked out; check it in before freeing it")
                self._wait_for_others(remaining)
            elif meta.pins or meta.moving:
                self._cv.wait()
            else:
                return
            if meta.freeing:
                raise StaleHandle(f"handle {meta.handle} names a freed object")

    def _drop(self, meta: ObjectMeta) -> None:
        """Remove a ``freeing`` object: journal first (a returned free is never undone)."""
        with self._cv:
            if meta.dropped:
                return
            meta.dropped = True
        if meta.durable:
            try:
                with self.journal.lock:
                    self.journal.append({"op": "free", "id": meta.id})
            except TierstoreError:
                with self._cv:
                    meta.dropped = False  # not freed: the caller puts it back as it was
                raise
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
            if meta.gpu_loc is not None:
                self.gpu.free(meta.gpu_loc, meta.nbytes)
                self._gpu_lru.pop(meta.id, None)
                meta.gpu_loc = None
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
        deadline = time.monotonic() + self.config.lease_wait_s
        with self._cv:
            while True:
                meta = self._get_meta(h, ns)
                if not meta.writer and not meta.moving:
                    meta.pins += 1
                    return meta, late
                late = late or meta.prefetching
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise Busy(f"object {h} is checked out for writing; try again after it is checked in")
                self._wait_for_others(remaining)

    def _unpin(self, meta: ObjectMeta) -> None:
        with self._cv:
            meta.pins -= 1
            self._cv.notify_all()
            drop = self._drop_if_released(meta)
        if drop:
            self._drop(meta)

    def _lease_ok(self, meta: ObjectMeta, mode: str) -> bool:
        if mode == "r":
            return not meta.writer
        return not meta.writer and meta.readers == 0 and meta.pins == 0

