"""One SOCK_SEQPACKET connection to the daemon, shared by any number of threads.

Requests are sent under a lock and matched to replies by id, so several can be in
flight and replies may come in any order. Whichever waiting thread finds the
receive lock free reads replies for everybody (leader/follower), so a single
thread doing one request at a time pays no thread hand-off on its round trip.
"""

from __future__ import annotations

import itertools
import logging
import os
import select
import socket
import threading
import time
import weakref
from concurrent.futures import Future
from typing import Any

from msgpack import unpackb as _unpackb

from tierstore.errors import Closed, DaemonUnavailable, InvalidArgument, ProtocolError, TierstoreError, error_for_code
from tierstore.protocol import MAX_REPLY_BYTES, PACKET_BYTES, PROTOCOL_VERSION, encode

__all__ = ["Connection"]

_open: "weakref.WeakSet[Connection]" = weakref.WeakSet()
"""Every connection of this process: a fork's child marks them its parent's."""


def _in_child() -> None:
    for conn in list(_open):
        conn._parent = os.getppid()
        # this process's copy of the socket goes: a forked helper that outlives its parent must
        # not keep the parent's session (its leases, its ephemeral objects) alive. (A close,
        # never a shutdown: the parent's own descriptor, the same socket, stays as it is.)
        try:
            conn.sock.close()
        except OSError:
            pass


os.register_at_fork(after_in_child=_in_child)

log = logging.getLogger(__name__)


_BACKLOG_RETRY_S = 0.005

GRANTING = frozenset({"checkout", "checkout_each", "checkout_many", "get", "put_reserve", "put_staged", "staging",
                      "gpu_attach"})
"""Requests whose answer hands the client something (a lease, a reservation, a staging
area, bytes copied into or out of the staging area): one interrupted before its answer
was read cannot be taken up again, so the connection is given up (``on_abandon``)."""


