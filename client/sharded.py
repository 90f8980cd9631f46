"""Sharded snapshots of a distributed job: every node exports the namespaces of the job's
ranks it holds (``JOB/rank{r}``) to a shared directory, one Zarr store per namespace, and
writes an index fragment naming them; together the fragments say which rank's state is in
which store and on which node it lived. A restore puts each node's ranks back, into the
same namespaces on the node named the same.

This module only arranges per-namespace snapshots (``Client.snapshot`` / ``restore``) and
the index; nothing here crosses nodes except files in the shared directory. Layout::

    DEST/rank0.zarr, DEST/rank1.zarr, ...      one Zarr v3 store per namespace
    DEST/index/NODE.json                       {"job", "node", "namespaces": {NS: entry}}

Each node writes only its own fragment (atomically, so a reader sees a whole one or none),
so nodes need no coordination; ``read_index`` merges them and refuses a namespace that two
fragments claim.
"""

from __future__ import annotations

import json
import os
import re
import socket as _socket
import stat
import tempfile
from typing import Any, Callable

from tierstore.contract import Pool
from tierstore.errors import InvalidArgument, NotFound

__all__ = ["snapshot_job", "restore_job", "read_index", "INDEX_DIR"]

INDEX_DIR = "index"
_FORMAT = 1
_RANK = re.compile(r"rank(\d+)$")
_STORE = re.compile(r"[A-Za-z0-9._-]{1,250}\.zarr")
"""A store's name in a fragment: a plain file name (``_store_name`` makes them)."""
_MAX_FRAGMENT = 64 << 20


def _node_name(node: str | None) -> str:
    name = node or _socket.gethostname()
    if not re.fullmatch(r"[A-Za-z0-9._-]{1,128}", name):
        raise InvalidArgument(f"node name {name!r} is not a plain file name; pass --node with letters, digits, . _ -")
    return name


def _store_name(job: str, namespace: str) -> str:
    """The Zarr store of a namespace: its part after ``JOB/``, made a plain file name."""
    rest = namespace[len(job) + 1:]
    return re.sub(r"[^A-Za-z0-9._-]", "_", rest) + ".zarr"


def _is_url(dest: str) -> bool:
    return "://" in dest and not dest.startswith("file://")


def _local(dest: str) -> str:
    return dest[len("file://"):] if dest.startswith("file://") else dest


def _join(dest: str, *parts: str) -> str:
    return "/".join([dest.rstrip("/"), *parts]) if _is_url(dest) else os.path.join(_local(dest), *parts)


def _write_fragment(dest: str, name: str, doc: dict[str, Any]) -> None:
    """Write this node's index fragment whole or not at all: a local file through a
    temporary and a rename (fsynced), a URL (object store) in one put."""
    data = json.dumps(doc, indent=1, sort_keys=True).encode()
    if _is_url(dest):
        import fsspec

        fs, root = fsspec.core.url_to_fs(dest)
        fs.pipe_file(f"{root.rstrip('/')}/{INDEX_DIR}/{name}", data)  # one object: whole or absent
        return
    d = os.path.join(_local(dest), INDEX_DIR)
    try:
        os.mkdir(d, 0o755)
    except FileExistsError:
        pass
    _own_dir(d)
    fd, tmp = tempfile.mkstemp(prefix=name + ".partial-", dir=d)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # whole on disk before it gets its name
        os.replace(tmp, os.path.join(d, name))
    except BaseException:
        os.unlink(tmp)
        raise
    dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)  # the rename itself survives a crash
    finally:
        os.close(dfd)


