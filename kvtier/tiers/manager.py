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
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.cache.clean_pages import CleanPages
from kvtier.cache.page_pool import PageId, PagePool
from kvtier.cache.radix import RadixIndex, RadixNode
from kvtier.domain.errors import IntegrityError, InvalidArgument
from kvtier.domain.hashing import PageKey, short
from kvtier.domain.tiers import Tier
from kvtier.tiers.demotion import Demotions
from kvtier.tiers.dram import DramPool
from kvtier.tiers.moves import MoveOutcome, MoveTicket, PendingMove
from kvtier.tiers.nvme.format import SlotId
from kvtier.tiers.nvme.pool import NvmePool
from kvtier.tiers.page_codec import PageCodec
from kvtier.tiers.promotion import Promotions
from kvtier.tiers.room import RoomMaking
from kvtier.tiers.shadows import Shadow, ShadowCopies
from kvtier.tiers.transfer import TransferDone, TransferId, TransferReason
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


class TierManager(ShadowCopies, RoomMaking, Demotions, Promotions):
    """Owns the DRAM and NVMe pools and the transfer engine of one engine.

    Runs on the engine thread only (``maintain`` once per step); the transfer engine's
    worker threads never touch the index. Its parts, one concept each, share this state:
    shadows (``kvtier.tiers.shadows``), room-making and synchronous moves (``room``),
    demotions (``demotion``) and promotions (``promotion``); completed transfers are applied
    here, in ``poll``, and nowhere else.
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
        self._pending: dict[TransferId, PendingMove] = {}
        # A tier whose writes fail (disk full, I/O errors) gets no new pages for a while,
        # so the engine drops instead of retrying the same failing copy every step.
        self._failing_until: dict[Tier, float] = {}
        # Copies below of HBM pages promoted from DRAM or NVMe (module doc), oldest first; the
        # node one belongs to must still be that key's node, in HBM, for it to be used.
        # Oldest first per tier (an allocation there takes the oldest); a key has at most one.
        self._shadows: dict[Tier, OrderedDict[PageKey, Shadow]] = {Tier.DRAM: OrderedDict(), Tier.NVME: OrderedDict()}
        self._keep_shadow: RadixNode | None = None  # a promotion in progress keeps its page below
        # HBM pages free to take at no copy, kept as they change (None: simulated, no copies)
        self.clean = None if config.simulate else CleanPages(index, self._has_copy, self._copied_nodes)
        index.release_lower = self._release_lower
        # While a prefetch allocates, the pages it must not take (``start_prefetch(spared=...)``).
        self._spared: Collection[PageKey] = ()
        index.on_remove.append(self._free_shadow)
        index.on_move.append(self._on_moved)
        if self.nvme is not None:
            self._restore_nvme()

    @property
    def tiers(self) -> list[Tier]:
        return [t for t, p in ((Tier.HBM, self.hbm), (Tier.DRAM, self.dram), (Tier.NVME, self.nvme)) if p]

    def close(self) -> None:
        self.transfers.close()
        self.poll()
        if self.nvme is not None:
            self.nvme.close()

    # ---- locations ------------------------------------------------------------------
    def _release_lower(self, node: RadixNode) -> None:
        if node is self._keep_shadow:  # promoted: the copy below stays, identical (module doc)
            self._keep_shadow = None
            self._add_shadow(Shadow(node, node.tier, node.page, node.checksum))
            return
        self._release_copy(node.tier, node.page)

    def _release_copy(self, tier: Tier, page: int) -> None:
        if tier is Tier.DRAM:
            assert self.dram is not None
            self.dram.unmark_cached(PageId(page))
        elif tier is Tier.NVME:
            assert self.nvme is not None
            self.nvme.free(SlotId(page))

    def _num_free(self, tier: Tier) -> int:
        pool = {Tier.HBM: self.hbm, Tier.DRAM: self.dram, Tier.NVME: self.nvme}[tier]
        if pool is None:
            return 0
        if tier is Tier.HBM:
            return self.num_reclaimable()
        return pool.num_free + self.num_shadows(tier)  # shadows give way

    def num_reclaimable(self) -> int:
        """HBM pages an allocation can have without copying a byte: the free ones, and the idle
        ones whose copy below is intact (clean) with nothing under them in HBM that must stay
        (leaves leave first: a clean page above a held or uncopied page is not free to take).
        Exact at every call, and O(what changed since the last one) (``kvtier.cache.clean_pages``)."""
        return self.hbm.num_free + (0 if self.clean is None else self.clean.count())

    def is_clean(self, node: RadixNode) -> bool:
        """Whether ``node`` is one of the clean HBM pages ``num_reclaimable`` counts."""
        return self.clean is not None and self.clean.contains(node)

    def _set_moving(self, node: RadixNode, moving: bool) -> None:
        node.moving = moving
        self._touch(node)

    def _touch(self, node: RadixNode) -> None:
        """``node``'s copy below or moving flag changed: the clean set looks at it again."""
        if self.clean is not None:
            self.clean.touch(node)

    def capacity(self, tier: Tier) -> int:
        """Pages (slots on NVMe) this tier has; 0 when it is not configured."""
        if tier is Tier.NVME:
            return 0 if self.nvme is None else self.nvme.num_slots
        pool = self.hbm if tier is Tier.HBM else self.dram
        return 0 if pool is None else pool.num_pages

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
        in_flight = sum(len(p.nodes) for p in self._pending.values() if p.src is tier)
        want = math.ceil((1.0 - mark.low) * capacity) - free - in_flight
        if want > 0:
            self.demote(tier, dst, min(want, self.config.max_batch_pages), TransferReason.WATERMARK,
                        dirty_only=tier is Tier.HBM)

    def has_pending(self) -> bool:
        """Transfers started and not yet applied (finished ones wait for ``poll``)."""
        return bool(self._pending)

    def hbm_holds(self) -> dict[PageId, int]:
        """HBM pages this manager holds a reference on (sources of demotions in flight)."""
        holds: dict[PageId, int] = {}
        for p in self._pending.values():
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
        pending = self._pending.get(transfer_id)
        if pending is None:
            return
        ticket = pending.ticket
        if ticket is None:
            del self._pending[transfer_id]
            self._apply_demotion(pending, done)
            return
        pending.done = done
        ticket.num_open -= 1
        if ticket.num_open == 0:
            self._apply_ticket(ticket)

    def _apply_ticket(self, ticket: MoveTicket) -> None:
        parts = [self._pending.pop(tid) for tid in ticket.transfer_ids]
        if ticket.is_promotion:
            self._apply_prefetch(ticket, parts)
        else:
            # Slower sources first: a page in DRAM lies below the HBM pages of its chain, and a
            # page may leave its tier only once nothing below it is faster than its target.
            for part in sorted(parts, key=lambda p: -int(p.src)):
                assert part.done is not None
                moved = self._apply_demotion(part, part.done)
                ticket.num_moved += moved
                ticket.num_skipped += len(part.nodes) + len(part.shadowed) - moved
        self._finish(ticket)

    @staticmethod
    def _finish(ticket: MoveTicket) -> None:
        ticket.is_done = True
        if ticket.on_done is not None:
            ticket.on_done(ticket.outcome)

    def _free_target(self, tier: Tier, target: int) -> None:
        if tier is Tier.DRAM:
            assert self.dram is not None
            self.dram.release(PageId(target))
        elif tier is Tier.NVME:
            assert self.nvme is not None
            self.nvme.free(SlotId(target))
        else:
            self.hbm.release(PageId(target))

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
        if self.clean is not None:
            self.clean.check()
        if self.dram is not None:
            self.dram.check_integrity()
            held = sum(1 for n in self.index.nodes() if n.tier is Tier.DRAM)
            all_shadows = [*self._shadows[Tier.DRAM].values(),
                           *(e.shadow for p in self._pending.values() for e in p.shadowed)]
            shadows = [PageId(sh.page) for sh in all_shadows if sh.tier is Tier.DRAM]
            cached = sum(1 for p in range(self.dram.num_pages) if self.dram.is_cached(PageId(p)))
            if held + len(shadows) != cached:
                raise IntegrityError(
                    f"DRAM caches {cached} pages but the index places {held} there and {len(shadows)} are shadows")
            if len(set(shadows)) != len(shadows) or not all(self.dram.is_cached(p) for p in shadows):
                raise IntegrityError("a DRAM shadow page is shared or not cached")
        for key, shadow in [*self._shadows[Tier.DRAM].items(), *self._shadows[Tier.NVME].items()]:
            if shadow.node.key != key or self.index.get(key) is not shadow.node or shadow.node.tier is not Tier.HBM:
                raise IntegrityError(f"shadow of page {short(key)} outlived its HBM page")
            if shadow.tier is Tier.NVME:
                assert self.nvme is not None
                stored = self.nvme.entry(SlotId(shadow.page))
                if stored is None or stored[0] != key:
                    raise IntegrityError(f"nvme shadow slot {shadow.page} does not hold page {short(key)}")
        if self._shadows[Tier.DRAM].keys() & self._shadows[Tier.NVME].keys():
            raise IntegrityError("a page has shadows in two tiers")
        if self.nvme is not None:
            self.nvme.check_integrity()
        self.transfers.check_integrity()
