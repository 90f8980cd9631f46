"""The daemon's socket server: accept, authenticate, read requests, dispatch, reply.

One event-loop thread owns every socket. A request that can finish without waiting
(a lookup, a get of a host-resident object, a volatile put) runs right there;
for anything that may wait or touch the disk the handler returns the rest of the
request (``Later``), which goes to a worker pool, and its reply comes back through a
queue plus a wake-up pipe. A durable put is handed to the store's group
committer instead (its handler returns a ``Deferred``), and its reply comes back the same
way once the batch it joined is durable; so does a streamed get's ``get_part``, once the
bytes it waits for are read. So the loop never blocks on disk I/O, a
lock held across an fsync, or a slow client (replies that do not fit in the socket
buffer wait in a per-connection outbox, bounded in bytes: a client that stops reading
is disconnected, not allowed to grow the daemon). A reply bigger than one packet
travels as fragments (see protocol.py); a reply that cannot be sent is logged and
answered with an error, never dropped with the connection.

Three pools, so that no one's wait holds up anyone else's work:

- op workers run requests that touch the disk. One that finds it must wait for
  another holder (a lease, host room, an object in flight) does not wait there: the
  store raises ``WouldWait`` and the request moves to
- wait threads, which may block for as long as the request's ``timeout_s``. A wait
  ends when it is satisfied, times out, its connection goes, or the daemon stops
  (``DaemonSurface.cancel_waits``). Both are ``FairPool``s: shared per connection,
  namespace and uid, with bounded queues whose requests' timeouts run; a request
  that ends unrun gives back what it took (``Later.give_back``).
- control threads run what releases memory and leases: a closed connection's
  clean-up, lease revocation and reservation expiry. They never queue behind requests.

Length: the connection lifecycle (accept, dispatch, a closed connection's clean-up)
and the three thread pools it hands work to; the request handlers themselves are in
``handlers``, a connection's reads, outbox and socket in ``session``.
"""

from __future__ import annotations

import gc
import itertools
import logging
import os
import queue
import selectors
import signal
import socket
import stat as stat_mod
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from typing import Any

from tierstore.config import Config
from tierstore.errors import Closed, InvalidArgument, PermissionDenied, ProtocolError, TierstoreError
from tierstore.objectindex import acting_for
from tierstore.waits import Later, WouldWait, wait_context
from tierstore.preflight import already_serving, check_dir, serving_pid
from tierstore.protocol import decode, reply_err, reply_ok
from tierstore.store import Store
from tierstore.units import format_size

from .stopsignals import STOP_SIGNALS, StopDuringStart
from .auth import admitted, peer_cred, resolve_groups
from .gcpolicy import FreezeAfterFullCollections, release_free_heap
from .loglimit import UidLines
from .handlers import ACTIVATION_FIELDS, Deferred, Handlers
from .metrics import LatencyHistogram, serve_metrics
from .sdnotify import Notifier, inherited_fds
from .fairpool import FairPool, Job
from .session import ReplyBudget, Session

__all__ = ["Server", "Session", "DaemonAlreadyRunning"]

log = logging.getLogger(__name__)

_HELLO_TIMEOUT_S = 10.0
_READ_BUDGET_S = 0.002
"""Time one connection's requests may hold the event loop before the others get their turn."""
_WAIT_THREADS = 128
"""Requests waiting for another holder at once, all connections together."""
_MAX_REQUEST_ID = (1 << 63) - 1
_SWITCH_INTERVAL_S = 0.001
"""How long a thread runs Python before the interpreter lock goes to another that wants
it (CPython's default is 5 ms): the event loop waits at most about this long behind a
worker's Python work at each step of a request (``bench/loop_stall.py``)."""


class DaemonAlreadyRunning(RuntimeError):
    pass


