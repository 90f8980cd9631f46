"""Staging areas: one host block per connection, private to it, through which its small
puts and gets travel without a reservation of their own.

``StagingAreas`` owns the table of areas (owner -> block) and their total size. The
blocks come from the host tier's allocator, under the object index's ``cv`` (the lock
that guards the allocator); an area lives until its owner goes (``drop``).
"""

from __future__ import annotations

from typing import Any

from .allocator import ExtentAllocator
from .errors import CapacityExceeded
from .objectindex import ObjectIndex

__all__ = ["StagingAreas"]


class StagingAreas:
    """Per-owner host blocks; see the module docstring."""

    def __init__(self, index: ObjectIndex, host: ExtentAllocator) -> None:
        self.index, self.host = index, host
        self._areas: dict[Any, tuple[int, int]] = {}
        """owner -> (offset, nbytes) of its area in the host arena (under cv)."""
        self.total_bytes = 0
        """The areas' bytes together (under cv): host space no object can use."""

    def area(self, owner: Any, nbytes: int) -> tuple[int, int]:
        """``owner``'s area, (offset, nbytes), made on first use; CapacityExceeded when the
        host tier has no room for it."""
        with self.index.cv:
            got = self._areas.get(owner)
            if got is not None:
                return got
            off = self.host.alloc(nbytes)
            if off is None:
                raise CapacityExceeded("host tier full: no room for a staging area; use the two-phase put")
            self._areas[owner] = (off, nbytes)
            self.total_bytes += nbytes
            return off, nbytes

    def of(self, owner: Any) -> tuple[int, int] | None:
        """(under cv) ``owner``'s area, (offset, nbytes), or None."""
        return self._areas.get(owner)

    def drop(self, owner: Any) -> bool:
        """(under cv) ``owner`` went away: its area goes back to the host tier. Whether it had one."""
        area = self._areas.pop(owner, None)
        if area is None:
            return False
        self.total_bytes -= area[1]
        self.host.free(*area)
        return True
