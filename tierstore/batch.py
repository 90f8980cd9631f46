"""``LeaseGroup``: the leases one ``checkout_many`` took, checked in together."""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

__all__ = ["LeaseGroup"]


class LeaseGroup(Sequence):
    """A sequence of leases (``Lease`` in-process, ``ClientLease`` through the daemon), in
    the order they were asked for. ``release()`` checks in those still held in one call
    (one message to the daemon); each lease may also be released on its own before.
    As a context manager it gives the list of tensors and checks everything in at exit.
    """

    def __init__(self, leases: list[Any], release_many: Callable[[list[Any]], None]) -> None:
        self._leases = leases
        self._release_many = release_many

    def __len__(self) -> int:
        return len(self._leases)

    def __getitem__(self, i: Any) -> Any:
        return self._leases[i]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._leases)

    @property
    def tensors(self) -> list[Any]:
        """Each lease's tensor (None for one already released)."""
        return [lease.tensor for lease in self._leases]

    def release(self) -> None:
        tokens = [t for t in (lease._take() for lease in self._leases) if t is not None]
        if tokens:
            self._release_many(tokens)

    def __enter__(self) -> list[Any]:
        return self.tensors

    def __exit__(self, *exc: Any) -> None:
        self.release()
