"""Durable export and import of a namespace as a Zarr v3 group, readable without tierstore.

Layout of a snapshot:

- root attributes: ``tierstore_version``, ``namespace``, ``complete`` (written last),
  ``objects`` (an index entry per object: key, kind, dtype, shape, nbytes, crc32c,
  and where its bytes are);
- an object of 1 MiB or more: one array at ``KEY/~data`` (key segments escaped), with
  its metadata as attributes; dtypes Zarr lacks (bfloat16, float8, complex32) are
  stored as unsigned integers of the same width, the true dtype in ``dtype``;
- smaller objects: packed back to back into ``_packs/N`` uint8 arrays (so 500 small
  tensors are not 500 files); the index gives each one's pack, offset and length.

Snapshots stream one object at a time. A local directory or zip is written under a
temporary name and renamed into place when complete; other URLs get ``complete``
only at the end. ``restore`` refuses anything not complete and verifies every
object's CRC32C before it writes a byte.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
import zipfile
from typing import Any, Callable

import numpy as np

from ._version import __version__
from .checksum import crc32c
from .errors import ChecksumMismatch, InvalidArgument, KeyExists
from .tensors import TensorSpec, from_bytes, to_bytes

__all__ = ["snapshot", "restore", "open_snapshot", "SMALL_BYTES"]

SMALL_BYTES = 1 << 20
_PACK_BYTES = 64 << 20
_PACK_CHUNK = 4 << 20
_NUMPY_NAMES = {"bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16",
                "float32", "float64", "complex64", "complex128"}
_SAFE = re.compile(r"[^A-Za-z0-9._-]")


def _escape_segment(seg: str) -> str:
    out = _SAFE.sub(lambda m: "".join(f"~{b:02x}" for b in m.group().encode()), seg)
    if out in ("", ".", "..") or out.startswith("__"):
        out = "~" + out.encode().hex()
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


def _is_local(dest: str) -> bool:
    return "://" not in dest or dest.startswith("file://")


def snapshot(source: Any, dest: str, *, namespace: str, prefix: str = "",
             progress: bool | None = None) -> dict[str, Any]:
    """Write every object of ``source`` (a Store or Client, in ``namespace``) under
    ``prefix`` to the Zarr v3 store ``dest`` (a directory, ``*.zip``, or a URL)."""
    import zarr

    dest = str(dest)
    entries = source.ls(prefix=prefix)
    local = _is_local(dest)
    path = dest[len("file://"):] if dest.startswith("file://") else dest
    is_zip = local and path.endswith(".zip")
    if local and os.path.exists(path):
        raise InvalidArgument(f"{path} already exists; choose a new destination or remove it")
    tmp = f"{path}.partial-{os.getpid()}" if local else None
    work = tmp if not is_zip else tmp + ".d"
    store = zarr.storage.LocalStore(work) if local else zarr.storage.FsspecStore.from_url(dest)
    root = zarr.open_group(store, mode="w", zarr_format=3)
    prog = _Progress(len(entries), sum(e["nbytes"] for e in entries), "snapshot", progress)
    index: list[dict[str, Any]] = []
    pack_n, pack_buf, pack_used = 0, np.empty(0, np.uint8), 0

    def flush_pack() -> None:
        nonlocal pack_n, pack_used
        if pack_used:
            arr = root.create_array(f"_packs/{pack_n}", shape=(pack_used,), dtype="uint8",
                                    chunks=(min(_PACK_CHUNK, pack_used),), compressors=None)
            arr[...] = pack_buf[:pack_used]
            pack_n += 1
            pack_used = 0

    try:
        for e in entries:
            data = source.get(e["handle"])
            u8, spec = to_bytes(data)
            entry = {"key": e["key"], "kind": spec.kind, "dtype": spec.dtype, "shape": list(spec.shape),
                     "nbytes": spec.nbytes, "crc32c": crc32c(u8), "durable": bool(e.get("durable"))}
            if spec.nbytes < SMALL_BYTES:
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
                # uncompressed (tensors of floats barely compress), metadata written once with the array
                arr = root.create_array(apath, shape=tuple(spec.shape) or (1,), dtype=sdt,
                                        chunks=_chunks(spec.shape, item), compressors=None,
                                        attributes={**entry, "tierstore_version": __version__,
                                                    "zero_d": not spec.shape})
                arr[...] = flat
                entry["array"] = apath
            index.append(entry)
            prog.update(spec.nbytes)
        flush_pack()
        # written last: a snapshot without it is incomplete and restore refuses it
        root.attrs.update({"tierstore_version": __version__, "namespace": namespace, "objects": index,
                           "complete": True})
    except BaseException:
        if local:
            shutil.rmtree(work, ignore_errors=True)
        raise
    finally:
        prog.done()
    if local:
        if is_zip:
            _zip_dir(work, tmp)
            shutil.rmtree(work)
        os.replace(tmp, path)
        _fsync_parent(path)
    return {"objects": len(index), "bytes": prog.bytes, "seconds": time.monotonic() - prog.t0, "dest": dest}


def _chunks(shape: list[int] | tuple[int, ...], item: int) -> tuple[int, ...]:
    """Chunks of about 16 MiB along the first axis."""
    if not shape:
        return (1,)
    row = max(1, int(np.prod(shape[1:])) * item)
    first = max(1, min(shape[0], (16 << 20) // row))
    return (first, *shape[1:])


def _zip_dir(src: str, dst: str) -> None:
    with zipfile.ZipFile(dst, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as z:
        for dirpath, _, files in os.walk(src):
            for f in sorted(files):
                full = os.path.join(dirpath, f)
                z.write(full, os.path.relpath(full, src))
    with open(dst, "rb+") as f:
        os.fsync(f.fileno())


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
        store = zarr.storage.ZipStore(path, mode="r") if path.endswith(".zip") else zarr.storage.LocalStore(
            path, read_only=True)
    else:
        store = zarr.storage.FsspecStore.from_url(src, read_only=True)
    return zarr.open_group(store, mode="r")


def restore(target: Any, src: str, *, overwrite: bool = False, progress: bool | None = None,
            key_exists: Callable[[str], bool] | None = None) -> dict[str, Any]:
    """Put every object of the snapshot ``src`` into ``target`` (a Store or Client).

    Refuses an incomplete snapshot, a corrupted object (named in the error) and,
    unless ``overwrite``, keys the namespace already has — all before writing.
    """
    try:
        root = open_snapshot(src)
    except InvalidArgument:
        raise
    except Exception as e:  # not a Zarr store at all
        raise InvalidArgument(f"{src} is not a readable snapshot: {type(e).__name__}: {e}") from None
    attrs = dict(root.attrs)
    if not attrs.get("complete"):
        raise InvalidArgument(f"{src} is an incomplete snapshot (interrupted?); it cannot be restored")
    index = attrs["objects"]
    if not overwrite:
        have = set(target.keys())
        clash = [e["key"] for e in index if e["key"] in have]
        if clash:
            raise KeyExists(f"the namespace already has {len(clash)} of these keys (e.g. {clash[0]!r}); "
                            "pass --overwrite to replace them")
    # verify everything first: a corrupted snapshot must not half-restore
    packs: dict[int, Any] = {}
    for e in index:
        _read(root, e, packs)
    prog = _Progress(len(index), sum(e["nbytes"] for e in index), "restore", progress)
    try:
        for e in index:
            u8 = _read(root, e, packs)
            spec = TensorSpec(e["kind"], e["dtype"], tuple(e["shape"]), e["nbytes"])
            target.put(_tensor(u8, spec), key=e["key"], replace=overwrite, durable=bool(e.get("durable")))
            prog.update(e["nbytes"])
    finally:
        prog.done()
    return {"objects": len(index), "bytes": prog.bytes, "seconds": time.monotonic() - prog.t0,
            "namespace": attrs.get("namespace")}


def _read(root: Any, e: dict[str, Any], packs: dict[int, Any]) -> np.ndarray:
    if "pack" in e:
        arr = packs.get(e["pack"])
        if arr is None:
            packs.clear()  # one pack (<= 64 MiB) in memory at a time; the index is in pack order
            arr = packs[e["pack"]] = root[f"_packs/{e['pack']}"][...]
        u8 = arr[e["offset"]:e["offset"] + e["nbytes"]]
    else:
        a = root[e["array"]][...]
        u8 = np.ascontiguousarray(a).reshape(-1).view(np.uint8)[:e["nbytes"]]
    if u8.nbytes != e["nbytes"] or crc32c(u8) != e["crc32c"]:
        raise ChecksumMismatch(f"object {e['key']!r} in the snapshot is corrupted (CRC32C mismatch); "
                               "the snapshot was not restored")
    return u8


def _tensor(u8: np.ndarray, spec: TensorSpec) -> Any:
    buf = np.empty(spec.nbytes, np.uint8)
    buf[:] = u8
    return from_bytes(buf, spec)
