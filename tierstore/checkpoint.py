"""The index checkpoint: the durable index as of a point in the journal, in columns, so a
restart builds a million objects without decoding and checking a million records.

An optimisation only: the journal stays the source of truth. A checkpoint holds exactly
what a compaction at the moment it was written would put in the journal (the live
records, the namespace owners, the epoch and the next id), and names the journal it
summarises: the journal's size then (``X``) and the CRC32C of its ``X`` bytes. The
journal is append-only between rewrites, so a start whose journal still begins with
exactly those bytes loads the checkpoint and replays only the records after ``X``, by
the same rules and with the same damage-tolerant scan as a full replay. On any doubt
(missing, a CRC or a version that does not check out, a journal rewritten, cut or
damaged anywhere in the covered bytes, a column that does not validate) the start says
why in one log line and replays the whole journal instead, so journal damage is found,
reported and kept aside exactly as without a checkpoint.

Written (temp file, fsync, rename, directory fsync) at a clean close, right after a
compaction, and in the background by a forked child once the journal has grown enough
since the last one (``Durability``), beside the journal (``index.ckpt``). Removed before a compaction renames
the new journal over the old, so no crash leaves a checkpoint naming a journal that is
gone.

File format: ``magic 8s | version u32 | crc32c(body) u32 | len(body) u64 | body``, the
body a msgpack map of plain fields and columns (``bin``: little-endian NumPy arrays):

- ``journal``: ``[X, crc32c of the journal's bytes [0, X)]``
- ``head``: ``[length, crc32c]`` of the journal's first record (its ``open``, with a
  random ``jid``), or ``[]``; ``ladder``: u32 CRC32C of the journal's first k × 4 KiB
  for each whole 4 KiB of ``X``: a journal shorter than ``X`` whose whole 4 KiB rungs
  (under 4 KiB: its first record) are those, and in which a replay skips nothing but a
  torn tail, or an empty or missing one, was cut, and the checkpoint stands in for it
  (``JournalCut``)
- ``epoch``, ``next_id``, ``owners`` (``[[root namespace, uid], ...]`` in claim order)
- ``ns``: the distinct namespaces; ``specs``: the distinct ``[kind, dtype, shape, nbytes]``
- per object: ``id`` u64, ``ord`` u64 (``ObjectMeta.order``; absent: the ids), ``gen``
  u32, ``nsi`` u32 (into ``ns``), ``spec`` u32 (into ``specs``), ``home`` u8 (1:
  ``"nvme"``), ``keys`` (a list, nil for none), ``next`` u32 (extents of each object),
  ``crcn`` u32 (block CRCs of each), ``recn`` u32 (bytes of its journal record)
- flat: ``ext`` u64 ``[dev, file_offset, obj_offset, nbytes]`` rows, ``crc`` u32, ``rec``
  (the objects' put records as the journal holds them, one after another)

The module knows nothing of the store: ``write`` takes the live records, ``load``
returns the objects and the replay structures that seed ``replay.Replay``.

Length: one concept, the checkpoint format, written, loaded and validated (every check
a replay makes of a record, vectorised, and the checks of the journal it names: covered
byte for byte, or cut below it) in one place.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import struct
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import msgpack
import numpy as np

from .checksum import BLOCK_BYTES, crc32c
from .errors import InvalidArgument
from .files import create_fresh, fsync_dir
from .index import ObjectMeta, validate_key, validate_namespace
from .journal import _write_all, mapped, scan
from .nvme import Extent
from .tensors import TensorSpec
from .units import PAGE

__all__ = ["BACKGROUND_TMP", "CHECKPOINT_FILE", "Checkpoint", "Refused", "gc_paused", "journal_identity", "write",
           "load", "publish_background", "remove", "remove_temp"]

log = logging.getLogger(__name__)

CHECKPOINT_FILE = "index.ckpt"
BACKGROUND_TMP = CHECKPOINT_FILE + ".bg.tmp"
"""The temp file a background checkpoint is written to; its parent renames it."""
_MAGIC = b"TSINDEX\x00"
VERSION = 1
_HEAD = struct.Struct("<8sIIQ")
_CHUNK = 8 << 20
"""Journal bytes read at a time to check its CRC."""
_ID_LIMIT = 1 << 48
_SAMPLE = 64
"""Records decoded at load to cross-check the columns (first, last and evenly between)."""


class Refused(Exception):
    """The checkpoint is not used; the message says why (the start logs it and replays
    the whole journal)."""


class JournalCut(Refused):
    """The journal holds fewer bytes than the checkpoint covered (cut, emptied or removed
    since), and nothing in it was written after the checkpoint: what the checkpoint holds
    is the only record of those bytes."""


@dataclass
class Checkpoint:
    """What a usable checkpoint holds, ready to seed a replay."""

    offset: int
    """Journal bytes it covers: the replay goes on from here."""
    live: dict[int, ObjectMeta]
    owners: dict[str, int]
    epoch: int
    next_id: int
    specs: dict[tuple, TensorSpec]
    namespaces: set[str]
    space: list[tuple[np.ndarray, np.ndarray, np.ndarray]]
    """Per drive: the objects' byte ranges (starts, ends, ids), sorted by start and disjoint."""
    keys: Callable[[], dict[str, dict[str, int]]]
    """Builds the namespace -> key -> id map of the objects (when a replay first needs it)."""
    load_s: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)
    cut: str | None = None
    """Set (why) where the journal was cut below what this covers (``load(allow_cut=True)``)."""


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection while a million long-lived objects are made: each
    collection would walk every one made so far (about half the time of a replay)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def path_in(directory: str) -> str:
    return os.path.join(directory, CHECKPOINT_FILE)


