"""Activation offload: the tensors autograd saves for backward live in the tierstore
pool between forward and backward, and come back, prefetched in reverse order, before
backward asks for them.

Built on ``torch.autograd.graph.saved_tensors_hooks``: this module sees only what
autograd hands to the pack hook and what it asks back from the unpack hook; it knows
nothing of modules, parameters' owners or optimizers. Mechanism only: which tensor
goes (``_worth``), where its bytes are (``_Entry``), and two kinds of background
worker (puts and frees; fetches).

Life of a saved tensor:

1. pack (forward): small tensors, parameters and leaves that require grad (and views
   of them), tensor subclasses and conjugate/negative views stay where they are. For
   the others the byte range of their storage they cover is queued for a put; the
   forward goes on. A second save of the same storage range (``x`` saved by three
   projections) shares the first one's object.
2. put (worker): the bytes go to the pool as one ephemeral uint8 object (host tier,
   NVMe when the host tier is full); then this process drops its reference.
3. unpack (backward): the bytes come back from whatever holds them: the tensor itself
   if its put has not run yet (the last ones saved, needed first), a buffer a fetch
   already filled, or a fetch now (a stall, counted). On the CPU a fetch checks the
   object out and backward reads the pool's memory in place (no copy out); the check-in
   follows once the last tensor over it is gone. A check-out that cannot be had at once
   (no room in the host tier) falls back to a copy. The restored tensor has the
   original's dtype, shape and strides, and its offset from a 512-byte boundary of its
   storage (so its address modulo the allocator's alignment: 64 bytes on the CPU, 512
   on CUDA), so the gradients are bit for bit those of the same loop without offload.
   The version the tensor had when saved is checked as autograd would (which it leaves
   to the hooks while they are active): a tensor changed in place since raises
   autograd's error.
   Each unpack starts fetches of the next entries in reverse save order up to
   ``prefetch_bytes``, and sends the pool a prefetch hint for the window after that
   (NVMe to host).
4. free: when autograd drops the packed handle (after the node that needed it ran, or
   when a retained graph goes), the object is freed (after its check-in, if backward
   read it in place). Objects are ephemeral: a process
   that dies takes its activations with it.

Length: one concept, the saved-tensor hooks (as a context or a module wrapper) with
their put/fetch workers, the version checks autograd leaves to them, and the counters
they report; the pieces share one lock and one queue of jobs, and split they would
share them across files.
"""

from __future__ import annotations

import itertools
import logging
import math
import queue
import threading
import time
import weakref
from dataclasses import asdict, dataclass
from typing import Any

import torch

from tierstore.contract import Pool, ReportsActivations
from tierstore.errors import Closed, DaemonUnavailable, InvalidArgument, TierstoreError
from tierstore.units import parse_size

__all__ = ["ActivationOffload", "ActivationStats", "offload_activations"]

log = logging.getLogger(__name__)

_STREAM = "activations"
"""The access-sequence tag of activation gets, apart from parameters' and optimizer states'."""

_ALIGN = 512
"""A range starts this many bytes below its tensor's first byte at most, at a multiple of
this from its storage's start: the restored tensor keeps its address modulo its
storage's alignment (64 bytes on the CPU, 512 on CUDA; kernels vectorise by
alignment), so reductions split the same way and results are identical."""

_REPORT_EVERY_S = 0.5
"""At most this often (and at the end of each forward and backward) the counters go to the daemon."""


@dataclass(slots=True)
class ActivationStats:
    """Counters of one ``ActivationOffload`` (``bytes`` are tensor bytes)."""

    saved: int = 0
    """Tensors autograd handed to the pack hook."""
    kept: int = 0
    """Of those, left where they were (small, parameters, leaves that require grad, subclasses)."""
    kept_bytes: int = 0
    offloaded: int = 0
    """Objects put into the pool."""
    offloaded_bytes: int = 0
    deduped: int = 0
    """Saves served by an object of an earlier save of the same storage range."""
    cancelled: int = 0
    """Puts not made because backward asked for the tensor first (it was still here)."""
    fetched_bytes: int = 0
    """Bytes read back from the pool (read in place or copied out)."""
    read_in_place: int = 0
    """Fetches that backward read where they are in the pool (a check-out, no copy out)."""
    hits: int = 0
    """Unpacks whose bytes were already here (prefetched, or never sent)."""
    late: int = 0
    """Unpacks that waited for a fetch already in flight."""
    misses: int = 0
    """Unpacks that had to fetch on demand."""
    backward_stall_s: float = 0.0
    """Time unpacks waited for bytes."""
    forward_stall_s: float = 0.0
    """Time packs waited for puts, ``inflight_bytes`` being reached."""
    bytes_in_flight: int = 0
    """Activation bytes in the pool now (put, not yet freed)."""
    peak_bytes_in_flight: int = 0
    held_bytes: int = 0
    """Bytes this process holds for offloaded tensors: waiting for their put, or fetched back."""
    peak_held_bytes: int = 0
    put_errors: int = 0
    """Puts that failed (the tensor then stays in memory; the error is logged)."""


