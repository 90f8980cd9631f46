"""Streamed gets: a large get through the daemon read from NVMe while its client copies.

A daemon ``get`` hands its client a lease on the object in the host tier, which the
client copies out of; an object only on NVMe is read into the host tier first, so the
copy waits for the whole read. A streamed get (``get`` with ``parts``) of a large object
that stays on NVMe (``put(tier="nvme")``, or ``promote_on_get`` off) instead reads it
into a host block of the request's own, chunk by chunk, and answers at once with that
block; the client asks ``get_part`` how far the checked bytes have come and copies each
piece as it lands, while the next are read; ``get_end`` gives the block back.

``StreamedGets`` owns the open streams. It is given the object index (the pin that
holds the object against writers and moves while it is read), placement (the block, the
read, the block's return), the lease table (an object a stream is not for goes through
an ordinary lease) and the prefetcher (the get is an access it learns from). The object
is pinned until its read is over (a writer or a free waits for the read, never for the
client); the block is the client's until it ends the stream (``get_end``, or its
connection goes) and the read is over. An ended stream sends no more chunks, and counts
against its connection's open streams until the chunks it sent are back. Streams hold
at most half the host tier together; a get past that takes a lease.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from .config import StoreConfig
from .errors import CapacityExceeded, InvalidArgument, NotFound
from .groupcommit import Pending
from .index import Handle, ObjectMeta
from .leases import LeaseInfo, LeaseTable
from .nvme import StreamRead
from .objectindex import ObjectIndex
from .placement import Placement
from .prefetch import Prefetcher
from .waits import Later

__all__ = ["STREAM_MIN_BYTES", "Stream", "StreamedGets"]


STREAM_MIN_BYTES = 32 << 20
"""A get streams only objects this large (at 16 - 32 MiB, streamed and whole reads were
within a few per cent of each other)."""
STREAM_HOST_SHARE = 0.5
"""The share of the host tier streamed gets may hold together; past it a get takes a
lease (one promoted copy, shared by every reader) as a get of a smaller object does."""
MAX_STREAMS_PER_OWNER = 8
MAX_WAITS_PER_STREAM = 64
"""``get_part`` requests one stream may have waiting at once."""


@dataclass(slots=True)
class Stream:
    """One streamed get: the host block ``offset`` its object is read into."""

    sid: int
    owner: Any
    meta: ObjectMeta
    offset: int
    read: StreamRead
    waits: int = 0
    ended: bool = False
    """The client ended it (or went): nothing more is answered for it."""
    over: bool = False
    """Its read is over: nothing lands in the block any more."""


class StreamedGets:
    """The open streamed gets; see the module docstring."""

    def __init__(self, config: StoreConfig, index: ObjectIndex, placement: Placement, leases: LeaseTable,
                 prefetcher: Prefetcher) -> None:
        self.index, self.placement, self.leases, self.prefetcher = index, placement, leases, prefetcher
        self.promote_on_get = config.promote_on_get
        self.cv = index.cv
        self.counters = index.counters
        self.streams: dict[int, Stream] = {}
        """Every stream until both ended and its read is over."""
        self._opening: dict[Any, int] = {}
        """Streams being opened, by owner (counted against the bound before they are in ``streams``)."""
        self._held = 0
        """Bytes of host blocks the streams hold or are opening with."""
        self.share_bytes = int(placement.host.capacity * STREAM_HOST_SHARE)
        """The most the streams hold together: so that streams of one object, however many
        connections ask for them, cannot take the host tier from everything else."""
        self._next = 1

    def _streams(self, meta: ObjectMeta) -> bool:
        """(under cv) Whether a get of ``meta`` streams: large, only on NVMe, and left there by a get."""
        return (meta.nbytes >= STREAM_MIN_BYTES and meta.nvme_valid and not meta.host_valid
                and meta.gpu_loc is None and not (self.promote_on_get and meta.home != "nvme"))

    def try_get(self, handle: Handle | int | str, *, owner: Any, namespace: str | None, stream: str,
                device: bool) -> LeaseInfo | Stream | Later:
        """A daemon get that may stream: the lease now when the object is where it is read
        from; otherwise ``Later`` of ``get`` (nothing taken)."""
        h, ns = Handle.parse(handle), self.index.ns(namespace)
        with self.cv:
            streams = self._streams(self.index.get_meta(h, ns))
        if not streams:
            return self.leases.try_checkout(h, "r", owner=owner, namespace=ns, stream=stream, device=device)
        return Later(lambda: self.get(h, owner=owner, namespace=ns, stream=stream, device=device))

    def get(self, h: Handle, *, owner: Any, namespace: str, stream: str, device: bool) -> LeaseInfo | Stream:
        """Begin streaming the object into a block of its own and return the stream; an
        object that does not stream (any more) gets an ordinary read lease instead."""
        ix = self.index
        t0 = time.monotonic()
        meta, late = ix.pin(h, namespace)
        n = meta.nbytes
        with self.cv:
            # (past the streams' share of the host tier, a get shares one promoted copy, as any other)
            streams = self._streams(meta) and self._held + n <= self.share_bytes
            full = streams and sum(s.owner == owner for s in self.streams.values()) + self._opening.get(owner, 0) \
                >= MAX_STREAMS_PER_OWNER
            if streams and not full:
                self._opening[owner] = self._opening.get(owner, 0) + 1
                self._held += n
        if full:
            self._unpin(meta)
            raise CapacityExceeded(f"this connection has {MAX_STREAMS_PER_OWNER} streamed gets open (or still "
                                   "reading), the most one may; end some first")
        if not streams:
            self._unpin(meta)
            return self.leases.checkout(h, "r", owner=owner, namespace=namespace, stream=stream, device=device)
        try:
            off = self.placement.alloc_host(meta.nbytes, wait_s=ix.lease_wait_s, reading=True)
            try:
                read = self.placement.read_stream(meta, off)
            except BaseException:
                with self.cv:
                    self.placement.host_free(off, meta.nbytes)
                raise
        except BaseException:
            with self.cv:
                self._opened(owner)
                self._held -= n
            self._unpin(meta)
            raise
        with self.cv:
            self._opened(owner)
            sid, self._next = self._next, self._next + 1
            s = self.streams[sid] = Stream(sid, owner, meta, off, read)
            self.counters["nvme_reads"] += 1
            self.counters["streamed_gets"] += 1
            self.counters["gets"] += 1
            self.counters["get_bytes"] += meta.nbytes
        read.on_done(lambda: self._read_over(s))
        with self.cv:
            self.prefetcher.access(owner, stream, meta, False, late, t0)
        return s

    def wait(self, sid: int, upto: int, *, owner: Any) -> int | Pending:
        """How many bytes of stream ``sid``'s object are in its block and checked, once at
        least ``upto``: now, or a ``Pending`` of it. A chunk that fails (its checksum, the
        drive) fails this and every later wait."""
        with self.cv:
            s = self._mine(sid, owner)
            n = s.meta.nbytes
            if not 0 < upto <= n:
                raise InvalidArgument(f"upto {upto} is outside streamed get {sid}'s 1..{n} bytes")
            if s.read.landed() >= upto:
                return s.read.landed()
            if s.waits >= MAX_WAITS_PER_STREAM:
                raise CapacityExceeded(f"streamed get {sid} has {MAX_WAITS_PER_STREAM} get_part requests waiting, "
                                       "the most it may")
            s.waits += 1
        done = Pending()

        def settle(landed: int, error: BaseException | None) -> None:
            with self.cv:
                s.waits -= 1
            done.settle(landed, error)

        s.read.when(upto, settle)
        return done

    def end(self, sid: int, *, owner: Any) -> None:
        """The client is done with stream ``sid``: no more of it is read, and its block
        goes back once no chunk is landing in it."""
        with self.cv:
            s = self._mine(sid, owner)
            s.ended = True
            over = self._forget_if_over(s)
        if not over:
            s.read.cancel(NotFound(f"streamed get {sid} was ended"))

    def drop_owner(self, owner: Any) -> int:
        """End every stream of ``owner`` (a connection that went away); how many."""
        with self.cv:
            mine = [s for s in self.streams.values() if s.owner == owner and not s.ended]
            for s in mine:
                s.ended = True
            reading = [s for s in mine if not self._forget_if_over(s)]
        for s in reading:
            s.read.cancel(NotFound(f"streamed get {s.sid} was ended with its connection"))
        return len(mine)

    def _mine(self, sid: int, owner: Any) -> Stream:
        """(under cv) Stream ``sid`` of ``owner``, not ended; else NotFound."""
        s = self.streams.get(sid)
        if s is None or s.owner != owner or s.ended:
            raise NotFound(f"no open streamed get {sid} for this connection")
        return s

    def _read_over(self, s: Stream) -> None:
        """(an I/O worker, or the thread that ended it) ``s``'s read is over: the object is
        let go, and the block too if the client is done with it."""
        self._unpin(s.meta)
        with self.cv:
            s.over = True
            self._forget_if_over(s)

    def _forget_if_over(self, s: Stream) -> bool:
        """(under cv) Drop an ended stream whose read is over, giving its block back; whether it was."""
        if not (s.ended and s.over):
            return False
        if self.streams.pop(s.sid, None) is s:
            self.placement.host_free(s.offset, s.meta.nbytes)
            self._held -= s.meta.nbytes
        return True

    def _opened(self, owner: Any) -> None:
        """(under cv) One stream of ``owner`` is no longer being opened."""
        left = self._opening[owner] - 1
        if left:
            self._opening[owner] = left
        else:
            del self._opening[owner]

    def _unpin(self, meta: ObjectMeta) -> None:
        if self.index.unpin(meta):
            self.placement.discard_later(meta)