# ---------------------------------------------------------------------------- write
def write(directory: str, identity: tuple[int, int], records: Iterable[dict[str, Any] | bytes], *,
          tmp: str | None = None) -> int:
    """Write the checkpoint of ``directory`` from ``records``: the journal's live content
    (``Durability._live_records``: an ``open`` map, ``ns`` maps and the durable objects'
    packed put records) as of the moment ``identity`` (``journal_identity``) was taken,
    with no record appended in between. Returns the objects written. ``tmp``: only write
    (and fsync) this temp file of ``directory``; the caller renames it."""
    with gc_paused():
        return _write(directory, identity, records, tmp)


def _write(directory: str, identity: tuple[int, int], records: Iterable[dict[str, Any] | bytes],
           tmp_name: str | None = None) -> int:
    t0 = time.perf_counter()
    owners: dict[str, int] = {}
    epoch, next_id = 0, 1
    ns_ix: dict[str, int] = {}
    spec_ix: dict[tuple, int] = {}
    ids, ords, gens, nsis, spis, homes, keys = [], [], [], [], [], [], []
    nexts, ext, crcn, crc, recn, rec = [], [], [], [], [], []
    unpack = msgpack.unpackb
    for r in records:
        if not isinstance(r, bytes):
            op = r.get("op")
            if op == "open":
                epoch, next_id = max(epoch, r["epoch"]), max(next_id, r["next_id"])
            elif op == "ns":
                owners.setdefault(r["name"], r["uid"])
            continue
        d = unpack(r, raw=False, strict_map_key=False)
        if not isinstance(d, dict) or d.get("op") != "put":
            raise ValueError(f"not a put record: {d!r:.200}")
        if d.get("nsuid") is not None:
            root = d["ns"].split("/")[0]
            if owners.setdefault(root, d["nsuid"]) != d["nsuid"]:
                raise ValueError(f"namespace {root!r}: a record names uid {d['nsuid']}, the owner is "
                                 f"uid {owners[root]}")
        ns = d["ns"]
        i = ns_ix.get(ns)
        if i is None:
            i = ns_ix[ns] = len(ns_ix)
        sk = (d["kind"], d["dtype"], tuple(d["shape"]), d["nbytes"])
        s = spec_ix.get(sk)
        if s is None:
            s = spec_ix[sk] = len(spec_ix)
        ids.append(d["id"])
        ords.append(d.get("ord", d["id"]))
        gens.append(d["gen"])
        nsis.append(i)
        spis.append(s)
        homes.append(d.get("home") == "nvme")
        keys.append(d.get("key"))
        nexts.append(len(d["ext"]))
        for e in d["ext"]:
            ext.extend(e)
        crcn.append(len(d["crc"]))
        crc.extend(d["crc"])
        recn.append(len(r))
        rec.append(r)
        epoch = max(epoch, d["gen"])
        next_id = max(next_id, d["id"] + 1, ords[-1] + 1)
    size, jcrc, *head = identity
    ladder = head.pop() if len(head) == 3 else b""
    body = msgpack.packb({
        "journal": [size, jcrc], "head": head, "ladder": ladder, "epoch": epoch, "next_id": next_id,
        "owners": [[n, u] for n, u in owners.items()], "ns": list(ns_ix),
        "specs": [[k, dt, list(sh), nb] for k, dt, sh, nb in spec_ix],
        "id": _col(ids, "<u8"), "ord": _col(ords, "<u8"), "gen": _col(gens, "<u4"), "nsi": _col(nsis, "<u4"),
        "spec": _col(spis, "<u4"),
        "home": _col(homes, "u1"), "keys": keys, "next": _col(nexts, "<u4"), "ext": _col(ext, "<u8"),
        "crcn": _col(crcn, "<u4"), "crc": _col(crc, "<u4"), "recn": _col(recn, "<u4"), "rec": b"".join(rec),
    }, use_bin_type=True)
    path = path_in(directory)
    tmp = path + ".tmp" if tmp_name is None else os.path.join(directory, tmp_name)
    fd = create_fresh(tmp)
    try:
        _write_all(fd, _HEAD.pack(_MAGIC, VERSION, crc32c(body), len(body)))
        _write_all(fd, body)
        os.fsync(fd)  # complete on disk before the name points at it
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    if tmp_name is not None:
        return len(ids)
    os.replace(tmp, path)
    fsync_dir(directory)
    log.info("index checkpoint of %d durable objects written (journal offset %d, %.2f s)",
             len(ids), size, time.perf_counter() - t0)
    return len(ids)