@dataclass(slots=True, eq=False)
class _Entry:
    """One pool object: bytes ``[b0, b1)`` of a storage, and where they are now."""

    seq: int
    b0: int  # where the range starts in its storage (bytes; a multiple of _ALIGN)
    nbytes: int
    device: torch.device
    src: torch.Tensor | None = None  # the bytes in place, until the put is done (or for good, after an error)
    queued: bool = False  # a put is queued and has not started: cancellable
    handle: Any = None  # the pool object, once put
    buf: torch.Tensor | None = None  # the bytes fetched back
    fetching: bool = False
    error: BaseException | None = None  # a fetch failed: the unpack raises it
    refs: int = 0  # packed handles alive
    unread: int = 0  # packed handles not yet unpacked (while > 0, buf is kept for them)
    hinted: bool = False
    wanted: bool = False  # inside a prefetch window: keep ``src`` after the put
    dead: bool = False
    gpu_ready: Any = None  # a CUDA event after the producer's work: the put waits for it
    views: int = 0  # check-outs of it that backward reads in place (or a fetch is taking): not freed meanwhile
    pending_free: Any = None  # the handle to free once the last of them is back in
    view_arr: Any = None  # a weak reference to the array the last in-place read's tensors hold
    unwanted: bool = False  # the fetch in flight is no longer wanted (``_resume``): its bytes are not kept
    cancelled: bool = False  # its put was cancelled (``_cancel``): not running, not made


@dataclass(slots=True, eq=False)
class _Unview:
    """A job for a put worker: the last tensor over a check-out's memory is gone; check it in."""

    entry: _Entry
    lease: Any


def _live(ref: Any) -> Any:
    """What a weak reference (or None) still refers to."""
    return None if ref is None else ref()


def _check_version(t: torch.Tensor | None, saved: int, dtype: torch.dtype, size: torch.Size) -> None:
    """Raise autograd's own error if ``t`` (or a view sharing its version counter) was
    changed in place since it was saved: with saved-tensor hooks active, autograd leaves
    that check to the hooks."""
    if t is not None and t._version != saved:
        raise RuntimeError(f"one of the variables needed for gradient computation has been modified by an inplace "
                           f"operation: [{dtype} {list(size)}] is at version {t._version}; expected version "
                           f"{saved} instead (a tensor saved for backward under tierstore's offload_activations)")


class _Kept:
    """A saved tensor left where it was, with its version when saved (checked at unpack).
    Held as ``t.detach()`` (the same storage and version counter): a node's own output
    held as itself would make a cycle (node, output, its grad_fn) that keeps a graph
    dropped without backward, and its pool objects, alive."""

    __slots__ = ("t", "version")

    def __init__(self, t: torch.Tensor) -> None:
        self.t, self.version = t.detach(), t._version


class _Saved:
    """What autograd holds instead of a tensor: the entry, the view to rebuild, and the
    version of the storage's tensor when it was saved (``base``: a weak reference to it)."""

    __slots__ = ("owner", "entry", "dtype", "size", "stride", "first", "span", "unread", "base", "version")

    def __init__(self, owner: "ActivationOffload", entry: _Entry, t: torch.Tensor, first: int, span: int,
                 base: torch.Tensor) -> None:
        self.owner, self.entry = owner, entry
        self.dtype, self.size, self.stride = t.dtype, t.size(), t.stride()
        self.first, self.span = first - entry.b0, span  # the tensor's bytes within the entry's
        self.unread = True
        # a view shares its base's version counter, and every view holds its base: with the
        # base gone, nothing can have changed the bytes
        self.base, self.version = weakref.ref(base), t._version

    def view(self, buf: torch.Tensor) -> torch.Tensor:
        """The saved tensor over ``buf`` (the entry's bytes): same dtype, shape, strides."""
        return buf[self.first:self.first + self.span].view(self.dtype).as_strided(self.size, self.stride)

    def __del__(self) -> None:
        # autograd drops this after the node that needed it ran (or when a retained graph goes)
        owner, self.owner = self.owner, None
        if owner is not None:
            owner._drop_ref(self)


