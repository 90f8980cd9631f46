"""The store: a thin front over the components that own the store's state.

``Store`` composes, in this order (each given the ones before it, nothing else):

- ``ObjectIndex`` (``objectindex``): the lock, the objects, their keys, ids, counters;
- ``Durability`` (``durability``): the journal, the host index log, namespace owners;
- ``Prefetcher`` (``prefetch``): access traces and the prefetch queue;
- ``Placement`` (``placement``): the tiers' space and the moves between them;
- ``LeaseTable`` (``leases``): who holds what, and ``LeaseBatches`` (``leasebatches``)
  over it: several check-outs or check-ins in one call;
- ``Puts`` (``puts``): reservations, commits, staging-area transfers;
- ``Hints`` (``hints``): prefetch hints and the loop's iteration boundaries;

and last ``DaemonSurface`` (``daemonsurface``, as ``Store.daemon``): the calls only the
daemon makes (two-phase puts, leases by owner, expiry, a closed connection's cleanup).

The methods of ``Store`` itself are the in-process API, the same contract as
``tierstore.client.Client`` (``tierstore.contract.Pool``). Each checks its arguments and
hands the call to the one component that does it.

Length: one short method per documented call of the API (each with its docstring,
which docs/store.md follows); the logic is in the components.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import Future
from typing import Any, Iterable, Literal, Sequence

import numpy as np

from . import checksum
from ._version import __version__
from .allocator import ExtentAllocator
from .arena import Arena
from .batch import LeaseGroup
from .config import Config, StoreConfig
from .engine import select_engine
from .errors import InvalidArgument
from .gpu import GpuTier, detect_backend
from .hints import Hints
from .hostindex import HostIndexLog, index_bytes_for
from .index import Handle, validate_key
from .journal import Journal
from .leasebatches import LeaseBatches
from .leases import LOCAL, LeaseInfo, LeaseTable
from .placement import Placement
from .nvme import NvmeTier
from .objectindex import ObjectIndex
from .policy import GpuOrder, make_policy
from .prefetch import Prefetcher
from .staging import StagingAreas
from .streams import StreamedGets
from .preflight import check_start
from .puts import Puts, Reservation
from .daemonsurface import DaemonSurface
from .durability import Durability
from .tensors import TensorSpec, aligned_empty, cuda_out, from_bytes, out_bytes
from .units import format_size

__all__ = ["Store", "Lease", "Reservation", "LeaseInfo"]

log = logging.getLogger(__name__)

SMALL_BLOCK_BYTES = 1 << 20
"""Host blocks below this size are placed apart from larger ones (less fragmentation)."""

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

    def give_back(self) -> None:
        """Check the object back in as never written (``PoolLease.give_back``)."""
        lid = self._take()
        if lid is not None:
            self._store.give_back(lid)

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

    def lookup(self, key: str) -> Handle | None:
        return self._s.lookup(key, namespace=self._ns)

    def get(self, handle: Any) -> Any:
        return self._s.get(handle, namespace=self._ns)

    def put(self, tensor: Any, key: str | None = None, **kw: Any) -> Handle:
        return self._s.put(tensor, key, namespace=self._ns, **kw)

    def free(self, handle: Any) -> None:
        self._s.free(handle, namespace=self._ns)


class Store:
    """An in-process tiered tensor store (host arena, NVMe, and a GPU tier where one is
    configured), usable without a daemon."""

    def __init__(self, config: Config | StoreConfig | None = None, *, namespace: str = "default",
                 inherited_fds: dict[str, int] | None = None, gpu_backend: Any = None,
                 populate_host: bool | Literal["background"] = True, **overrides: Any) -> None:
        """Start-up checks (``tierstore.preflight``: directories, their locks, free disk,
        memory) come first, so a start that cannot work fails in milliseconds, before the
        host arena is mapped. ``populate_host=False`` leaves populating the arena's pages
        to ``self.arena.populate()``; ``"background"`` starts it on a thread before the
        journal is replayed, and ``self.arena.populate()`` waits for it (the daemon: it
        replays meanwhile, and waits while already serving).
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
        self.index = ix = ObjectIndex(namespace, cfg.lease_wait_s)
        self.namespace = ix.namespace
        self.counters = ix.counters
        self._started = time.monotonic()
        self.gpu: GpuTier | None = None
        self.host_pinned, self.host_pinned_reason = False, "no GPU tier in this process: host memory is not page-locked"
        self.engine = select_engine(cfg.engine, cfg.io_threads, cfg.io_chunk_bytes)
        try:
            inherited = inherited_fds or {}
            adopt = "arena" in inherited and "index" in inherited
            self.arena = Arena(cfg.host_bytes, fd=inherited["arena"] if adopt else None, populate=populate_host,
                               huge_pages=cfg.host_huge_pages)
            self.hostlog = HostIndexLog(inherited["index"] if adopt else None, size=index_bytes_for(self.arena.size))
            # small blocks (staging areas, scalars, biases) from the top, big ones from the bottom
            self.host = ExtentAllocator(self.arena.size, small_bytes=SMALL_BLOCK_BYTES)
            self.nvme = NvmeTier(cfg.nvme_dirs, cfg.nvme_bytes, self.engine, direct_io=cfg.direct_io,
                                 chunk_bytes=cfg.io_chunk_bytes, grow_bytes=cfg.nvme_grow_bytes,
                                 trim_after_s=cfg.nvme_trim_after_s)
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
            self._abandon()
            raise
        try:
            self._open(cfg, ix, adopt)
        except BaseException:
            self._abandon()
            raise
        log.info("store open: host %s, nvme %s in %s, engine %s (%s); %d durable objects recovered",
                 format_size(self.arena.size), format_size(self.nvme.capacity_bytes), ", ".join(cfg.nvme_dirs),
                 self.engine.name, self.engine.reason, ix.object_count())

    def _open(self, cfg: StoreConfig, ix: ObjectIndex, adopt: bool) -> None:
        """The components over the tiers, and the journal's replay (``__init__``)."""
        self.journal = Journal(cfg.nvme_dirs[0])
        self.durability = Durability(ix, self.journal, self.hostlog, self.nvme, self.host, cfg.journal_compact_bytes,
                                     cfg.checkpoint_tail_bytes)
        self.prefetcher = Prefetcher(cfg, ix.holder, lambda oid: self.placement.fetch(oid))
        self.policy = make_policy(cfg.policy, self.prefetcher.learned_order, self.prefetcher.protected_ids,
                                  self.prefetcher.reach, ix.nbytes_of, cfg.prefetch_budget_bytes)
        self.staging = StagingAreas(ix, self.host)
        self.gpu_order = GpuOrder()
        self.placement = Placement(cfg, ix, self.durability, self.prefetcher, self.policy, self.gpu_order, self.arena,
                                   self.host, self.nvme, self.gpu, self.engine, self.staging, self.gpu_reason)
        self.leases = LeaseTable(ix, self.placement, self.durability, self.prefetcher, cfg.lease_wait_s)
        self.batches = LeaseBatches(self.leases, ix, self.placement)
        self.puts = Puts(ix, self.placement, self.durability, self.prefetcher, self.staging)
        self.hints = Hints(ix, self.prefetcher, self.placement.later)
        self.streams = StreamedGets(cfg, ix, self.placement, self.leases, self.prefetcher)
        self.daemon = DaemonSurface(ix, self.durability, self.placement, self.leases, self.batches, self.puts,
                                    self.staging, self.hints, self.streams)
        """The calls only the daemon makes, for its connections (``tierstore.daemonsurface``)."""
        self.replay_info = self.durability.replay()
        self.nvme.record_identity()
        self.replay_info["adopted"] = 0
        if adopt:
            adopted = self.durability.adopt_host_objects()
            for meta in adopted:
                self.placement.admit(meta)
            self.replay_info["adopted"] = len(adopted)
        else:
            self.hostlog.start_empty()
        self.placement.start()

    def _abandon(self) -> None:
        """A start that failed: whatever it opened is closed (the directories' locks, files,
        threads and memory), so the same process may start a store on them again."""
        for name in ("prefetcher", "journal", "engine", "nvme", "gpu", "arena", "hostlog"):
            part = self.__dict__.get(name)
            if part is None:
                continue
            try:
                part.close()
            except Exception:  # (the error that ended the start is the one to raise)
                log.exception("closing the %s of a store that did not start", name)

    # ------------------------------------------------------------------ puts and gets
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
        return self.puts.put(tensor, validate_key(key), tier, durable, replace, self.index.ns(namespace), wait_s,
                             ephemeral)

    def get(self, handle: Handle | int | str, out: Any = None, *, namespace: str | None = None,
            stream: str = "default") -> Any:
        """A new CPU tensor with the object's bytes, or the bytes copied into ``out``.

        ``stream`` names the access sequence this get belongs to (e.g. "params",
        "optim"), so interleaved loops are learned separately.
        """
        made = []

        def into(spec: TensorSpec) -> tuple[Any, bool]:
            if cuda_out(out, spec):  # a CUDA tensor: straight from NVMe where GPUDirect Storage is on
                return out, True
            made.append(out_bytes(out, spec) if out is not None else aligned_empty(spec.nbytes))
            return made[0], False

        spec = self.placement.read_pinned(Handle.parse(handle), self.index.ns(namespace), LOCAL, stream, into)
        return out if out is not None else from_bytes(made[0], spec)

    def free(self, handle: Handle | int | str, *, namespace: str | None = None) -> None:
        """Delete the object. Once this returns, the object is gone for good (also after a crash).

        Any lease on it (this process's, or a daemon connection's) makes it ``Busy`` at
        once; copies and moves in flight are waited for.
        """
        self.leases.free(Handle.parse(handle), self.index.ns(namespace), LOCAL)

    # ------------------------------------------------------------------ check-outs
    def checkout(self, handle: Handle | int | str, mode: str = "r", *, namespace: str | None = None,
                 timeout_s: float | None = None, stream: str = "default",
                 source: Handle | int | str | None = None) -> "Lease":
        """Lease the object and return a ``Lease`` whose tensor views the host arena (zero copy).

        ``source`` (with mode ``"w"``): the lease starts with that object's bytes instead of
        its own (same size), and ``source`` is unchanged: a double-buffered update that
        reads one version and writes the other, without copying (``checkout_from``)."""
        if source is not None:
            if mode != "w":
                raise InvalidArgument(f"a check-out from a source is a 'w' check-out, got mode {mode!r}")
            return self._lease(self.leases.checkout_from(handle, source, owner=LOCAL, namespace=namespace,
                                                         timeout_s=timeout_s, stream=stream))
        return self._lease(self.leases.checkout(handle, mode, owner=LOCAL, namespace=namespace, timeout_s=timeout_s,
                                                stream=stream))

    def _lease(self, info: LeaseInfo) -> "Lease":
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
        infos = self.batches.checkout_each(list(requests), owner=LOCAL, namespace=namespace, timeout_s=timeout_s,
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
        infos = self.batches.checkout_many(hs, modes, owner=LOCAL, namespace=namespace, timeout_s=timeout_s,
                                           stream=stream)
        return LeaseGroup([self._lease(info) for info in infos], self.release_many)

    def release(self, lid: int) -> None:
        """Check a lease in. After ``rw`` the object is dirty; a durable one is written back first."""
        self.leases.release(lid)

    def release_many(self, lids: list[int]) -> None:
        """Check several leases in (``release`` each); see ``LeaseBatches.release_many``."""
        self.batches.release_many(lids, owner=LOCAL)

    def give_back(self, lid: int) -> None:
        """End a lease its holder never wrote through, as if it had never been taken."""
        self.leases.give_back(lid)

    # ------------------------------------------------------------------ the index
    def lookup(self, key: str, *, namespace: str | None = None) -> Handle | None:
        return self.index.lookup(key, namespace)

    def keys(self, prefix: str = "", *, namespace: str | None = None) -> list[str]:
        return self._all_pages(self.key_names, prefix, namespace, lambda k: k)

    def key_names(self, prefix: str = "", after: str | None = None, limit: int | None = None, *,
                  namespace: str | None = None) -> list[str]:
        """The namespace's keys starting with ``prefix``, in key order, after the key
        ``after`` (exclusive), at most ``limit``: one page of a listing, in O(log n + limit)
        of this namespace alone."""
        return self.index.key_names(prefix, after, limit, namespace)

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

    def info(self, handle: Handle | int | str, *, namespace: str | None = None) -> dict[str, Any]:
        """Metadata of one object: key, dtype, shape, nbytes, residency, leases, durability."""
        return self.index.info(Handle.parse(handle), namespace)

    def ls(self, prefix: str = "", *, namespace: str | None = None) -> list[dict[str, Any]]:
        """``info`` of every keyed object in the namespace whose key starts with ``prefix``."""
        return self._all_pages(self.ls_page, prefix, namespace, lambda e: e["key"])

    def ls_page(self, prefix: str = "", after: str | None = None, limit: int | None = None, *,
                namespace: str | None = None) -> list[dict[str, Any]]:
        """One page of ``ls``: as ``key_names``, each object's ``info``."""
        return self.index.ls_page(prefix, after, limit, namespace)

    def snapshot(self, dest: str, *, prefix: str = "", namespace: str | None = None,
                 progress: bool | None = None) -> dict[str, Any]:
        """Export the namespace (keys under ``prefix``) as a Zarr v3 store; see ``tierstore.snapshot``."""
        from .snapshot import snapshot

        ns = self.index.ns(namespace)
        return snapshot(_NamespaceView(self, ns), dest, namespace=ns, prefix=prefix, progress=progress)

    def restore(self, src: str, *, namespace: str | None = None, overwrite: bool = False,
                progress: bool | None = None) -> dict[str, Any]:
        """Import a snapshot into the namespace; refuses incomplete or corrupted snapshots."""
        from .snapshot import restore

        return restore(_NamespaceView(self, self.index.ns(namespace)), src, overwrite=overwrite, progress=progress)

    # ------------------------------------------------------------------ prefetch
    def prefetch(self, handles: Iterable[Handle | int | str], *, namespace: str | None = None,
                 wait: bool = True) -> None:
        """Hint: bring these objects into the host tier now, through the prefetch queue
        (and within its byte budget). In process the hint is queued before this returns,
        ``wait`` or not (the contract's ``wait=False`` matters through a daemon);
        ``prefetch_tracked`` also says when the fetches are done."""
        self.hints.hint(handles, self.index.ns(namespace), LOCAL)

    def prefetch_tracked(self, handles: Iterable[Handle | int | str], *, namespace: str | None = None) -> Future:
        """``prefetch``, with a future that resolves, once the fetches issued for this hint
        are done, to how many of the objects are host-resident (benchmarks, tests)."""
        return self.hints.hint_tracked(handles, self.index.ns(namespace), LOCAL)

    def wait_prefetch(self, timeout_s: float | None = None) -> bool:
        """Block until no prefetch is queued or in flight (benchmarks, tests). False on timeout."""
        return self.hints.wait_idle(timeout_s)

    def step(self) -> None:
        """Iteration boundary of this process's loop: the prefetcher compares it with the last."""
        self.hints.step(LOCAL)

    # ------------------------------------------------------------------ state
    def stat_namespaces(self, after: str | None = None, limit: int | None = None) -> dict[str, dict[str, int]]:
        """Objects and bytes per namespace, in name order, after the name ``after``, at most
        ``limit``: from counters kept as objects come and go, O(log namespaces + what it returns)."""
        return self.index.stat_namespaces(after, limit)

    def stat(self, *, namespace_limit: int | None = None) -> dict[str, Any]:
        """The store's state; ``namespace_limit``: the first that many namespaces by name
        (``namespaces_total`` says how many there are; ``stat_namespaces`` gives the rest)."""
        namespaces = self.stat_namespaces(limit=namespace_limit)
        huge = self.arena.huge()
        ix = self.index
        with ix.cv:  # every figure from counters kept as objects change: O(1) in objects
            host_objects, nvme_objects = ix.resident_counts()
            return {
                "tiers": {
                    "host": {"capacity_bytes": self.host.capacity, "used_bytes": self.host.used_bytes,
                             "free_bytes": self.host.free_bytes, "fenced_bytes": self.host.held_bytes,
                             "objects": host_objects,
                             "pinned": self.host_pinned, "pinned_reason": self.host_pinned_reason,
                             "huge_page_bytes": huge[0], "huge_pages": huge[1]},
                    "nvme": {"capacity_bytes": self.nvme.capacity_bytes, "used_bytes": self.nvme.used_bytes,
                             "free_bytes": self.nvme.free_bytes, "objects": nvme_objects,
                             "engine": self.engine.name, "engine_reason": self.engine.reason,
                             "device_io": self.engine.device_reason,
                             "direct_io": self.nvme.direct, "direct_io_reason": self.nvme.direct_reason,
                             "checksums": checksum.IMPLEMENTATION,
                             "bytes_read": self.nvme.bytes_read, "bytes_written": self.nvme.bytes_written,
                             "staged_bytes": self.nvme.staged_bytes,
                             "trimmed_bytes": self.nvme.trimmed_bytes,
                             "drives": self.nvme.describe()},
                    **({"gpu": {**self.gpu.describe(), "objects": len(self.gpu_order)}}
                       if self.gpu is not None else {}),
                },
                "prefetch": self.prefetcher.stat(),
                "gpu_reason": self.gpu_reason,
                "namespaces": namespaces,
                "namespaces_total": ix.namespace_count(),
                "leases": len(self.leases),
                "reservations": self.puts.open_count(),
                "policy": self.policy.name,
                "counters": dict(self.counters),
                "journal": {**self.durability.journal_stat(),
                            **{k: v for k, v in self.replay_info.items() if k not in ("objects", "adopted")}},
                "uptime_s": time.monotonic() - self._started,
                "version": __version__,
            }

    def close(self) -> None:
        """Stop background work, drain in-flight I/O, flush the journal, release memory."""
        if not self.index.close():
            return
        self.puts.close()  # durable commits already queued finish first
        self.placement.close()
        self.prefetcher.close()
        self.engine.close()
        self.durability.close()  # the journal flushed, and its index checkpoint written
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
