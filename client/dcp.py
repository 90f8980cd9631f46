"""Distributed checkpoints (``torch.distributed.checkpoint``, DCP) of an offloaded
optimizer that stream between the pool and the checkpoint's files.

``dcp_save(model, optimizer, path)`` writes what ``dcp.save({"model": msd, "optim": osd})``
of ``get_state_dict(model, optimizer)`` writes, the same files and metadata (a plain
``dcp.load`` reads them, and ``dcp_load`` reads a plain save), without the optimizer
state ever being whole in the rank's memory:

- the state dict holds placeholders for the state tensors (``lazy_state_dict``: the
  shape and dtype of each pool object, over no memory);
- ``PoolSavePlanner.resolve_data``, which the writer calls for one tensor at a time as
  it writes it, fetches that tensor from the pool; the writer drops it once written;
- ``StreamingWriter`` is a ``FileSystemWriter`` that closes a file every ``file_bytes``
  of tensor data: torch 2.13's writer keeps each tensor it has written to a file
  referenced until that file is closed, so one file per rank (its default) would end
  up holding the whole state after all. At most about one file's worth (and one
  tensor) of state is in memory at a time (``StreamStats`` counts it).

``dcp_load(model, optimizer, path)`` is the way back. A fresh optimizer first gets its
state (what ``get_state_dict`` would make with a zero-gradient step over every parameter
at once) a bucket at a time (``make_state``); then ``PoolLoadPlanner.resolve_tensor``
gives the reader a buffer for each placeholder's shard (the pieces of a resharded
tensor land in it), and ``commit_tensor`` puts it into the pool (every version kept)
and drops it as soon as the last piece is in. Resharding N → M ranks works as DCP does
it. Models' parameters are ordinary tensors and go as DCP moves them.

Only ``StateDictOptions()`` with its defaults (sharded, nested) is streamed; other
options go through ``get_state_dict`` + ``dcp.save`` as before.
"""

from __future__ import annotations

import os
import queue
import weakref
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem, WriteItem, WriteItemType
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_model_state_dict)

from .optimizer.offloaded import OffloadedOptimizer
from .optimizer.state_dict import Placeholder, Placeholders

__all__ = ["dcp_save", "dcp_load", "PoolSavePlanner", "PoolLoadPlanner", "StreamingWriter", "StreamStats",
           "DEFAULT_FILE_BYTES"]

DEFAULT_FILE_BYTES = 64 << 20
"""Tensor bytes per checkpoint file that ``StreamingWriter`` writes before closing it."""


class StreamStats:
    """State bytes fetched from (or read for) the pool and still referenced: now, at
    most, and in all. A tensor counts from its fetch until it is garbage (the writer or
    the planner dropped it)."""

    def __init__(self) -> None:
        self.live_bytes = 0
        self.peak_bytes = 0
        self.total_bytes = 0
        self.tensors = 0

    def track(self, t: torch.Tensor) -> torch.Tensor:
        n = t.untyped_storage().nbytes()
        self.live_bytes += n
        self.total_bytes += n
        self.tensors += 1
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(t.untyped_storage(), self._gone, n)
        return t

    def _gone(self, n: int) -> None:
        self.live_bytes -= n


def _by_fqn(flat: dict[str, Any], ph: Placeholders) -> dict[str, Placeholder]:
    """Flattened state dict key -> the placeholder that stands there."""
    out = {}
    for fqn, v in flat.items():
        found = ph.find(v)
        if found is not None:
            out[fqn] = found
    return out


class PoolSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, but a placeholder's data is fetched from the pool
    when the writer asks for it (``resolve_data``), not before."""

    def __init__(self, placeholders: Placeholders, **kw: Any) -> None:
        super().__init__(**kw)
        self.placeholders = placeholders
        self.stats = StreamStats()
        self._lazy: dict[str, Placeholder] = {}

    def set_up_planner(self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        self._lazy = _by_fqn(self.state_dict, self.placeholders)

    def resolve_data(self, write_item: WriteItem) -> Any:
        ph = self._lazy.get(write_item.index.fqn)
        if ph is None:
            return super().resolve_data(write_item)
        return self.stats.track(self.placeholders.fetch(ph))


class PoolLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but each placeholder's shard is read into a buffer of
    its own, put into the pool (every version kept) once its last piece is in, and
    dropped."""

    def __init__(self, placeholders: Placeholders, **kw: Any) -> None:
        super().__init__(**kw)
        self.placeholders = placeholders
        self.stats = StreamStats()
        self._lazy: dict[str, Placeholder] = {}
        self._buffers: dict[str, torch.Tensor] = {}
        self._left: dict[str, int] = {}  # fqn -> elements still to come

    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        self._lazy = _by_fqn(self.state_dict, self.placeholders)

    def create_local_plan(self) -> Any:
        plan = super().create_local_plan()
        for item in plan.items:
            if item.type == LoadItemType.TENSOR and item.dest_index.fqn in self._lazy:
                fqn = item.dest_index.fqn
                self._left[fqn] = self._left.get(fqn, 0) + int(torch.Size(item.lengths).numel())
        return plan

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        fqn = read_item.dest_index.fqn
        ph = self._lazy.get(fqn)
        if ph is None:
            return super().resolve_tensor(read_item)
        buf = self._buffers.get(fqn)
        if buf is None:
            buf = self._buffers[fqn] = self.stats.track(torch.empty(ph.shape, dtype=ph.dtype))
        return self.transform_tensor(read_item, buf)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        fqn = read_item.dest_index.fqn
        ph = self._lazy.get(fqn)
        if ph is None:
            return super().commit_tensor(read_item, tensor)
        self._left[fqn] -= tensor.numel()
        if self._left[fqn] == 0:  # the shard is whole: into the pool, and out of memory
            self.placeholders.states.put_both(ph.gi, ph.pi, ph.name, self._buffers.pop(fqn))
        return None


