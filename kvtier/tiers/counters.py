"""The tier manager's totals for telemetry: what moved between tiers, what was dropped, waited for."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.domain.tiers import Tier


@dataclass(slots=True)
class TierCounters:
    """Totals for telemetry. Bytes moved per tier pair include synchronous spills."""

    bytes_moved: dict[tuple[Tier, Tier], int] = field(default_factory=dict)
    pages_moved: dict[tuple[Tier, Tier], int] = field(default_factory=dict)
    pages_dropped: int = 0
    checksum_failures: int = 0
    # Pages copied down for nothing: they stayed where they were once the copy landed, because
    # a sequence took them up meanwhile (reused) or a pin kept them there, or a page below them
    # stayed (kept: a session's hold recalled them, an operator pinned them).
    demotions_abandoned: int = 0
    demotions_kept: int = 0  # of those, not taken up by a sequence
    disk_full_events: int = 0
    promotion_wait_s: float = 0.0
    promoted_pages: int = 0
    spill_link_wait_s: float = 0.0  # synchronous moves waiting on an emulated link (engine thread)
    # HBM pages demoted onto the DRAM copy they were promoted from (no bytes moved; module doc)
    demotions_without_copy: int = 0

    def moved(self, src: Tier, dst: Tier, num_pages: int, page_bytes: int) -> None:
        pair = (src, dst)
        self.pages_moved[pair] = self.pages_moved.get(pair, 0) + num_pages
        self.bytes_moved[pair] = self.bytes_moved.get(pair, 0) + num_pages * page_bytes