class Server:
    def __init__(self, config: Config, *, notifier: Notifier | None = None) -> None:
        self.config = config.resolved()
        self.notifier = notifier or Notifier()
        self.allowed_gids = resolve_groups(self.config.daemon.allowed_groups)
        self.store: Store | None = None
        self._sel = selectors.DefaultSelector()
        self._listen: socket.socket | None = None
        self._sessions: dict[int, Session] = {}
        self._replies = ReplyBudget()
        self._holding_lock = threading.Lock()  # guards every session's holding / drop_waiting
        self._refused: dict[socket.socket, float] = {}
        self._refusals_logged = UidLines(1)
        """A refused uid's warnings: one a second."""
        self._session_lines = UidLines(5)
        """What admitted connections' troubles (malformed messages, failed sends) may log: 5 lines a second a uid."""
        self._cids = itertools.count(1)
        ops = max(8, self.config.store.io_threads)
        # one connection or namespace runs at most half the op workers, a uid all but one:
        # the others' requests find a free worker, not one busy for a long batch
        self._pool = FairPool("op", self._op, self._unrun, threads=ops, per_session=ops // 2, per_namespace=ops // 2,
                              per_uid=ops - 1)
        self._waits = FairPool("wait", self._wait, self._unrun, threads=_WAIT_THREADS, per_session=16,
                               per_namespace=32, per_uid=64)
        self._control = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tierstore-ctl")
        self._expiring: Any = None  # the expiry run in progress, if any (one at a time)
        self._corked: set[Session] | None = None
        """Sessions with replies held back until the current read burst or drain ends (clients that take joined replies)."""
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        # every request is read into this one buffer (only the event loop reads): a
        # recvmsg(n) allocates n bytes per call, which at max_message_bytes costs several
        # times the syscall itself
        self._rbuf = bytearray(self.config.daemon.max_message_bytes + 1)
        self._rview = memoryview(self._rbuf)
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._wake_pending = False
        self._stop = threading.Event()
        self._started = time.monotonic()
        self._ready_s: float | None = None
        """Seconds from the start to serving (READY=1), once there."""
        self.errors_by_code: dict[str, int] = {}
        self.accepted = 0
        self.refused = 0
        self.latency = LatencyHistogram()
        self.metrics_server = None
        self.metrics_port: int | None = None
        self.failed: BaseException | None = None
        """Set when the start could not finish in the background (the arena's memory was not there)."""
        self.stop_on_signals = False
        """Whether this server's process is the daemon's (``run``): once its store is open,
        a stop signal asks it for a clean stop."""

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Check, open, bind, then populate: the start-up sequence.

        1. Checks that can refuse the start, in milliseconds: a live daemon on the
           socket, the socket's directory, then (in ``Store``) the NVMe directories, their
           locks, free disk and memory.
        2. The store: the host arena is created and mapped, its pages populated by a
           background thread from here on, while the journal is replayed.
        3. The socket is bound: clients are served from here on.
        4. ``READY=1``, with the start line as its ``STATUS=``: the pools are mapped and
           the journal replayed, so every object is there and every request is served.
           A 12 GiB host tier takes seconds to populate on few cores; a request meanwhile
           is served all the same, its first touch of a page faulting it in.
        5. A thread waits for the populating to end and says so (``STATUS=`` and the log).
           Memory that is not there after all stops the daemon then, with one error line.
        """
        path = self.config.daemon.socket
        self.notifier.status("checking the configuration")
        self._check_no_live_daemon(path)
        check_dir(os.path.dirname(path) or ".", mode=0o750, what="socket directory", flag="--socket")
        inherited = inherited_fds()
        if inherited:
            log.info("systemd handed back %s", ", ".join(sorted(inherited)))
        self.notifier.status("replaying the journal")
        # no cyclic collection while a million objects are built (each pass would walk every one
        # made so far); then they are frozen out of later collections: they live as long as the
        # daemon, and a full pass over them all would hold up the event loop
        gc_was_on = gc.isenabled()
        gc.disable()
        try:
            self.store = Store(self.config, inherited_fds=inherited, populate_host="background")
        finally:
            gc.collect(0)  # the opening's own short-lived cycles, not frozen with the rest
            gc.freeze()
            if gc_was_on:
                gc.enable()
            release_free_heap()  # what the replay's decoded records took goes back to the system
        if self.stop_on_signals:
            # the store is open: from here a stop signal asks for a clean stop, which the start
            # finishes first (nothing half-opened to leave behind) and serve_forever then does
            for sig in STOP_SIGNALS:
                signal.signal(sig, self._stop_on_signal)
        # the arena and its index go to systemd's fd store: a restarted daemon (upgrade,
        # crash) gets them back and adopts every host-resident object
        if self.notifier.store_fd("arena", self.store.arena.fd) and \
                self.notifier.store_fd("index", self.store.hostlog.fd):
            self.store.daemon.enable_host_index()
        # one uid's connections share one bound on leases held (beside each connection's own)
        self.store.daemon.group_lease_owners(_uid_of)
        self.handlers = Handlers(self.store, self._server_stats)
        try:
            self._listen = self._bind(path)
        except BaseException:
            self.store.close()
            raise
        if self.config.daemon.metrics_port >= 0:
            try:
                self.metrics_server, self.metrics_port = serve_metrics(
                    self._full_stat, self.config.daemon.metrics_port, self.config.daemon.metrics_addr)
            except OSError as e:
                self._listen.close()
                os.unlink(path)
                self.store.close()
                raise DaemonAlreadyRunning(f"cannot serve metrics on {self.config.daemon.metrics_addr}:"
                                           f"{self.config.daemon.metrics_port}: {e}") from None
        self._sel.register(self._listen, selectors.EVENT_READ, ("listen", None))
        self._sel.register(self._wake_r, selectors.EVENT_READ, ("wake", None))
        status = self.start_line(None)
        log.info("%s", status)
        self.notifier.ready(self._damage_note(status))
        self._populater = threading.Thread(target=self._populate, name="tierstore-populate", daemon=True)
        self._populater.start()

    def _populate(self) -> None:
        try:
            seconds = self.store.arena.populate()
        except TierstoreError as e:
            if self._stop.is_set():
                return  # stopping while populating: the arena is going away anyway
            log.error("stopping: the host arena's memory is not there after all: %s", e)
            self.failed = e
            self.request_stop()
            return
        status = self.start_line(seconds)
        log.info("%s", status)
        self.notifier.status(self._damage_note(status))

    def _damage_note(self, status: str) -> str:
        if self.store.replay_info.get("kept_aside"):
            status += f"; the journal was damaged (see the log), kept as found at {self.store.replay_info['kept_aside']}"
        return status

    def start_line(self, populate_s: float | None) -> str:
        """One line, in human units, of what the tiers are and where (the log and ``STATUS=``):
        ``populate_s`` None while the host arena's pages are still being populated."""
        st = self.store.stat()
        t = st["tiers"]
        nvme = t["nvme"]
        gpu = (f"gpu {format_size(t['gpu']['capacity_bytes'])}" if "gpu" in t
               else f"gpu none ({st.get('gpu_reason') or 'gpu_bytes is 0'})")
        if self._ready_s is None:
            self._ready_s = time.monotonic() - self._started
        return (f"serving on {self.config.daemon.socket}, ready in {self._ready_s:.1f} s: "
                f"host {format_size(t['host']['capacity_bytes'])} (shared memfd, "
                f"{self._populated(populate_s)}), "
                f"nvme {format_size(nvme['capacity_bytes'])} in {', '.join(self.config.store.nvme_dirs)} "
                f"(engine {nvme['engine']}, O_DIRECT {'on' if nvme.get('direct_io') else 'off'}), {gpu}; "
                f"{self.store.replay_info['objects']} durable objects recovered "
                f"({self._recovered_how()}), "
                f"{self.store.replay_info['adopted']} host-resident objects adopted")

    def _populated(self, populate_s: float | None) -> str:
        how = "adopted" if self.store.arena.adopted else "populated"
        return f"{how} in {populate_s:.1f} s" if populate_s is not None else f"being {how} in the background"

    def _recovered_how(self) -> str:
        info = self.store.replay_info
        if info.get("cut_bytes"):
            return (f"from the index checkpoint alone: the journal was cut {info['cut_bytes']} bytes below what "
                    "it covers, and what it held after that is lost")
        if info.get("checkpoint") == "used":
            return f"from the index checkpoint and {info['records_replayed']} journal records"
        return f"replaying {info.get('records_replayed', 0)} journal records"

    def discard(self) -> None:
        """A server made but never served (``serve_forever`` not called): its wake-up pipe
        and its threads go."""
        os.close(self._wake_r)
        os.close(self._wake_w)
        self._control.shutdown(wait=False)
        self._pool.close()
        self._waits.close()

    def request_stop(self) -> None:
        self._stop.set()
        self._wake()

    def _stop_on_signal(self, signum: int, _frame: Any) -> None:
        log.info("received %s", signal.Signals(signum).name)
        self.request_stop()

    def serve_forever(self) -> None:
        last_tick = last_expiry = time.monotonic()
        watchdog = self.notifier.watchdog_interval_s
        last_watchdog = 0.0
        try:
            while not self._stop.is_set():
                queued = self._waits.queued or self._pool.queued
                for key, events in self._sel.select(timeout=0.1 if queued else 0.5):
                    kind, sess = key.data
                    if kind == "listen":
                        self._accept()
                    elif kind == "wake":
                        self._drain_wake()
                    elif kind == "refused":
                        self._drain_refused(sess)
                    else:
                        if events & selectors.EVENT_READ and not sess.closed:
                            self._read(sess)
                        if events & selectors.EVENT_WRITE and not sess.closed:
                            self._flush(sess)
                self._drain_done()
                now = time.monotonic()
                if queued and now - last_expiry >= 0.1:  # a queued request's timeout_s runs too
                    last_expiry = now
                    self._pool.expire(now)
                    self._waits.expire(now)
                if now - last_tick >= 1.0:
                    last_tick = now
                    self._tick(now)
                if watchdog and now - last_watchdog >= watchdog:
                    last_watchdog = now
                    self.notifier.watchdog()
        finally:
            self._shutdown()

    def _drain_refused(self, conn: socket.socket) -> None:
        try:
            while conn.recv(65536):
                pass
            self._drop_refused(conn)  # EOF: the peer read the refusal and left
        except BlockingIOError:
            pass
        except OSError:
            self._drop_refused(conn)

    def _drop_refused(self, conn: socket.socket) -> None:
        if self._refused.pop(conn, None) is not None:
            self._sel.unregister(conn)
            conn.close()

    def _tick(self, now: float) -> None:
        for conn, since in list(self._refused.items()):
            if now - since > 2.0:
                self._drop_refused(conn)
        for sess in list(self._sessions.values()):
            if sess.namespace is None and not sess.hello_pending and now - sess.opened > _HELLO_TIMEOUT_S:
                sess.say(logging.INFO, "sent no hello in %.0f s; closing", _HELLO_TIMEOUT_S)
                self._close(sess)
            elif sess.eof and sess.parked_and_gone():  # half-closed, then gone while its requests run
                self._close(sess)
        if (self.config.daemon.lease_timeout_s > 0 or self.config.daemon.reservation_timeout_s > 0) and \
                (self._expiring is None or self._expiring.done()):
            self._expiring = self._control.submit(self._expire)

    def _shutdown(self) -> None:
        log.info("stopping: draining in-flight requests")
        self.notifier.stopping()
        if self._listen is not None:
            self._sel.unregister(self._listen)
            self._listen.close()
            try:
                os.unlink(self.config.daemon.socket)
            except FileNotFoundError:
                pass
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
        if self.store is not None:
            self.store.daemon.cancel_waits()  # waiting requests end now (Closed), whatever their timeout_s
        # requests already running finish (their I/O drains); queued ones end, giving back what they took
        ended = self._pool.close()
        ended += self._waits.close()  # (after the op workers: one of them may still hand a request over)
        for job in ended:
            self._unrun(job, Closed("the daemon is stopping; reconnect once it is back"))
        if self.store is not None:
            self.store.daemon.finish_commits()  # durable puts handed to the group committer are answered too
        self._drain_done()
        for sess in list(self._sessions.values()):
            self._close(sess, sync=True)
        self._control.shutdown(wait=True)
        if self.store is not None:
            self.store.close()  # drains I/O, flushes the journal
        os.close(self._wake_r)
        os.close(self._wake_w)
        self._sel.close()
        log.info("daemon stopped")

    # ------------------------------------------------------------------ socket setup
    def _check_no_live_daemon(self, path: str) -> None:
        if not os.path.lexists(path):
            return
        mode = os.lstat(path).st_mode
        if stat_mod.S_ISLNK(mode):  # (never followed: the daemon makes its socket itself)
            raise DaemonAlreadyRunning(f"{path} is a symbolic link; remove it or choose another --socket")
        if not stat_mod.S_ISSOCK(mode):
            raise DaemonAlreadyRunning(f"{path} exists and is not a socket; remove it or choose another --socket")
        try:
            pid = serving_pid(path)
        except OSError as e:
            raise DaemonAlreadyRunning(f"cannot probe existing socket {path}: {e}") from None
        if pid is not None:
            raise DaemonAlreadyRunning(already_serving(pid, path))
        log.info("replacing stale socket %s of a daemon that is gone", path)
        os.unlink(path)

    def _bind(self, path: str) -> socket.socket:
        d = os.path.dirname(path) or "."
        if not os.path.isdir(d):
            os.makedirs(d, mode=0o750, exist_ok=True)
            os.chmod(d, 0o750)
        st = os.stat(d)
        mode = stat_mod.S_IMODE(st.st_mode)
        # whoever may rename or replace names in the directory could move the socket away, put
        # their own in its place, or swap it for a link between the bind and the chown below
        if st.st_uid not in (os.geteuid(), 0):
            raise InvalidArgument(f"socket directory {d} belongs to uid {st.st_uid}, who could replace the "
                                  f"daemon's socket; use a directory of uid {os.geteuid()} (or root's)")
        if mode & 0o022 and not mode & stat_mod.S_ISVTX:
            raise InvalidArgument(f"socket directory {d} has mode {mode:o}: others may replace the daemon's socket "
                                  "in it; use a directory only its owner writes (0750), or a sticky one")
        if mode & 0o027:
            log.warning("socket directory %s has mode %o; 0750 keeps other users from even reaching the socket",
                        d, mode)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        old = os.umask(0o117)  # the socket file is born 0660: no window where others could connect
        try:
            sock.bind(path)
        finally:
            os.umask(old)
        if self.allowed_gids:
            # members of the first allowed group reach the socket through group permissions;
            # admission is still decided per connection from SO_PEERCRED (never through a link)
            gid = sorted(self.allowed_gids)[0]
            os.chown(path, -1, gid, follow_symlinks=False)
            if stat_mod.S_IMODE(os.stat(d).st_mode) == 0o750 and os.stat(d).st_uid == os.geteuid():
                os.chown(d, -1, gid)
        sock.listen(128)
        return sock

    # ------------------------------------------------------------------ connections
    def _accept(self) -> None:
        """Accept the connections waiting, at most ``_ACCEPTS_PER_TURN`` before the loop
        serves everything else once: a process that opens and closes connections in a tight
        loop cannot keep the event loop from the requests (and the closes) of others."""
        for _ in range(_ACCEPTS_PER_TURN):
            try:
                conn, _ = self._listen.accept()
            except BlockingIOError:
                return
            except OSError as e:
                log.error("accept failed: %s", e)
                return
            conn.setblocking(False)
            cred = peer_cred(conn)
            reason = None
            if not admitted(cred, self.allowed_gids):
                reason = PermissionDenied(f"uid {cred.uid} may not use this daemon; ask its operator to add one "
                                          "of your groups to allowed_groups")
            elif len(self._sessions) >= self._room_for(cred.uid, self._held_by(cred.uid)):
                most = self.config.daemon.max_clients
                reason = TierstoreError(f"the daemon already serves {len(self._sessions)} connections "
                                        f"(max_clients {most}, the last {_root_reserve(most)} kept for root and "
                                        f"{_root_reserve(most)} before them for uids holding fewer than "
                                        f"{_NEWCOMER_HOLDS}); close idle clients or raise the limit")
            elif cred.uid != 0 and self._held_by(cred.uid) >= self.config.daemon.max_clients_per_uid:
                reason = TierstoreError(f"uid {cred.uid} already holds {self.config.daemon.max_clients_per_uid} "
                                        "connections (max_clients_per_uid); close idle clients")
            if reason is not None:
                self.refused += 1
                self._count_error(reason.code)
                self._log_refusal(cred, reason)
                try:
                    conn.send(reply_err(None, reason))
                except OSError:
                    conn.close()
                    continue
                # closing now, with the peer's hello unread, would reset the connection and
                # destroy the error reply; drain it and close shortly instead
                self._refused[conn] = time.monotonic()
                self._sel.register(conn, selectors.EVENT_READ, ("refused", conn))
                if len(self._refused) > 64:
                    self._drop_refused(next(iter(self._refused)))
                continue
            sess = Session(next(self._cids), conn, cred, os.getpid(), self._sel, self._replies, self._count_error,
                           self._session_lines)
            self._sessions[sess.cid] = sess
            self.accepted += 1
            self._sel.register(conn, selectors.EVENT_READ, ("sess", sess))
            log.debug("session %d: pid %d uid %d connected", sess.cid, cred.pid, cred.uid)

    def _log_refusal(self, cred: Any, reason: TierstoreError) -> None:
        """A refused connection's warning: at most one a second per uid, saying how many
        were refused since the last (a refused uid retrying in a loop does not fill the log)."""
        quiet = self._refusals_logged.allow(cred.uid)
        if quiet is not None:
            log.warning("refused connection from pid %d uid %d%s: %s", cred.pid, cred.uid,
                        f" (and {quiet} more of that uid's in the last second)" if quiet else "", reason.message)

    def _room_for(self, uid: int, holds: int) -> int:
        """Connections at once beyond which ``uid``, holding ``holds``, is refused: root may
        use the last few, so a full daemon can still be inspected and stopped, and a uid
        holding fewer than ``_NEWCOMER_HOLDS`` the few before them, so uids that filled the
        daemon between them do not lock out another."""
        most = self.config.daemon.max_clients
        if uid == 0:
            return most
        return most - _root_reserve(most) - (0 if holds < _NEWCOMER_HOLDS else _root_reserve(most))

    def _held_by(self, uid: int) -> int:
        return sum(1 for x in self._sessions.values() if x.cred.uid == uid)

    def _read(self, sess: Session) -> None:
        """A burst of ``sess``'s requests, each handled as it is read; their replies leave
        together, in as few packets as they fit."""
        self._corked = {sess}
        try:
            limit = self.config.daemon.max_message_bytes
            deadline = time.perf_counter() + _READ_BUDGET_S
            for _ in range(64):  # bounded, so one chatty client cannot starve the others
                if time.perf_counter() > deadline:
                    return  # the rest waits in the socket; the selector reports it again
                n = sess.receive(self._rbuf, limit)
                if type(n) is str:
                    if n == "gone":
                        self._close(sess)
                    elif n == "eof":
                        self._half_closed(sess)
                    elif n == "empty":
                        self._fatal(sess, ProtocolError("an empty message: every request is a msgpack map; closing"))
                    elif n == "large":
                        self._fatal(sess, ProtocolError(f"message larger than max_message_bytes ({limit}); closing"))
                    return
                self._handle(sess, self._rview[:n])  # decoded at once: the buffer is read into again
                if sess.closed:
                    return
        finally:
            self._uncork()

    def _handle(self, sess: Session, data: bytes | memoryview) -> None:
        try:
            msg = decode(data, self.config.daemon.max_message_bytes)
        except ProtocolError as e:
            self._fatal(sess, e)
            return
        rid = msg.get("id")
        if not isinstance(rid, int) or isinstance(rid, bool) or not 0 <= rid <= _MAX_REQUEST_ID:
            self._fatal(sess, ProtocolError("every request needs an integer 'id' in [0, 2**63)"))
            return
        op = msg.get("op")
        fn = self.handlers.table.get(op) if type(op) is str else None
        if fn is None:
            self._reply_error(sess, rid, ProtocolError(f"unknown op {str(op)[:40]!r}"))
            return
        if sess.namespace is None and op != "hello":
            self._fatal(sess, ProtocolError(f"'{op}' before 'hello'; the first request must be hello"), rid)
            return
        if op == "hello":
            if sess.namespace is not None or sess.hello_pending:
                self._reply_error(sess, rid, ProtocolError("hello was already sent on this connection"))
                return
            sess.hello_pending = True
        elif op != "ping" and (refused := self._namespace_refusal(sess)) is not None:
            self._reply_error(sess, rid, refused)
            return
        sess.requests += 1
        t0 = time.perf_counter()
        try:
            if sess.owns_namespace or sess.cred.uid == 0:
                result = fn(sess, msg)
            else:
                with acting_for(sess.cred.uid):
                    result = fn(sess, msg)
        except TierstoreError as e:
            if op == "hello":
                sess.hello_pending = False
            self._reply_error(sess, rid, e)
            return
        except Exception as e:  # a bug must cost one request, not the daemon
            log.exception("op %s failed", op)
            sess.hello_pending = False
            self._reply_error(sess, rid, TierstoreError(f"internal error in {op}: {type(e).__name__}: {e}"))
            return
        if isinstance(result, Later):  # the rest may wait or touch the disk: on an op worker
            now = time.monotonic()
            if result.give_back is not None:
                with self._holding_lock:
                    sess.holding += 1  # (until it has run or given back: ``_let_go``)
            sess.awaiting += 1  # (until its reply is drained: ``_drain_done_corked``)
            self._pool.submit(Job(sess, result.run, rid, op, t0, now, now + self._wait_budget(msg), result.give_back))
            return
        if isinstance(result, Deferred):  # answered once settled (a group commit, a streamed read)
            sess.awaiting += 1
            result.done.add_done_callback(
                lambda f: self._committed(sess, rid, op, t0, lambda: result.reply(f.result()), result.acquires))
            return
        self.latency.observe(op, time.perf_counter() - t0)
        if op == "hello":
            sess.hello_pending = False
            self._send(sess, reply_ok(rid, result), [self.store.arena.fd], rid)
            return
        self._send(sess, reply_ok(rid, result), rid=rid)

    def _op(self, job: Job) -> None:
        """(an op worker) Run the rest of a request (``rest()``, its reply) off the loop; a
        wait for another holder moves it to the wait threads, its timeouts counted from now
        (what it took goes with it). A request whose namespace another uid claimed while it
        was queued is refused, not run."""
        if (refused := self._namespace_refusal(job.sess)) is not None:
            self._unrun(job, refused)
            return
        try:
            with wait_context(park=True), _acting(job.sess):
                out = _outcome(job.rest, job.rid, job.op)
        except WouldWait:
            now = time.monotonic()
            self._waits.submit(Job(job.sess, job.rest, job.rid, job.op, job.t0, now,
                                   now + (job.deadline - job.since), job.give_back))
            return
        try:
            self._finish(job.sess, job.rid, *out, time.perf_counter() - job.t0)
        finally:
            self._let_go(job)

    def _namespace_refusal(self, sess: Session) -> PermissionDenied | None:
        """Why ``sess`` may no longer use its namespace (another uid claimed it since its
        hello), or None. Asked as each request is read and again as a request queued for a
        worker or a wait starts: a request read while the namespace was free must not run
        in it once another uid's objects are there."""
        if sess.owns_namespace:
            return None
        uid = sess.cred.uid
        owner = self.store.daemon.namespace_owner(sess.namespace)
        if owner is None:
            return None
        if owner == uid or uid == 0:
            sess.owns_namespace = True
            return None
        return PermissionDenied(f"namespace {sess.namespace.split('/')[0]!r} now belongs to uid {owner}; "
                                "use another namespace")

    def _let_go(self, job: Job) -> None:
        """A request that went on from leases it took has run, or given them back: its
        connection's clean-up, if it waits for the last such request, goes on."""
        if job.give_back is None:
            return
        sess = job.sess
        with self._holding_lock:
            sess.holding -= 1
            release = not sess.holding and sess.drop_waiting
            if release:
                sess.drop_waiting = False
        if release:
            self._drop_owner(sess)

    def _wait_budget(self, msg: dict) -> float:
        """How long a request may wait for a thread, queued: its ``timeout_s`` if it has
        one; else the longer of its ``wait_s`` and ``lease_wait_s`` (the longest its
        waits may take). A field that is not a number of seconds in [0, 86400] is not
        one (an op that does not read it has not checked it)."""
        default = self.config.store.lease_wait_s
        given = _seconds(msg.get("timeout_s"))
        if given is not None:
            return given
        given = _seconds(msg.get("wait_s"))
        return default if given is None else max(given, default)

    def _wait(self, job: Job) -> None:
        """(a wait thread) Run the rest of a request that must wait; its timeouts count
        from when it first had to."""
        sess = job.sess
        if (refused := self._namespace_refusal(sess)) is not None:
            self._unrun(job, refused)
            return
        try:
            with wait_context(park=False, abandoned=lambda: sess.closed, since=job.since), _acting(sess):
                out = _outcome(job.rest, job.rid, job.op)
            self._finish(sess, job.rid, *out, time.perf_counter() - job.t0)
        finally:
            self._let_go(job)

    def _unrun(self, job: Job, error: TierstoreError) -> None:
        """A request ends without running its rest (refused, out of time, its connection
        gone, the daemon stopping): what it took so far is given back, then it is answered
        — on a control thread (a give-back may touch the disk); its connection's clean-up
        waits for the give-back. A closed connection's request that took nothing needs
        neither."""
        if job.give_back is not None or not job.sess.closed:
            self._control.submit(self._end_unrun, job, error)

    def _end_unrun(self, job: Job, error: TierstoreError) -> None:
        sess = job.sess
        if job.give_back is not None:
            self._give_back_job(job)
            self._let_go(job)
        if not sess.closed:  # (a closed one's other leases went with it)
            self._finish(job.sess, job.rid, reply_err(job.rid, error), job.op, error.code,
                         time.perf_counter() - job.t0)

    def _committed(self, sess: Session, rid: int, op: str, t0: float, reply, acquires: bool = True) -> None:
        """(on the thread that settled it: the group committer's, for a durable put's
        commit; an I/O worker's, for a streamed get's ``get_part``) A deferred request is
        done: its reply (``reply()``) goes out. A request that ``acquires`` (a commit may
        publish an object of the connection's) of a connection that went away meanwhile
        is cleaned up after on a control thread, so the committer goes on with the next
        batch; one that does not (``get_part``) has nothing to clean up, so no I/O worker
        ever does that work."""
        out = (*_outcome(reply, rid, op), time.perf_counter() - t0)
        if not acquires:
            self._finish(sess, rid, *out, clean=False)
        elif sess.closed:
            self._control.submit(self._finish, sess, rid, *out)
        else:
            self._finish(sess, rid, *out)

    def _finish(self, sess: Session, rid: int, blob: bytes, op: str, code: str | None, seconds: float,
                clean: bool = True) -> None:
        if sess.closed and clean:
            # the client went away while this ran: whatever it acquired is released now
            self._drop_owner(sess)
        self._done.put((sess, rid, (blob, op, code), seconds))
        self._wake()

    def _drain_done(self) -> None:
        if self._done.empty():
            return
        self._corked = set()  # replies finished together (one group commit's) leave together
        try:
            self._drain_done_corked()
        finally:
            self._uncork()

    def _uncork(self) -> None:
        corked, self._corked = self._corked, None
        for sess in corked:
            if not sess.closed:
                self._flush(sess)
                self._check_budget(sess)

    def _drain_done_corked(self) -> None:
        while True:
            try:
                sess, rid, (blob, op, code), seconds = self._done.get_nowait()
            except queue.Empty:
                return
            self.latency.observe(op, seconds)
            sess.awaiting -= 1
            if op == "hello":
                sess.hello_pending = False
            if code:
                self._count_error(code)
            if sess.closed:
                continue
            fds = [self.store.arena.fd] if op == "hello" and code is None else None
            self._send(sess, blob, fds, rid)

    # ------------------------------------------------------------------ replies
    def _reply_error(self, sess: Session, rid: int | None, e: TierstoreError) -> None:
        self._count_error(e.code)
        self._send(sess, reply_err(rid, e), rid=rid)

    def _fatal(self, sess: Session, e: TierstoreError, rid: int | None = None) -> None:
        sess.say(logging.WARNING, "%s", e.message)
        self._count_error(e.code)
        self._flush_queued(sess)  # the requests before the bad one happened: their replies go first
        sess.send_now(reply_err(rid, e))
        self._close(sess)

    def _flush_queued(self, sess: Session) -> None:
        """Send what is queued for ``sess`` now, as far as the socket takes it without blocking
        (replies held back to leave joined with the rest of their burst)."""
        if self._corked is not None:
            self._corked.discard(sess)
        if not sess.closed:
            self._flush(sess)

    def _half_closed(self, sess: Session) -> None:
        """EOF from the peer: it still reads the replies its requests earned, more of them
        than the socket may take at once, and those of requests still under way (on a
        worker, waiting, in a group commit). Reading stops (EOF stays readable); the rest
        of the outbox goes as the peer reads and the replies to come as they come, then
        the connection closes (``_flush``)."""
        self._flush_queued(sess)
        if sess.closed:
            return
        if not sess.outbox and not sess.awaiting:
            self._close(sess)
            return
        sess.drain_then_close()

    def _send(self, sess: Session, blob: bytes, fds: list[int] | None = None, rid: int | None = None) -> None:
        if sess.closed:
            return
        sess.queue(blob, fds, rid)
        if self._corked is not None and sess.joined:
            self._corked.add(sess)  # sent when the burst (or the drain) ends, then its budget checked
            if sess.over_own_bound():  # (its own bound at once: one burst could be many large replies)
                self._check_budget(sess)
            return
        if not sess.flush():
            self._close(sess)
            return
        if sess.outbox:  # (``_check_budget``'s first test, inline: most replies leave at once)
            self._check_budget(sess)

    def _check_budget(self, sess: Session) -> None:
        """Close ``sess`` if it leaves replies unread past its, its uid's or everyone's
        bound (a connection with nothing unread is not the one to close)."""
        if sess.closed or not sess.outbox:
            return
        why = sess.over_budget()
        if why is not None:
            sess.say(logging.WARNING, "%s; closing it", why)
            self._close(sess)

    def _flush(self, sess: Session) -> None:
        if not sess.flush():
            self._close(sess)

    def _close(self, sess: Session, sync: bool = False) -> None:
        if sess.closed:
            return
        sess.close_socket()
        self._sessions.pop(sess.cid, None)
        ended = self._pool.drop(sess) + self._waits.drop(sess)  # nobody to answer
        log.debug("session %d closed after %d requests", sess.cid, sess.requests)
        # every lease and unfinished put of the connection ends with it, however it ended;
        # a durable rw write-back may touch the disk, so not on the loop thread
        # (what its queued requests took is given back first: a batch's blank ``w`` lease must
        # be dropped, not checked in as written)
        if sync:
            self._give_back(sess, ended)
        else:
            self._control.submit(self._give_back, sess, ended)

    def _expire(self) -> None:
        """(a control thread, once a second) Revoke old leases, drop old reservations, end old streamed gets."""
        try:
            if self.config.daemon.lease_timeout_s > 0:
                self.store.daemon.expire_leases(self.config.daemon.lease_timeout_s)
            if self.config.daemon.reservation_timeout_s > 0:
                self.store.daemon.expire_reservations(self.config.daemon.reservation_timeout_s)
        except Exception:  # logged; the next tick tries again
            log.exception("expiring leases and reservations failed")

    def _give_back(self, sess: Session, ended: list[Job]) -> None:
        """A closed connection's requests that ended unrun give back what they took, then
        the connection's leases and unfinished puts are released."""
        for job in ended:
            if job.give_back is not None:
                self._give_back_job(job)
                self._let_go(job)
        self._drop_owner(sess)

    def _give_back_job(self, job: Job) -> None:
        try:
            job.give_back()
        except Exception:
            log.exception("giving back what '%s' took before it ended", job.op)

    def _drop_owner(self, sess: Session) -> None:
        """(``sess`` closed) Release its leases and unfinished puts — once no give-back of
        its requests is under way (the last one to finish releases them then)."""
        with self._holding_lock:
            if sess.holding:
                sess.drop_waiting = True
                return
        leases, puts = self.store.daemon.drop_owner(sess)
        if leases or puts:
            log.info("session %d ended holding %d leases and %d unfinished puts; released", sess.cid, leases, puts)

    # ------------------------------------------------------------------ misc
    def _wake(self) -> None:
        # (after the caller queued its work) one byte per wake-up, not per reply: a group
        # commit answers hundreds at once. The loop empties the pipe, then clears the flag,
        # then drains the queue: work queued by a caller that saw the flag set is drained
        # then, and a caller that sees it clear writes a byte the loop has not yet read.
        if self._wake_pending:
            return
        self._wake_pending = True
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass  # the pipe is full, so the loop is already going to wake

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        self._wake_pending = False  # after the read: a byte written from here on stays for the next select

    def _count_error(self, code: str) -> None:
        self.errors_by_code[code] = self.errors_by_code.get(code, 0) + 1

    def _server_stats(self, uid: int = 0) -> dict[str, Any]:
        """The daemon's figures; the sessions listed are ``uid``'s (root: every one)."""
        sessions = [{"session": s.cid, "pid": s.cred.pid, "uid": s.cred.uid, "namespace": s.namespace,
                     "requests": s.requests, "age_s": time.monotonic() - s.opened, "pinned": s.pinned,
                     "pinned_reason": s.pinned_reason,
                     **({"activations": s.activations} if s.activations is not None else {})}
                    for s in list(self._sessions.values()) if uid == 0 or s.cred.uid == uid]
        waiting = self._waits.waiting()
        op_queue = self._pool.waiting()
        return {"clients": len(self._sessions), "sessions": sessions, "activations": _sum_activations(sessions),
                "waiting": waiting, "op_queue": op_queue, "pid": os.getpid(), "socket": self.config.daemon.socket,
                "uptime_s": time.monotonic() - self._started, "errors": dict(self.errors_by_code),
                "connections_accepted": self.accepted, "connections_refused": self.refused,
                "ops": self.latency.snapshot(), "metrics_port": self.metrics_port}

    def _full_stat(self) -> dict[str, Any]:
        st = self.store.stat()
        st.update(self._server_stats())
        return st


