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
connection goes, or it is older than ``reservation_timeout_s``) and the read is over.
An ended stream sends no more chunks, and counts against its connection's open streams
until the chunks it sent are back. Streams hold at most half the host tier together,
and a connection at most 8; a get past either takes a lease.
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
"""Streams one connection may hold (open, or ended with chunks still landing); a get past them takes a lease."""
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
    since: float
    """When it was opened (``time.monotonic()``): ``expire`` ends old ones."""
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
        self._held = 0
        """Bytes of host blocks the streams hold."""
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
        """Begin streaming the object into a block of its own and return the stream. A get
        that does not stream gets an ordinary read lease instead (one promoted copy, shared
        by every reader): of an object that does not stream (any more), past the streams'
        share of the host tier or a connection's streams, or with no free block for it now
        (outside the read reserve: a stream takes only free room, never demotes another
        object to make it, and leaves the reserve to reads that cannot do without it)."""
        ix = self.index
        t0 = time.monotonic()
        meta, late = ix.pin(h, namespace)
        n = meta.nbytes
        with self.cv:
            streams = (self._streams(meta) and self._held + n <= self.share_bytes
                       and sum(s.owner == owner for s in self.streams.values()) < MAX_STREAMS_PER_OWNER)
            # free room only: a stream never pushes another object out of the host tier
            off = self.placement.host_take(n) if streams else None
            if off is not None:
                # (the read is begun under the lock, so the stream is whole when anyone sees it;
                # beginning it only hands chunks to the engine, and never raises: a request it
                # could not send fails the read)
                sid, self._next = self._next, self._next + 1
                s = self.streams[sid] = Stream(sid, owner, meta, off, self.placement.read_stream(meta, off),
                                               time.monotonic())
                self._held += n
                self.counters["nvme_reads"] += 1
                self.counters["streamed_gets"] += 1
                self.counters["gets"] += 1
                self.counters["get_bytes"] += n
        if off is None:
            self._unpin(meta)
            return self.leases.checkout(h, "r", owner=owner, namespace=namespace, stream=stream, device=device)
        s.read.on_done(lambda: self._read_over(s))
        try:
            with self.cv:
                self.prefetcher.access(owner, stream, meta, False, late, t0)
        except BaseException:
            self.end(sid, owner=owner)  # (the client never learns of it)
            raise
        return s

    def wait(self, sid: int, upto: int, *, owner: Any) -> int | Pending:
        """How many bytes of stream ``sid``'s object are in its block and checked, once at
        least ``upto``: now, or a ``Pending`` of it. A chunk that fails (its checksum, the
        drive) fails every wait for bytes at or past it."""
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

    def expire(self, max_age_s: float) -> int:
        """End streams open longer than ``max_age_s`` (a client that stopped, still
        connected, must not hold host memory for its connection's life): their blocks go
        back as ``get_end`` gives them, and the client's ``get_part`` and ``get_end`` answer
        ``NotFound`` (its get fails: the bytes it copied may be another object's by then).
        Returns how many."""
        now = time.monotonic()
        with self.cv:
            old = [s for s in self.streams.values() if not s.ended and now - s.since > max_age_s]
            for s in old:
                s.ended = True
            reading = [s for s in old if not self._forget_if_over(s)]
            self.counters["streams_expired"] += len(old)
        for s in reading:
            s.read.cancel(NotFound(f"streamed get {s.sid} was open longer than {max_age_s:.0f} s and was ended"))
        return len(old)

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

    def _unpin(self, meta: ObjectMeta) -> None:
        if self.index.unpin(meta):
            self.placement.discard_later(meta)