def publish_background(directory: str) -> None:
    """The background checkpoint's temp file of ``directory`` becomes its checkpoint."""
    os.replace(os.path.join(directory, BACKGROUND_TMP), path_in(directory))
    fsync_dir(directory)


def remove_temp(directory: str) -> None:
    """Temp files a crash left behind (the checkpoint itself stays)."""
    for name in (CHECKPOINT_FILE + ".tmp", BACKGROUND_TMP):
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(directory, name))


def keep_aside(directory: str) -> str | None:
    """Move the checkpoint to ``index.ckpt.damaged-<UTC time>``, where no start reads it
    (kept, as a damaged journal is: no recovery decision is final). Its new path, or
    None where there was none (or it could not be moved: then removed)."""
    src = path_in(directory)
    if not os.path.exists(src):
        return None
    dst = f"{src}.damaged-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    try:
        os.rename(src, dst)
        fsync_dir(directory)
        return dst
    except OSError as e:
        log.warning("index checkpoint not kept aside (%s); removed", e)
        remove(directory)
        return None


def remove(directory: str) -> None:
    """No checkpoint (before the journal it names is replaced). A removal that fails, or
    that a crash undoes, leaves one a start finds stale (logged, not raised)."""
    for name in (CHECKPOINT_FILE, CHECKPOINT_FILE + ".tmp", BACKGROUND_TMP):
        try:
            os.unlink(os.path.join(directory, name))
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("index checkpoint %s not removed (a start finds it stale): %s", name, e)


def _col(values: list, dtype: str) -> bytes:
    return np.asarray(values, dtype=dtype).tobytes()


def journal_identity(journal_path: str, size: int | None = None) -> tuple[int, ...]:
    """The journal's size and the CRC32C of all of it: what a checkpoint written now
    covers (taken with the journal's lock held, so nothing is appended meanwhile); then,
    where the journal begins with a whole record, that record's length and CRC32C (its
    ``open`` record carries a random ``jid``: it tells this journal from any other, and a
    cut one that kept its first record from one rewritten or replaced since).
    ``size``: of its first ``size`` bytes instead (the journal is append-only between
    rewrites, so what it held at that size is still its prefix; ``Refused`` if shorter)."""
    ladder: list[int] = []
    with open(journal_path, "rb") as f:
        if size is None:
            size = os.fstat(f.fileno()).st_size
        crc = _crc_of(f, size, ladder)
        f.seek(0)
        data = f.read(min(size, _HEAD_SCAN))
    first = next(iter(scan(data)), None)
    if first is None or first[0] != 0 or first[2] is None or first[1] == len(data) < size:
        return size, crc
    return size, crc, first[1], crc32c(data[:first[1]]), np.asarray(ladder, np.uint32).tobytes()


