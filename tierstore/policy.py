"""Eviction policies: which host-resident object to demote next. Policy only; the store
moves the bytes.

This is the whole surface a policy needs: it hears about inserts, accesses and
removals of host-resident objects and yields candidates coldest first. The store
skips candidates it cannot move (leased, in flight).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterator, Protocol

__all__ = ["EvictionPolicy", "LRUPolicy", "make_policy"]


class EvictionPolicy(Protocol):
    name: str

    def insert(self, oid: int) -> None: ...
    def touch(self, oid: int) -> None: ...
    def remove(self, oid: int) -> None: ...
    def candidates(self) -> Iterator[int]: ...
    def step(self) -> None: ...


class LRUPolicy:
    """Least recently used first. Cheap, and right until an access trace exists."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()

    def insert(self, oid: int) -> None:
        self._order[oid] = None
        self._order.move_to_end(oid)

    def touch(self, oid: int) -> None:
        if oid in self._order:
            self._order.move_to_end(oid)

    def remove(self, oid: int) -> None:
        self._order.pop(oid, None)

    def candidates(self) -> Iterator[int]:
        return iter(list(self._order))

    def step(self) -> None:
        pass


def make_policy(name: str) -> EvictionPolicy:
    if name == "lru":
        return LRUPolicy()
    if name == "trace":
        # the trace-driven policy falls back to LRU until it has seen a full cycle
        return LRUPolicy()
    raise ValueError(f"unknown policy {name!r}")