def _loop(jobs: queue.SimpleQueue, name: str, run: Any) -> None:
    """A worker: ``run(offload, job)`` for each ``(offload, job)`` until the ``None``
    sentinel; one failure stops nothing. Each queued job holds its offload (so an offload
    dropped without ``close()`` lives until its last free and check-in have run); between
    jobs the worker holds none, and the offload's ``__del__`` stops it."""
    while True:
        item = jobs.get()
        if item is None:
            log.debug("activation %s worker stopped", name)
            return
        self, job = item
        try:
            run(self, job)
        except TierstoreError as err:
            log.warning("activation %s failed: %s", name, err)
        except Exception:
            log.exception("activation %s failed", name)
        finally:
            with self._cv:
                if isinstance(job, _Unview):
                    self._unviews_done += 1
                else:
                    self._jobs -= 1
                self._cv.notify_all()
        del self, job, item


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """(first byte in its storage, bytes from there to its last element's end) of ``t``."""
    item = t.element_size()
    return t.storage_offset() * item, (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * item


def _size_arg(name: str, v: Any) -> int:
    """A byte count given as an int or a size string (``"64MiB"``)."""
    try:
        return parse_size(v, field=name)
    except ValueError as e:
        raise InvalidArgument(str(e)) from None


def _check_args(store: Any, min_bytes: Any, tier: Any, inflight_bytes: Any, prefetch_bytes: Any, threads: Any,
                wait_s: Any) -> tuple[int, int, int]:
    """The sizes as byte counts; ``InvalidArgument`` (a ``TypeError`` for a ``store`` that
    is not a pool) naming what is wrong."""
    if not isinstance(store, Pool):
        raise TypeError(f"offload_activations needs a daemon Client or an in-process tierstore.Store, "
                        f"got {type(store).__name__}")
    sizes = _size_arg("min_bytes", min_bytes), _size_arg("inflight_bytes", inflight_bytes), \
        _size_arg("prefetch_bytes", prefetch_bytes)
    if not sizes[1]:
        raise InvalidArgument("inflight_bytes must be > 0")
    if type(threads) is not int or threads < 1:
        raise InvalidArgument(f"threads must be an int >= 1, got {threads!r}")
    if type(wait_s) not in (int, float) or not (math.isfinite(wait_s) and wait_s >= 0):
        raise InvalidArgument(f"wait_s must be a finite number of seconds >= 0, got {wait_s!r}")
    if tier not in (None, "host", "nvme"):
        raise InvalidArgument(f"tier must be None, 'host' or 'nvme' for activations, got {tier!r}")
    return sizes


_sources = itertools.count(1)


class ActivationOffload:
    """Saved-tensor hooks that keep activations in a tierstore pool; see ``offload_activations``."""

    def __init__(self, store: Pool, *, min_bytes: int | str, tier: str | None, inflight_bytes: int | str,
                 prefetch_bytes: int | str, threads: int, wait_s: float) -> None:
        # (until it is whole: ``__del__`` of one refused here does nothing)
        self._closed, self._workers, self._reporter = True, [], None
        min_bytes, inflight_bytes, prefetch_bytes = _check_args(store, min_bytes, tier, inflight_bytes,
                                                                prefetch_bytes, threads, wait_s)
        self.store = store
        self.min_bytes, self.tier, self.wait_s = min_bytes, tier, wait_s
        self.inflight_bytes, self.prefetch_bytes = inflight_bytes, prefetch_bytes
        self.stats = ActivationStats()
        # guards every entry field and the counters; reentrant, because the last tensor over
        # an in-place read (``_view_gone``) or a saved handle (``_drop_ref``) may go while its
        # thread holds it (a collection inside a critical section)
        self._cv = threading.Condition(threading.RLock())
        self._seq = 0
        self._order: list[_Entry] = []  # live entries in save order (backward reads them in reverse)
        self._index: dict[int, int] = {}  # id(entry) -> position in _order
        self._live = 0
        self._pending = 0  # bytes held for puts not yet done (the forward's bound)
        self._jobs = 0  # puts, frees and fetches queued or running (flush waits for none)
        self._by_storage: dict[tuple[str, int], list[tuple[Any, int, int, _Entry]]] = {}  # (owner, version, end, entry)
        self._hooks: list[Any] = []
        self._modules: list[Any] = []  # hook handles of ``wrap``ped modules (removed at close)
        self._gone: TierstoreError | None = None  # the pool went away: the next forward raises it
        self._warned: set[str] = set()  # put failures logged once each (then at debug level)
        self._closed = False
        self._last_report = 0.0
        self._source = next(_sources)  # who these counters are, to a client that sums several
        self._unviews_sent = 0  # check-ins of in-place reads queued, and done
        self._ended: list[_Entry] = []  # entries the last end of a forward kept in memory (``_resume``)
        self._unviews_done = 0
        self._puts: queue.SimpleQueue[tuple[str, _Entry] | None] = queue.SimpleQueue()  # puts and frees, in order
        self._gets: queue.SimpleQueue[_Entry | None] = queue.SimpleQueue()
        # the workers hold this offload only through queued jobs: one dropped without close()
        # (``with offload_activations(c):`` each step) goes once its jobs are done, and its
        # ``__del__`` stops them
        self._workers = [threading.Thread(target=_loop, args=(q, name, run), name=f"tierstore-act-{name}{k}",
                                          daemon=True)
                         for q, name, run in ((self._puts, "put", ActivationOffload._put_or_free),
                                              (self._gets, "fetch", ActivationOffload._fetch))
                         for k in range(threads)]
        for w in self._workers:
            w.start()
        # a daemon Client shows the counters in `stat`; an in-process Store has no one to show them to
        self._reporter = store.report_activations if isinstance(store, ReportsActivations) else None

    # ------------------------------------------------------------------ context
    def __enter__(self) -> "ActivationOffload":
        if self._closed:
            raise InvalidArgument("this activation offload is closed; make a new one with offload_activations()")
        if self._gone is not None:
            raise type(self._gone)(f"activation offload stopped, the pool is gone: {self._gone.message}")
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        hooks.__enter__()
        self._hooks.append(hooks)
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self._hooks:
            return  # (a wrapped module's forward that failed before its pre-hook entered)
        self._hooks.pop().__exit__(*exc)
        if not self._hooks:  # the end of a forward: backward starts with the last entries
            with self._cv:
                self._ended = []
                hints = self._prefetch_before(len(self._order), keep=True)
            if hints:
                self._hint(hints)
        self._report(force=True)  # the most bytes in flight

    def wrap(self, module: torch.nn.Module) -> torch.nn.Module:
        """Offload what ``module``'s forward saves, on every call (its forward runs inside
        this context; backward may run anywhere). Returns ``module``, whose hooks
        ``close()`` removes."""
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"wrap() takes a torch.nn.Module, got {type(module).__name__}")
        if self._closed:
            raise InvalidArgument("this activation offload is closed; make a new one with offload_activations()")
        self._modules.append(module.register_forward_pre_hook(lambda _m, _args: self.__enter__() and None))
        self._modules.append(module.register_forward_hook(lambda _m, _args, _out: self.__exit__(None, None, None),
                                                          always_call=True))
        return module

    # ------------------------------------------------------------------ pack
    def _worth(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s bytes go to the pool (else autograd keeps ``t`` itself)."""
        if type(t) is not torch.Tensor or t.layout != torch.strided or t.device.type not in ("cpu", "cuda"):
            return False  # parameters, subclasses (DTensor, ...), sparse and the like stay
        if t.is_quantized or t.is_conj() or t.is_neg() or t.numel() * t.element_size() < max(self.min_bytes, 1):
            return False
        base = t._base if t._base is not None else t
        # a leaf that requires grad (a weight, an input) or any parameter (a frozen one, whose
        # view ``W.t()`` a linear layer saves) is held anyway
        return not (base.requires_grad and base.is_leaf or isinstance(base, torch.nn.Parameter))

    def _resume(self) -> None:
        """A save after what looked like the end of a forward (a module wrapped per block, a
        context entered per block): the entries that end kept in memory go to the pool after
        all, so each block's end does not hold ``prefetch_bytes`` back."""
        requeue = []
        with self._cv:
            ended, self._ended = self._ended, []
            for e in ended:
                if e.dead or e.unread <= 0:
                    continue
                if e.buf is not None and e.handle is not None:  # fetched back early: the pool still has it
                    self._held(-e.nbytes)
                    e.buf = None
                elif e.fetching:
                    e.unwanted = True
                if not e.wanted:
                    continue
                e.wanted = False
                if e.handle is not None and e.src is not None:  # put already: the pool has the bytes
                    self._held(-e.nbytes)
                    e.src = None
                elif e.cancelled and e.src is not None:  # its put was cancelled: made after all
                    e.cancelled = False
                    e.queued = True
                    self._pending += e.nbytes
                    self.stats.cancelled -= 1
                    requeue.append(e)
        for e in requeue:
            self._queue(self._puts, ("put", e))

    def _pack(self, t: torch.Tensor) -> Any:
        if self._ended:
            self._resume()
        if self._closed or not self._worth(t):
            with self._cv:
                self.stats.saved += 1
                self.stats.kept += 1
                self.stats.kept_bytes += t.numel() * t.element_size()
            return _Kept(t)
        item = t.element_size()
        first, span = _extent(t)
        lo, hi = first, first + span  # the bytes to put: the tensor's own, or its base's (below)
        owner = t._base if t._base is not None else t
        if owner is not t and owner.dtype == t.dtype:
            o_first, o_span = _extent(owner)
            if o_span <= 4 * span:  # q, k, v of one QKV output: one object for the three
                lo, hi = min(lo, o_first), max(hi, o_first + o_span)
        key = (str(t.device), t.untyped_storage().data_ptr())
        with self._cv:
            self.stats.saved += 1
            entry = self._shared(key, owner, t._version, first, first + span)
            if entry is not None:
                self.stats.deduped += 1
                entry.refs += 1
                entry.unread += 1
                return _Saved(self, entry, t, first, span, owner)
        b0 = lo - lo % _ALIGN  # a multiple of every element size
        with torch.no_grad():  # the storage's bytes [b0, hi) as one flat uint8 tensor, no copy
            src = t.detach().as_strided(((hi - b0) // item,), (1,), b0 // item).view(torch.uint8)
        ready = None
        if src.is_cuda:  # the put runs on a worker: it first waits for the work producing t, on t's stream
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(src.device))
        self._wait_room(src.numel())
        with self._cv:
            self._seq += 1
            entry = _Entry(self._seq, b0, src.numel(), src.device, src=src, queued=True, refs=1, unread=1,
                           gpu_ready=ready)
            self._index[id(entry)] = len(self._order)
            self._order.append(entry)
            self._live += 1
            self._pending += entry.nbytes
            self._held(entry.nbytes)
            self._by_storage.setdefault(key, []).append((weakref.ref(owner), t._version, hi, entry))
        self._queue(self._puts, ("put", entry))
        self._report()
        return _Saved(self, entry, t, first, span, owner)

    def _shared(self, key: tuple[str, int], owner: torch.Tensor, version: int, first: int,
                end: int) -> _Entry | None:
        """(under _cv) A live entry of the same storage, same version, holding [first, end)."""
        rows = self._by_storage.get(key)
        if not rows:
            return None
        rows[:] = [r for r in rows if not r[3].dead and r[0]() is not None]
        for ref, ver, e1, entry in rows:
            # the same owner alive means the same storage (its address was not reused)
            if ref() is owner and ver == version and entry.b0 <= first and end <= e1:
                return entry
        return None

    def _wait_room(self, nbytes: int) -> None:
        """Bound the bytes held for puts: wait (a forward stall) while they pass ``inflight_bytes``."""
        with self._cv:
            if self._pending == 0 or self._pending + nbytes <= self.inflight_bytes:
                return
            t0 = time.monotonic()
            self._cv.wait_for(lambda: self._pending == 0 or self._pending + nbytes <= self.inflight_bytes)
            self.stats.forward_stall_s += time.monotonic() - t0

    # ------------------------------------------------------------------ unpack
    def _unpack(self, s: _Saved | _Kept) -> torch.Tensor:
        if type(s) is _Kept:  # kept in place at pack
            _check_version(s.t, s.version, s.t.dtype, s.t.size())
            return s.t
        e = s.entry
        # (its tensor gone: a detach() of it shares the counter, and so does ``src`` while held)
        base = s.base()
        _check_version(base if base is not None else e.src, s.version, s.dtype, s.size)
        with self._cv:
            buf = self._ready(e)
            if buf is None:
                t0 = time.monotonic()
                if e.fetching:
                    self.stats.late += 1
                    self._cv.wait_for(lambda: not e.fetching)
                    buf = self._ready(e)
                if buf is None:
                    self.stats.misses += 1
                    e.fetching = True
                    self._cv.release()
                    try:
                        self._fetch(e)  # on demand, in this thread
                    finally:
                        self._cv.acquire()
                    buf = self._ready(e)
                self.stats.backward_stall_s += time.monotonic() - t0
            else:
                self.stats.hits += 1
            if e.error is not None:
                err, e.error = e.error, None
                raise err
            if s.unread:
                s.unread = False
                e.unread -= 1
            if e.unread <= 0 and e.buf is not None:  # every handle of it read: the tensor we return holds it now
                self._held(-e.nbytes)
                e.buf = None
            hints = self._prefetch_before(self._index.get(id(e)))
        if buf.is_cuda:
            buf.record_stream(torch.cuda.current_stream(buf.device))  # fetched on a worker's stream
        if hints:
            self._hint(hints)
        self._report()
        return s.view(buf)

    def _ready(self, e: _Entry) -> torch.Tensor | None:
        """(under _cv) The entry's bytes if this process has them; cancels a put not started."""
        if e.src is not None:
            if e.queued:  # backward got here before the put: no need to make it
                self._cancel(e)
            return e.src
        return e.buf

    def _cancel(self, e: _Entry) -> None:
        """(under _cv) The put of ``e`` will not be made (it has not started): its bytes stay here."""
        e.queued = False
        e.cancelled = True
        self.stats.cancelled += 1
        self._pending -= e.nbytes
        self._cv.notify_all()

    def _prefetch_before(self, i: int | None, *, keep: bool = False) -> list[Any]:
        """(under _cv) Start fetches of the entries saved before position ``i`` of the
        order (next in backward) up to ``prefetch_bytes``; the handles of the window
        after that, to hint the pool about (NVMe to host). ``keep``: the end of a
        forward, whose last entries backward reads first: those whose put has not
        started stay in memory (the put is cancelled) instead of going and coming back.
        Only entries not yet read: a retained graph's second backward fetches on demand."""
        if i is None:
            return []
        ahead = hinted = 0
        hints = []
        for k in range(i - 1, -1, -1):
            p = self._order[k]
            if p.dead or p.unread <= 0:
                continue
            if ahead < self.prefetch_bytes:
                ahead += p.nbytes
                if p.src is not None:
                    p.wanted = True  # a put running now does not let the bytes go: backward is near
                    if keep:
                        self._ended.append(p)
                        if p.queued:
                            self._cancel(p)
                elif p.src is None and p.buf is None and not p.fetching and p.handle is not None \
                        and not self._closed:  # (closed: no fetch workers; backward fetches on demand)
                    if keep:
                        self._ended.append(p)
                    p.fetching = True
                    self._jobs += 1  # (under _cv already)
                    self._gets.put((self, p))
            elif hinted < self.prefetch_bytes:
                hinted += p.nbytes
                if not p.hinted and p.handle is not None:
                    p.hinted = True
                    hints.append(p.handle)
            else:
                break
        return hints

    def _hint(self, hints: list[Any]) -> None:
        try:
            self.store.prefetch(hints, wait=False)
        except TierstoreError as err:  # a hint only (an object freed meanwhile, say)
            log.debug("activation prefetch hint failed: %s", err)

    # ------------------------------------------------------------------ free
    def _drop_ref(self, s: _Saved) -> None:
        e = s.entry
        # (this thread inside a critical section already: a collection freed a graph there;
        # the order is left as it is, the outer section may be walking it)
        nested = self._cv._is_owned()
        with self._cv:
            e.refs -= 1
            if s.unread:
                e.unread -= 1
            if e.refs > 0 or e.dead:
                return
            e.dead = True
            self._live -= 1
            if e.queued:  # never put
                e.queued = False
                self._pending -= e.nbytes
                self._cv.notify_all()
            handle, e.handle = e.handle, None
            if handle is not None:
                if e.views:  # backward reads it in place: freed (and out of the pool) after the check-in
                    e.pending_free, handle = handle, None
                else:
                    self._in_pool(-e.nbytes)
            if e.src is not None or e.buf is not None:
                self._held(-e.nbytes)
            e.src = e.buf = None
            if nested:
                pass
            elif self._live == 0:  # a backward is over: start the order afresh
                self._order = []
                self._index.clear()
                self._by_storage.clear()
                self._ended = []
            else:
                self._index.pop(id(e), None)
                if len(self._order) > 2 * self._live + 64:  # graphs that never all go (1F1B): keep it short
                    self._compact()
        if handle is not None:
            self._queue(self._puts, ("free", handle))
        if self._live == 0:
            self._report(force=True)

    def _compact(self) -> None:
        """(under _cv) Drop the dead entries from the save order and the storage map, so
        neither grows while some graph is always alive (a pipeline schedule running the
        next micro-batch's forward before the last one's backward)."""
        self._order = [e for e in self._order if not e.dead]
        self._index = {id(e): k for k, e in enumerate(self._order)}
        for key in list(self._by_storage):
            rows = [r for r in self._by_storage[key] if not r[3].dead and r[0]() is not None]
            if rows:
                self._by_storage[key] = rows
            else:
                del self._by_storage[key]

    # ------------------------------------------------------------------ workers
    def _queue(self, jobs: queue.SimpleQueue, job: tuple[str, Any]) -> None:
        """A put or a free for the put workers; queued under the lock, so before ``close``'s
        stop. Once closed: a put is not made (its bytes stay here), a free is made now."""
        with self._cv:
            if not self._closed:
                self._jobs += 1
                jobs.put((self, job))
                return
            kind, what = job
            if kind == "put":
                if what.queued:
                    what.queued = False
                    self._pending -= what.nbytes
                    self._cv.notify_all()
                return
        self._free(what)

    def _put_or_free(self, job: tuple[str, Any] | _Unview) -> None:
        if isinstance(job, _Unview):
            self._end_view(job.entry, job.lease)
            return
        kind, what = job
        if kind == "free":
            self._free(what)
        else:
            self._put(what)

    def _put(self, e: _Entry) -> None:
        with self._cv:
            if not e.queued:
                return  # cancelled or dropped meanwhile
            e.queued = False
            src = e.src
        try:
            if e.gpu_ready is not None:
                e.gpu_ready.synchronize()
            h = self.store.put(src, tier=self.tier, ephemeral=True, wait_s=self.wait_s)
        except BaseException as err:
            with self._cv:  # the tensor stays in memory: backward finds it there
                self.stats.put_errors += 1
                self._pending -= e.nbytes
                self._cv.notify_all()
            if isinstance(err, (DaemonUnavailable, Closed)):
                # the pool is gone: this forward's tensors stay in memory, the next forward fails
                # (training on without it would only run out of memory later, with a warning a tensor)
                if self._gone is None:
                    log.error("activation offload stops: the pool is gone (%s); the next forward raises it", err)
                    self._gone = err
                return
            if isinstance(err, TierstoreError):
                why = err.code
                if why in self._warned:
                    log.debug("activation of %d bytes stays in memory: %s", e.nbytes, err)
                else:
                    self._warned.add(why)
                    log.warning("activation of %d bytes stays in memory: %s (said once; stats.put_errors counts "
                                "them)", e.nbytes, err)
                return
            raise
        with self._cv:
            self._pending -= e.nbytes
            self._cv.notify_all()
            self.stats.offloaded += 1
            self.stats.offloaded_bytes += e.nbytes
            if e.dead:
                free = h
            else:
                free = None
                e.handle = h
                self._in_pool(e.nbytes)
                if e.src is not None and not e.wanted:
                    self._held(-e.nbytes)
                    e.src = None  # the pool has the bytes: this process lets them go
        if free is not None:
            self._free(free)

    def _free(self, handle: Any) -> None:
        try:
            self.store.free(handle)
        except TierstoreError as err:  # gone already (the store closed, say): nothing to give back
            log.debug("freeing an activation: %s", err)

    def _fetch(self, e: _Entry) -> None:
        """Read ``e``'s bytes back (``e.fetching`` is set); wakes whoever waits for them."""
        buf = err = None
        viewing = in_place = False
        with self._cv:
            handle = None if e.dead else e.handle
            if handle is not None and e.device.type == "cpu":
                # an earlier in-place read of it (a retained graph read twice): its memory
                # again while a tensor over it lives, else its check-in first (it is queued)
                self._cv.wait_for(lambda: e.views == 0 or _live(e.view_arr) is not None)
                arr = _live(e.view_arr)
                if arr is not None:
                    buf = torch.from_numpy(arr)
                else:
                    viewing = True
                    e.views += 1  # from here a free of it waits for the check-in (``_drop_ref``)
        try:
            if viewing:
                got = self._view(handle, e)
                if got is not None:
                    buf, arr = got
                    in_place = True
                    with self._cv:
                        e.view_arr = weakref.ref(arr)
                        self.stats.read_in_place += 1
            if buf is None and handle is not None:
                buf = self._read(handle, e)
        except BaseException as x:
            err = x
        finally:
            if viewing and not in_place:
                self._end_view(e, None)
        with self._cv:
            e.fetching = False
            drop, e.unwanted = e.unwanted, False
            if err is not None:
                e.error = err
            elif buf is not None and drop:
                pass  # (not kept: an in-place read is checked in once ``buf`` goes)
            elif buf is not None and not e.dead and e.src is None:
                e.buf = buf
                self._held(e.nbytes)
                self.stats.fetched_bytes += e.nbytes
            elif handle is None and not e.dead and e.src is None and e.buf is None:
                e.error = TierstoreError("an offloaded activation is gone from the pool before backward used it")
            self._cv.notify_all()

    def _view(self, handle: Any, e: _Entry) -> tuple[torch.Tensor, Any] | None:
        """(CPU) The object's bytes where they are in the pool, for backward to read in
        place: a check-out, back in once the last tensor over it is gone (``_view_gone``).
        The tensor and the array its storage holds; None if it cannot be had at once (the
        host tier full, say): then a copy.

        The check-out is ``rw``, not ``r``, although backward only reads: an ``r`` view
        through a daemon is a read-only mapping, where a write (a custom autograd
        function changing what it saved) would kill the process instead of failing."""
        try:
            lease = self.store.checkout(handle, "rw", timeout_s=0.0, stream=_STREAM)
        except TierstoreError as err:
            log.debug("activation read as a copy: %s", err)
            return None
        arr = lease.tensor.numpy()  # the pool's bytes; holds the lease's tensor
        buf = torch.from_numpy(arr)  # its storage holds ``arr`` until the last tensor over it goes
        weakref.finalize(arr, self._view_gone, e, lease)
        return buf, arr

    def _view_gone(self, e: _Entry, lease: Any) -> None:
        """(any thread, maybe under ``_cv``) The last tensor over an in-place read is gone:
        its check-in (and the free it held back) goes to a put worker."""
        with self._cv:
            self._unviews_sent += 1
            if not self._closed:  # (under the lock ``close`` sets it with: queued before the workers' stop)
                self._puts.put((self, _Unview(e, lease)))
                return
        try:
            self._end_view(e, lease)  # no workers left
        finally:
            with self._cv:
                self._unviews_done += 1
                self._cv.notify_all()

    def _end_view(self, e: _Entry, lease: Any) -> None:
        """Check an in-place read's object back in, then free it if it was dropped meanwhile.
        Given back as never written (backward only read it): after an ``rw`` check-in the
        object would be dirty, and a demotion in the moment before its free — a consumed
        activation is the first the trace policy picks — would write it to NVMe again."""
        if lease is not None:
            try:
                lease.give_back()
            except TierstoreError as err:  # the connection is gone: the daemon checked it in
                log.debug("checking in an activation: %s", err)
        with self._cv:
            handle = self._viewed(e)
            last = self._live == 0
            self._cv.notify_all()
        if handle is not None:
            self._free(handle)
            self._report(force=last)  # (its bytes left the pool only now)

    def _viewed(self, e: _Entry) -> Any:
        """(under ``_cv``) One in-place read of ``e`` is over: the handle to free now, if any."""
        e.views -= 1
        if e.views:
            return None
        handle, e.pending_free = e.pending_free, None
        if handle is not None:
            self._in_pool(-e.nbytes)
        return handle

    def _read(self, handle: Any, e: _Entry) -> torch.Tensor:
        if e.device.type == "cuda":
            buf = torch.empty(e.nbytes, dtype=torch.uint8, device=e.device)
            # a daemon Client copies on a side stream from the pinned arena; a Store through host memory
            return self.store.get(handle, out=buf, stream=_STREAM)
        return self.store.get(handle, stream=_STREAM)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every put, free and fetch queued so far is done (benchmarks, tests:
        after a backward, the pool holds none of its objects then); False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: self._jobs == 0 and self._unviews_done == self._unviews_sent,
                                     timeout=timeout_s)

    # ------------------------------------------------------------------ counters
    def _held(self, delta: int) -> None:
        st = self.stats
        st.held_bytes += delta
        st.peak_held_bytes = max(st.peak_held_bytes, st.held_bytes)

    def _in_pool(self, delta: int) -> None:
        st = self.stats
        st.bytes_in_flight += delta
        st.peak_bytes_in_flight = max(st.peak_bytes_in_flight, st.bytes_in_flight)

    def snapshot(self) -> dict[str, Any]:
        """The counters as a dict (consistent: taken under the lock)."""
        with self._cv:
            return asdict(self.stats)

    def _report(self, force: bool = False, final: bool = False) -> None:
        """Send the counters to the daemon for ``stat`` and the metrics (no reply awaited;
        the client sums those of its offloads). ``final``: this offload is done."""
        if self._reporter is None:
            return
        now = time.monotonic()
        if not force and now - self._last_report < _REPORT_EVERY_S:
            return
        self._last_report = now
        try:
            self._reporter(self.snapshot(), source=self._source, final=final)
        except Exception as err:  # counters only: never the training's failure
            log.debug("reporting activation counters failed: %s", err)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Stop the workers (after the puts and frees queued); later saves stay in memory.
        Objects of graphs still alive are freed as those graphs go (by the process's
        end at the latest: they are ephemeral)."""
        with self._cv:  # every job queued so far is ahead of the stop
            if self._closed:
                return
            self._closed = True
            for _ in self._workers:
                self._puts.put(None)
                self._gets.put(None)
        for w in self._workers:
            w.join()
        for h in self._modules:
            h.remove()
        self._modules.clear()
        self._report(force=True)

    def __del__(self) -> None:
        # gone, closed or not: nothing of it is in the pool or queued (every saved tensor and
        # every queued job held it); its workers stop, and a client keeps its totals
        if not self._closed:
            self._closed = True
            for _ in self._workers:
                self._puts.put(None)
                self._gets.put(None)
        self._report(force=True, final=True)  # (never raises)


def offload_activations(client: Pool, module: torch.nn.Module | None = None, *, min_bytes: int | str = 1 << 20,
                        tier: str | None = None, inflight_bytes: int | str = 256 << 20,
                        prefetch_bytes: int | str = 128 << 20, threads: int = 2,
                        wait_s: float = 0.0) -> ActivationOffload:
    """Keep the tensors autograd saves for backward in the pool (``client``: a daemon
    ``Client`` or an in-process ``tierstore.Store``) from forward to backward.

    Use the result as a context manager around the forward; backward may run outside
    it (and usually does)::

        acts = offload_activations(client)
        for x, y in batches:
            with acts:
                loss = loss_fn(model(x), y)
            loss.backward()
        acts.close()

    or give it a module (or call ``acts.wrap(module)``): every call of that module's
    forward then runs inside it::

        acts = offload_activations(client, model)

    Parameters
    ----------
    module
        A ``torch.nn.Module`` whose forward runs inside the context on every call
        (``wrap``); ``close()`` removes its hooks.
    min_bytes
        Saved tensors smaller than this stay in memory (a pool object costs a round
        trip or two; below ~1 MiB that costs more than the memory is worth).
    tier
        ``None``: the host tier, NVMe when it is full; ``"host"`` or ``"nvme"`` to force one.
    inflight_bytes
        At most this many bytes wait in memory for their put; a forward that produces
        them faster waits (``stats.forward_stall_s``).
    prefetch_bytes
        How far backward reads ahead: bytes fetched back before they are asked for
        (and as many again hinted to the pool, NVMe to host).
    threads
        Worker threads per direction (puts and frees; fetches).
    wait_s
        How long a put may wait for room in a full pool before the tensor stays in
        memory instead (``stats.put_errors``; each kind of failure logged once).

    Sizes are byte counts or strings such as ``"64MiB"``. If the pool goes away (the
    daemon stops), the tensors of that forward stay in memory and the next entry into
    the context (the next forward) raises the pool's error (``DaemonUnavailable``,
    ``Closed``).

    Notes
    -----
    Parameters, leaves that require grad and views of them stay where they are (the
    model holds them anyway), as do tensor subclasses such as ``DTensor`` and sparse
    or quantized tensors. Two saves of the same storage range while its tensor lives
    share one object. The counters are ``.stats`` (and ``snapshot()``); through a
    daemon they also appear in ``tierstore stat`` under ``activations``.
    """
    acts = ActivationOffload(client, min_bytes=min_bytes, tier=tier, inflight_bytes=inflight_bytes,
                             prefetch_bytes=prefetch_bytes, threads=threads, wait_s=wait_s)
    if module is not None:
        try:
            acts.wrap(module)
        except BaseException:
            acts.close()
            raise
    return acts