class StreamingWriter(FileSystemWriter):
    """A ``FileSystemWriter`` that closes a file after every ``file_bytes`` of tensor data
    (a tensor larger than that gets a file of its own), so the tensors it keeps
    referenced until a file closes are at most about that many bytes. Each rank's files
    are ``__RANK_N.distcp`` as with ``single_file_per_rank=False``; the metadata and any
    reader are DCP's own."""

    def __init__(self, path: str | os.PathLike, *, file_bytes: int = DEFAULT_FILE_BYTES, **kw: Any) -> None:
        if not isinstance(file_bytes, int) or file_bytes <= 0:
            raise ValueError(f"file_bytes must be a positive int, got {file_bytes!r}")
        super().__init__(path, **kw)
        self.file_bytes = file_bytes

    def write_data(self, plan: Any, planner: Any) -> Any:
        from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _item_size

        prefix = plan.storage_data.prefix
        files: list[list[WriteItem]] = [[]]
        size = 0
        blobs = [wi for wi in plan.items if wi.type == WriteItemType.BYTE_IO]
        for wi in [wi for wi in plan.items if wi.type != WriteItemType.BYTE_IO]:
            n = _item_size(wi)
            if files[-1] and size + n > self.file_bytes:
                files.append([])
                size = 0
            files[-1].append(wi)
            size += n
        files[0] = blobs + files[0]
        file_queue: queue.Queue = queue.Queue()
        for i, items in enumerate(f for f in files if f):
            name = f"{prefix}{i}{DEFAULT_SUFFIX}"
            file_queue.put((self.fs.concat_path(self.path, name), name, items))
        return self._write_data(planner, file_queue)


def _check(optimizer: Any, options: StateDictOptions | None) -> None:
    if not isinstance(optimizer, OffloadedOptimizer):
        raise TypeError(f"dcp_save / dcp_load stream an offloaded optimizer's state, got "
                        f"{type(optimizer).__name__}; use get_state_dict + dcp.save for others")
    if options is not None and (options.full_state_dict or options.cpu_offload or options.flatten_optimizer_state_dict):
        raise ValueError("dcp_save / dcp_load stream the sharded, nested state dict only (no full_state_dict, "
                         "cpu_offload or flatten_optimizer_state_dict); for those use get_state_dict + dcp.save "
                         "/ dcp.load + set_state_dict")


def dcp_save(model: torch.nn.Module, optimizer: OffloadedOptimizer, checkpoint_id: str | os.PathLike, *,
             process_group: Any = None, file_bytes: int = DEFAULT_FILE_BYTES,
             options: StateDictOptions | None = None, key: str | None = None) -> StreamStats:
    """Save ``{"model": ..., "optim": ...}`` as ``dcp.save`` of ``get_state_dict(model,
    optimizer)`` does, streaming the optimizer state from the pool into the files (see
    the module docstring); ``key``: nested under it, ``{key: {"model": ..., "optim": ...}}``
    (a pipeline stage's own name, so stages' equal parameter names stay apart). Collective
    like ``dcp.save``. Returns this rank's ``StreamStats`` (its ``peak_bytes``: the most
    optimizer state in memory at once)."""
    _check(optimizer, options)
    with optimizer.lazy_state_dict() as ph:
        msd, osd = get_state_dict(model, optimizer, options=options)
    planner = PoolSavePlanner(ph)
    sd = {"model": msd, "optim": osd}
    dcp.save(sd if key is None else {key: sd}, storage_writer=StreamingWriter(checkpoint_id, file_bytes=file_bytes),
             planner=planner, process_group=process_group)
    return planner.stats


def dcp_load(model: torch.nn.Module, optimizer: OffloadedOptimizer, checkpoint_id: str | os.PathLike, *,
             process_group: Any = None, options: StateDictOptions | None = None, key: str | None = None) -> StreamStats:
    """Load a checkpoint ``dcp_save`` (or ``dcp.save`` of ``get_state_dict``) wrote, on
    any number of ranks (``key`` as it was saved with): the model as
    ``set_model_state_dict`` loads it, the optimizer state read one shard at a time
    straight into the pool (see the module docstring), at the saved step. Collective
    like ``dcp.load``. Returns this rank's ``StreamStats``."""
    _check(optimizer, options)
    optimizer.make_state()  # get_state_dict's zero-gradient step, a bucket at a time
    with optimizer.lazy_state_dict() as ph:
        msd, osd = get_state_dict(model, optimizer, options=options)
    optimizer.progress.forget()  # the state is replaced in place: until it is whole, a resume starts fresh
    planner = PoolLoadPlanner(ph)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd if key is None else {key: sd}, checkpoint_id=checkpoint_id, planner=planner,
             process_group=process_group)
    set_model_state_dict(model, sd["model"], options=options)
    optimizer.loaded_in_place(ph)
    return planner.stats
