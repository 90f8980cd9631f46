"""Where an object's bytes lie on NVMe: a leaf value, shared by the NVMe tier, the
object index's records and the journal."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Extent"]


@dataclass(slots=True, frozen=True)
class Extent:
    """``nbytes`` of an object starting at ``obj_offset``, stored on drive ``dev`` at ``file_offset``."""

    dev: int
    file_offset: int
    obj_offset: int
    nbytes: int

    def to_wire(self) -> list[int]:
        return [self.dev, self.file_offset, self.obj_offset, self.nbytes]

    @classmethod
    def from_wire(cls, v: list[int]) -> "Extent":
        return cls(int(v[0]), int(v[1]), int(v[2]), int(v[3]))
