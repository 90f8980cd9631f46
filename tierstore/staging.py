"""Staging areas: one host block per connection, private to it, through which its small
puts and gets travel without a reservation of their own.

``StagingAreas`` owns the table of areas (owner -> block) and their total size. The
blocks come from the host tier's allocator, under the object index's ``cv`` (the lock
that guards the allocator); an area lives until its owner goes (``drop``). The areas
together hold at most a quarter of the host tier, and those of one group of owners (a
uid's connections) an eighth, but for each group's first area (a small host tier still
gives every uid one): idle connections cannot pin the tier others need (an owner
refused an area takes the two-phase put instead).
"""

from __future__ import annotations

from collections import Counter
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
        self._group_of: dict[Any, Any] = {}
        self._group_bytes: Counter = Counter()

    def area(self, owner: Any, nbytes: int, group: Any = None) -> tuple[int, int]:
        """``owner``'s area, (offset, nbytes), made on first use; CapacityExceeded when the
        host tier has no room for it, or the areas (``group``'s) already hold their share."""
        with self.index.cv:
            got = self._areas.get(owner)
            if got is not None:
                return got
            cap = self.host.capacity
            if self._group_bytes[group] and (self.total_bytes + nbytes > cap // 4
                                             or self._group_bytes[group] + nbytes > cap // 8):
                raise CapacityExceeded(f"staging areas hold {self.total_bytes} bytes ({self._group_bytes[group]} "
                                       f"of them this uid's connections'), their share of the host tier; "
                                       "use the two-phase put")
            off = self.host.alloc(nbytes)
            if off is None:
                raise CapacityExceeded("host tier full: no room for a staging area; use the two-phase put")
            self._areas[owner] = (off, nbytes)
            self._group_of[owner] = group
            self._group_bytes[group] += nbytes
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
        group = self._group_of.pop(owner, None)
        self._group_bytes[group] -= area[1]
        if not self._group_bytes[group]:
            del self._group_bytes[group]
        self.host.free(*area)
        return True
