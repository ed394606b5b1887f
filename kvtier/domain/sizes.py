"""Sizes in bytes written as text: ``4294967296``, ``4GiB``, ``512Mi``, ``1.5GB``."""

from __future__ import annotations

import re

SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "ki": 2**10,
    "kib": 2**10,
    "mi": 2**20,
    "mib": 2**20,
    "gi": 2**30,
    "gib": 2**30,
    "ti": 2**40,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(-?[0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


class SizeError(ValueError):
    """A text that is not a size; ``expected`` says what is accepted."""

    def __init__(self, expected: str, text: str) -> None:
        super().__init__(f"expected {expected}, got {text!r}")
        self.expected = expected


def parse_size(text: str) -> int:
    """``"4GiB"`` → 4294967296; raises ``SizeError`` saying what is accepted."""
    match = _SIZE_RE.match(text)
    unit = match and SIZE_UNITS.get(match.group(2).lower())
    if not match or unit is None:
        raise SizeError("a size in bytes such as 4294967296, 4GiB or 512Mi", text)
    value = float(match.group(1)) * unit
    if value != int(value):
        raise SizeError("a whole number of bytes", text)
    return int(value)
