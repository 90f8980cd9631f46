"""Extent allocator: best-fit over aligned byte ranges with coalescing on free.

Used for both the host arena (blocks of shared memory) and the NVMe data files
(extents of a file). Pure bookkeeping: it never touches memory or disk. Not
thread-safe; the store serialises calls under its lock.

Fences: memory another process may still write into (a client whose lease was
revoked keeps its mapping) is fenced for that owner; an extent freed while it
overlaps a fence is held back, counted as used, and returned to the free lists
only once the owner's fences are lifted (its connection ended).
"""

from __future__ import annotations

import bisect
from typing import Any

import numpy as np

from .units import PAGE, align_up

__all__ = ["ExtentAllocator"]


class ExtentAllocator:
    """Hands out ``align``-aligned extents of ``[0, capacity)``.

    Free extents are kept twice: by start (to coalesce neighbours on free) and by
    (size, start) (for best fit), so fragmentation from mixed sizes is recovered
    as soon as neighbours are freed.
    """

    def __init__(self, capacity: int, *, align: int = PAGE, small_bytes: int = 0) -> None:
        if capacity < 0 or align <= 0 or small_bytes < 0:
            raise ValueError("capacity must be >= 0, align > 0 and small_bytes >= 0")
        self.align = align
        self.small_bytes = small_bytes
        """Allocations below this size are taken from the top of the range, larger ones
        best-fit from the bottom: small objects do not split the holes big ones leave."""
        self.capacity = capacity // align * align
        self._starts: list[int] = []
        self._size_at: dict[int, int] = {}
        self._by_size: list[tuple[int, int]] = []
        self.used_bytes = 0
        self._fences: dict[Any, list[tuple[int, int]]] = {}
        self._held: dict[int, int] = {}
        """Extents freed while fenced: start -> size, still counted as used."""
        self._peak = 0  # the highest end handed out or reserved since ``take_peak``
        if self.capacity:
            self._add_free(0, self.capacity)

    # -- queries -------------------------------------------------------------------------
    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used_bytes

    @property
    def largest_free(self) -> int:
        return self._by_size[-1][0] if self._by_size else 0

    def rounded(self, nbytes: int) -> int:
        """The size an allocation of ``nbytes`` really takes."""
        return align_up(max(nbytes, 1), self.align)

    def free_extents(self) -> list[tuple[int, int]]:
        return [(s, self._size_at[s]) for s in self._starts]

    def high_water(self) -> int:
        """The end of the topmost extent in use (held ones included): everything above it is free."""
        if self._starts:
            last = self._starts[-1]
            if last + self._size_at[last] == self.capacity:
                return last
        return self.capacity if self.used_bytes else 0

    def take_peak(self) -> int:
        """The highest ``high_water`` since the last call (an extent taken and given back
        in between counts too)."""
        now = self.high_water()
        peak, self._peak = max(self._peak, now), now
        return peak

    @property
    def held_bytes(self) -> int:
        """Bytes freed but held back by a fence (included in ``used_bytes``)."""
        return sum(self._held.values())

    # -- fences --------------------------------------------------------------------------
    def fence(self, owner: Any, offset: int, nbytes: int) -> None:
        """Keep ``[offset, offset + nbytes)`` from being handed out again while ``owner``'s
        fences stand: a free of an extent overlapping it is held back until ``unfence``."""
        self._fences.setdefault(owner, []).append((offset, self.rounded(nbytes)))

    def unfence(self, owner: Any) -> int:
        """Lift ``owner``'s fences; held extents no other fence covers are freed. Returns
        the bytes given back."""
        if self._fences.pop(owner, None) is None:
            return 0
        before = self.free_bytes
        held, self._held = self._held, {}
        for start, size in sorted(held.items()):
            self._release(start, size)  # held again if another fence still covers it
        return self.free_bytes - before

    def _fenced(self, start: int, size: int) -> bool:
        return any(f < start + size and start < f + n for v in self._fences.values() for f, n in v)

    # -- mutation ------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> int | None:
        """Offset of a new extent of ``rounded(nbytes)`` bytes, or None if none fits."""
        size = self.rounded(nbytes)
        if size < self.small_bytes:
            for start in reversed(self._starts):  # the topmost free extent that fits
                fsize = self._size_at[start]
                if fsize >= size:
                    self._remove_free(start)
                    if fsize > size:
                        self._add_free(start, fsize - size)
                    self.used_bytes += size
                    self._peak = max(self._peak, start + fsize)
                    return start + fsize - size
            return None
        i = bisect.bisect_left(self._by_size, (size, -1))
        if i == len(self._by_size):
            return None
        fsize, start = self._by_size[i]
        self._remove_free(start)
        if fsize > size:
            self._add_free(start + size, fsize - size)
        self.used_bytes += size
        self._peak = max(self._peak, start + size)
        return start

    def alloc_run(self, sizes: list[int]) -> list[int] | None:
        """Offsets of adjacent extents for ``sizes`` (each ``rounded``), taken as one
        allocation of their sum (so each costs what one ``alloc`` does, not one each);
        None, with nothing taken, when no free extent holds them all. Each is freed on its
        own later, as if it came from ``alloc``."""
        rounded = [self.rounded(n) for n in sizes]
        start = self.alloc(sum(rounded)) if rounded else None
        if start is None:
            return None
        out = []
        for r in rounded:
            out.append(start)
            start += r
        return out

    def free(self, offset: int, nbytes: int) -> None:
        """Return an extent obtained from ``alloc(nbytes)`` (or ``reserve``)."""
        size = self.rounded(nbytes)
        if offset % self.align or offset < 0 or offset + size > self.capacity:
            raise ValueError(f"free of extent ({offset}, {size}) outside the allocator")
        i = bisect.bisect_left(self._starts, offset)
        if i < len(self._starts) and self._starts[i] < offset + size:
            raise ValueError(f"double free of extent ({offset}, {size})")
        if i > 0 and self._starts[i - 1] + self._size_at[self._starts[i - 1]] > offset:
            raise ValueError(f"double free of extent ({offset}, {size})")
        if offset in self._held:
            raise ValueError(f"double free of extent ({offset}, {size})")
        self._release(offset, size)

    def _release(self, offset: int, size: int) -> None:
        if self._fences and self._fenced(offset, size):
            self._held[offset] = size
            return
        self.used_bytes -= size
        i = bisect.bisect_left(self._starts, offset)
        start, end = offset, offset + size
        # coalesce with the free neighbour after, then the one before
        if i < len(self._starts) and self._starts[i] == end:
            end += self._size_at[end]
            self._remove_free(offset + size)
        if i > 0:
            prev = self._starts[i - 1]
            if prev + self._size_at[prev] == start:
                start = prev
                self._remove_free(prev)
        self._add_free(start, end - start)

    def reserve(self, offset: int, nbytes: int) -> None:
        """Mark a specific extent used (journal replay). Raises if it is not free."""
        size = self.rounded(nbytes)
        i = bisect.bisect_right(self._starts, offset) - 1
        if i < 0:
            raise ValueError(f"extent ({offset}, {size}) is not free")
        start = self._starts[i]
        fsize = self._size_at[start]
        if offset + size > start + fsize:
            raise ValueError(f"extent ({offset}, {size}) is not free")
        self._remove_free(start)
        if offset > start:
            self._add_free(start, offset - start)
        if offset + size < start + fsize:
            self._add_free(offset + size, start + fsize - offset - size)
        self.used_bytes += size
        self._peak = max(self._peak, offset + size)

    def reserve_arrays(self, offsets: np.ndarray, nbytes: np.ndarray) -> None:
        """``reserve`` of many extents at once (journal replay: a million objects), as
        arrays sorted by offset: the free lists are rebuilt in one vectorised pass instead
        of being edited extent by extent. All or nothing: raises ValueError, changing
        nothing, if one is not aligned or not free, or two overlap."""
        if not len(offsets):
            return
        a = self.align
        offsets = np.asarray(offsets, np.int64)
        size = (np.maximum(np.asarray(nbytes, np.int64), 1) + a - 1) // a * a
        end = offsets + size
        if (offsets % a).any() or (end[:-1] > offsets[1:]).any():
            raise ValueError("extents to reserve are unaligned or overlap")
        fs = np.array(self._starts, np.int64)
        fe = fs + np.array([self._size_at[x] for x in self._starts], np.int64)
        where = np.searchsorted(fs, offsets, side="right") - 1  # the free extent each lies in
        if (where < 0).any() or (end > fe[np.maximum(where, 0)]).any():
            bad = int(np.argmax((where < 0) | (end > fe[np.maximum(where, 0)])))
            raise ValueError(f"extent ({int(offsets[bad])}, {int(size[bad])}) is not free")
        same = where[:-1] == where[1:]  # neighbours in one free extent: the gap between stays free
        first, last = np.r_[True, ~same], np.r_[~same, True]
        touched = np.zeros(len(fs), bool)
        touched[where] = True
        gs = np.concatenate([end[:-1][same], fs[where[first]], end[last], fs[~touched]])
        ge = np.concatenate([offsets[1:][same], offsets[first], fe[where[last]], fe[~touched]])
        keep = gs < ge
        order = np.argsort(gs[keep], kind="stable")
        starts, sizes = gs[keep][order].tolist(), (ge[keep] - gs[keep])[order].tolist()
        self._starts = starts
        self._size_at = dict(zip(starts, sizes))
        self._by_size = sorted(zip(sizes, starts))
        self.used_bytes += int(size.sum())
        self._peak = max(self._peak, int(end[-1]))

    # -- internals -----------------------------------------------------------------------
    def _add_free(self, start: int, size: int) -> None:
        bisect.insort(self._starts, start)
        self._size_at[start] = size
        bisect.insort(self._by_size, (size, start))

    def _remove_free(self, start: int) -> None:
        size = self._size_at.pop(start)
        del self._starts[bisect.bisect_left(self._starts, start)]
        del self._by_size[bisect.bisect_left(self._by_size, (size, start))]