def _connect(sock: socket.socket, path: str, timeout_s: float | None) -> None:
    """``sock.connect(path)``, waiting while the daemon's listen backlog is full: a Unix
    socket answers a connect with a timeout ``EAGAIN`` then (others connecting faster than
    the daemon accepts, e.g. a storm of refused connects from another uid), where a
    blocking one would wait; so wait here, up to ``timeout_s``."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        try:
            sock.connect(path)
            return
        except BlockingIOError:
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"the daemon's listen backlog stayed full for {timeout_s} s") from None
            time.sleep(_BACKLOG_RETRY_S)  # (nothing to wait on: the kernel wakes no one when room frees)


class Connection:
    def __init__(self, path: str, *, timeout_s: float) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self.sock.settimeout(timeout_s)
        try:
            _connect(self.sock, path, timeout_s)
        except (FileNotFoundError, ConnectionRefusedError) as e:
            self.sock.close()
            raise DaemonUnavailable(
                f"no tierstore daemon on {path} ({e.strerror}); start one with `tierstore daemon` "
                "(or `systemctl start tierstore`), set TIERSTORE_SOCKET, or pass autostart=True") from None
        except PermissionError:
            self.sock.close()
            raise error_for_code("PermissionDenied", f"cannot reach {path}: permission denied (the socket is "
                                 "0660 in a 0750 directory; ask the operator to add you to allowed_groups)") from None
        except OSError as e:
            self.sock.close()
            raise DaemonUnavailable(f"cannot connect to {path}: {e}") from None
        self._ids = itertools.count(1)
        self._pending: dict[int, Future] = {}
        self._send_lock = threading.Lock()  # one sendmsg at a time keeps id registration and send together
        self._recv_lock = threading.Lock()  # held by the thread currently reading replies for everybody
        self._cv = threading.Condition()
        self._closed: BaseException | None = None
        self._frags: list[bytes] = []  # a fragmented reply so far (touched only by the reading thread)
        # every packet after hello fits this (replies over PACKET_BYTES come as fragments); one
        # buffer, reused (only the thread holding _recv_lock reads): a recv(n) allocates n bytes each
        # call, and at MAX_REPLY_BYTES that malloc costs more than the round trip itself
        self._rbuf = bytearray(_RECV_BYTES)
        self._rview = memoryview(self._rbuf)
        self._parent: int | None = None
        """The pid of the process that made this connection, in a child it forked (which
        must connect its own: the two would share the socket, the request ids and the
        staging area, and both hang)."""
        self.on_abandon: Any = None
        """Called (a ``weakref.WeakMethod`` or a function, with the reason) when a granting
        request is interrupted before its answer; the connection is closed after it."""
        _open.add(self)

    # ------------------------------------------------------------------ handshake
    def hello(self, namespace: str) -> tuple[dict[str, Any], int]:
        """First exchange: returns the daemon's reply and the arena fd it passed."""
        self.sock.send(encode({"id": 0, "op": "hello", "version": PROTOCOL_VERSION, "namespace": namespace,
                               "fragments": True, "joined": True}))
        try:
            data, fds, _flags, _ = socket.recv_fds(self.sock, MAX_REPLY_BYTES, 4)
        except socket.timeout:
            raise DaemonUnavailable(f"the daemon on {self.path} did not answer hello") from None
        except OSError as e:
            raise DaemonUnavailable(f"the daemon on {self.path} dropped the connection during hello: {e}") from None
        if not data:
            raise DaemonUnavailable(f"the daemon on {self.path} closed the connection during hello")
        reply = _unpack(data)
        if type(reply) is not dict:
            raise ProtocolError("the daemon's hello reply is not a map")
        if "err" in reply:
            for fd in fds:
                _close_fd(fd)
            err = reply["err"]
            raise error_for_code(err.get("code", ""), err.get("message", "hello refused"))
        if len(fds) != 1:
            for fd in fds:
                _close_fd(fd)
            raise ProtocolError(f"hello reply carried {len(fds)} file descriptors, expected 1")
        self.sock.settimeout(None)  # from here on a long durable put may legitimately take a while
        return reply["ok"], fds[0]

    # ------------------------------------------------------------------ requests
    def submit(self, op: str, **fields: Any) -> Future:
        fut: Future = Future()
        self._send(op, fields, fut)
        return fut

    def send_with(self, op: str, waiter: Any, **fields: Any) -> None:
        """Send without waiting; the reply goes to ``waiter`` (``set_result(ok)`` or
        ``set_exception(error)``, on the thread reading replies; ``done()`` says whether it
        has), as to a ``submit``'s future, without one."""
        self._send(op, fields, waiter)

    def check_own(self) -> None:
        """Raise ``InvalidArgument`` in a process this connection's process forked."""
        if self._parent is not None:
            raise InvalidArgument(f"this client was connected by process {self._parent}, which forked this one; a "
                                  "forked process must connect a client of its own (Client.connect), e.g. in a "
                                  "DataLoader's worker_init_fn")

    def _send(self, op: str, fields: dict[str, Any], waiter: Any) -> int:
        self.check_own()
        with self._send_lock:
            if isinstance(self._closed, Closed):
                raise Closed(str(self._closed))
            if self._closed is not None:
                raise DaemonUnavailable(f"connection to {self.path} is closed: {self._closed}")
            rid = next(self._ids)
            fields["id"] = rid
            fields["op"] = op
            self._pending[rid] = waiter
            try:
                self.sock.send(encode(fields))
            except OSError as e:
                self._pending.pop(rid, None)
                self._fail_all(DaemonUnavailable(f"lost the daemon on {self.path}: {e}"))
                raise DaemonUnavailable(f"lost the daemon on {self.path}: {e}") from None
        return rid

    def request(self, op: str, **fields: Any) -> Any:
        """Send and wait. A thread that finds nobody reading replies reads its own (and
        any others that arrive first) directly: no Future, no hand-off. A granting request
        (``GRANTING``) interrupted before its answer (``KeyboardInterrupt``) gives the
        connection up: the daemon then takes back whatever it granted with the session."""
        try:
            return self._request(op, fields)
        except Exception:
            raise
        except BaseException as e:
            if op in GRANTING and self._closed is None:
                self.abandon(f"{op} was interrupted ({type(e).__name__}) before its answer was read")
            raise

    def abandon(self, why: str) -> None:
        """Give the connection up: ``on_abandon`` first (the client makes its views private),
        then the socket goes, and every later call raises ``Closed``."""
        cb = self.on_abandon
        fn = cb() if isinstance(cb, weakref.WeakMethod) else cb
        if fn is not None:
            try:
                fn(why)
            except Exception:  # (the connection goes all the same)
                log.exception("giving up the connection to %s", self.path)
        self._closed = Closed(f"this client's connection was given up: {why}, so whatever the daemon granted "
                              "for it goes back with the session; connect again")
        self._end_socket()
        self._fail_all(self._closed)

    def _end_socket(self) -> None:
        """Shut the socket down, then close it. A shutdown, not only a close: it wakes a
        thread of this client blocked reading it (a close would leave that read holding the
        socket, and the session, open). Never in a forked child: its copy was closed at the
        fork, and the socket is the parent's."""
        if self._parent is None:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        try:
            self.sock.close()
        except OSError:
            pass

    def _request(self, op: str, fields: dict[str, Any]) -> Any:
        if not self._recv_lock.acquire(blocking=False):
            return self.wait(self.submit(op, **fields))
        try:
            rid = self._send(op, fields, _DIRECT)
            while True:
                reply = self._recv_one(want=rid)
                if reply is not None:
                    if "err" in reply:
                        err = reply["err"]
                        raise error_for_code(err.get("code", ""), err.get("message", ""))
                    return reply.get("ok")
        finally:
            self._recv_lock.release()
            with self._cv:
                self._cv.notify_all()  # let a follower take over reading

    def wait(self, fut: Future, timeout: float | None = None) -> Any:
        """Read replies (or let another thread read them) until ``fut`` is done; its result.
        With ``timeout``, ``TimeoutError`` once that many seconds passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not fut.done():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if self._recv_lock.acquire(blocking=False):
                try:
                    while not fut.done():
                        # (with a deadline: what is there already is read even at 0 s left)
                        if deadline is not None and not self._readable(max(0.0, deadline - time.monotonic())):
                            break
                        self._recv_one()
                finally:
                    self._recv_lock.release()
                    with self._cv:
                        self._cv.notify_all()  # let a follower take over reading
            else:
                with self._cv:
                    self._cv.wait_for(lambda: fut.done() or not self._recv_lock.locked(),
                                      timeout=0.2 if left is None else min(0.2, left))
            if not fut.done() and deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"no answer from the daemon within {timeout} s")
        return fut.result()

    def _readable(self, left: float) -> bool:
        """Whether a packet (or the connection's end) is there to read within ``left`` seconds
        (``poll``: any descriptor number, unlike ``select``)."""
        if self._closed is not None:
            return True  # (the read says what happened)
        try:
            poller = select.poll()
            poller.register(self.sock.fileno(), select.POLLIN)
            return bool(poller.poll(left * 1000.0))
        except (OSError, ValueError):  # (closed under us: the read below says so)
            return True

    def _recv_one(self, want: int | None = None) -> dict[str, Any] | None:
        """Read one packet and hand each reply in it to its waiter; the reply itself if it
        answers ``want`` (whose failure, like the connection's, is raised). Threads waiting
        for their futures are woken once per packet."""
        try:
            return self._read_packet(want)
        finally:
            with self._cv:
                self._cv.notify_all()

    def _read_packet(self, want: int | None) -> dict[str, Any] | None:
        try:
            n, _anc, flags, _ = self.sock.recvmsg_into([self._rbuf])
        except TimeoutError:  # (a connection given a timeout for its answers: the CLI's)
            return self._fail_all(DaemonUnavailable(
                f"the daemon on {self.path} did not answer within {self.sock.gettimeout():g} s (stopped with "
                "SIGSTOP, or wedged?)"), want)
        except OSError as e:
            return self._fail_all(DaemonUnavailable(f"lost the daemon on {self.path}: {e}"), want)
        if not n:
            return self._fail_all(DaemonUnavailable(f"the daemon on {self.path} closed the connection "
                                                    "(stopped or restarted); reconnect"), want)
        if flags & socket.MSG_TRUNC:
            return self._fail_all(ProtocolError(f"a reply packet from the daemon over {_RECV_BYTES} bytes"), want)
        data = self._rview[:n]  # decoded at once: the values are copies, the buffer is read into again
        try:
            reply = _unpack(data)
            if type(reply) is list:  # several replies joined in one packet
                found = None
                for one in reply:
                    if type(one) is not dict:
                        raise ProtocolError("malformed joined reply from the daemon")
                    got = self._deliver(one, want)
                    if got is not None:
                        found = got
                return found
            if "frag" in reply:  # one piece of a reply too big for one packet
                if not isinstance(reply["frag"], bytes):
                    raise ProtocolError("malformed reply fragment from the daemon")
                self._frags.append(reply["frag"])
                if reply.get("more"):
                    return None
                data, self._frags = b"".join(self._frags), []
                reply = _unpack(data)
                if type(reply) is not dict:
                    raise ProtocolError("reply is not a map")
        except ProtocolError as e:
            return self._fail_all(e, want)
        return self._deliver(reply, want)

    def _deliver(self, reply: dict[str, Any], want: int | None) -> dict[str, Any] | None:
        """Hand one reply to its waiter; the reply itself if it answers ``want``."""
        rid = reply.get("id")
        fut = self._pending.pop(rid, None) if isinstance(rid, int) else None
        if fut is _DIRECT:
            if rid == want:
                return reply
            return None  # a direct waiter that gave up (cannot happen while it holds the lock)
        if fut is None:
            if "err" in reply:  # an error about no request in particular (e.g. the daemon is closing us)
                err = reply["err"]
                return self._fail_all(error_for_code(err.get("code", ""), err.get("message", "")), want)
            return None
        if "err" in reply:
            err = reply["err"]
            fut.set_exception(error_for_code(err.get("code", ""), err.get("message", "")))
        else:
            fut.set_result(reply.get("ok"))
        return None

    def _fail_all(self, exc: TierstoreError, want: int | None = None) -> None:
        self._closed = self._closed or exc
        if isinstance(self._closed, Closed):  # (closed or given up here: what a read then meets says less)
            exc = self._closed
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if fut is not _DIRECT and not fut.done():
                fut.set_exception(exc)
        with self._cv:
            self._cv.notify_all()
        if want is not None:
            raise exc

    def drain(self, timeout_s: float = 5.0) -> None:
        """Read the replies of requests still in flight (fire-and-forget check-ins), so
        they have taken effect before the connection closes."""
        if self._parent is not None:
            return  # (its replies are the parent's to read)
        deadline = time.monotonic() + timeout_s
        while self._pending and self._closed is None:
            left = deadline - time.monotonic()
            if left <= 0 or not self._recv_lock.acquire(timeout=left):
                return
            try:
                if not self._pending:
                    return
                self.sock.settimeout(left)
                self._recv_one()
            finally:
                if self._closed is None:
                    self.sock.settimeout(None)
                self._recv_lock.release()

    def close(self) -> None:
        if self._closed is None:
            self._closed = Closed("this client is closed: connect again")
        self._end_socket()
        self._fail_all(DaemonUnavailable("connection closed by the client"))


_RECV_BYTES = 2 * PACKET_BYTES
"""Room for any packet after hello: a fragment or a joined batch is PACKET_BYTES and a header."""

_DIRECT = object()
"""Pending-table marker of a request whose thread reads its own reply."""


def _unpack(data: bytes) -> Any:
    """A reply's map, or a list of them (replies joined in one packet)."""
    try:
        reply = _unpackb(data, raw=False, strict_map_key=False)
    except Exception:
        raise ProtocolError("undecodable reply from the daemon") from None
    if not isinstance(reply, (dict, list)):
        raise ProtocolError("reply is not a map")
    return reply


def _close_fd(fd: int) -> None:
    import os

    try:
        os.close(fd)
    except OSError:
        pass
