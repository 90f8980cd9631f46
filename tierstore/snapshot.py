"""Durable export and import of a namespace as a Zarr v3 group, readable without tierstore.

Layout of a snapshot:

- root attributes: ``tierstore_version``, ``namespace``, ``complete`` (written last),
  ``objects`` (an index entry per object: key, kind, dtype, shape, nbytes, crc32c,
  and where its bytes are);
- an object of 1 MiB or more: one array at ``KEY/~data`` (key segments escaped), with
  its metadata as attributes; dtypes Zarr lacks (bfloat16, float8, complex32) are
  stored as unsigned integers of the same width, the true dtype in ``dtype``;
- smaller objects: packed back to back into ``_packs/N`` uint8 arrays (so 500 small
  tensors are not 500 files); the index gives each one's pack, offset and length;
- an empty object (no bytes): its index entry only.

Snapshots stream one object at a time. A local directory or zip is written under a
temporary name and renamed into place when complete; other URLs get ``complete``
only at the end. ``restore`` refuses anything not complete and verifies every
object's CRC32C; a corrupted object makes it take back everything it had put (with
``overwrite``, everything is verified before the first write instead).

Length: one concept, the Zarr snapshot format, written and read in one place so the
writer and the checks that restore makes (paths, sizes, CRCs) cannot drift apart.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import tempfile
import shutil
import stat
import sys
import time
import zipfile
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from ._version import __version__
from .checksum import crc32c
from .errors import Busy, ChecksumMismatch, InvalidArgument, KeyExists, NotFound, StaleHandle, StorageError, TierstoreError
from .index import validate_key, validate_namespace
from .tensors import TensorSpec, aligned_empty, from_bytes, to_bytes
from .units import PAGE

if TYPE_CHECKING:
    from .contract import Objects

__all__ = ["snapshot", "restore", "open_snapshot", "snapshot_namespace", "SMALL_BYTES"]

SMALL_BYTES = 1 << 20
_PACK_BYTES = 64 << 20
_REREADS = 8
"""Times a snapshot reads a key again that was replaced while it read it."""
_PACK_CHUNK = 4 << 20
_NUMPY_NAMES = {"bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16",
                "float32", "float64", "complex64", "complex128"}
_SAFE = re.compile(r"[^A-Za-z0-9._-]")


_RESERVED = {"", ".", "..", "zarr.json", "c"}
"""Names a key segment may not take as they are: path tricks, and the names Zarr gives
to a node's metadata and an array's chunk directory."""
_MAX_SEGMENT = 200
"""Longer escaped segments (a filesystem allows 255 bytes) are shortened, keeping a
hash of the whole: ``PREFIX~hHASH``."""


def _escape_segment(seg: str) -> str:
    out = _SAFE.sub(lambda m: "".join(f"~{b:02x}" for b in m.group().encode()), seg)
    if out in _RESERVED or out.startswith("__"):
        out = "~" + out.encode().hex()
    if len(out) > _MAX_SEGMENT:
        # escaping writes "~" only before two hex digits: no other name holds "~h"
        out = out[:_MAX_SEGMENT - 66] + "~h" + hashlib.sha256(seg.encode()).hexdigest()
    return out


_LEAF = "~data"
"""Name of an object's array inside its key's group. Escaping turns every "~" of a key
into "~7e", so no key segment can be "~data": keys that are prefixes of other keys
("opt" and "opt/m") never collide."""


def _array_path(key: str) -> str:
    return "/".join([*(_escape_segment(s) for s in key.split("/")), _LEAF])


def _storage_dtype(dtype: str, nbytes_per_item: int) -> str:
    return dtype if dtype in _NUMPY_NAMES else f"uint{8 * nbytes_per_item}"


def _itemsize(dtype: str) -> int:
    sizes = {"bool": 1, "int8": 1, "uint8": 1, "int16": 2, "uint16": 2, "int32": 4, "uint32": 4, "int64": 8,
             "uint64": 8, "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "complex32": 4,
             "complex64": 8, "complex128": 16}
    if dtype.startswith("float8"):
        return 1
    if dtype not in sizes:
        raise InvalidArgument(f"cannot snapshot dtype {dtype}")
    return sizes[dtype]


class _Progress:
    def __init__(self, total_objects: int, total_bytes: int, verb: str, enabled: bool | None) -> None:
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.total_objects, self.total_bytes, self.verb = total_objects, total_bytes, verb
        self.objects = self.bytes = 0
        self.t0 = time.monotonic()

    def update(self, nbytes: int) -> None:
        self.objects += 1
        self.bytes += nbytes
        if self.enabled:
            dt = max(time.monotonic() - self.t0, 1e-9)
            frac = self.bytes / self.total_bytes if self.total_bytes else 1.0
            bar = "#" * int(frac * 24) + "." * (24 - int(frac * 24))
            sys.stderr.write(f"\r{self.verb} [{bar}] {self.objects}/{self.total_objects} objects  "
                             f"{self.bytes / 2**20:.1f}/{self.total_bytes / 2**20:.1f} MiB  "
                             f"{self.bytes / dt / 2**20:.1f} MiB/s")
            sys.stderr.flush()

    def done(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


class _ZarrWriterBase:
    def abort(self) -> None:
        pass


class _ZarrWriter(_ZarrWriterBase):
    """Writes through zarr-python (any store URL)."""

    def __init__(self, store: Any) -> None:
        import zarr

        self.root = zarr.open_group(store, mode="w", zarr_format=3)

    def array(self, path: str, dtype: str, shape: tuple[int, ...], chunks: tuple[int, ...], attrs: dict,
              data: np.ndarray) -> None:
        arr = self.root.create_array(path, shape=shape, dtype=dtype, chunks=chunks, compressors=None,
                                     attributes=attrs)
        arr[...] = data

    def finish(self, attrs: dict) -> None:
        self.root.attrs.update(attrs)


class _LocalWriter:
    """Writes the Zarr v3 layout of a local directory directly: zarr.json documents and
    raw little-endian chunk files (the ``bytes`` codec, no compression), one big write
    per chunk and one filesystem sync at the end. Read back with plain zarr."""

    def __init__(self, root: str) -> None:
        self.root = root  # created (mkdtemp) by the caller: private and new
        self._groups: set[str] = set()
        self._group("")
        # chunk files are written by a few threads (O_DIRECT where the buffer allows),
        # overlapping with reading the next object out of the store
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="tierstore-snapshot")
        self._inflight: list[Future] = []

    def _group(self, path: str) -> None:
        if path in self._groups:
            return
        if path:
            self._group(path.rsplit("/", 1)[0] if "/" in path else "")
        os.makedirs(os.path.join(self.root, path), exist_ok=True)
        self._json(path, {"zarr_format": 3, "node_type": "group", "attributes": {}})
        self._groups.add(path)

    def _json(self, path: str, doc: dict) -> None:
        with open(os.path.join(self.root, path, "zarr.json"), "w") as f:
            json.dump(doc, f, separators=(",", ":"), allow_nan=False)

    def array(self, path: str, dtype: str, shape: tuple[int, ...], chunks: tuple[int, ...], attrs: dict,
              data: np.ndarray) -> None:
        parent = path.rsplit("/", 1)[0] if "/" in path else ""
        self._group(parent)
        os.makedirs(os.path.join(self.root, path), exist_ok=True)
        fill = False if dtype == "bool" else ([0.0, 0.0] if dtype.startswith("complex") else
                                              (0.0 if dtype.startswith("float") else 0))
        self._json(path, {"shape": list(shape), "data_type": dtype,
                          "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunks)}},
                          "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
                          "fill_value": fill, "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
                          "attributes": attrs, "zarr_format": 3, "node_type": "array", "storage_transformers": []})
        # chunks split the first axis only; edge chunks are stored full size, zero-padded
        flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        row = flat.nbytes // shape[0] if shape[0] else 0
        per = chunks[0] * row
        zeros = "/".join("0" for _ in shape[1:])
        for k in range(max(1, -(-shape[0] // chunks[0]))):
            d = os.path.join(self.root, path, "c", str(k), *([zeros] if zeros else []))
            os.makedirs(os.path.dirname(d), exist_ok=True)
            piece = flat[k * per:(k + 1) * per]
            if len(self._inflight) >= 8:  # bound the bytes held for writing
                self._inflight.pop(0).result()
            self._inflight.append(self._pool.submit(_write_chunk_file, d, piece, per))

    def finish(self, attrs: dict) -> None:
        for f in self._inflight:
            f.result()
        self._pool.shutdown()
        self._json("", {"zarr_format": 3, "node_type": "group", "attributes": attrs})
        _syncfs(self.root)  # everything on disk before the rename publishes it

    def abort(self) -> None:
        for f in self._inflight:
            f.cancel()
        self._pool.shutdown(wait=True)


def _write_chunk_file(path: str, piece: np.ndarray, size: int) -> None:
    """``piece`` zero-padded to ``size`` bytes; the aligned head with O_DIRECT when possible."""
    head = piece.nbytes // PAGE * PAGE if piece.ctypes.data % PAGE == 0 else 0
    if head:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT | os.O_CLOEXEC, 0o644)
        except OSError:  # the filesystem does not do O_DIRECT
            head = 0
        else:
            try:
                mv = memoryview(piece[:head])
                done = 0
                while done < head:
                    done += os.pwrite(fd, mv[done:], done)
            finally:
                os.close(fd)
    with open(path, "r+b" if head else "wb") as f:
        f.seek(head)
        f.write(piece[head:])
        if piece.nbytes < size:
            f.write(b"\0" * (size - piece.nbytes))


def _syncfs(path: str) -> None:
    import ctypes

    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syncfs(fd) != 0:
            os.sync()
    finally:
        os.close(fd)


def _is_local(dest: str) -> bool:
    return "://" not in dest or dest.startswith("file://")


def _current(source: Objects, e: dict[str, Any]) -> Any:
    """The bytes of listed object ``e`` as they are now: a key replaced since the listing
    is read under its new handle (the snapshot holds each key's value at the time it was
    read); None for an object freed meanwhile."""
    handle = e["handle"]
    for _ in range(_REREADS):
        try:
            return source.get(handle)
        except (StaleHandle, NotFound):
            if e.get("key") is None:
                return None
            handle = source.lookup(e["key"])
            if handle is None:
                return None
    raise Busy(f"key {e['key']!r} was replaced {_REREADS} times while the snapshot read it; snapshot it when "
               "its writer pauses")


def snapshot(source: Objects, dest: str, *, namespace: str, prefix: str = "",
             progress: bool | None = None) -> dict[str, Any]:
    """Write every object of ``source`` (a ``Pool``, or a store's view of ``namespace``) under
    ``prefix`` to the Zarr v3 store ``dest`` (a directory, ``*.zip``, or a URL)."""
    dest = str(dest)
    entries = source.ls(prefix=prefix)
    local = _is_local(dest)
    path = dest[len("file://"):] if dest.startswith("file://") else dest
    is_zip = local and path.endswith(".zip")
    if local and os.path.lexists(path):
        raise InvalidArgument(f"{path} already exists; choose a new destination or remove it")
    work = _WorkDir(path) if local else None  # unpredictable, new, ours, held open: nothing planted is followed
    writer: _LocalWriter | _ZarrWriter | None = None
    prog = _Progress(len(entries), sum(e["nbytes"] for e in entries), "snapshot", progress)
    index: list[dict[str, Any]] = []
    freed_meanwhile = 0
    pack_n, pack_buf, pack_used = 0, np.empty(0, np.uint8), 0

    def flush_pack() -> None:
        nonlocal pack_n, pack_used
        if pack_used:
            writer.array(f"_packs/{pack_n}", "uint8", (pack_used,), (min(_PACK_CHUNK, pack_used),), {},
                         pack_buf[:pack_used])
            pack_n += 1
            pack_used = 0

    try:
        # its first file is written at once: a full disk fails here, inside the clean-up
        writer = _LocalWriter(work.root) if work else _ZarrWriter(_url_store(dest, read_only=False))
        for e in entries:
            data = _current(source, e)
            if data is None:  # freed since the listing: not in the snapshot
                freed_meanwhile += 1
                continue
            u8, spec = to_bytes(data)
            entry = {"key": e["key"], "kind": spec.kind, "dtype": spec.dtype, "shape": list(spec.shape),
                     "nbytes": spec.nbytes, "crc32c": crc32c(u8), "durable": bool(e.get("durable"))}
            if spec.nbytes == 0:
                pass  # nothing to store: the index entry says it all
            elif spec.nbytes < SMALL_BYTES:
                if pack_used + spec.nbytes > _PACK_BYTES:
                    flush_pack()
                if pack_buf.size < _PACK_BYTES:
                    pack_buf = np.empty(_PACK_BYTES, np.uint8)
                pack_buf[pack_used:pack_used + spec.nbytes] = u8
                entry.update(pack=pack_n, offset=pack_used)
                pack_used += spec.nbytes
            else:
                item = _itemsize(spec.dtype)
                sdt = _storage_dtype(spec.dtype, item)
                flat = u8.view(np.dtype(sdt)).reshape(spec.shape) if spec.shape else u8.view(np.dtype(sdt))[0:1]
                apath = _array_path(e["key"])
                # uncompressed: tensors of floats barely compress, and the disk is the limit
                writer.array(apath, sdt, tuple(spec.shape) or (1,), _chunks(spec.shape, item),
                             {**entry, "tierstore_version": __version__, "zero_d": not spec.shape}, flat)
                entry["array"] = apath
            index.append(entry)
            prog.update(spec.nbytes)
        flush_pack()
        # written last: a snapshot without it is incomplete and restore refuses it
        writer.finish({"tierstore_version": __version__, "namespace": namespace, "objects": index,
                       "complete": True})
    except BaseException as e:
        if work:
            if writer is not None:
                writer.abort()
            work.remove()
        if isinstance(e, OSError):
            where = f" ({e.filename})" if e.filename else ""
            raise StorageError(f"snapshot to {path} failed: {e.strerror or e}{where}; "
                               "nothing was written at the destination") from None
        raise
    finally:
        prog.done()
    if work:
        try:
            _publish(work, path, is_zip)
        except OSError as e:
            raise StorageError(f"snapshot to {path} could not be put in place: {e.strerror or e}; "
                               "nothing was written at the destination") from None
    return {"objects": len(index), "bytes": prog.bytes, "seconds": time.monotonic() - prog.t0, "dest": dest,
            "freed_meanwhile": freed_meanwhile}


def _chunks(shape: list[int] | tuple[int, ...], item: int) -> tuple[int, ...]:
    """Chunks of about 64 MiB along the first axis."""
    if not shape:
        return (1,)
    row = max(1, int(np.prod(shape[1:])) * item)
    first = max(1, min(shape[0], (64 << 20) // row))
    return (first, *shape[1:])


class _WorkDir:
    """A local snapshot's temporary directory: new, beside the destination, under a name
    nobody can predict (mkdtemp: created exclusively, mode 0700), and held open. Its files
    are reached through the descriptor (``root``, ``/proc/self/fd/N``), never through its
    name: in a shared directory without the sticky bit, others may rename the name away
    and plant a link, or another directory, in its place, and nothing is then written
    there, read from there (into a zip), or removed there."""

    def __init__(self, dest: str) -> None:
        parent = os.path.dirname(os.path.abspath(dest))
        try:
            self.path = tempfile.mkdtemp(prefix=os.path.basename(dest) + ".partial-", dir=parent)
            self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise StorageError(f"cannot write a snapshot in {parent}: {e.strerror}") from None
        st = os.fstat(self.fd)
        if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) != 0o700 or os.listdir(self.fd):
            os.close(self.fd)
            raise StorageError(f"the snapshot's temporary directory {self.path} was replaced as it was made (someone "
                               f"else can rename names in {parent}); nothing was written")
        self.id = (st.st_dev, st.st_ino)
        self.root = f"/proc/self/fd/{self.fd}"

    def named(self, path: str) -> bool:
        """Whether ``path`` names this directory (not a link, nor another one put there)."""
        try:
            st = os.lstat(path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self.id

    def remove(self) -> None:
        """Remove what it holds, through the descriptor; then the name, if it still names it."""
        for name in os.listdir(self.fd):
            try:
                if stat.S_ISDIR(os.lstat(name, dir_fd=self.fd).st_mode):
                    shutil.rmtree(name, dir_fd=self.fd)
                else:
                    os.unlink(name, dir_fd=self.fd)
            except OSError:
                pass
        if self.named(self.path):
            try:
                os.rmdir(self.path)
            except OSError:
                pass
        os.close(self.fd)


def _umask_mode(mode: int) -> int:
    """``mode`` as a plain create would have made it (the process umask applied)."""
    try:
        with open("/proc/self/status") as f:  # read, not set: other threads may be creating files
            mask = next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        mask = 0o022
    return mode & ~mask


def _publish(work: _WorkDir, path: str, is_zip: bool) -> None:
    """Put a finished snapshot (the directory ``work``) at ``path``: renamed into place,
    or packed into a zip created exclusively beside it (mkstemp) and linked into place;
    neither replaces anything that appeared at ``path`` meanwhile."""
    if not is_zip:
        try:
            os.fchmod(work.fd, _umask_mode(0o777))
            if not work.named(work.path):
                raise StorageError(f"the snapshot's temporary directory {work.path} was moved or replaced while "
                                   "the snapshot was written (someone else can rename names there)")
            os.rename(work.path, path)  # (fails onto anything but an empty directory: nothing is followed)
        except BaseException:
            work.remove()
            raise
        moved = not work.named(path)
        os.close(work.fd)
        if moved:
            raise StorageError(f"{path} is not the snapshot just written there: someone else can rename names in "
                               "its directory; write snapshots where only you can")
        _fsync_parent(path)
        return
    try:
        fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".partial-", suffix=".zip",
                                   dir=os.path.dirname(os.path.abspath(path)))
    except OSError:
        work.remove()
        raise
    try:
        with os.fdopen(fd, "wb") as f:
            _zip_dir(work.root, f)  # (read through the descriptor: whatever was planted at the name is not)
            os.fchmod(f.fileno(), _umask_mode(0o666))
            zipped = os.fstat(f.fileno())
        os.link(tmp, path)  # EEXIST rather than replace: whatever appeared at DEST stays as it was
    finally:
        os.unlink(tmp)
        work.remove()
    st = os.lstat(path)
    if (st.st_dev, st.st_ino) != (zipped.st_dev, zipped.st_ino):
        raise StorageError(f"{path} is not the snapshot just written there: someone else can rename names in its "
                           "directory; write snapshots where only you can")
    _fsync_parent(path)


def _zip_dir(src: str, dst: Any) -> None:
    """Pack a finished snapshot directory into an uncompressed zip (a Zarr ZipStore)."""
    with zipfile.ZipFile(dst, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as z:
        for dirpath, _, files in os.walk(src):
            for f in sorted(files):
                full = os.path.join(dirpath, f)
                z.write(full, os.path.relpath(full, src))
    dst.flush()
    os.fsync(dst.fileno())


def _fsync_parent(path: str) -> None:
    fd = os.open(os.path.dirname(os.path.abspath(path)) or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_snapshot(src: str) -> Any:
    import zarr

    src = str(src)
    path = src[len("file://"):] if src.startswith("file://") else src
    if _is_local(src):
        if not os.path.exists(path):
            raise InvalidArgument(f"no snapshot at {path}")
        if path.endswith(".zip"):
            _regular_file(path, None)
            _check_zip(path)
            store = zarr.storage.ZipStore(path, mode="r")
        else:
            if os.path.isdir(path):
                _regular_file(os.path.join(path, "zarr.json"), _MAX_INDEX_BYTES)
            store = zarr.storage.LocalStore(path, read_only=True)
    else:
        store = _url_store(src, read_only=True)
    # (format 3 only, as tierstore writes: zarr would otherwise also read a format 2
    # ``.zgroup``/``.zattrs``/``.zmetadata``, files none of these checks has seen)
    return zarr.open_group(store, mode="r", zarr_format=3)


_MAX_INDEX_BYTES = 2 << 30
"""The most a snapshot's root ``zarr.json`` (its index: a few hundred bytes an object) may hold."""


def _url_store(url: str, *, read_only: bool) -> Any:
    """The Zarr store at a URL (``s3://``, ``gs://``, ...): fsspec's filesystem for its
    scheme, refused with what to install where that package is missing."""
    import zarr

    try:
        return zarr.storage.FsspecStore.from_url(url, read_only=read_only)
    except ImportError as e:
        raise InvalidArgument(f"{url.split('://', 1)[0]}:// needs a package that is not installed: {e}") from None
    except ValueError as e:
        raise InvalidArgument(f"{url} is not a URL a snapshot can use: {e}") from None


def _regular_file(path: str, most: int | None) -> None:
    """Refuse a file of a local snapshot that is not a regular file (a FIFO would hang the
    read, a link to ``/dev/zero`` never end it) or is larger than ``most``."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return  # (zarr says what is missing)
    if not stat.S_ISREG(st.st_mode):
        raise InvalidArgument(f"{path} is not a regular file; the snapshot is damaged and was not restored")
    if most is not None and st.st_size > most:
        raise InvalidArgument(f"{path} holds {st.st_size} bytes, more than a snapshot's metadata needs")


_ZIP_RATIO = 16
"""The most a zip entry of a snapshot may expand by (tierstore writes them stored, 1:1)."""


def _check_zip(path: str) -> None:
    """Refuse a zip that could not be one of tierstore's snapshots before zarr reads it: an
    entry that is not a regular file, or that expands far beyond its stored size (a zip
    bomb; tierstore stores entries uncompressed)."""
    try:
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                if info.is_dir():
                    continue
                if stat.S_IFMT(info.external_attr >> 16) not in (0, stat.S_IFREG):
                    raise InvalidArgument(f"{path}: entry {info.filename[:80]!r} is not a regular file")
                if info.file_size > _ZIP_RATIO * max(info.compress_size, 1 << 20):
                    raise InvalidArgument(f"{path}: entry {info.filename[:80]!r} expands from {info.compress_size} "
                                          f"to {info.file_size} bytes; tierstore's snapshots store entries as they are")
    except zipfile.BadZipFile as e:
        raise InvalidArgument(f"{path} is not a readable zip: {e}") from None


def snapshot_namespace(src: str) -> str:
    """The namespace a snapshot says it was taken from (checked), for a restore that names
    none; the daemon still decides whether the caller may enter it."""
    _, attrs = _open_complete(src)
    ns = attrs.get("namespace")
    try:
        return validate_namespace(ns)
    except InvalidArgument:
        raise InvalidArgument(f"{src} names no valid namespace ({str(ns)[:80]!r}); pass --namespace") from None


def _open_complete(src: str) -> tuple[Any, dict[str, Any]]:
    try:
        root = open_snapshot(src)
        attrs = dict(root.attrs)
    except InvalidArgument:
        raise
    except Exception as e:  # not a Zarr store at all
        raise InvalidArgument(f"{src} is not a readable snapshot: {type(e).__name__}: {e}") from None
    if attrs.get("complete") is not True:
        raise InvalidArgument(f"{src} is an incomplete snapshot (interrupted?); it cannot be restored")
    return root, attrs


def restore(target: Objects, src: str, *, overwrite: bool = False, progress: bool | None = None) -> dict[str, Any]:
    """Put every object of the snapshot ``src`` into ``target`` (a ``Pool``, or a store's view
    of a namespace; its namespace is the target, whatever the snapshot's attributes say).

    Nothing in the snapshot is trusted: every entry is checked (a valid key, a known
    dtype, ``nbytes`` that agrees with shape and dtype, paths that stay inside the
    snapshot, chunk files that exist and hold the bytes, CRC32C) before the first
    write. Refuses an incomplete snapshot and, unless ``overwrite``, keys the namespace
    already has. Every refusal is an ``InvalidArgument`` (or ``ChecksumMismatch``) naming
    the entry.
    """
    root, attrs = _open_complete(src)
    local_dir = _local_dir(src)
    index = _checked_index(attrs, src, local_dir)
    if not overwrite:
        have = set(target.keys())
        clash = [e["key"] for e in index if e["key"] in have]
        if clash:
            raise KeyExists(f"the namespace already has {len(clash)} of these keys (e.g. {clash[0]!r}); "
                            "restore with overwrite=True (tierstore restore --overwrite) to replace them")
    packs: dict[int, Any] = {}
    # every object's bytes read and verified before the first write (a refusal after a
    # partial restore, or after replacing objects, could not be undone)
    for e in index:
        _read_checked(root, e, packs, local_dir, src)
    packs.clear()
    # bookkeeping keys (an optimizer's progress records, ``_BOOKKEEPING``) go last, and with
    # overwrite the target's own go first: a restore interrupted part-way never leaves a
    # record that names state only partly restored
    index = [e for e in index if not _bookkeeping(e["key"])] + [e for e in index if _bookkeeping(e["key"])]
    if overwrite:
        for e in index:
            h = target.lookup(e["key"]) if _bookkeeping(e["key"]) else None
            if h is not None:
                target.free(h)
    prog = _Progress(len(index), sum(e["nbytes"] for e in index), "restore", progress)
    done: list[Any] = []
    # arrays are read a few objects ahead on worker threads, overlapping disk reads with puts
    pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="tierstore-restore")
    ahead: dict[int, Future] = {}

    def fetch(i: int) -> None:
        if i < len(index) and i not in ahead and "pack" not in index[i]:
            ahead[i] = pool.submit(_read_checked, root, index[i], {}, local_dir, src)

    current = None  # the entry being put (an interrupt may come after the target made it, before its handle)
    try:
        for i in range(6):
            fetch(i)
        for i, e in enumerate(index):
            current = e
            fetch(i + 6)
            u8 = ahead.pop(i).result() if i in ahead else _read_checked(root, e, packs, local_dir, src)
            spec = TensorSpec(e["kind"], e["dtype"], tuple(e["shape"]), e["nbytes"])
            done.append(target.put(_tensor(u8, spec, owned="pack" not in e), key=e["key"], replace=overwrite,
                                   durable=bool(e.get("durable"))))
            prog.update(e["nbytes"])
    except BaseException as err:
        # changed since it was verified, a full pool or disk, the daemon gone, an interrupt:
        # without overwrite, what this restore put is taken back (as far as the target still answers)
        if not overwrite:
            kept = _take_back(target, done + _made_unanswered(target, current, done))
            if kept and isinstance(err, TierstoreError):
                raise type(err)(f"{err.message}; {kept} of the {len(done)} objects this restore put could not be "
                                "taken back (free them, or restore with --overwrite)") from None
            raise
        if done and not isinstance(err, TierstoreError):  # (an interrupt: it goes on as one, saying this)
            err.add_note(f"tierstore restore: interrupted with {len(done)} of {len(index)} objects already written "
                         "over their keys (--overwrite: their values before are gone), the rest not; restore again")
        if not done or not isinstance(err, TierstoreError):
            raise
        # (keys written over cannot be given their old values back: say so, not "not restored")
        cause = f"{src} changed while it was restored" if isinstance(err, (ChecksumMismatch, InvalidArgument)) \
            else "the restore failed"
        raise type(err)(f"{cause} ({str(err)[:200]}): {len(done)} of {len(index)} objects were already written "
                        "over their keys (--overwrite: their values before are gone), the rest were not; restore "
                        "again (from a snapshot nothing writes to)") from None
    finally:
        for f in ahead.values():
            f.cancel()
        pool.shutdown(wait=True)
        prog.done()
    return {"objects": len(index), "bytes": prog.bytes, "seconds": time.monotonic() - prog.t0,
            "namespace": attrs.get("namespace")}


_BOOKKEEPING = ("_progress", "_progress.prev", "_torn", "_owner")
"""Last key components of records about the other keys under their prefix (an offloaded
optimizer's progress records, its torn-step marker, an owner's mark)."""


def _bookkeeping(key: str) -> bool:
    return key.rsplit("/", 1)[-1] in _BOOKKEEPING


def _made_unanswered(target: Objects, entry: dict[str, Any] | None, done: list[Any]) -> list[Any]:
    """The object of ``entry`` (the one being put when the restore stopped) if the target
    made it though its handle never came back (a restore without overwrite: the key was
    free before), so it is taken back with the rest."""
    if entry is None:
        return []
    try:
        h = target.lookup(entry["key"])
    except Exception:  # noqa: BLE001 - the target gone: nothing more to take back
        return []
    return [h] if h is not None and h not in done else []


def _take_back(target: Objects, handles: list[Any]) -> int:
    """Free what a failed restore put; how many could not be freed (the target gone)."""
    kept = 0
    for h in handles:
        try:
            target.free(h)
        except (NotFound, StaleHandle):
            pass  # freed or replaced by someone else meanwhile
        except Exception:  # noqa: BLE001 - the daemon gone, a full journal: count it, free the rest
            kept += 1
    return kept


_FLOAT8 = {"float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"}


def _checked_index(attrs: dict[str, Any], src: str, local_dir: str | None) -> list[dict[str, Any]]:
    """The snapshot's index, every entry checked against itself (not yet against the bytes)."""
    index = attrs.get("objects")
    if not isinstance(index, list):
        raise InvalidArgument(f"{src} is not a valid snapshot: it has no list of objects; nothing was restored")
    seen: set[str] = set()
    last_pack = 0
    for i, e in enumerate(index):
        try:
            _check_entry(e, seen, local_dir)
            if "pack" in e:  # in pack order, as written: one read of each pack, whatever the index's length
                if e["pack"] < last_pack:
                    raise InvalidArgument(f"pack {e['pack']} after pack {last_pack}: a snapshot's index lists its "
                                          "packs in order")
                last_pack = e["pack"]
        except InvalidArgument as err:
            key = e.get("key") if isinstance(e, dict) else None
            raise InvalidArgument(f"{src} is not a valid snapshot: entry {i}"
                                  f"{f' ({key!r})' if isinstance(key, str) else ''}: {err.message}; "
                                  "nothing was restored") from None
    return index


def _is_int(v: Any, lo: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


def _check_entry(e: Any, seen: set[str], local_dir: str | None) -> None:
    if not isinstance(e, dict):
        raise InvalidArgument("not a map")
    key = e.get("key")
    if not isinstance(key, str):
        raise InvalidArgument("no key")
    validate_key(key)
    if key in seen:
        raise InvalidArgument("a second entry for the same key")
    seen.add(key)
    kind, dtype = e.get("kind"), e.get("dtype")
    if kind not in ("torch", "numpy") or not isinstance(dtype, str):
        raise InvalidArgument(f"kind {str(kind)[:20]!r} / dtype {str(dtype)[:20]!r} is not a tensor type")
    if (kind == "numpy" and dtype not in _NUMPY_NAMES) or (dtype.startswith("float8") and dtype not in _FLOAT8):
        raise InvalidArgument(f"unknown {kind} dtype {dtype[:20]!r}")
    item = _itemsize(dtype)
    shape, nbytes = e.get("shape"), e.get("nbytes")
    if not (isinstance(shape, list) and len(shape) <= 64 and all(_is_int(d) for d in shape)):
        raise InvalidArgument("shape is not a list of sizes")
    want = item
    for d in shape:
        want *= d
    if nbytes != want:
        raise InvalidArgument(f"nbytes {str(nbytes)[:20]} disagrees with shape {shape} of {dtype} ({want} bytes)")
    if not _is_int(e.get("crc32c")) or e["crc32c"] >= 1 << 32:
        raise InvalidArgument("no CRC32C")
    if "durable" in e and not isinstance(e["durable"], bool):
        raise InvalidArgument("durable is not a bool")
    if nbytes == 0:
        return
    if "pack" in e:
        if not (_is_int(e["pack"]) and _is_int(e.get("offset"))) or "array" in e:
            raise InvalidArgument("bad pack location")
        return
    path = e.get("array")
    if not isinstance(path, str) or not path or path.startswith("/") or "\\" in path or "\0" in path \
            or any(p in ("", ".", "..") for p in path.split("/")):
        raise InvalidArgument(f"array path {str(path)[:80]!r} does not stay inside the snapshot")
    if local_dir is not None:
        _inside(local_dir, path)


def _inside(local_dir: str, rel: str) -> str:
    """``local_dir/rel``, refused if it (symbolic links resolved) leaves the snapshot."""
    full = os.path.join(local_dir, rel)
    base = os.path.realpath(local_dir)
    if not os.path.realpath(full).startswith(base + os.sep):
        raise InvalidArgument(f"{rel[:80]!r} leads outside the snapshot")
    return full


def _read_checked(root: Any, e: dict[str, Any], packs: dict[int, Any], local_dir: str | None,
                  src: str) -> np.ndarray:
    """``_read``, every failure a one-line typed error naming the object."""
    try:
        return _read(root, e, packs, local_dir)
    except TierstoreError:
        raise
    except Exception as err:  # a missing file, unreadable metadata: the snapshot is damaged
        raise InvalidArgument(f"{src}: the bytes of {e['key']!r} cannot be read ({type(err).__name__}: "
                              f"{str(err)[:200]}); the snapshot is damaged and was not restored") from None


def _local_dir(src: str) -> str | None:
    path = src[len("file://"):] if src.startswith("file://") else src
    return path if _is_local(src) and os.path.isdir(path) else None


def _read_array(root: Any, path: str, local_dir: str | None, limit: int) -> np.ndarray:
    """An array's bytes (C order, padding dropped): straight from the chunk files of a
    local directory in tierstore's own layout, through zarr otherwise. An array of more
    than ``limit`` bytes is refused before anything is allocated for it."""
    if local_dir is not None:
        meta_path = _inside(local_dir, path + "/zarr.json")
        _regular_file(meta_path, 1 << 20)
        with open(meta_path) as f:
            meta = json.load(f)
        grid = meta.get("chunk_grid", {}).get("configuration", {}).get("chunk_shape")
        shape = meta.get("shape")
        if meta.get("codecs") == [{"name": "bytes", "configuration": {"endian": "little"}}] and \
                isinstance(shape, list) and shape and all(_is_int(d) for d in shape) and \
                isinstance(grid, list) and len(grid) == len(shape) and _is_int(grid[0], 1) and grid[1:] == shape[1:]:
            chunk0 = grid[0]
            item = np.dtype(str(meta["data_type"])).itemsize
            total = math.prod(shape) * item  # (Python ints: a hostile shape cannot wrap around)
            if total > limit:
                raise InvalidArgument(f"array {path!r} holds {total} bytes, its entry {limit}")
            per = chunk0 * (total // shape[0]) if shape[0] else 0
            if -(-shape[0] // chunk0) > max(1, -(-total // max(per, 1))):
                raise InvalidArgument(f"array {path!r} is split into more chunks than its {total} bytes need")
            zeros = ["/".join("0" for _ in shape[1:])] if len(shape) > 1 else []
            files = [_inside(local_dir, "/".join([path, "c", str(k), *zeros]))
                     for k in range(max(1, -(-shape[0] // chunk0)))]
            if any(os.stat(p).st_size < min(per, total - k * per) for k, p in enumerate(files)):
                raise ChecksumMismatch(f"a chunk of {path} is truncated")
            out = aligned_empty(total)
            for k, p in enumerate(files):
                n = min(per, total - k * per)
                if _read_chunk_file(p, out[k * per:k * per + n]) != n:
                    raise ChecksumMismatch(f"chunk {k} of {path} is truncated")
            return out
    if local_dir is not None:
        _plain_files(local_dir, path, limit)
    arr = root[path]
    codecs = getattr(arr.metadata, "codecs", None)
    if not codecs or any(type(c).__name__ != "BytesCodec" for c in codecs):
        # a compressor could expand a small file far past what the entry says
        names = ", ".join(type(c).__name__ for c in codecs or ())
        raise InvalidArgument(f"array {path!r} is compressed or filtered ({names}); tierstore snapshots store each "
                              "array's bytes as they are")
    if math.prod(arr.shape) * arr.dtype.itemsize > limit:
        raise InvalidArgument(f"array {path!r} holds more bytes than its entry says")
    chunks = math.prod(-(-s // max(c, 1)) for s, c in zip(arr.shape, arr.chunks))
    if chunks > max(1, math.prod(arr.shape)):  # (each chunk holds at least one of its elements)
        raise InvalidArgument(f"array {path!r} is split into more chunks ({chunks}) than it has elements")
    return np.ascontiguousarray(arr[...]).reshape(-1).view(np.uint8)


def _plain_files(local_dir: str, path: str, limit: int) -> None:
    """Before zarr reads an array of a local snapshot: every file under it a regular file
    inside the snapshot (a link leading out, a FIFO, a device are refused) and none larger
    than the array's bytes could need."""
    top = _inside(local_dir, path)
    for dirpath, dirs, files in os.walk(top):
        for name in dirs + files:
            full = os.path.join(dirpath, name)
            st = os.lstat(full)
            if stat.S_ISLNK(st.st_mode):
                _inside(local_dir, os.path.relpath(full, local_dir))
                st = os.stat(full)
            if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                raise InvalidArgument(f"{os.path.relpath(full, local_dir)[:80]!r} in the snapshot is not a regular "
                                      "file")
            if stat.S_ISREG(st.st_mode) and st.st_size > limit + (1 << 20):
                raise InvalidArgument(f"{os.path.relpath(full, local_dir)[:80]!r} holds {st.st_size} bytes, more "
                                      f"than the {limit} its array needs")


def _read_chunk_file(path: str, dst: np.ndarray) -> int:
    """Fill ``dst`` from the start of a chunk file: the page-aligned head with O_DIRECT
    (no page-cache copy), the rest buffered. Returns the bytes read."""
    head = dst.nbytes // PAGE * PAGE if dst.ctypes.data % PAGE == 0 and dst.nbytes >= PAGE else 0
    got = 0
    if head:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
        except OSError:
            head = 0
        else:
            try:
                mv = memoryview(dst[:head])
                while got < head:
                    n = os.preadv(fd, [mv[got:]], got)
                    if n <= 0:
                        break
                    got += n
            finally:
                os.close(fd)
            if got < head:
                return got
    with open(path, "rb") as f:
        f.seek(got)
        got += f.readinto(memoryview(dst)[got:])
    return got


def _read(root: Any, e: dict[str, Any], packs: dict[int, Any], local_dir: str | None = None) -> np.ndarray:
    if e["nbytes"] == 0:
        u8 = np.empty(0, np.uint8)  # an empty object has no bytes in the snapshot
    elif "pack" in e:
        arr = packs.get(e["pack"])
        if arr is None:
            packs.clear()  # one pack (<= 64 MiB) in memory at a time; the index is in pack order
            arr = packs[e["pack"]] = _read_array(root, f"_packs/{e['pack']}", local_dir, _PACK_BYTES)
        u8 = arr[e["offset"]:e["offset"] + e["nbytes"]]
    else:
        u8 = _read_array(root, e["array"], local_dir, e["nbytes"])[:e["nbytes"]]
    if u8.nbytes != e["nbytes"] or crc32c(u8) != e["crc32c"]:
        raise ChecksumMismatch(f"object {e['key']!r} in the snapshot is corrupted (CRC32C mismatch); "
                               "the snapshot was not restored")
    return u8


def _tensor(u8: np.ndarray, spec: TensorSpec, owned: bool = False) -> Any:
    """A tensor over the bytes; copied unless ``u8`` is a buffer of its own (not a pack slice)."""
    if owned and u8.flags.c_contiguous and u8.ctypes.data % 64 == 0:
        return from_bytes(u8, spec)
    buf = np.empty(spec.nbytes, np.uint8)
    buf[:] = u8
    return from_bytes(buf, spec)