def _outcome(get, rid: int, op: str) -> tuple[bytes, str, str | None]:
    """The reply to request ``rid`` from ``get()`` (its result, or the error it raises),
    with its op and error code; ``WouldWait`` passes on."""
    try:
        return reply_ok(rid, get()), op, None
    except WouldWait:
        raise
    except TierstoreError as e:
        return reply_err(rid, e), op, e.code
    except Exception as e:
        log.exception("op %s failed", op)
        return reply_err(rid, TierstoreError(f"internal error in {op}: {type(e).__name__}: {e}")), op, "internal"


_ACCEPTS_PER_TURN = 32
"""Connections accepted in one turn of the event loop (``Server._accept``)."""


def _acting(sess: Session) -> Any:
    """What a request of ``sess`` runs in: for a connection whose namespace no uid had
    claimed when it was last asked, a check, as each object, key or listing of the
    namespace is looked up, that no other uid claimed it since (``acting_for``)."""
    return _NOTHING if sess.owns_namespace or sess.cred.uid == 0 else acting_for(sess.cred.uid)


_NOTHING = nullcontext()
"""(reusable) What a request of a connection that owns its namespace runs in."""


def _uid_of(owner: Any) -> Any:
    """Whose share of leases ``owner``'s count against: a connection's uid."""
    return owner.cred.uid if isinstance(owner, Session) else owner


