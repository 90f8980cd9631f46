"""One client connection (``Session``): its socket's reads, its outbox of replies and the
closing of its socket, with the bytes of unread replies counted against the connection,
its uid and the daemon (``ReplyBudget``).

The event loop is the only thread that calls a session's methods. The server decides
what a request does and what a closed connection gives back (its leases, its queued
requests); a session only moves bytes and says when it must be closed.
"""

from __future__ import annotations

import errno
import logging
import select
import selectors
import socket
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable

from tierstore.errors import TierstoreError
from tierstore.protocol import MAX_REPLY_BYTES, PACKET_BYTES, fragments, reply_err

from .auth import PeerCred
from .loglimit import UidLines

__all__ = ["ReplyBudget", "Session"]

log = logging.getLogger(__name__)
_MSG_TRUNC = int(socket.MSG_TRUNC)  # a plain int: IntFlag arithmetic costs microseconds per message

_BATCH_ITEM_BYTES = 4096
"""Replies up to this size are joined with their neighbours into one packet (clients that take joined replies)."""
_OUTBOX_BYTES = 2 * MAX_REPLY_BYTES
"""Bytes of replies one connection may leave unread before it is disconnected."""
_ENTRY_BYTES = 256
"""What a queued reply costs the daemon besides its bytes (its bytes object, the outbox
entry, the deque's slot), counted with them: a flood of tiny unread replies is bounded
by memory, not by the replies' payload."""
_UID_OUTBOX_BYTES = 128 << 20
"""... one uid's connections together (the one whose reply passes it is disconnected)."""
_ALL_OUTBOX_BYTES = 512 << 20
"""... every connection together."""


class ReplyBudget:
    """Bytes of replies left unread, per uid and in all (each session counts its own)."""

    def __init__(self) -> None:
        self.by_uid: Counter = Counter()
        self.total = 0

    def add(self, uid: int, n: int) -> None:
        self.total += n
        self.by_uid[uid] += n
        if not self.by_uid[uid]:
            del self.by_uid[uid]


