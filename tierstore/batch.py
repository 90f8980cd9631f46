"""``LeaseGroup``: the leases one ``checkout_many`` took, checked in together; and the
check of a ``checkout_each`` list."""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

from .errors import InvalidArgument
from .names import Handle

__all__ = ["LeaseGroup", "check_each"]

MAX_EACH = 4096
"""Most check-outs one ``checkout_each`` sends."""


def check_each(requests: list[tuple[Any, str, Any]]) -> None:
    """Refuse a ``checkout_each`` list that could only wait on itself: an object named
    twice (as an object or a source) where one of the two writes it. Its check-outs are
    served independently, possibly out of order, so a later one could take the object
    first and leave an earlier one waiting for a lease its own caller holds."""
    if not 1 <= len(requests) <= MAX_EACH:
        raise InvalidArgument(f"checkout_each takes 1 to {MAX_EACH} check-outs, got {len(requests)}")
    seen: dict[int, bool] = {}  # object id -> written by one of the requests so far
    for i, req in enumerate(requests):
        if not isinstance(req, (tuple, list)) or len(req) != 3:
            raise InvalidArgument(f"check-out #{i}: expected (handle, mode, source), got {req!r}")
        h, mode, source = req
        if mode not in ("r", "rw", "w"):
            raise InvalidArgument(f"mode must be 'r', 'rw' or 'w', got {mode!r}")
        if source is not None and mode != "w":
            raise InvalidArgument(f"a check-out from a source is a 'w' check-out, got mode {mode!r}")
        named = [(Handle.parse(h), mode != "r")]
        if source is not None:
            named.append((Handle.parse(source), False))
        for obj, writes in named:
            prev = seen.get(obj.id)
            if prev is not None and (prev or writes):
                raise InvalidArgument(f"object {obj} is named twice in checkout_each, once to write: its "
                                      "check-outs are served independently and would wait on each other")
            seen[obj.id] = bool(prev) or writes


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
