"""Which NVMe tier a directory belongs to, and as which of its directories.

Objects are striped over the tier's directories by position (an extent names drive 0,
1, ...), and the journal lives in the first. A start that names the directories in
another order, or fewer or more of them, would read one directory's data as another's,
or find no journal and hand the old objects' space out again. So each directory holds
``tier.id`` (``{"tier": id, "index": i, "dirs": n}``), written when the tier is first
opened in it, and every later start checks it against the position it is named at:
anything else is refused, in one line, before anything is read or written.

A directory without the file is new (its tier's other directories have none either) or
was used by a version that did not write one: its position is taken as given, and
recorded — unless where the journal is says otherwise (a journal anywhere but in the
first directory, or data but no journal in the first: refused).
"""

from __future__ import annotations

import errno
import json
import os
import uuid

from .errors import InvalidArgument
from .files import create_fresh, fsync_dir, open_own

__all__ = ["ID_FILE", "check", "record"]

ID_FILE = "tier.id"
_MAX_BYTES = 4096


def check(dirs: list[str]) -> bool:
    """Check that ``dirs`` are, in this order, the directories of one tier (where they
    record one); ``InvalidArgument`` otherwise. Whether the tier is yet to be recorded
    (``record``, once the journal agrees with the directories as named). Called with
    every directory locked."""
    found = [_read(d) for d in dirs]
    tiers = {f["tier"] for f in found if f is not None}
    n = len(dirs)
    for pos, (d, f) in enumerate(zip(dirs, found)):
        if f is None:
            if tiers:
                raise InvalidArgument(
                    f"NVMe directory {d} has no {ID_FILE}, but the others named with it belong to a tier: a "
                    "tier's directories cannot be added or swapped; start with the nvme_dirs, in the same order, "
                    "that wrote them (a new tier needs empty directories of its own)")
            continue
        if len(tiers) > 1 or f["index"] != pos or f["dirs"] != n:
            raise InvalidArgument(
                f"NVMe directory {d} is directory {f['index'] + 1} of {f['dirs']} of its tier, but this start "
                f"names it as {pos + 1} of {n}{' with directories of another tier' if len(tiers) > 1 else ''}: "
                "start with the nvme_dirs, in the same order, and the nvme_bytes that wrote them")
    if not tiers:
        _check_unrecorded(dirs)
    return not tiers


_JOURNAL_FILES = ("journal.log", "index.ckpt")
"""What only a tier's first directory holds (``tierstore.journal.JOURNAL_FILE``,
``tierstore.checkpoint.CHECKPOINT_FILE``)."""
_DATA_FILE = "data.bin"
"""``tierstore.nvme.DATA_FILE`` (not imported: ``nvme`` imports this module)."""


def _check_unrecorded(dirs: list[str]) -> None:
    """Directories of a tier that recorded none (a version that wrote no ``tier.id``, or the
    files removed): the journal, which lives in the first, says which that is. One named
    after the first that holds a journal, or a first that holds objects' data but neither a
    journal nor a checkpoint, is refused, before anything is written over."""
    for pos, d in enumerate(dirs):
        held = [name for name in _JOURNAL_FILES if os.path.exists(os.path.join(d, name))]
        if pos and held:
            raise InvalidArgument(
                f"NVMe directory {d} holds {held[0]}, which only a tier's first directory has, but this start names "
                f"it as directory {pos + 1} of {len(dirs)}: start with the nvme_dirs, in the same order, that wrote "
                "them")
        if not pos and not held and _holds_data(os.path.join(d, _DATA_FILE)):
            raise InvalidArgument(
                f"NVMe directory {d} holds objects' data ({_DATA_FILE}) but no journal: it is not the first "
                "directory of the tier that wrote it; start with the nvme_dirs, in the same order, that wrote them "
                "(or empty it for a new tier)")


def _holds_data(path: str) -> bool:
    """Whether anything was ever written to the file: space reserved and never written
    (``fallocate``, by a first start stopped before its journal was made) reads as a hole
    to ``SEEK_DATA``; where the filesystem cannot say, any size counts."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    except OSError:
        return True  # (not ours to judge here: opening the tier says what is wrong)
    try:
        os.lseek(fd, 0, os.SEEK_DATA)
        return True
    except OSError as e:
        return e.errno != errno.ENXIO and os.fstat(fd).st_size > 0
    finally:
        os.close(fd)


def record(dirs: list[str]) -> None:
    """Record ``dirs``, in this order, as the directories of one new tier."""
    tier = uuid.uuid4().hex
    for pos, d in enumerate(dirs):
        _write(d, {"tier": tier, "index": pos, "dirs": len(dirs)})


def _read(d: str) -> dict | None:
    path = os.path.join(d, ID_FILE)
    try:
        fd = open_own(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise InvalidArgument(f"cannot read {path}: {e.strerror}") from None
    try:
        raw = os.read(fd, _MAX_BYTES)
    finally:
        os.close(fd)
    try:
        f = json.loads(raw)
        ok = (isinstance(f, dict) and isinstance(f.get("tier"), str) and type(f.get("index")) is int
              and type(f.get("dirs")) is int and 0 <= f["index"] < f["dirs"])
    except ValueError:
        ok = False
    if not ok:
        raise InvalidArgument(f"{path} is damaged ({raw[:80]!r}); it says which tier the directory belongs to, "
                              "and as which directory: write it back as it was, or remove it only if the nvme_dirs "
                              "are named as they were when the tier was made")
    return f


def _write(d: str, f: dict) -> None:
    path = os.path.join(d, ID_FILE)
    tmp = path + ".tmp"
    fd = create_fresh(tmp)
    try:
        os.write(fd, json.dumps(f).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(d)