_HEAD_SCAN = 1 << 16
"""Bytes read for the journal's first record (an ``open`` record is tens of bytes)."""
_RUNG = 4096
"""The ladder's step: a checkpoint holds the CRC32C of the journal's first k × this bytes
for every k, so a shorter journal is known for an exact prefix of the covered one (cut)
to within its last few KiB."""


def _crc_of(f: Any, size: int, ladder: list[int] | None = None) -> int:
    """CRC32C of the first ``size`` bytes of ``f``, read a chunk at a time; with
    ``ladder``, the CRC32C of its first k × ``_RUNG`` bytes, for each whole rung, too."""
    crc, left = 0, size
    f.seek(0)
    while left:
        chunk = f.read(min(left, _CHUNK))
        if not chunk:
            raise Refused(f"the journal ended {left} bytes before the {size} it covered")
        if ladder is None:
            crc = crc32c(chunk, crc)
        else:  # (_CHUNK is a multiple of _RUNG: rungs end where the chunks' do)
            mv = memoryview(chunk)
            for o in range(0, len(chunk), _RUNG):
                crc = crc32c(mv[o:o + _RUNG], crc)
                if o + _RUNG <= len(chunk):
                    ladder.append(crc)
        left -= len(chunk)
    return crc


# ---------------------------------------------------------------------------- load
def load(directory: str, journal_path: str, *, ndrives: int, drive_bytes: int,
         allow_cut: bool = False) -> Checkpoint | None:
    """The checkpoint of ``directory`` if there is one and every check holds; None if
    there is none; ``Refused`` (saying why) if there is one that cannot be used.
    ``allow_cut``: one whose journal was cut below what it covers (``JournalCut``) is
    returned with ``cut`` saying so, for the caller to recover from it alone."""
    t0 = time.perf_counter()
    try:
        with open(path_in(directory), "rb") as f:
            # the header first: a file that is not a checkpoint costs no read of its whole size
            head = f.read(_HEAD.size)
            if len(head) < _HEAD.size:
                raise Refused("it is shorter than its header")
            magic, version, crc, n = _HEAD.unpack_from(head)
            if magic != _MAGIC:
                raise Refused("bad magic")
            if version != VERSION:
                raise Refused(f"version {version}, this build reads version {VERSION}")
            if n != os.fstat(f.fileno()).st_size - _HEAD.size:
                raise Refused("its length does not match its header (damaged or cut)")
            data = head + f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise Refused(f"cannot read it: {os.strerror(e.errno or 0)}") from None
    body = memoryview(data)[_HEAD.size:]
    if n != len(body) or crc32c(body) != crc:
        raise Refused("its CRC does not check out (damaged or cut)")
    try:
        b = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception as e:  # (CRC-valid but undecodable: written by something else)
        raise Refused(f"undecodable: {e}") from None
    del data, body
    cut = None
    try:
        _check_journal(b, journal_path)
    except JournalCut as e:
        if not allow_cut:
            raise
        cut = str(e)
    ck = _build(b, ndrives, drive_bytes)
    ck.cut = cut
    ck.load_s = time.perf_counter() - t0
    return ck


def _check_journal(b: dict, journal_path: str) -> None:
    j = b.get("journal")
    if not (isinstance(j, list) and len(j) == 2 and all(type(v) is int for v in j)):
        raise Refused("no journal identity")
    size, crc = j
    try:
        with open(journal_path, "rb") as f:
            have = os.fstat(f.fileno()).st_size
            if have < size:
                # a cut (or emptied) journal: one that still begins with the first record the
                # checkpoint saw, or holds no whole record (``empty``: emptied, or cut inside its
                # first); any other was rewritten or replaced since
                if not _a_prefix(b, f, have):
                    raise Refused(f"the journal is {have} bytes, shorter than the {size} it covered, and not the "
                                  "first bytes of that one (rewritten, replaced or damaged since)")
                raise JournalCut(f"the journal is {have} bytes, shorter than the {size} it covered (cut)")
            if _crc_of(f, size) != crc:
                raise Refused(f"the journal's first {size} bytes are not the ones it covered (rewritten or damaged)")
    except FileNotFoundError:
        raise JournalCut(f"there is no journal; it held {size} bytes when the checkpoint was written") from None


