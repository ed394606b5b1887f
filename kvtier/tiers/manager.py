"""Moves cached pages between HBM, DRAM and NVMe for one engine (DESIGN §5 decisions 5–7).

Three paths, all applied to the radix index only once the bytes are where it says:

- **Watermark demotion** (asynchronous): when a tier's free pages fall below
  ``1 − high``, its coldest evictable pages are copied one tier down by the transfer
  engine until ``1 − low`` is free again. Decode keeps stepping meanwhile; a page that a
  sequence picked up again before the copy finished stays where it is. In HBM a *clean* page
  (an intact copy below: a shadow) counts as free, and only pages without a copy are copied
  down: a clean page leaves at no cost when its room is needed (``num_reclaimable``).
- **Spill** (synchronous fallback): an allocation that finds no free HBM page first takes a
  clean one (``reclaim_clean``: back onto its copy, no bytes), else moves one victim down at
  once instead of dropping it; with no room below, the victim is dropped. A running sequence
  whose next page finds every idle page already on its way down waits for those copies
  (``wait_leaving``) rather than being preempted.
- **Promotion on hit**: matched pages in DRAM/NVMe are copied into HBM before prefill,
  each verified against the checksum it carried since it left HBM. A mismatch drops
  that page and everything below it (the engine recomputes them) — wrong bytes are
  never used. The wait is recorded as eviction-induced first-token latency. A page
  a prefetch is bringing up is waited for, not promoted a second time.
- **Commanded moves** (the controller's Demote and Prefetch, asynchronous): the engine
  thread allocates destinations, marks the pages moving and submits the transfers
  (``start_demotion`` / ``start_prefetch``); a ``MoveTicket`` collects them and is
  applied, all of its transfers together, once the last one completes. Its ``on_done``
  is the acknowledgement: the bytes are where the index says.

Every page held by a transfer carries an extra reference (HBM/DRAM) or a reserved slot
(NVMe) until its ``TransferDone`` is applied, so nothing it reads can be reused.

**Copies below of promoted pages (shadows).** A full KV page never changes, so a page promoted
from DRAM or NVMe keeps the DRAM page or NVMe slot it came from as a *shadow* (decision 0012):
when it leaves HBM again for that tier — a spill, a watermark or room-making demotion, a
commanded park — it is pointed back at that copy and no bytes are copied or written
(``TierCounters.demotions_without_copy``). A shadow is used only while its node is still that
key's node, in HBM; it is freed when the node is dropped or leaves HBM another way, and it is
the first thing an allocation in its tier takes (``_num_free`` and the worker's occupancy count
shadows as free). In a batch, pages going back onto their copy are applied with the copied
ones, deepest first, once the copy lands (a page may leave HBM only once nothing below it is
faster). The directory never sees shadows: it learns of the move when it is applied, as for a
copy. An NVMe shadow slot keeps its header, so a restart restores the page from it (its bytes
are the page's). Simulated managers (trace replay) keep none, so replay's capacities mean what
they did.

``TierConfig.simulate`` (trace replay, ``loadtests/replay.py``) keeps every decision and
all page accounting but copies no bytes: NVMe is a slot counter without files, spills
and promotions complete at once, and background demotion is off.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.cache.clean_pages import CleanPages
from kvtier.cache.page_pool import PageId, PagePool
from kvtier.cache.radix import RadixIndex, RadixNode
from kvtier.domain.errors import IntegrityError, InvalidArgument
from kvtier.domain.hashing import PageKey
from kvtier.domain.tiers import Tier
from kvtier.tiers.counters import TierCounters
from kvtier.tiers.demotion import Demotions
from kvtier.tiers.dram import DramPool
from kvtier.tiers.moves import MoveOutcome, MovesInFlight, MoveTicket, finish
from kvtier.tiers.nvme.pool import NvmePool
from kvtier.tiers.page_codec import PageCodec
from kvtier.tiers.pools import SimulatedSlots, TierPools
from kvtier.tiers.promotion import Promotions
from kvtier.tiers.room import RoomMaker
from kvtier.tiers.shadows import Shadows
from kvtier.tiers.transfer import TransferDone, TransferReason
from kvtier.tiers.transfer_engine import TransferEngine

log = logging.getLogger("kvtier.domain.tiers")
# Longest single block on the transfer engine's completion condition while waiting for a ticket.
WAIT_STEP_S = 1.0


@dataclass(slots=True)
class Watermark:
    """Occupied fractions: above ``high`` the tier sheds pages until it is at ``low``."""

    high: float = 0.95
    low: float = 0.85

    def validate(self, name: str) -> None:
        if not (0.0 < self.low <= self.high <= 1.0):
            raise InvalidArgument(
                f"{name} watermarks need 0 < low <= high <= 1, got low={self.low} high={self.high}",
                field=f"{name}.watermark",
            )


@dataclass(slots=True)
class TierConfig:
    dram_pages: int = 0
    nvme_slots: int = 0
    nvme_dir: Path | None = None
    hbm_watermark: Watermark = field(default_factory=Watermark)
    dram_watermark: Watermark = field(default_factory=Watermark)
    max_batch_pages: int = 256  # pages per asynchronous transfer
    failure_backoff_s: float = 2.0  # after a failed write into a tier, leave it alone this long
    # Anti-thrash budget for background demotion (promotions are never paced). On the
    # CPU the copy competes with decode for cores; on a GPU it rides a copy engine.
    demotion_budget_bytes_per_s: float | None = 256 << 20
    # Link emulation for benchmarks on machines without a GPU (kvtier.tiers.transfer's doc, decision
    # 0011): bytes/s per tier pair that touches HBM; None (the default) moves at memory speed.
    link_bytes_per_s: dict[tuple[Tier, Tier], float] | None = None
    simulate: bool = False  # move pages in the index and pools only (no bytes, no files)
    # DRAM and NVMe hold pages in this codec's format (``lower_tier_dtype = fp8``: requantized on
    # the way down, kvtier.tiers.page_codec); None: in HBM's format, byte for byte.
    lower_codec: PageCodec | None = None


class TierManager:
    """Owns the DRAM and NVMe pools and the transfer engine of one engine.

    Runs on the engine thread only (``maintain`` once per step); the transfer engine's
    worker threads never touch the index. It composes parts that each own their state and
    are handed what they need: the pools (``kvtier.tiers.pools``), the shadows and the clean
    pages they make (``shadows``), destinations and synchronous moves (``room``), demotions
    (``demotion``) and promotions (``promotion``), the last two sharing the moves in flight
    (``moves.MovesInFlight``). Completed transfers are applied here, in ``poll``, and nowhere
    else; the public methods below are the engine's, the worker's and the tools' one surface.
    """

    def __init__(self, index: RadixIndex, config: TierConfig) -> None:
        config.hbm_watermark.validate("hbm")
        config.dram_watermark.validate("dram")
        self.index = index
        self.hbm: PagePool = index.pool
        self.config = config
        geometry = self.hbm.geometry if config.lower_codec is None else config.lower_codec.lower_geometry
        self.page_bytes = geometry.page_bytes  # of a page as DRAM and NVMe store it: what a move carries
        self.dram = DramPool(config.dram_pages, geometry) if config.dram_pages > 0 else None
        self.nvme: NvmePool | None = None
        if config.nvme_slots > 0 and config.simulate:
            self.nvme = SimulatedSlots(config.nvme_slots)  # type: ignore[assignment]
        elif config.nvme_slots > 0:
            if config.nvme_dir is None:
                raise InvalidArgument("an NVMe tier needs a directory", field="nvme_dir")
            self.nvme = NvmePool(config.nvme_dir, config.nvme_slots, geometry)
        self.transfers = TransferEngine(
            self.hbm, self.dram, None if config.simulate else self.nvme,
            budget_bytes_per_s=config.demotion_budget_bytes_per_s,
            link_bytes_per_s=None if config.simulate else config.link_bytes_per_s,
            codec=config.lower_codec,
        )
        self.counters = TierCounters()
        self.pools = TierPools(self.hbm, self.dram, self.nvme, failure_backoff_s=config.failure_backoff_s)
        self.shadows = Shadows(index, self.pools, self.counters, simulate=config.simulate)
        self.room = RoomMaker(index, self.pools, self.shadows, self.transfers, self.counters,
                              simulate=config.simulate, page_bytes=self.page_bytes)
        self.in_flight = MovesInFlight()
        self.demotions = Demotions(index, self.pools, self.shadows, self.room, self.transfers, self.in_flight,
                                   self.counters, page_bytes=self.page_bytes)
        self.promotions = Promotions(index, self.pools, self.shadows, self.room, self.transfers, self.in_flight,
                                     self.counters, simulate=config.simulate, page_bytes=self.page_bytes,
                                     wait_for=self.wait_for)
        if self.nvme is not None:
            self._restore_nvme()

    @property
    def tiers(self) -> list[Tier]:
        return self.pools.tiers

    @property
    def clean(self) -> CleanPages | None:
        """HBM pages free to take at no copy, kept as they change (None: simulated, no copies)."""
        return self.shadows.clean

    def close(self) -> None:
        self.transfers.close()
        self.poll()
        if self.nvme is not None:
            self.nvme.close()

    # ---- locations ------------------------------------------------------------------
    def _num_free(self, tier: Tier) -> int:
        pool = {Tier.HBM: self.hbm, Tier.DRAM: self.dram, Tier.NVME: self.nvme}[tier]
        if pool is None:
            return 0
        if tier is Tier.HBM:
            return self.num_reclaimable()
        return pool.num_free + self.num_shadows(tier)  # shadows give way

    def num_reclaimable(self) -> int:
        """HBM pages an allocation can have without copying a byte (``Shadows.num_reclaimable``)."""
        return self.shadows.num_reclaimable()

    def is_clean(self, node: RadixNode) -> bool:
        """Whether ``node`` is one of the clean HBM pages ``num_reclaimable`` counts."""
        return self.shadows.is_clean(node)

    def num_shadows(self, tier: Tier) -> int:
        """Pages of ``tier`` that are copies of HBM pages (module doc): cached, and free to take."""
        return self.shadows.count(tier)

    def capacity(self, tier: Tier) -> int:
        """Pages (slots on NVMe) this tier has; 0 when it is not configured."""
        return self.pools.capacity(tier)

    def is_usable(self, tier: Tier) -> bool:
        """Configured, and not backing off after a failed write."""
        return self.pools.is_usable(tier)

    # ---- room and synchronous moves (``RoomMaker``) ------------------------------------
    def reclaim_clean(self, *, search: int = 32) -> bool:
        """Free one HBM page at no copy (``RoomMaker.reclaim_clean``)."""
        return self.room.reclaim_clean(search=search)

    def free_hbm_page(self) -> bool:
        """Free one HBM page for an allocation that found none (``RoomMaker.free_hbm_page``)."""
        return self.room.free_hbm_page()

    def spill(self, node: RadixNode) -> bool:
        """Free an HBM victim's page now (``RoomMaker.spill``)."""
        return self.room.spill(node)

    def move_to_free(self, node: RadixNode, dst: Tier) -> bool:
        """Move an evictable ``node`` down to ``dst`` now, only into a free page there (``RoomMaker.move_to_free``)."""
        return self.room.move_to_free(node, dst)

    def demote_all(self, dst: Tier) -> int:
        """Move every idle cached page above ``dst`` down to it, synchronously (drain, tests)."""
        return self.room.demote_all(dst)

    # ---- demotions (``Demotions``) -----------------------------------------------------
    def demote(self, src: Tier, dst: Tier, num_pages: int, reason: TransferReason, *, dirty_only: bool = False) -> int:
        """Start moving up to ``num_pages`` of ``src``'s coldest idle pages to ``dst`` (``Demotions.demote``)."""
        return self.demotions.demote(src, dst, num_pages, reason, dirty_only=dirty_only)

    def start_demotion(self, nodes: Sequence[RadixNode], dst: Tier) -> MoveTicket:
        """Start moving the idle ones of ``nodes`` down to ``dst`` (``Demotions.start``)."""
        return self.demotions.start(nodes, dst)

    def demote_pages(self, nodes: Sequence[RadixNode], dst: Tier) -> MoveOutcome:
        """``start_demotion`` and wait until it is applied (tests, tools)."""
        return self.wait_for(self.start_demotion(nodes, dst))

    def num_leaving(self, tier: Tier) -> int:
        """Pages of ``tier`` in background transfers to a slower tier: freed there once applied."""
        return self.in_flight.num_leaving(tier)

    def wait_leaving(self, tier: Tier, timeout_s: float = 30.0) -> None:
        """Block, applying transfers as they complete, until no background transfer out of
        ``tier`` is left (or ``timeout_s`` passed): the pages they carry are free once applied.
        For an allocation that found every idle page on its way down (decision 0012)."""
        deadline = time.monotonic() + timeout_s
        while self.in_flight.has_from(tier):
            left_s = deadline - time.monotonic()
            if left_s <= 0 or not self.poll(timeout_s=left_s):
                break
        self.poll()

    # ---- promotions (``Promotions``) ---------------------------------------------------
    def promote(self, nodes: Sequence[RadixNode]) -> list[RadixNode]:
        """Bring matched lower-tier pages (a chain, parents first) into HBM, verified
        (``Promotions.promote``): the leading nodes now in HBM, one reference each for the caller."""
        return self.promotions.promote(nodes)

    def start_prefetch(
        self, chain: Sequence[RadixNode], *, for_request: bool = False, spared: Collection[PageKey] = (),
    ) -> MoveTicket:
        """Start promoting the lower-tier pages of ``chain`` (root first) into HBM (``Promotions.start_prefetch``)."""
        return self.promotions.start_prefetch(chain, for_request=for_request, spared=spared)

    def cancel_prefetches(self, nodes: Sequence[RadixNode]) -> int:
        """Cancel the prefetches in flight for any of ``nodes`` and apply them now (``Promotions.cancel``)."""
        return self.promotions.cancel(nodes)

    def prefetch(self, chain: Sequence[RadixNode]) -> MoveOutcome:
        """``start_prefetch`` and wait until it is applied (tests, tools)."""
        return self.wait_for(self.start_prefetch(chain))

    # ---- each step, completions -------------------------------------------------------
    def maintain(self) -> None:
        """Apply finished transfers, then start demotions where a tier is above its watermark."""
        if self.config.simulate:
            return
        self.poll()
        self._demote_over_watermark(Tier.HBM, self.config.hbm_watermark, Tier.DRAM if self.dram else Tier.NVME)
        if self.dram is not None:
            self._demote_over_watermark(Tier.DRAM, self.config.dram_watermark, Tier.NVME)

    def _demote_over_watermark(self, tier: Tier, mark: Watermark, dst: Tier) -> None:
        capacity = self.capacity(tier)
        if capacity == 0 or not self.is_usable(dst):
            return
        pool = self.hbm if tier is Tier.HBM else self.dram
        if pool is not None and capacity - pool.num_free <= mark.high * capacity:
            return  # the common case, without counting what else is free to take
        free = self._num_free(tier)
        if capacity - free <= mark.high * capacity:
            return
        in_flight = self.in_flight.num_from(tier)
        want = math.ceil((1.0 - mark.low) * capacity) - free - in_flight
        if want > 0:
            self.demote(tier, dst, min(want, self.config.max_batch_pages), TransferReason.WATERMARK,
                        dirty_only=tier is Tier.HBM)

    def has_pending(self) -> bool:
        """Transfers started and not yet applied (finished ones wait for ``poll``)."""
        return bool(self.in_flight)

    def hbm_holds(self) -> dict[PageId, int]:
        """HBM pages this manager holds a reference on (sources of demotions in flight)."""
        holds: dict[PageId, int] = {}
        for p in self.in_flight:
            for entry in p.shadowed:  # going back onto their copy with the others
                holds[entry.hbm_page] = holds.get(entry.hbm_page, 0) + 1
            if p.src is Tier.HBM:
                for node in p.nodes:
                    holds[PageId(node.page)] = holds.get(PageId(node.page), 0) + 1
            elif p.dst is Tier.HBM:  # a prefetch's destinations, allocated with one reference
                for page in p.dsts:
                    holds[PageId(page)] = holds.get(PageId(page), 0) + 1
        return holds

    def poll(self, timeout_s: float = 0.0) -> int:
        """Apply every transfer that completed (the one place completions are applied); with
        ``timeout_s``, first block on the transfer engine's completion condition until one has
        or nothing is pending. Returns how many were applied."""
        completed = self.transfers.poll_completed(timeout_s=timeout_s)
        for done in completed:
            self._on_done(done)
        return len(completed)

    def _on_done(self, done: TransferDone) -> None:
        transfer_id = done.transfer.transfer_id
        pending = self.in_flight.get(transfer_id)
        if pending is None:
            return
        ticket = pending.ticket
        if ticket is None:
            self.in_flight.pop(transfer_id)
            self.demotions.apply(pending, done)
            return
        pending.done = done
        ticket.num_open -= 1
        if ticket.num_open == 0:
            self._apply_ticket(ticket)

    def _apply_ticket(self, ticket: MoveTicket) -> None:
        parts = [self.in_flight.pop(tid) for tid in ticket.transfer_ids]
        if ticket.is_promotion:
            self.promotions.apply(ticket, parts)
        else:
            # Slower sources first: a page in DRAM lies below the HBM pages of its chain, and a
            # page may leave its tier only once nothing below it is faster than its target.
            for part in sorted(parts, key=lambda p: -int(p.src)):
                assert part.done is not None
                moved = self.demotions.apply(part, part.done)
                ticket.num_moved += moved
                ticket.num_skipped += len(part.nodes) + len(part.shadowed) - moved
        finish(ticket)

    def wait_idle(self, timeout_s: float = 30.0) -> None:
        """Block until every started transfer is applied (tests, drain, shutdown)."""
        self.transfers.wait_idle(timeout_s)
        self.poll()

    def wait_for(self, ticket: MoveTicket) -> MoveOutcome:
        """Block (applying every transfer that completes meanwhile) until ``ticket`` is done."""
        while not ticket.is_done:
            if self.poll(timeout_s=WAIT_STEP_S) or self.transfers.num_pending:
                continue
            # Nothing pending: every completion is queued already (a transfer leaves the pending
            # set and joins the queue at once), so one more poll applies what is left.
            if not self.poll() and not ticket.is_done:
                raise IntegrityError(f"move ticket has {ticket.num_open} open transfers but none is pending")
        return ticket.outcome

    # ---- restart ----------------------------------------------------------------------
    def _restore_nvme(self) -> None:
        """Re-index pages the NVMe pool recovered, parents before children."""
        assert self.nvme is not None
        report = self.nvme.recovery
        if report is None or not report.recovered:
            return
        pending = {p.key: p for p in report.recovered}
        restored = 0
        progress = True
        while pending and progress:
            progress = False
            for key, page in list(pending.items()):
                if page.parent_key is not None and page.parent_key in pending:
                    continue
                # An NVMe node's page field holds its slot id (RadixNode.tier).
                node = self.index.insert(
                    key, page.parent_key, PageId(page.slot), page.tokens or (), page.namespace,
                    tier=Tier.NVME, checksum=page.checksum,
                ) if page.tokens and len(page.tokens) == self.hbm.page_size else None
                if node is None:
                    self.nvme.free(page.slot)
                else:
                    restored += 1
                del pending[key]
                progress = True
        log.info("restored %d NVMe pages into the index (%d discarded)", restored, len(report.discarded))

    def check_integrity(self) -> None:
        self.index.check_integrity()
        if self.dram is not None:
            self.dram.check_integrity()
        self.shadows.check_integrity(self.in_flight.shadowed())
        if self.nvme is not None:
            self.nvme.check_integrity()
        self.transfers.check_integrity()