def _read_fragments(dest: str) -> list[tuple[str, dict[str, Any]]]:
    """(where, document) of every index fragment under ``dest``."""
    if _is_url(dest):
        import fsspec

        fs, root = fsspec.core.url_to_fs(dest)
        d = f"{root.rstrip('/')}/{INDEX_DIR}"
        try:
            names = sorted(p for p in fs.ls(d, detail=False) if p.endswith(".json"))
        except FileNotFoundError:
            names = None
        return None if names is None else [(p, _decode(p, fs.cat_file(p))) for p in names]
    d = os.path.join(_local(dest), INDEX_DIR)
    try:
        names = sorted(n for n in os.listdir(d) if n.endswith(".json"))
    except FileNotFoundError:
        return None
    out = []
    for n in names:
        where = os.path.join(d, n)
        try:
            fd = os.open(where, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as f:
                if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                    raise InvalidArgument(f"{where} is not a regular file")
                out.append((where, _decode(where, f.read(_MAX_FRAGMENT + 1))))
        except OSError as e:
            raise InvalidArgument(f"cannot read the index fragment {where}: {e.strerror}") from None
    return out


def _decode(where: str, data: bytes) -> Any:
    if len(data) > _MAX_FRAGMENT:
        raise InvalidArgument(f"index fragment {where} is larger than {_MAX_FRAGMENT >> 20} MiB")
    try:
        return json.loads(data)
    except ValueError as e:
        raise InvalidArgument(f"index fragment {where} is not JSON: {e}") from None


def _own_dir(d: str) -> None:
    """``d`` is a directory of this uid, not a link to one: a sharded snapshot's files are
    written in it."""
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else \
            ("not a directory" if not stat.S_ISDIR(st.st_mode) else f"owned by uid {st.st_uid}")
        raise InvalidArgument(f"{d} is {what}; a sharded snapshot writes only into directories of its own uid "
                              f"({os.geteuid()}): choose another destination")


def _check_fragment(where: str, doc: Any) -> None:
    """Refuse a fragment that does not hold together: every name in it is used as a path
    (its stores) or a namespace to restore into."""
    if not (isinstance(doc, dict) and isinstance(doc.get("job"), str) and isinstance(doc.get("node"), str)
            and isinstance(doc.get("namespaces"), dict)):
        raise InvalidArgument(f"index fragment {where} lacks 'job', 'node' or 'namespaces'")
    job = doc["job"]
    for ns, e in doc["namespaces"].items():
        if not (isinstance(ns, str) and ns.startswith(job + "/")):
            raise InvalidArgument(f"index fragment {where} names namespace {ns!r}, which is not under its job "
                                  f"{job + '/'!r}")
        store = e.get("store") if isinstance(e, dict) else None
        if not (isinstance(store, str) and _STORE.fullmatch(store) and store not in (".zarr", "..zarr")):
            raise InvalidArgument(f"index fragment {where} gives namespace {ns!r} the store {store!r}, which is "
                                  "not a plain name inside the snapshot")
        rank = e.get("rank")
        if rank is not None and (type(rank) is not int or rank < 0):
            raise InvalidArgument(f"index fragment {where} gives namespace {ns!r} the rank {rank!r}")


def snapshot_job(connect: Callable[[str], Pool], job: str, dest: str, *, node: str | None = None,
                 progress: bool | None = False) -> dict[str, Any]:
    """Snapshot every namespace ``JOB/...`` of this node's daemon into ``dest`` (a shared
    directory), one Zarr store each, and write this node's index fragment. ``connect(ns)``
    gives a client in namespace ``ns`` (closed by a ``with``). Returns the fragment."""
    job = job.rstrip("/")
    name = _node_name(node)
    with connect(job) as c:
        namespaces = sorted(ns for ns in c.stat()["namespaces"] if ns.startswith(job + "/"))
    if not namespaces:
        raise NotFound(f"this node's daemon has no namespace under {job + '/'!r}; is the job name right?")
    if not _is_url(dest):
        try:
            os.mkdir(_local(dest), 0o755)
        except FileExistsError:
            pass
        _own_dir(_local(dest))
        if os.path.lexists(os.path.join(_local(dest), INDEX_DIR)):  # (checked again as the fragment is written)
            _own_dir(os.path.join(_local(dest), INDEX_DIR))
    entries: dict[str, Any] = {}
    for ns in namespaces:
        store = _store_name(job, ns)
        with connect(ns) as c:
            r = c.snapshot(_join(dest, store), progress=progress)
            keys = c.keys(prefix="")
        m = _RANK.search(ns)
        entries[ns] = {"store": store, "rank": int(m.group(1)) if m else None, "objects": r["objects"],
                       "bytes": r["bytes"], "prefixes": sorted({k.split("/", 1)[0] + "/" for k in keys if "/" in k})}
    doc = {"format": _FORMAT, "job": job, "node": name, "namespaces": entries}
    _write_fragment(dest, name + ".json", doc)
    return doc


def read_index(dest: str) -> dict[str, Any]:
    """The merged index of a sharded snapshot: ``{"job", "namespaces": {NS: entry + "node"},
    "ranks": {rank: NS}}``."""
    fragments = _read_fragments(dest)
    if fragments is None:
        raise NotFound(f"{dest} has no {INDEX_DIR}/ directory; is it a sharded snapshot (tierstore snapshot "
                       "--sharded)?")
    job, merged, ranks = None, {}, {}
    for where, doc in fragments:
        if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
            raise InvalidArgument(f"{where} is index format "
                                  f"{doc.get('format') if isinstance(doc, dict) else None!r}; this tierstore "
                                  f"reads format {_FORMAT}")
        _check_fragment(where, doc)
        if job is not None and doc["job"] != job:
            raise InvalidArgument(f"{dest} holds fragments of two jobs, {job!r} and {doc['job']!r}")
        job = doc["job"]
        for ns, e in doc["namespaces"].items():
            if ns in merged:
                raise InvalidArgument(f"namespace {ns!r} is claimed by nodes {merged[ns]['node']!r} and "
                                      f"{doc['node']!r}; remove the stale fragment from {dest}/{INDEX_DIR}")
            merged[ns] = dict(e, node=doc["node"])
            if e.get("rank") is not None:
                ranks[e["rank"]] = ns
    if job is None:
        raise NotFound(f"{dest}/{INDEX_DIR} holds no index fragment; was the snapshot finished on any node?")
    return {"job": job, "namespaces": merged, "ranks": dict(sorted(ranks.items()))}


def restore_job(connect: Callable[[str], Pool], src: str, *, node: str | None = None, overwrite: bool = False,
                progress: bool | None = False) -> dict[str, Any]:
    """Restore the namespaces the index places on ``node`` (this host's name by default)
    into this node's daemon, each from its own store. Returns ``{namespace: result}``."""
    name = _node_name(node)
    index = read_index(src)
    mine = {ns: e for ns, e in index["namespaces"].items() if e["node"] == name}
    if not mine:
        nodes = sorted({e["node"] for e in index["namespaces"].values()})
        raise NotFound(f"the snapshot in {src} has nothing for node {name!r} (it has {', '.join(nodes)}); "
                       "pass --node with one of those")
    done = {}
    for ns, e in sorted(mine.items()):
        with connect(ns) as c:
            done[ns] = c.restore(_join(src, e["store"]), overwrite=overwrite, progress=progress)
    return done