def _a_prefix(b: dict, f: Any, have: int) -> bool:
    """Whether the journal open as ``f`` (``have`` bytes, fewer than the checkpoint ``b``
    covered) is those bytes' beginning, cut: it holds no whole record (emptied, or cut
    inside its first); or its first whole rungs are the covered journal's (``ladder``;
    a checkpoint without one: its first record, ``head``) and a replay would skip
    nothing in it but a torn tail (so no stretch was cut out of its last rung). Scanned
    through a mapping, in bounded memory."""
    whole = damaged = False
    with mapped(f.name) as (data, release):
        if len(data) != have:
            return False  # (changed under the check)
        for _, end, r in scan(data, 0, release):
            whole = whole or r is not None
            damaged = damaged or (r is None and end != have)
    if not whole:
        return True
    if damaged:
        return False  # damaged, not only cut: a full replay finds and keeps what is whole
    ladder, head, k = b.get("ladder"), b.get("head"), have // _RUNG
    if isinstance(ladder, bytes) and ladder and len(ladder) % 4 == 0 and k:
        rungs = np.frombuffer(ladder, np.uint32)
        if k > len(rungs):
            return False
        try:
            return _crc_of(f, k * _RUNG) == int(rungs[k - 1])
        except Refused:
            return False
    if not (isinstance(head, list) and len(head) == 2 and all(type(v) is int for v in head) and 0 < head[0] <= have):
        return False
    return _crc_of(f, head[0]) == head[1]


def _arr(b: dict, name: str, dtype: str, n: int | None = None) -> np.ndarray:
    v = b.get(name)
    if not isinstance(v, bytes) or len(v) % np.dtype(dtype).itemsize:
        raise Refused(f"column {name!r} is missing or malformed")
    a = np.frombuffer(v, dtype=dtype)
    if n is not None and len(a) != n:
        raise Refused(f"column {name!r} has {len(a)} entries, not {n}")
    return a