@dataclass(eq=False)
class Session:
    """One client connection. Owns its socket's reads and its outbox; the store's leases
    and reservations it holds are released by the server when it closes."""

    cid: int
    sock: socket.socket
    cred: PeerCred
    server_pid: int
    sel: selectors.BaseSelector | None = None
    """The event loop's selector (the session registers itself for writing when its outbox waits)."""
    budget: ReplyBudget = field(default_factory=ReplyBudget)
    count_error: Callable[[str], None] = lambda code: None
    """Counts an error the session answers by itself (a reply too large to send)."""
    lines: UidLines = field(default_factory=lambda: UidLines(5))
    """The log lines its uid's connections may write (the server's, shared by all)."""
    namespace: str | None = None
    owns_namespace: bool = False
    """Its uid owns its namespace (or is root): ownership never changes, so no request of it
    needs to check again. Until then each request checks, since another uid may claim
    the namespace after this hello."""
    hello_pending: bool = False
    opened: float = field(default_factory=time.monotonic)
    outbox: deque = field(default_factory=deque)
    """(packet, fds, request id, joinable) not yet sent, in order."""
    outbox_bytes: int = 0
    writing: bool = False
    """Registered for EVENT_WRITE (the outbox waits for room in the socket)."""
    eof: bool = False
    """The peer half-closed with replies still queued: no more reading; closed once they are sent."""
    fragments: bool = False
    """The client joins fragmented replies (said so in hello)."""
    joined: bool = False
    """The client takes several replies joined in one packet (said so in hello)."""
    closed: bool = False
    requests: int = 0
    pinned: bool | None = None
    """Whether the client page-locked its arena mapping (reported by it; None: not said)."""
    pinned_reason: str = ""
    activations: dict[str, float] | None = None
    """The client's activation-offload counters, as it last reported them (None: never)."""
    holding: int = 0
    """Its requests that went on from leases they took (``Later.give_back``), from the moment
    they are handed to a pool until they have run or given back what they took: its
    clean-up waits for them (a batch's blank ``w`` lease must be given back, not checked in
    as written)."""
    drop_waiting: bool = False
    """It closed while such requests were under way: the last one releases what it holds."""
    awaiting: int = 0
    """Its requests whose replies are still to come (on a worker, waiting, in a group
    commit); changed on the event loop only. A half-closed peer is closed once they are
    answered and every reply is sent."""

    def say(self, level: int, what: str, *args: object) -> None:
        """Log ``what % args`` about this connection, within its uid's share of lines (``UidLines``)."""
        quiet = self.lines.allow(self.cred.uid)
        if quiet is not None:
            log.log(level, "session %d (pid %d, uid %d)%s: " + what, self.cid, self.cred.pid, self.cred.uid,
                    self.lines.left_out(quiet), *args)

    # ------------------------------------------------------------------ reads
    def receive(self, buf: bytearray, limit: int) -> int | str:
        """One request read into ``buf``: its length, or why there is none — ``"none"``
        (nothing waiting), ``"eof"`` (the peer half-closed: it still reads), ``"empty"`` (a
        message of no bytes), ``"gone"`` (the peer closed, or the socket failed) or
        ``"large"`` (longer than ``limit``)."""
        try:
            n, _anc, flags, _ = self.sock.recvmsg_into([buf])
        except BlockingIOError:
            return "none"
        except OSError:
            return "gone"
        if not n:  # the peer's EOF, or an empty message (SEQPACKET reads both as 0 bytes)
            shut = _peer_shut(self.sock)
            return "gone" if shut & (select.POLLHUP | select.POLLERR) else "eof" if shut else "empty"
        if flags & _MSG_TRUNC or n > limit:
            return "large"
        return n

    # ------------------------------------------------------------------ replies
    def queue(self, blob: bytes, fds: list[int] | None, rid: int | None) -> None:
        """Queue one reply: as fragments when it is longer than a packet and the client
        joins them, else whole (joinable with its neighbours when it is small and the
        client takes joined replies). A reply over ``MAX_REPLY_BYTES`` becomes an error."""
        if len(blob) > MAX_REPLY_BYTES:
            self.say(logging.WARNING, "a reply of %d bytes exceeds %d; answered with an error",
                     len(blob), MAX_REPLY_BYTES)
            self.count_error("TierstoreError")
            blob = reply_err(rid, TierstoreError(f"reply of {len(blob)} bytes is too large; list in pages "
                                                 "(keys/ls with 'after') or narrow the request"))
        if len(blob) > PACKET_BYTES and self.fragments and not fds:
            for frag in fragments(blob):
                self.outbox.append((frag, None, rid, False))
                self._count(len(frag) + _ENTRY_BYTES)
        else:
            n = len(blob)
            self.outbox.append((blob, fds, rid, self.joined and not fds and n <= _BATCH_ITEM_BYTES))
            n += _ENTRY_BYTES  # (``_count``, inline: once per reply)
            self.outbox_bytes += n
            b = self.budget
            b.total += n
            b.by_uid[self.cred.uid] += n

    def over_own_bound(self) -> bool:
        """Whether this connection alone leaves more reply bytes unread than it may."""
        return self.outbox_bytes > _OUTBOX_BYTES

    def over_budget(self) -> str | None:
        """Why this connection leaves too many reply bytes unread (then it is closed), or None."""
        if self.outbox_bytes > _OUTBOX_BYTES:
            return f"does not read its replies ({self.outbox_bytes} bytes unread)"
        uid = self.cred.uid
        if self.budget.by_uid[uid] > _UID_OUTBOX_BYTES or self.budget.total > _ALL_OUTBOX_BYTES:
            return (f"leaves {self.outbox_bytes} bytes of replies unread, its uid's connections "
                    f"{self.budget.by_uid[uid]}, all connections {self.budget.total}")
        return None

    def flush(self) -> bool:
        """Send what the socket takes now, joining small replies into packets; the rest
        waits for EVENT_WRITE. False: the connection must be closed (the socket failed, or
        a half-closed peer has had every reply)."""
        out = self.outbox
        while out:
            if out[0][3] and len(out) > 1 and out[1][3]:
                self._count(_join_replies(out))
            blob, fds, rid, _ = out[0]
            try:
                _send_packet(self.sock, blob, fds)
            except BlockingIOError:
                if not self.writing:
                    self.writing = True
                    if self.eof:  # (parked, below: watched again for the socket's room)
                        self.sel.register(self.sock, selectors.EVENT_WRITE, ("sess", self))
                    else:
                        self.sel.modify(self.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, ("sess", self))
                return True
            except OSError as e:
                if e.errno in (errno.EMSGSIZE, errno.ENOBUFS) and rid is not None and len(blob) > PACKET_BYTES:
                    # too big for one message on this socket (a client that takes no fragments)
                    self.say(logging.WARNING, "a reply of %d bytes does not fit one message (%s); answered "
                             "with an error", len(blob), e.strerror)
                    self.count_error("TierstoreError")
                    err = reply_err(rid, TierstoreError(f"reply of {len(blob)} bytes does not fit one message; "
                                                        "list in pages (keys/ls with 'after')"))
                    out[0] = (err, None, None, False)
                    self._count(len(err) - len(blob))
                    continue
                self.say(logging.INFO, "sending a reply failed (%s); closing", e.strerror or e)
                return False
            out.popleft()
            n = len(blob) + _ENTRY_BYTES  # (``_count``, inline: once per packet)
            self.outbox_bytes -= n
            b = self.budget
            b.total -= n
            uid = self.cred.uid
            b.by_uid[uid] -= n
            if not b.by_uid[uid]:
                del b.by_uid[uid]
        if self.eof:  # a half-closed peer: closed once it has all its replies, its requests' too
            if not self.awaiting:
                return False
            if self.writing:  # nothing to send until a request under way is answered: not watched
                self.writing = False  # (but looked at once a second: ``parked_and_gone``)
                self.sel.unregister(self.sock)
            return True
        if self.writing:
            self.writing = False
            self.sel.modify(self.sock, selectors.EVENT_READ, ("sess", self))
        return True

    def parked_and_gone(self) -> bool:
        """Whether this half-closed connection waits, unwatched, for replies still to come
        (``flush``) while its peer has closed for good: nobody is left to answer."""
        return self.eof and not self.writing and not self.closed and \
            bool(_peer_shut(self.sock) & (select.POLLHUP | select.POLLERR))

    def send_now(self, blob: bytes) -> None:
        """One packet sent at once, if the socket takes it (the last word before a close)."""
        try:
            self.sock.send(blob)
        except OSError:
            pass

    def drain_then_close(self) -> None:
        """EOF from the peer with replies still queued: reading stops (EOF stays
        readable); the rest goes as the peer reads (``flush``), then it is closed."""
        self.eof = self.writing = True
        self.sel.modify(self.sock, selectors.EVENT_WRITE, ("sess", self))

    def close_socket(self) -> None:
        """Unqueue every reply and close the socket (once; ``closed`` is set)."""
        self.closed = True
        self.outbox.clear()
        self._count(-self.outbox_bytes)
        try:
            self.sel.unregister(self.sock)
        except (KeyError, ValueError, AttributeError):
            pass
        self.sock.close()

    def _count(self, n: int) -> None:
        """Its unread reply bytes change by ``n`` (and its uid's, and everyone's)."""
        self.outbox_bytes += n
        b = self.budget  # (``ReplyBudget.add``, inline: twice per reply)
        b.total += n
        uid = self.cred.uid
        b.by_uid[uid] += n
        if not b.by_uid[uid]:
            del b.by_uid[uid]


