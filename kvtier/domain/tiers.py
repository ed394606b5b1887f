"""The three storage tiers a page can live in, fastest first.

Values equal the wire enum ``kvtier.v1.Tier`` (0 is "unspecified" there and has no
member here), so ``Tier(value)`` and ``int(tier)`` are the whole conversion.
"""

from __future__ import annotations

import enum

from kvtier.domain.errors import InvalidArgument


class Tier(enum.IntEnum):
    HBM = 1  # device memory (the CPU tensor without a GPU)
    DRAM = 2  # host memory, pinned when CUDA is present
    NVME = 3  # page slots in preallocated local files

    @property
    def label(self) -> str:
        """Lower-case name used in configuration, policies, metrics and the CLI: ``"hbm"``."""
        return self.name.lower()

    @property
    def slower(self) -> Tier | None:
        """The next tier down, or ``None`` for the last tier."""
        return Tier(self + 1) if self < Tier.NVME else None

    @property
    def faster(self) -> Tier | None:
        """The next tier up, or ``None`` for HBM."""
        return Tier(self - 1) if self > Tier.HBM else None

    def is_faster_than(self, other: Tier) -> bool:
        return self < other

    @classmethod
    def parse(cls, name: str, *, field: str = "tier") -> Tier:
        """``"hbm"`` / ``"HBM"`` / ``"nvme"`` → Tier; anything else raises naming ``field``."""
        try:
            return cls[name.strip().upper()]
        except KeyError:
            raise InvalidArgument(
                f"{field}: unknown tier {name!r}; valid tiers are {', '.join(TIER_LABELS)}", field=field
            ) from None

    @classmethod
    def from_value(cls, value: int, *, field: str = "tier") -> Tier:
        """Wire number → Tier; 0 (unspecified) and unknown numbers raise naming ``field``."""
        if value == 0:
            raise InvalidArgument(f"{field} must be set to one of {', '.join(TIER_LABELS)}", field=field)
        try:
            return cls(value)
        except ValueError:
            raise InvalidArgument(
                f"{field} has unknown tier value {value}; valid tiers are "
                + ", ".join(f"{t.label}={t.value}" for t in cls),
                field=field,
            ) from None


TIER_LABELS: tuple[str, ...] = tuple(t.label for t in Tier)