def _root_reserve(max_clients: int) -> int:
    """Connections kept for root once all others are taken (and as many before them for
    uids that hold fewer than ``_NEWCOMER_HOLDS``)."""
    return min(8, max_clients // 16)


_NEWCOMER_HOLDS = 2
"""A uid holding fewer connections than this may use the slots kept for other uids."""


def _sum_activations(sessions: list[dict[str, Any]]) -> dict[str, Any]:
    """Activation-offload counters summed over the connected clients that report them."""
    told = [s["activations"] for s in sessions if "activations" in s]
    total: dict[str, Any] = {k: 0 for k in sorted(ACTIVATION_FIELDS)}
    for a in told:
        for k, v in a.items():
            total[k] += v
    total["clients"] = len(told)
    return total


def _seconds(v: Any) -> float | None:
    """``v`` as a number of seconds a request may wait, if it is one: finite, in [0, 86400]."""
    if type(v) not in (int, float) or not 0 <= v <= 86400:  # (NaN compares false: not one)
        return None
    return float(v)


def run(config: Config) -> int:
    """Run a daemon in the foreground until SIGTERM, SIGINT or SIGHUP (a closed terminal)
    (exit 1 when it cannot start; 143, 130 or 129, with a line saying so, when such a
    signal comes while it starts)."""
    try:
        server = Server(config)
        server.stop_on_signals = True
        server.start()
    except StopDuringStart as e:
        log.error("%s", e)
        return e.status
    except DaemonAlreadyRunning as e:
        log.error("%s", e)
        return 1
    except TierstoreError as e:  # a setting this machine cannot honour, a directory in use, ...
        log.error("cannot start: %s", e)
        return 1
    except OSError as e:
        log.error("cannot start: %s; check --socket and --nvme-dir", e)
        return 1

    for sig in STOP_SIGNALS:  # (as the start installed them once the store was open)
        signal.signal(sig, server._stop_on_signal)
    FreezeAfterFullCollections().install()  # (the process is the daemon's: an in-process Server is left alone)
    sys.setswitchinterval(_SWITCH_INTERVAL_S)
    server.serve_forever()
    return 1 if server.failed is not None else 0
