"""Durability: the journal of durable objects and namespace claims, the host index log
that lets a restarted daemon adopt the host arena, and recovery from both at start.

``Durability`` owns the journal, the host index log and the namespace owners. It is
given the object index (``ObjectIndex``: it reads objects under the index's lock to
write live records, and fills it at replay) and the NVMe and host allocators (the
space replayed and adopted objects hold). It never moves bytes.

Lock order: the journal lock (``lock``) is always taken before the index's ``cv``,
never the other way around.

The replay rules themselves (what a record means, how conflicts resolve) are
``replay.py``'s; the index checkpoint's format is ``checkpoint.py``'s.

Length: one owner, the journal lock, and everything that must hold it — appends, frees,
claims, compaction, the checkpoints (foreground and background) that read the same
live records, and the start's recovery that decides which of journal and checkpoint to
trust — is kept together so the lock's rules are read in one place.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
from typing import Any, Callable

from . import checkpoint, forkjob
from .allocator import ExtentAllocator
from .errors import InvalidArgument, PermissionDenied, StorageError, TierstoreError
from .hostindex import HostIndexLog
from .index import ObjectMeta, validate_namespace
from .journal import Journal, ReplayResult, pack as pack_record
from .nvme import NvmeTier
from .objectindex import ObjectIndex
from .replay import Replay
from .tensors import TensorSpec

__all__ = ["Durability"]

log = logging.getLogger(__name__)


class Durability:
    """The journal, the host index log and the namespace owners; see the module docstring."""

    def __init__(self, index: ObjectIndex, journal: Journal, hostlog: HostIndexLog, nvme: NvmeTier,
                 host: ExtentAllocator, compact_bytes: int, checkpoint_tail_bytes: int = 0) -> None:
        self.index, self.journal, self.hostlog, self.nvme, self.host = index, journal, hostlog, nvme, host
        self.lock = journal.lock
        """The journal lock: taken before the index's ``cv``, never after."""
        self.compact_bytes = compact_bytes
        self.checkpoint_tail_bytes = checkpoint_tail_bytes
        """A background checkpoint once the journal has grown this much (and by an eighth of
        what the last one covered) since the last; 0: none."""
        self.checkpoint_at = 0
        """Journal bytes the newest index checkpoint covers (0: none of this journal)."""
        self._compact_retry_at = 0
        """After a compaction failed: the journal size below which none is tried again."""
        self.checkpoints_written = 0
        self._counted_from = 0
        """The journal offset the next background checkpoint's growth is counted from: the
        last checkpoint's, or where the last try failed (so it is not retried at once)."""
        self._background: forkjob.ForkJob | None = None
        self._checkpointer: threading.Thread | None = None
        self._due = threading.Event()
        self._freed: set[int] = set()
        """Durable objects whose free is journaled but that are still in the index: a
        checkpoint or a compaction taken meanwhile must not bring them back."""
        self._closed = False
        self._last_order = 0
        """The highest ``ObjectMeta.order`` journaled (every object of the journal found at
        start counts as journaled: their orders are below the next id)."""
        self.owners: dict[str, int] = {}
        """Root namespace -> the uid that claimed it."""
        self.roots_of: dict[int, set[str]] = {}
        """uid -> the root namespaces it claimed (``owners`` inverted, changed with it): a
        uid's view of the namespaces is found without a walk over everyone's."""
        index.owner_of = self.owner_of  # (``objectindex.acting_for``)
        self.hostlog_on = False
        self._checkpoint_lock = threading.Lock()  # one checkpoint write at a time (they share a temp file)
        self.damage_kept = False
        """The journal holds damage a start found but could not set aside: no checkpoint may
        cover it (the next start must find it again) until a compaction rewrites it."""

    # ------------------------------------------------------------------ journal
    def record_write_back(self, meta: ObjectMeta) -> None:
        """Journal ``meta``'s new NVMe copy (a durable object written down: demoted, or
        checked in after a write) and sync it, under the journal lock."""
        with self.lock:
            self.journal_put(meta)
            self._after_append()

    def journal_put(self, meta: ObjectMeta, *, sync: bool = True) -> None:
        """Append meta's put record (caller holds ``lock``). ``sync=False``: the caller
        calls ``commit()`` once it has let go of the lock (group commit)."""
        self.journal_puts([meta], sync=sync)

    def journal_puts(self, metas: list[ObjectMeta], *, sync: bool = False) -> None:
        """``journal_put`` of several objects with one write: all of them, or none."""
        self._order(metas)
        recs = []
        for meta in metas:
            rec = meta.to_record()
            owner = self.owners.get(meta.namespace.split("/")[0])
            if owner is not None:
                rec["nsuid"] = owner  # ownership in every record: it survives the loss of the claim's
            recs.append(rec)
        payloads = self.journal.append_many(recs, sync=sync)
        for meta, rec, payload in zip(metas, recs, payloads):
            meta.record = pack_record(rec) if payload is None else payload

    def _order(self, metas: list[ObjectMeta]) -> None:
        """(under the journal lock) Give each object journaled for the first time its order:
        its id while ids come in order, else the next number of the id counter, so the order
        of first records is the order the objects were published in (a replay resolves a
        key held twice by it, as the index did)."""
        fresh = [m for m in metas if m.order is None]
        if not fresh:
            return
        with self.index.cv:
            for m in fresh:
                if m.key is None:  # (no key to hold: its order decides nothing)
                    m.order = m.id
                    continue
                m.order = m.id if m.id > self._last_order else self.index.new_id()
                self._last_order = m.order

    def record_put(self, meta: ObjectMeta, *, replace: bool, publish: Callable[[], None]) -> None:
        """A put's one pass through durability: under the journal lock, the key is checked
        again, a durable object's record appended and ``publish`` run (under the index's
        ``cv``; it makes the object visible); then, the lock let go, a durable put waits for
        the group commit. The record is visible from the publish, but a durable put returns
        only once an fdatasync that covers it is done: a crash in between may lose an object
        someone saw, never one whose put returned."""
        with self.lock:
            self._check_and_publish(meta, replace, publish)
        if meta.durable:
            self.commit()

    def try_record_put(self, meta: ObjectMeta, *, replace: bool, publish: Callable[[], None]) -> bool:
        """``record_put`` of a volatile object, for a caller that must not wait (the daemon's
        event loop): False, with nothing done, while another holds the journal lock (a
        durable op may be syncing under it)."""
        if meta.durable:
            raise InvalidArgument("try_record_put is for volatile objects: a durable put waits for the journal sync")
        if not self.lock.acquire(blocking=False):
            return False
        try:
            self._check_and_publish(meta, replace, publish)
        finally:
            self.lock.release()
        return True

    def _check_and_publish(self, meta: ObjectMeta, replace: bool, publish: Callable[[], None]) -> None:
        # (under the journal lock) held across check, append and publish: no other put can
        # bind the same key in between, and compaction sees either both or neither
        cv = self.index.cv
        with cv:
            self.index.check_key(meta.namespace, meta.key, replace)
        if meta.durable:
            self.journal_put(meta, sync=False)  # made durable by the group commit that follows
        with cv:
            publish()
        if meta.durable:
            self._after_append()  # (once published: a checkpoint covering the record holds the object)

    def record_puts(self, puts: list[tuple[ObjectMeta, bool, Callable[[], None]]]) -> list[None | Exception]:
        """``record_put`` for a batch of durable puts (``meta, replace, publish`` each), in
        one hold of the journal lock: the keys checked, the records appended with one
        write, the objects published; then one group commit for all of them. Per put None,
        or the error that failed it (a put that fails its key check is not
        appended; a failed append fails the puts it carried, unpublished; a failed commit
        fails every put appended, as it fails ``record_put``)."""
        out: list[None | Exception] = [None] * len(puts)
        cv, ix = self.index.cv, self.index
        appended = []
        with self.lock:
            i = 0
            while i < len(puts):
                # a run of puts of distinct keys: each is checked against what is published so far,
                # so a second put of a key in the batch waits for the next run (it may replace the first)
                run, keys = [], set()
                with cv:
                    while i < len(puts) and (puts[i][0].key is None or
                                             (puts[i][0].namespace, puts[i][0].key) not in keys):
                        meta, replace, _ = puts[i]
                        keys.add((meta.namespace, meta.key))
                        try:
                            ix.check_key(meta.namespace, meta.key, replace)
                            run.append(i)
                        except Exception as e:  # this put fails; the others go on
                            out[i] = e
                        i += 1
                if not run:
                    continue
                try:
                    # held across check, append and publish: no other put can bind these keys in
                    # between, and compaction sees either both or neither
                    self.journal_puts([puts[j][0] for j in run])  # made durable by the commit below
                except Exception as e:
                    for j in run:
                        out[j] = e
                    continue
                appended += run
                with cv:
                    for j in run:
                        try:
                            out[j] = puts[j][2]()
                        except Exception as e:
                            out[j] = e
            if appended:
                self._after_append()
        if appended:
            try:
                self.commit()
            except Exception as e:
                for j in appended:
                    out[j] = e
        return out

    def journal_free(self, oid: int) -> None:
        """A free, journaled and synced: once this returns it is never undone. The caller
        calls ``forgotten`` once the object has left the index."""
        with self.lock:
            self.journal.append({"op": "free", "id": oid})
            self._freed.add(oid)
            self._after_append()

    def forgotten(self, oid: int) -> None:
        """(under the index's cv) A freed object has left the index."""
        self._freed.discard(oid)

    def commit(self) -> None:
        """Group commit: returns once an fdatasync covering every record appended so far is done."""
        self.journal.commit()

    def maybe_compact(self, force: bool = False) -> None:
        """Rewrite the journal once it exceeds ``compact_bytes`` and is mostly garbage (or
        ``force``). Never raises: a compaction that fails (a full filesystem) leaves the
        journal as it was, is logged, and is tried again only once the journal has grown
        by another eighth of ``compact_bytes`` — what the caller did (a free, journaled
        before this) stands."""
        size = self.journal.size()
        if not force and (size < self.compact_bytes or size < self._compact_retry_at):
            return
        try:
            self._compact(force, size)
        except Exception as e:  # (the journal is unchanged: ``Journal.rewrite`` is atomic)
            self._compact_retry_at = size + max(self.compact_bytes // 8, 1)
            log.error("journal compaction failed, the journal is unchanged (tried again once it has grown %d "
                      "bytes): %s", self._compact_retry_at - size, e)

    def _compact(self, force: bool, size: int) -> None:
        with self.lock:
            records = self._live_records()
            est = sum(len(r) if isinstance(r, bytes) else len(str(r)) for r in records)
            if not force and size < 2 * est:
                return
            directory = self.journal.directory
            # (it names the journal about to be replaced: removed once the new one is complete, so
            # a compaction that cannot write it leaves the checkpoint as good as it was)
            self.journal.rewrite(iter(records), before_replace=lambda: checkpoint.remove(directory))
            self._compact_retry_at = 0
            self.checkpoint_at = self._counted_from = 0  # (no checkpoint of the new journal yet)
            self.damage_kept = False
            covered = self._covered()  # (before the next append)
        # the new journal is these records: its checkpoint, written with appends going on
        self._write_checkpoint(covered, records)

    def close(self) -> None:
        """Close the journal (flushed) and write the index checkpoint of what it holds
        (a background checkpoint still being written is ended first)."""
        with self.lock:
            self._closed = True
            job, thread = self._background, self._checkpointer
            self._due.set()
        if job is not None:
            job.kill()
        if thread is not None:
            thread.join()  # (it finds the store closed, removes its temp file and ends)
        self.journal.close()
        if self.journal.sync_failed or self.damage_kept:
            # a failed sync: objects were published under records that may be lost, none is
            # vouched for; damage kept: the next start must meet it again. (An earlier
            # checkpoint stays: what it covers is unchanged, or it is found stale.)
            log.warning("index checkpoint not written: the journal %s", "failed a sync" if self.journal.sync_failed
                        else "holds damage that was not set aside")
            return
        with self.lock:
            records = self._live_records()
            covered = self._covered()
        self._write_checkpoint(covered, records)

    def _covered(self) -> tuple[int, int] | Exception:
        """(under the journal lock) What a checkpoint written of the journal now covers."""
        try:
            return checkpoint.journal_identity(self.journal.path)
        except OSError as e:
            return e

    def _write_checkpoint(self, covered: tuple[int, int] | Exception, records: list[dict[str, Any] | bytes]
                          ) -> None:
        # an optimisation only: a checkpoint that cannot be written costs the next start time
        with self._checkpoint_lock:
            try:
                if isinstance(covered, Exception):
                    raise covered
                checkpoint.write(self.journal.directory, covered, records)
                self.checkpoint_at = self._counted_from = covered[0]
                self.checkpoints_written += 1
            except Exception as e:
                log.warning("index checkpoint not written (the next start replays the whole journal): %s", e)
                checkpoint.remove(self.journal.directory)

    def _live_records(self) -> list[dict[str, Any] | bytes]:
        """(under the journal lock) The journal's content as of now: the namespace claims
        (twice: first and last, so no single lost record loses one) and the durable objects."""
        with self.index.cv:
            return self._collect()

    def _collect(self) -> list[dict[str, Any] | bytes]:
        """``_live_records`` with both locks held by the caller, or in a forked child that
        holds a snapshot taken under them (and may take no lock). An object whose free is
        journaled, or whose key a later put took, is not live in the journal."""
        owners = [{"op": "ns", "name": n, "uid": u} for n, u in self.owners.items()]
        epoch, next_id, recs = self.index.durable_records(self._freed)
        # (``jid``: a compacted journal's first record is its own, as a new journal's is)
        return [{"op": "open", "epoch": epoch, "next_id": next_id, "jid": secrets.randbits(62)}, *owners, *recs,
                *owners]

    # ------------------------------------------------------------------ background checkpoint
    def _after_append(self) -> None:
        """(under the journal lock, what was appended published) Wake the checkpoint thread
        when the journal has grown ``checkpoint_tail_bytes`` and an eighth of what the last
        checkpoint covered since it: a restart after a crash then replays at most about
        that much, whatever the journal's size."""
        tail = self.checkpoint_tail_bytes
        if not tail or self._closed or self._background is not None or not self._grown(tail):
            return
        if self._checkpointer is None:
            t = threading.Thread(target=self._checkpoints, name="tierstore-checkpoint", daemon=True)
            try:
                t.start()
            except RuntimeError as e:  # (no thread to be had: the next append tries again)
                log.warning("background index checkpoint thread not started: %s", e)
                return
            self._checkpointer = t
        self._due.set()

    def _grown(self, tail: int) -> bool:
        return self.journal.position - self._counted_from >= max(tail, self.checkpoint_at // 8)

    def _checkpoints(self) -> None:
        """The checkpoint thread: forks each background checkpoint (under the journal lock
        and the index's cv, so the child's snapshot is consistent) and publishes what the
        child wrote. One long-lived thread: a forked child dies with the thread that forked
        it (``forkjob``)."""
        while True:
            self._due.wait()
            self._due.clear()
            with self.lock:
                if self._closed:
                    return
                if self.journal.sync_failed or self.damage_kept or not self._grown(self.checkpoint_tail_bytes):
                    continue
                job, pos, rewrites = self._fork()
            if job is not None:
                self._publish(job, pos, rewrites)

    def _fork(self) -> tuple[forkjob.ForkJob | None, int, int]:
        """(under the journal lock) Start the child that writes the checkpoint of now."""
        directory, path = self.journal.directory, self.journal.path
        pos, rewrites = self.journal.position, self.journal.rewrites

        def write() -> None:  # (in the child: a snapshot of this moment, no lock held or taken)
            checkpoint.write(directory, checkpoint.journal_identity(path, pos), self._collect(),
                             tmp=checkpoint.BACKGROUND_TMP)

        try:
            with self.index.cv:  # (no object changes half-way through the snapshot)
                job = forkjob.start(write)
        except OSError as e:
            log.warning("background index checkpoint not started (the next start replays more of the journal): "
                        "%s", e)
            self._counted_from = pos  # (not retried at once: the next try after as much again)
            return None, pos, rewrites
        self._background = job
        return job, pos, rewrites

    def _publish(self, job: forkjob.ForkJob, pos: int, rewrites: int) -> None:
        """Wait for a background checkpoint's child; put what it wrote in place (rename) if
        the journal it covers is still the one in use, else remove it."""
        why = job.wait()
        directory = self.journal.directory
        with self.lock:
            self._background = None
            if self._closed:
                why = "the store closed"
            elif why is None and self.journal.rewrites != rewrites:
                why = "the journal was rewritten meanwhile"
            elif why is None and (self.journal.sync_failed or self.damage_kept):
                why = "the journal failed a sync" if self.journal.sync_failed else "the journal holds damage"
            if why is None:
                try:
                    checkpoint.publish_background(directory)
                except OSError as e:
                    why = f"not renamed into place: {os.strerror(e.errno or 0)}"
                else:
                    self.checkpoint_at = self._counted_from = pos
                    self.checkpoints_written += 1
                    log.info("background index checkpoint written: it covers the journal's first %d bytes", pos)
                    return
            if self.journal.rewrites == rewrites:
                self._counted_from = max(self._counted_from, pos)  # (the next try after as much again)
            try:
                os.unlink(os.path.join(directory, checkpoint.BACKGROUND_TMP))
            except OSError:
                pass
        if why != "the store closed":
            log.warning("background index checkpoint not used: %s", why.splitlines()[-1] if why else why)

    # ------------------------------------------------------------------ namespaces
    def claim_namespace(self, namespace: str, uid: int) -> None:
        """Bind a namespace to the uid that first uses it (journaled); others are refused."""
        root = validate_namespace(namespace).split("/")[0]
        with self.lock:
            with self.index.cv:
                owner = self.owners.get(root)
                if owner is not None:
                    if owner != uid and uid != 0:
                        raise PermissionDenied(f"namespace {root!r} belongs to uid {owner}; use another namespace")
                    return
            self.journal.append({"op": "ns", "name": root, "uid": uid})
            with self.index.cv:
                self.owners[root] = uid
                self.roots_of.setdefault(uid, set()).add(root)
            self._after_append()

    def check_namespace(self, namespace: str, uid: int) -> None:
        """``PermissionDenied`` if another uid owns the namespace (root may enter any)."""
        owner = self.namespace_owner(validate_namespace(namespace))
        if owner is not None and owner != uid and uid != 0:
            raise PermissionDenied(f"namespace {namespace.split('/')[0]!r} belongs to uid {owner}; "
                                   "use another namespace")

    def namespace_owner(self, namespace: str) -> int | None:
        with self.index.cv:
            return self.owner_of(namespace)

    def roots_owned_by(self, uid: int) -> list[str]:
        """(under cv) The root namespaces ``uid`` claimed, in name order."""
        return sorted(self.roots_of.get(uid, ()))

    def owner_of(self, namespace: str) -> int | None:
        """(under cv) The uid that claimed ``namespace``'s root, if any."""
        return self.owners.get(namespace.split("/")[0])

    def journal_stat(self) -> dict[str, int]:
        """The journal's size, the bytes the index checkpoint covers and the checkpoints written (``stat``)."""
        return {"bytes": self.journal.size(), "checkpoint_covers_bytes": self.checkpoint_at,
                "checkpoints_written": self.checkpoints_written}

    # ------------------------------------------------------------------ host index log
    @staticmethod
    def _host_rec(m: ObjectMeta) -> list[Any]:
        # a list, not a map: this is on the path of every put
        return [m.id, m.gen, m.namespace, m.key, m.spec.kind, m.spec.dtype, list(m.spec.shape), m.nbytes,
                m.host_off, m.durable, m.home]

    def enable_host_index(self) -> None:
        """Start recording host residency in the index log (the daemon calls this once the
        arena and the log are in systemd's fd store; without a keeper it is not worth it)."""
        with self.index.cv:
            if not self.hostlog_on:
                self.hostlog.rewrite(self._host_live())
                self.hostlog_on = True

    def _host_live(self) -> list[list[Any]]:
        # an ephemeral object's connection does not outlive the daemon: not handed on
        return [self._host_rec(m) for m in self.index.all_objects()
                if m.host_valid and m.host_off is not None and not m.freeing and m.ephemeral is None
                and not (m.durable and m.writer)]

    def log_host(self, meta: ObjectMeta) -> None:
        """(under cv) meta's bytes are valid in its host block: recorded before it is published.
        Not while a writer holds a durable object: until its check-in is journaled, the
        block is not its bytes (a restart serves the NVMe copy)."""
        if self.hostlog_on and meta.host_off is not None and meta.ephemeral is None \
                and not (meta.durable and meta.writer):
            self.hostlog.append_host(self._host_rec(meta), self._host_live)

    def log_drop(self, meta: ObjectMeta) -> None:
        """(under cv) meta's host block is about to go back to the allocator."""
        if self.hostlog_on and meta.host_off is not None:
            self.hostlog.append_drop(meta.id, self._host_live)

    # ------------------------------------------------------------------ recovery at start
    def adopt_host_objects(self) -> list[ObjectMeta]:
        """Take over the host-resident objects of the daemon that handed us its arena;
        returns them (the caller admits them to the eviction order)."""
        ix = self.index
        adopted = []
        for rec in sorted(self.hostlog.replay(), key=lambda r: r[0]):
            keys = ("id", "gen", "ns", "key", "kind", "dtype", "shape", "nbytes", "off", "durable", "home")
            r = dict(zip(keys, rec))
            n, off = int(r["nbytes"]), r["off"]
            if off is None or n <= 0 or off < 0 or off + n > self.host.capacity:
                continue
            meta = ix.holder(r["id"])
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
                prev = None if meta.key is None else ix.key_id(meta.namespace, meta.key)
                if prev is not None and prev > meta.id:
                    self.host.free(off, n)
                    continue
                gone = ix.adopt(meta)
                if gone is not None:  # replaced by this newer object just before the restart
                    if gone.nvme:
                        self.nvme.free(gone.nvme)
                    if gone.host_valid and gone.host_off is not None:  # adopted above: its block too
                        self.host.free(gone.host_off, gone.spec.nbytes)
                        gone.host_off, gone.host_valid = None, False
                        adopted = [m for m in adopted if m is not gone]
            meta.host_off, meta.host_valid = off, True
            ix.note_id(meta.id)
            adopted.append(meta)
        self.hostlog.rewrite(self._host_live())
        self.hostlog_on = True  # whoever handed it back keeps it: go on recording
        log.info("adopted %d host-resident objects from the previous daemon's arena", len(adopted))
        return adopted

    def replay(self) -> dict[str, Any]:
        """Rebuild the durable index from the journal, losing only what is damaged (see
        ``Replay``); a damaged journal is kept aside before it is rewritten."""
        with checkpoint.gc_paused():
            return self._replay()

    def _replay(self) -> dict[str, Any]:
        ix = self.index
        res, rp, ck = self._replay_journal()
        if rp.beyond:  # refused before anything is rewritten: the journal stays as it is
            ndrives, drive_bytes = self.nvme.geometry()
            oid, why = next(iter(rp.beyond.items()))
            raise InvalidArgument(
                f"the journal in {self.journal.directory} names {len(rp.beyond)} durable object(s) in NVMe space "
                f"this start does not have (object {oid}: {why}; this start has {ndrives} director"
                f"{'y' if ndrives == 1 else 'ies'} of {drive_bytes >> 20} MiB): start with the nvme_dirs, in the "
                "same order, and the nvme_bytes that wrote them")
        rp.settle()
        dropped, live = 0, rp.live
        try:  # the usual case, in one pass: replay left the live objects' extents disjoint
            self.nvme.reserve_all([e for m in live.values() for e in m.nvme])
        except (ValueError, TierstoreError):
            for oid in list(live):  # (not expected) one at a time, dropping those that fail
                try:
                    self.nvme.reserve(live[oid].nvme)
                except (ValueError, TierstoreError) as e:
                    log.error("journal names object %s with extents the NVMe tier cannot hold; dropped: %s",
                              oid, e)
                    del live[oid]
                    dropped += 1
        ix.load(live, (rp.epoch % 0xFFFF) + 1, rp.next_id)
        rp.live = live = {}
        self.owners.update(rp.owners)
        for root, uid in rp.owners.items():
            self.roots_of.setdefault(uid, set()).add(root)
        info = {"torn_bytes": res.torn_bytes, "corrupt_records": res.corrupt_records,
                "corrupt_bytes": res.corrupt_bytes, "cut_bytes": res.cut_bytes, "malformed_records": rp.malformed,
                "superseded": rp.superseded, "dropped": dropped, "owner_conflicts": rp.owner_conflicts,
                "kept_aside": None, "objects": ix.object_count(), **ck}
        damaged = res.torn_bytes or res.corrupt_records or res.cut_bytes or rp.malformed or dropped \
            or rp.owner_conflicts
        if damaged:
            # nothing recovery decided is final: the journal as found stays beside the new one
            info["kept_aside"] = self.journal.keep_aside()
            log.warning("journal recovery: %d damaged stretches (%d bytes) and %d malformed records skipped, "
                        "torn tail of %d bytes dropped, %d bytes cut (the index checkpoint stood in), %d objects "
                        "superseded by later records, %d dropped; %d durable objects recovered; the journal as "
                        "found is kept at %s", res.corrupt_records, res.corrupt_bytes, rp.malformed, res.torn_bytes,
                        res.cut_bytes, rp.superseded, dropped, ix.object_count(), info["kept_aside"])
            if info["kept_aside"] is None and not res.cut_bytes:  # (logged) nothing decided for good: appended to
                self.damage_kept = True
                self.journal.open_for_append()
            else:
                directory = self.journal.directory
                # the checkpoint names the journal about to be replaced; one that stood in for a
                # cut journal is kept aside until the rewrite holds what it held
                # (after the rename: until the new journal has its name, a crash leaves the checkpoint
                # with the cut journal, and the next start recovers from it again; after it, the new
                # journal's first record is not the one the checkpoint names, so it is never used)
                drop = (lambda: checkpoint.keep_aside(directory)) if res.cut_bytes else \
                    (lambda: checkpoint.remove(directory))
                try:
                    self.checkpoint_at = self._counted_from = 0
                    # the damage is not carried forward
                    self.journal.rewrite(iter(self._live_records()), after_replace=drop)
                except StorageError as e:
                    if res.cut_bytes:  # appending to the cut journal would leave the checkpoint's objects out
                        raise StorageError(
                            f"journal recovery: the journal was cut below what the index checkpoint covers and "
                            f"could not be rewritten from it ({e.message}); the store does not open, so that the "
                            "checkpoint stays the record of its objects: free space there and start again") from None
                    log.error("journal recovery: the journal could not be rewritten (%s); appending to it as "
                              "it is", e)
                    self.damage_kept = True
                    self.journal.open_for_append()
        else:
            self.journal.open_for_append()
        # ``jid``: random, so the first record of every journal is its own (``checkpoint.JournalCut``)
        self.journal.append({"op": "open", "epoch": ix.epoch, "next_id": ix.next_id, "jid": secrets.randbits(62)},
                            start=True)
        self._last_order = ix.next_id - 1
        with self.lock:
            self._after_append()  # (a long replay: its checkpoint now, not after the next puts)
        return info

    def _replay_journal(self) -> tuple[ReplayResult, "Replay", dict[str, Any]]:
        """The journal applied to a ``Replay``: from the index checkpoint and the records
        after the point it covers when it is usable, else every record. Also what was
        used (``checkpoint``: None, or why not; ``records_replayed``)."""
        ndrives, drive_bytes = self.nvme.geometry()
        directory, path = self.journal.directory, self.journal.path
        checkpoint.remove_temp(directory)  # (a background one a crash cut short)
        try:
            ck = checkpoint.load(directory, path, ndrives=ndrives, drive_bytes=drive_bytes, allow_cut=True)
        except checkpoint.Refused as e:
            log.warning("index checkpoint not used, replaying the whole journal: %s", e)
            ck, why = None, f"refused: {e}"
        except Exception as e:  # (a bug in the loader must not stop a start the journal allows)
            log.error("index checkpoint not used, replaying the whole journal: %r", e)
            ck, why = None, f"refused: {e!r}"
        else:
            why = None if ck is not None else "none"
        if ck is not None and ck.cut is not None and (late := self._written_after(ck)) is not None:
            log.warning("index checkpoint not used, replaying the whole journal: it is shorter than the checkpoint "
                        "covered but holds %s, written after it", late)
            ck, why = None, f"refused: the journal is shorter than it covered, but holds {late} written after it"
        if ck is not None and ck.cut is not None:
            # the journal lost bytes only the checkpoint still holds: it stands in for all of
            # them (what the journal held after it is gone, as a torn tail's records are)
            res, rp = ReplayResult(), Replay(ndrives=ndrives, drive_bytes=drive_bytes)
            rp.seed(ck)
            res.cut_bytes = ck.offset - self.journal.size()
            log.error("journal recovery: %s; the index checkpoint's %d durable objects are recovered as they were "
                      "when it was written, and whatever the journal held after that is lost", ck.cut, len(ck.live))
            return res, rp, {"checkpoint": "used", "records_replayed": 0}
        if ck is not None:
            try:
                res, rp = ReplayResult(), Replay(ndrives=ndrives, drive_bytes=drive_bytes)
                rp.seed(ck)
                n = self._apply(rp, res, ck.offset)
                log.info("index checkpoint used: %d durable objects in %.2f s, then %d journal records after "
                         "offset %d", len(ck.live), ck.load_s, n, ck.offset)
                self.checkpoint_at = self._counted_from = ck.offset
                return res, rp, {"checkpoint": "used", "records_replayed": n}
            except Exception as e:
                log.error("index checkpoint not used, replaying the whole journal: the records after it "
                          "failed: %r", e)
                why = f"refused: {e!r}"
        res, rp = ReplayResult(), Replay(ndrives=ndrives, drive_bytes=drive_bytes)
        n = self._apply(rp, res, 0)
        return res, rp, {"checkpoint": why, "records_replayed": n}

    def _written_after(self, ck: checkpoint.Checkpoint) -> str | None:
        """A record of the (cut) journal that the checkpoint ``ck`` does not reflect — so it
        was written after the checkpoint, and the journal lost something other than its
        end (whole records cut out of its last 4 KiB, where the checkpoint's rungs cannot
        tell) — named; None if every record is one the checkpoint already holds the effect
        of. Such records: a later start's ``open`` (a higher epoch), a namespace claim it
        lacks, a put of an id or order from its ``next_id`` on, a free (or a repeat of one)
        of an object it holds live, and a record of such an object after the one it holds."""
        latest: set[int] = set()
        for r, _ in self.journal.stream(ReplayResult()):
            op = r.get("op")
            repeats = r.get("fr")
            if isinstance(repeats, list) and any(type(i) is int and i in ck.live for i in repeats):
                return "a repeat of a free of an object it holds"
            owns = r.get("own")
            if isinstance(owns, list) and any(isinstance(o, list) and len(o) == 2 and ck.owners.get(o[0]) != o[1]
                                              for o in owns):
                return "a repeat of a namespace claim it lacks"
            if op == "open" and not (type(r.get("epoch")) is int and r["epoch"] <= ck.epoch):
                return "a later start's record"
            if op == "ns" and ck.owners.get(r.get("name")) != r.get("uid"):
                return "a namespace claim it lacks"
            oid = r.get("id")
            if type(oid) is not int:
                continue
            if op == "free" and oid in ck.live:
                return f"the free of object {oid}"
            if op != "put":
                continue
            order = r.get("ord", oid)
            if oid >= ck.next_id or (type(order) is int and order >= ck.next_id):
                return f"the put of object {oid}"
            m = ck.live.get(oid)
            if m is not None:
                if oid in latest:
                    return f"a later version of object {oid}"
                if pack_record({k: v for k, v in r.items() if k not in ("fr", "own")}) == m.record:
                    latest.add(oid)
        return None

    def _apply(self, rp: "Replay", res: ReplayResult, start: int) -> int:
        n = 0
        for r, payload in self.journal.stream(res, start):
            rp.apply(r, payload)  # (each decoded record goes once applied: they are never all held)
            n += 1
        return n
