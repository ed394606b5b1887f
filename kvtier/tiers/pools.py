"""The pools of one engine's tiers: HBM (the page pool), DRAM and NVMe, which of the lower ones
is failing, and what the tier manager's parts do to a page or slot there: free it, release a
transfer's destination, hand a DRAM page to the index."""

from __future__ import annotations

import time

from kvtier.cache.page_pool import PageId, PagePool
from kvtier.domain.errors import IntegrityError
from kvtier.domain.tiers import Tier
from kvtier.tiers.dram import DramPool
from kvtier.tiers.nvme.format import SlotId
from kvtier.tiers.nvme.pool import NvmePool


class SimulatedSlots:
    """The NVMe tier of a simulated manager: slot accounting only (no files, no I/O)."""

    recovery = None  # nothing to restore after a restart

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> SlotId | None:
        if not self._free:
            return None
        slot = self._free.pop()
        self._used.add(slot)
        return SlotId(slot)

    def free(self, slot: SlotId) -> None:
        if slot not in self._used:
            raise IntegrityError(f"free of simulated nvme slot {slot} that is already free")
        self._used.remove(slot)
        self._free.append(slot)

    def close(self) -> None:
        pass

    def check_integrity(self) -> None:
        if len(self._free) + len(self._used) != self.num_slots:
            raise IntegrityError(
                f"simulated nvme: free {len(self._free)} + used {len(self._used)} != total {self.num_slots}"
            )


class TierPools:
    """HBM, DRAM and NVMe pools (the lower two optional), and the lower tiers whose writes fail:
    such a tier (disk full, I/O errors) gets no new pages for ``failure_backoff_s``, so the
    engine drops instead of retrying the same failing copy every step."""

    def __init__(self, hbm: PagePool, dram: DramPool | None, nvme: NvmePool | None, *, failure_backoff_s: float) -> None:
        self.hbm = hbm
        self.dram = dram
        self.nvme = nvme
        self._failure_backoff_s = failure_backoff_s
        self._failing_until: dict[Tier, float] = {}

    @property
    def tiers(self) -> list[Tier]:
        return [t for t, p in ((Tier.HBM, self.hbm), (Tier.DRAM, self.dram), (Tier.NVME, self.nvme)) if p]

    def capacity(self, tier: Tier) -> int:
        """Pages (slots on NVMe) this tier has; 0 when it is not configured."""
        if tier is Tier.NVME:
            return 0 if self.nvme is None else self.nvme.num_slots
        pool = self.hbm if tier is Tier.HBM else self.dram
        return 0 if pool is None else pool.num_pages

    def is_usable(self, tier: Tier) -> bool:
        return self.capacity(tier) > 0 and time.monotonic() >= self._failing_until.get(tier, 0.0)

    def mark_failing(self, tier: Tier) -> None:
        self._failing_until[tier] = time.monotonic() + self._failure_backoff_s

    def release_copy(self, tier: Tier, page: int) -> None:
        """Give back a cached page (DRAM) or slot (NVMe) that no node points at any more."""
        if tier is Tier.DRAM:
            assert self.dram is not None
            self.dram.unmark_cached(PageId(page))
        elif tier is Tier.NVME:
            assert self.nvme is not None
            self.nvme.free(SlotId(page))

    def free_target(self, tier: Tier, target: int) -> None:
        """Give back a transfer's destination that was not applied."""
        if tier is Tier.DRAM:
            assert self.dram is not None
            self.dram.release(PageId(target))
        elif tier is Tier.NVME:
            assert self.nvme is not None
            self.nvme.free(SlotId(target))
        else:
            self.hbm.release(PageId(target))

    def adopt_dram_copy(self, page: PageId, checksum: int | None) -> None:
        """A page copied down into DRAM: its checksum recorded, then the index's (``adopt_dram``)."""
        assert self.dram is not None
        self.dram.set_checksums([page], [checksum or 0])
        self.adopt_dram(page)

    def adopt_dram(self, page: PageId) -> None:
        """The index now owns this DRAM page (allocated with one reference)."""
        assert self.dram is not None
        self.dram.mark_cached(page)
        self.dram.release(page)