def _build(b: dict, ndrives: int, drive_bytes: int) -> Checkpoint:
    epoch, next_id = b.get("epoch"), b.get("next_id")
    if not (type(epoch) is int and 0 <= epoch < 1 << 63 and type(next_id) is int and 1 <= next_id <= _ID_LIMIT):
        raise Refused("bad epoch or next id")
    owners = _owners(b.get("owners"))
    names, specs = _namespaces(b.get("ns")), _specs(b.get("specs"))
    ids = _arr(b, "id", "<u8")
    n = len(ids)
    ords = _arr(b, "ord", "<u8", n) if "ord" in b else ids  # (a checkpoint written before orders: ids)
    gens, nsi, spi = _arr(b, "gen", "<u4", n), _arr(b, "nsi", "<u4", n), _arr(b, "spec", "<u4", n)
    home, nxt, crcn, recn = _arr(b, "home", "u1", n), _arr(b, "next", "<u4", n), _arr(b, "crcn", "<u4", n), \
        _arr(b, "recn", "<u4", n)
    ext = _arr(b, "ext", "<u8").reshape(-1, 4) if b.get("ext") is not None else None
    crcs = _arr(b, "crc", "<u4")
    keys, rec = b.get("keys"), b.get("rec")
    if ext is None or len(b["ext"]) % 32:
        raise Refused("column 'ext' is malformed")
    if not isinstance(keys, list) or len(keys) != n or not isinstance(rec, bytes):
        raise Refused("columns 'keys' or 'rec' are malformed")
    # -- per object, vectorised (the checks ``_check_record`` makes of each put record)
    if n and (ids.min() < 1 or ids.max() >= _ID_LIMIT or ids.max() >= next_id):
        raise Refused("an object id is out of range")
    if n and not (np.diff(ids.astype(np.int64)) > 0).all():
        raise Refused("object ids are not unique and in order")
    if n and (ords.min() < 1 or ords.max() >= next_id):
        raise Refused("an object's order is out of range")
    if n and (gens.max() >= 0x10000 or gens.max() > epoch):
        raise Refused("a generation is out of range")
    if n and (nsi.max() >= len(names) or spi.max() >= len(specs) or home.max() > 1):
        raise Refused("a namespace, spec or home index is out of range")
    nbytes = np.array([s.nbytes for s in specs], dtype=np.int64)[spi] if n else np.zeros(0, np.int64)
    if int(nxt.sum(dtype=np.int64)) != len(ext) or int(crcn.sum(dtype=np.int64)) != len(crcs) \
            or int(recn.sum(dtype=np.int64)) != len(rec):
        raise Refused("per-object counts do not add up to the flat columns")
    if ((nxt == 0) & (nbytes > 0)).any():
        raise Refused("an object with bytes has no extent")
    if not (crcn == -(-nbytes // BLOCK_BYTES)).all():
        raise Refused("an object's block CRC count disagrees with its size")
    dev, off, oof, en = (ext[:, k].astype(np.int64) for k in range(4)) if len(ext) else \
        (np.zeros(0, np.int64),) * 4
    if len(ext):
        if ext.max() >= 1 << 62:
            raise Refused("an extent field is out of range")
        span = (np.maximum(en, 1) + PAGE - 1) // PAGE * PAGE
        if dev.max() >= ndrives or (off % PAGE).any() or (off + span > drive_bytes).any():
            raise Refused("an extent is outside the configured NVMe tier")
        owner = np.repeat(np.arange(n), nxt)
        first = np.cumsum(nxt, dtype=np.int64) - nxt
        before = np.cumsum(en) - en  # bytes of all earlier extents
        if not (oof == before - np.repeat(before[first[nxt > 0]], nxt[nxt > 0])).all():
            raise Refused("an object's extents do not tile it")
        total = np.zeros(n, np.int64)
        has = nxt > 0
        total[has] = np.add.reduceat(en, first[has])  # (each object's extents are contiguous)
        if not (total == nbytes).all():
            raise Refused("an object's extents do not add up to its size")
        space = []
        for d in range(ndrives):
            sel = np.flatnonzero(dev == d)
            order = sel[np.argsort(off[sel], kind="stable")]
            s, e = off[order], off[order] + span[order]
            if len(s) > 1 and (s[1:] < e[:-1]).any():
                raise Refused(f"extents on drive {d} overlap")
            space.append((s, e, ids[owner[order]].astype(np.int64)))
    else:
        if (nbytes > 0).any():
            raise Refused("an object with bytes has no extent")
        space = [(np.zeros(0, np.int64),) * 3 for _ in range(ndrives)]
    _check_keys(keys, nsi, len(names))
    # -- the objects
    for ns, uid in owners.items():
        if uid is None:
            raise Refused(f"namespace {ns!r} has no owner")
    live = _objects(ids, ords, gens, nsi, spi, home, keys, nxt, ext, crcn, crcs, recn, rec, names, specs)
    _cross_check(live, ids)
    ns_used = [names[i] for i in np.unique(nsi)] if n else []

    def keys_of() -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for oid, m in live.items():
            if m.key is not None:
                out.setdefault(m.namespace, {})[m.key] = oid
        return out
    return Checkpoint(offset=int(b["journal"][0]), live=live, owners=owners, epoch=epoch, next_id=next_id,
                      specs={(s.kind, s.dtype, s.shape, s.nbytes): s for s in specs}, namespaces=set(ns_used),
                      space=space, keys=keys_of)


def _owners(v: Any) -> dict[str, int]:
    if not isinstance(v, list):
        raise Refused("bad owners")
    out: dict[str, int] = {}
    for x in v:
        if not (isinstance(x, list) and len(x) == 2 and type(x[1]) is int and 0 <= x[1] < 1 << 32):
            raise Refused("bad owner entry")
        try:
            if "/" in validate_namespace(x[0]):
                raise InvalidArgument("not a root")
        except InvalidArgument:
            raise Refused(f"bad owned namespace {x[0]!r:.80}") from None
        out.setdefault(x[0], x[1])
    return out


def _namespaces(v: Any) -> list[str]:
    if not isinstance(v, list):
        raise Refused("bad namespace table")
    try:
        return [sys.intern(validate_namespace(x)) for x in v]  # (each distinct one checked once)
    except InvalidArgument:
        raise Refused("a namespace in the table is invalid") from None


def _specs(v: Any) -> list[TensorSpec]:
    if not isinstance(v, list):
        raise Refused("bad spec table")
    out = []
    for s in v:
        if not (isinstance(s, list) and len(s) == 4):
            raise Refused("bad spec")
        kind, dtype, shape, nb = s
        if kind not in ("torch", "numpy") or not isinstance(dtype, str) or not 0 < len(dtype) <= 32:
            raise Refused("a spec has a bad kind or dtype")
        if not (isinstance(shape, list) and len(shape) <= 64 and all(type(d) is int and 0 <= d < 1 << 63
                                                                   for d in shape)) \
                or not (type(nb) is int and 0 <= nb < 1 << 62) or (nb and not all(shape)):
            raise Refused("a spec has a bad shape or size")
        out.append(TensorSpec(sys.intern(kind), sys.intern(dtype), tuple(shape), nb))
    return out


def _check_keys(keys: list, nsi: np.ndarray, nnames: int) -> None:
    """Every key valid (``index.validate_key``), all at once in the usual case (every key
    a str of at most 256 characters, so at most 1024 bytes, and the lot printable), and
    no key held twice in a namespace."""
    present = [k for k in keys if k is not None]
    if not all(type(k) is str for k in present):
        raise Refused("a key is not a string")
    if nnames == 1:
        distinct = len(set(present))
    else:
        distinct = len({(i, k) for i, k in zip(nsi.tolist(), keys) if k is not None})
    if distinct != len(present):
        raise Refused("a key is held by two objects")
    lens = np.fromiter(map(len, present), dtype=np.int64, count=len(present))
    if len(present) and lens.min() < 1:
        raise Refused("a key is empty")
    if not len(present) or lens.max() <= 256 and "".join(present).isprintable():
        return
    try:
        for k in present:
            validate_key(k)
    except InvalidArgument:
        raise Refused("a key is invalid") from None


def _objects(ids, ords, gens, nsi, spi, home, keys, nxt, ext, crcn, crcs, recn, rec, names, specs
             ) -> dict[int, ObjectMeta]:
    """The ObjectMetas, in id order, as ``ObjectMeta.from_record`` makes them."""
    rows = [Extent(*row) for row in ext.tolist()]
    exts = [(e,) for e in rows] if (nxt == 1).all() else _split(rows, nxt)  # (one extent each: the usual)
    crc_list = crcs.tolist()
    crc_of = [(c,) for c in crc_list] if (crcn == 1).all() else _split(crc_list, crcn)
    ri = np.cumsum(recn, dtype=np.int64).tolist()
    rec_of = [rec[a:b] for a, b in zip([0, *ri], ri)]
    n = len(ids)
    ns_of = [names[0]] * n if len(names) == 1 else [names[i] for i in nsi.tolist()]
    spec_of = [specs[0]] * n if len(specs) == 1 else [specs[i] for i in spi.tolist()]
    home_of = [None] * n if not home.any() else [(None, "nvme")[h] for h in home.tolist()]
    id_list = ids.tolist()
    metas = [ObjectMeta(id=oid, gen=gen, namespace=ns, key=key, spec=spec, durable=True, nvme=ex, crcs=cr,
                        nvme_valid=True, home=h)
             for oid, gen, ns, key, spec, h, ex, cr in zip(id_list, gens.tolist(), ns_of, keys, spec_of, home_of,
                                                           exts, crc_of)]
    for m, rc, o in zip(metas, rec_of, ords.tolist()):
        m.record = rc
        m.order = m.id if o == m.id else o  # (the id itself: no second int per object)
    return dict(zip(id_list, metas))


def _split(items: list, counts: np.ndarray) -> list[tuple]:
    ends = np.cumsum(counts, dtype=np.int64).tolist()
    return [tuple(items[a:b]) for a, b in zip([0, *ends], ends)]


def _cross_check(live: dict[int, ObjectMeta], ids: np.ndarray) -> None:
    """Decode a sample of the kept records and compare them with the objects built from
    the columns: a checkpoint whose two halves disagree is not used."""
    n = len(ids)
    if not n:
        return
    for k in sorted({0, n - 1, *np.linspace(0, n - 1, min(n, _SAMPLE)).astype(int).tolist()}):
        m = live[int(ids[k])]
        try:
            r = msgpack.unpackb(m.record, raw=False, strict_map_key=False)
        except Exception:
            raise Refused(f"the record of object {m.id} is undecodable") from None
        want = m.to_record()
        if not isinstance(r, dict) or any(r.get(f) != v for f, v in want.items()):
            raise Refused(f"the record of object {m.id} disagrees with the columns")
