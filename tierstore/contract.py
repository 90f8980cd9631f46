"""The contract of a tensor pool: what ``tierstore.Store`` (in process) and
``tierstore.client.Client`` (through the node daemon) both offer, with the same
signatures and return types.

The training hooks (``tierstore.client.torch``), snapshots (``tierstore.snapshot``)
and the sharded snapshot helpers are written against ``Pool``, never against either
class: they call only what is here, and they never tell the two apart by probing for
attributes. A capability only one side has is a small protocol of its own, checked
with ``isinstance`` (``ReportsActivations``). ``tests/test_contract.py`` compares the
signatures of both classes with these, so a change to one side that the other does
not follow fails there.

Each side may add keyword-only parameters with defaults after the contract's own
(``Store``'s ``namespace=``; ``Client.stat``'s ``ops=``): a caller written against the contract never passes them.

This module is the whole surface; it imports nothing at run time, so either side
imports it without importing the other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:
    from .batch import LeaseGroup
    from .names import Handle

__all__ = ["Objects", "Pool", "PoolLease", "ReportsActivations"]


class PoolLease(Protocol):
    """A check-out (``Store``: ``Lease``; ``Client``: ``ClientLease``): ``tensor`` views the
    object's bytes in the host arena until ``release()`` checks it back in."""

    tensor: Any
    """The view (``None`` once released); read-only for an ``r`` check-out through a daemon."""
    handle: Handle
    mode: str
    """``"r"``, ``"rw"`` or ``"w"``."""

    def release(self) -> None:
        """Check the object back in (a second call does nothing)."""

    def give_back(self) -> None:
        """Check the object back in as never written: after ``rw`` it is not dirty, and
        its NVMe copy, if it has one, stays current (a demotion then writes nothing).
        Bytes written through the view may be lost. For a holder that only read."""

    def __enter__(self) -> Any:
        """The tensor; leaving the block releases the lease."""

    def __exit__(self, *exc: Any) -> None: ...


class Objects(Protocol):
    """The part of a pool that snapshots use: one namespace's objects by key. ``Pool``
    has all of it; ``Store.snapshot`` hands over a view of the store bound to another
    namespace that has only this."""

    def put(self, tensor: Any, key: str | None = None, tier: str | None = None, durable: bool = False, *,
            replace: bool = False, wait_s: float = 0.0, ephemeral: bool = False) -> Handle:
        """Store a copy of ``tensor`` (CPU or CUDA torch tensor, NumPy array); its handle."""

    def get(self, handle: Handle | int | str, out: Any = None, *, stream: str = "default") -> Any:
        """A new CPU tensor with the object's bytes, or the bytes copied into ``out``
        (CPU or CUDA: both sides read into a CUDA ``out``)."""

    def free(self, handle: Handle | int | str) -> None: ...

    def keys(self, prefix: str = "") -> list[str]: ...

    def ls(self, prefix: str = "") -> list[dict[str, Any]]: ...

    def lookup(self, key: str) -> Handle | None:
        """The handle of the object under ``key`` now, or None."""


@runtime_checkable
class Pool(Objects, Protocol):
    """The tensor pool both ``Store`` and ``Client`` are: one namespace's objects, by handle
    and by key, on the host, NVMe and GPU tiers.

    ``prefetch`` is a hint on both sides and returns nothing: with ``wait=True`` it
    returns once the hint is queued (an unknown handle raises); with ``wait=False``
    through a daemon it does not wait for the daemon's answer (an error is only
    logged). ``Store.prefetch_tracked`` gives, in process, a future of how many of the
    objects came up.
    """

    namespace: str
    """The namespace calls without one act on."""

    def checkout(self, handle: Handle | int | str, mode: str = "r", *, timeout_s: float | None = None,
                 stream: str = "default", source: Handle | int | str | None = None) -> PoolLease:
        """Lease the object; ``source`` (mode ``w``): the lease starts with that object's bytes."""

    def checkout_each(self, requests: Iterable[tuple[Handle | int | str, str, Handle | int | str | None]], *,
                      timeout_s: float | None = None, stream: str = "default") -> LeaseGroup:
        """Independent check-outs, ``(handle, mode, source)`` each, in one call."""

    def checkout_many(self, handles: Sequence[Handle | int | str], mode: str | Sequence[str] = "r", *,
                      timeout_s: float | None = None, stream: str = "default") -> LeaseGroup:
        """Several check-outs, all or none."""

    def lookup(self, key: str) -> Handle | None: ...

    def info(self, handle: Handle | int | str) -> dict[str, Any]: ...

    def prefetch(self, handles: Iterable[Handle | int | str], *, wait: bool = True) -> None:
        """Hint: bring these objects up now (see the class docstring)."""

    def step(self) -> None:
        """The caller's iteration boundary, for the prefetcher."""

    def stat(self) -> dict[str, Any]: ...

    def snapshot(self, dest: str, *, prefix: str = "", progress: bool | None = None) -> dict[str, Any]: ...

    def restore(self, src: str, *, overwrite: bool = False, progress: bool | None = None) -> dict[str, Any]: ...

    def close(self) -> None: ...

    def __enter__(self) -> Any: ...

    def __exit__(self, *exc: Any) -> None: ...


@runtime_checkable
class ReportsActivations(Protocol):
    """A pool that shows this process's activation-offload counters to others (a daemon
    ``Client``: in ``tierstore stat`` and the metrics). An in-process ``Store`` has no
    one to show them to; ``ActivationOffload.stats`` has them either way."""

    def report_activations(self, counters: dict[str, Any], *, source: int = 0, final: bool = False) -> None: ...