def _peer_shut(sock: socket.socket) -> int:
    """How the peer has shut the connection: ``POLLRDHUP`` alone (``shutdown(SHUT_WR)``: it
    still reads), with ``POLLHUP`` (closed, or shut both ways), or 0 (it has not: a read
    of 0 bytes was an empty message)."""
    p = select.poll()
    p.register(sock, select.POLLRDHUP)
    return sum(ev for _, ev in p.poll(0)) & (select.POLLRDHUP | select.POLLHUP | select.POLLERR)


def _join_replies(out: deque) -> int:
    """Replace the joinable replies at the head of ``out`` with one packet holding them: a
    msgpack array of the replies' maps (an array's encoding is its header and its items'
    encodings, so joining costs a concatenation), at most ``PACKET_BYTES``."""
    parts: list[bytes] = []
    size = 0
    while out and out[0][3] and size + len(out[0][0]) <= PACKET_BYTES - 5 and len(parts) < 0xFFFF:
        blob = out.popleft()[0]
        parts.append(blob)
        size += len(blob)
    head = bytes((0x90 | len(parts),)) if len(parts) < 16 else b"\xdc" + len(parts).to_bytes(2, "big")
    out.appendleft((head + b"".join(parts), None, None, False))
    # the outbox's bytes grow by the header (taken back when it is sent) and hold one entry
    # where there were len(parts)
    return len(head) - (len(parts) - 1) * _ENTRY_BYTES


def _send_packet(sock: socket.socket, blob: bytes, fds: list[int] | None) -> None:
    """One SEQPACKET message, with file descriptors attached when given (the hello reply)."""
    if fds:
        socket.send_fds(sock, [blob], fds)
    else:
        sock.send(blob)
