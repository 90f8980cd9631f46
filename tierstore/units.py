"""Byte sizes: parse "8GiB"-style strings, format sizes for people."""

from __future__ import annotations

import re

__all__ = ["parse_size", "format_size", "align_up", "PAGE"]

PAGE = 4096

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1 << 10,
    "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
    "g": 1000**3, "gb": 1000**3, "gib": 1 << 30,
    "t": 1000**4, "tb": 1000**4, "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | str, *, field: str = "size") -> int:
    """Return a byte count from an int or a string such as ``"8GiB"`` or ``"512 MB"``."""
    if isinstance(value, bool):
        raise ValueError(f"{field}: expected a size, got a bool")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{field}: size must be >= 0, got {value}")
        return value
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m is None or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{field}: cannot parse size {value!r}; use e.g. 8GiB, 512MiB or 1048576")
        number, unit = m.group(1), _UNITS[m.group(2).lower()]
        if "." not in number:
            return int(number) * unit  # exact, however large
        whole, frac = number.split(".")
        return int(whole) * unit + int(frac) * unit // 10 ** len(frac)
    raise ValueError(f"{field}: expected int or str size, got {type(value).__name__}")


def format_size(n: float) -> str:
    """Format a byte count with binary units: 1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def align_up(n: int, alignment: int = PAGE) -> int:
    return (n + alignment - 1) // alignment * alignment
