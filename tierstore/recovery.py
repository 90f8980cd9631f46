"""Recovery: journal replay and compaction for durable objects, and the host index
log that lets a restarted daemon adopt the host arena. Part of ``Store`` (a mixin)."""

from __future__ import annotations

import logging
from typing import Any

from .errors import TierstoreError
from .index import ObjectMeta
from .tensors import TensorSpec

__all__ = ["Recovery"]

log = logging.getLogger(__name__)


class Recovery:
    """Store methods that rebuild the index after a restart (mixed into ``Store``)."""

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
        # an ephemeral object's connection does not outlive the daemon: not handed on
        return [self._host_rec(m) for m in self._objects.values()
                if m.host_valid and m.host_off is not None and not m.freeing and m.ephemeral is None
                and not (m.durable and m.writer)]

    def _log_host(self, meta: ObjectMeta) -> None:
        """(under _cv) meta's bytes are valid in its host block: recorded before it is published.
        Not while a writer holds a durable object: until its check-in is journaled, the
        block is not its bytes (a restart serves the NVMe copy)."""
        if self._hostlog_on and meta.host_off is not None and meta.ephemeral is None \
                and not (meta.durable and meta.writer):
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

