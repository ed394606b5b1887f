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
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.cache.clean_pages import CleanPages
from kvtier.cache.page_pool import PageId, PagePool
from kvtier.cache.radix import RadixIndex, RadixNode
from kvtier.domain.errors import IntegrityError, InvalidArgument
from kvtier.domain.hashing import PageKey, short
from kvtier.domain.tiers import Tier
from kvtier.tiers.dram import DramPool
from kvtier.tiers.nvme.format import SlotId
from kvtier.tiers.nvme.pool import NvmePool
from kvtier.tiers.transfer import TransferDone, TransferId, TransferReason, TransferStatus
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


class _SimulatedSlots:
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


@dataclass(frozen=True, slots=True)
class MoveOutcome:
    """Result of a commanded move: pages moved, and pages left where they were (held by a
    sequence, pinned, moving, under a faster child, or no room in the destination)."""

    num_moved: int
    num_skipped: int


@dataclass(slots=True, eq=False)
class MoveTicket:
    """A commanded move (controller Demote / Prefetch) while its transfers run.

    Its transfers are applied together once the last one completes (a prefetch's DRAM
    parents must land before its NVMe children; a park's DRAM pages before the HBM pages
    above them). Then ``is_done`` is set and ``on_done`` runs once, on the engine thread,
    with the final outcome. A ticket with nothing to move is done when it is returned.
    """

    is_promotion: bool
    num_moved: int = 0
    num_skipped: int = 0
    promoted: list[PageKey] = field(default_factory=list)  # a promotion's pages that went up, once applied
    transfer_ids: list[TransferId] = field(default_factory=list)
    num_open: int = 0  # transfers not completed yet
    hold: RadixNode | None = None  # a prefetch pins the chain's deepest HBM page meanwhile
    is_done: bool = False
    on_done: Callable[[MoveOutcome], None] | None = None

    @property
    def outcome(self) -> MoveOutcome:
        return MoveOutcome(num_moved=self.num_moved, num_skipped=self.num_skipped)


@dataclass(frozen=True, slots=True)
class _Shadow:
    """An HBM page's identical copy below: the DRAM page or NVMe slot it was promoted from."""

    node: RadixNode
    tier: Tier
    page: int
    checksum: int | None


@dataclass(frozen=True, slots=True)
class _Shadowed:
    """A demotion onto a shadow, reserved until applied (the node's HBM page is held)."""

    shadow: _Shadow
    hbm_page: PageId


@dataclass(slots=True)
class _Pending:
    nodes: list[RadixNode]
    dsts: list[int]
    src: Tier
    dst: Tier
    ticket: MoveTicket | None = None  # a commanded move's part: applied with the whole ticket
    done: TransferDone | None = None  # completed, waiting for the ticket's other parts
    # HBM pages that go back onto their copy below, no bytes copied; applied with the copied
    # ones, deepest first (their HBM pages held meanwhile).
    shadowed: list[_Shadowed] = field(default_factory=list)


class TierManager:
    """Owns the DRAM and NVMe pools and the transfer engine of one engine.

    Runs on the engine thread only (``maintain`` once per step); the transfer engine's
    worker threads never touch the index.
    """

    def __init__(self, index: RadixIndex, config: TierConfig) -> None:
        config.hbm_watermark.validate("hbm")
        config.dram_watermark.validate("dram")
        self.index = index
        self.hbm: PagePool = index.pool
        self.config = config
        geometry = self.hbm.geometry
        self.page_bytes = geometry.page_bytes
        self.dram = DramPool(config.dram_pages, geometry) if config.dram_pages > 0 else None
        self.nvme: NvmePool | None = None
        if config.nvme_slots > 0 and config.simulate:
            self.nvme = _SimulatedSlots(config.nvme_slots)  # type: ignore[assignment]
        elif config.nvme_slots > 0:
            if config.nvme_dir is None:
                raise InvalidArgument("an NVMe tier needs a directory", field="nvme_dir")
            self.nvme = NvmePool(config.nvme_dir, config.nvme_slots, geometry)
        self.transfers = TransferEngine(
            self.hbm, self.dram, None if config.simulate else self.nvme,
            budget_bytes_per_s=config.demotion_budget_bytes_per_s,
            link_bytes_per_s=None if config.simulate else config.link_bytes_per_s,
        )
        self.counters = TierCounters()
        self._pending: dict[TransferId, _Pending] = {}
        # A tier whose writes fail (disk full, I/O errors) gets no new pages for a while,
        # so the engine drops instead of retrying the same failing copy every step.
        self._failing_until: dict[Tier, float] = {}
        # Copies below of HBM pages promoted from DRAM or NVMe (module doc), oldest first; the
        # node one belongs to must still be that key's node, in HBM, for it to be used.
        # Oldest first per tier (an allocation there takes the oldest); a key has at most one.
        self._shadows: dict[Tier, OrderedDict[PageKey, _Shadow]] = {Tier.DRAM: OrderedDict(), Tier.NVME: OrderedDict()}
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
            self._add_shadow(_Shadow(node, node.tier, node.page, node.checksum))
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

    def reclaim_clean(self, *, search: int = 32) -> bool:
        """Free one HBM page at no copy: the coldest of the ``search`` coldest idle pages whose
        copy below is intact goes back onto it (while a prefetch allocates, not one it spares:
        ``start_prefetch``). False when none of them has one, or the manager is simulated."""
        if self.clean is None or self.clean.count() == 0:
            return False  # an idle HBM leaf with a copy below would be clean: there is none to find
        skipped: list[RadixNode] = []
        chosen: RadixNode | None = None
        while chosen is None and len(skipped) < search:
            popped = self.index.pop_victims(Tier.HBM, 1)
            if not popped:
                break
            if self._shadow_of(popped[0].key) is not None and popped[0].key not in self._spared:
                chosen = popped[0]
            else:
                skipped.append(popped[0])
        for node in skipped:
            self.index.requeue(node)
        if chosen is None:
            return False
        shadow = self._take_shadow(chosen, Tier.DRAM) or self._take_shadow(chosen, Tier.NVME)
        if shadow is None:
            self.index.requeue(chosen)
            return False
        self._onto_shadow(shadow)
        return True

    # ---- copies below of promoted pages (shadows) --------------------------------------
    def _move_up(self, node: RadixNode, page: int) -> None:
        """Point ``node`` at its new HBM page; the page it leaves below stays as its shadow."""
        self._keep_shadow = node if node.tier is not Tier.HBM and not self.config.simulate else None
        try:
            self.index.move(node, Tier.HBM, page)
        finally:
            self._keep_shadow = None

    def num_shadows(self, tier: Tier) -> int:
        """Pages of ``tier`` that are copies of HBM pages (module doc): cached, and free to take."""
        shadows = self._shadows.get(tier)
        return 0 if shadows is None else len(shadows)

    def _add_shadow(self, shadow: _Shadow) -> None:
        self._shadows[shadow.tier][shadow.node.key] = shadow
        self._touch(shadow.node)

    def _shadow_of(self, key: PageKey) -> _Shadow | None:
        return self._shadows[Tier.DRAM].get(key) or self._shadows[Tier.NVME].get(key)

    def _has_copy(self, node: RadixNode) -> bool:
        shadow = self._shadow_of(node.key)
        return shadow is not None and shadow.node is node

    def _copied_nodes(self) -> list[RadixNode]:
        return [shadow.node for shadows in self._shadows.values() for shadow in shadows.values()]

    def _pop_shadow(self, shadow: _Shadow) -> _Shadow:
        self._touch(shadow.node)
        return self._shadows[shadow.tier].pop(shadow.node.key)

    def _set_moving(self, node: RadixNode, moving: bool) -> None:
        node.moving = moving
        self._touch(node)

    def _touch(self, node: RadixNode) -> None:
        """``node``'s copy below or moving flag changed: the clean set looks at it again."""
        if self.clean is not None:
            self.clean.touch(node)

    def _on_moved(self, node: RadixNode, old: Tier) -> None:
        if old is Tier.HBM:  # left HBM other than onto its shadow: the copy is of no more use
            self._free_shadow(node)

    def _free_shadow(self, node: RadixNode) -> None:
        shadow = self._shadow_of(node.key)
        if shadow is not None and shadow.node is node:
            self._pop_shadow(shadow)
            self._release_copy(shadow.tier, shadow.page)

    def _drop_oldest_shadow(self, tier: Tier) -> bool:
        """Free the oldest shadow in ``tier`` (an allocation there found no free page)."""
        if not self._shadows[tier]:
            return False
        _, shadow = self._shadows[tier].popitem(last=False)
        self._touch(shadow.node)
        self._release_copy(shadow.tier, shadow.page)
        return True

    def _take_shadow(self, node: RadixNode, tier: Tier) -> _Shadow | None:
        """``node``'s copy in ``tier`` (it must be that key's node, in HBM), removed from the
        shadows (the caller applies or frees it); None when it has none there."""
        shadow = self._shadows[tier].get(node.key)
        if (shadow is None or shadow.node is not node
                or self.index.get(node.key) is not node or node.tier is not Tier.HBM):
            return None
        return self._pop_shadow(shadow)

    def _onto_shadow(self, shadow: _Shadow) -> None:
        self.index.move(shadow.node, shadow.tier, shadow.page, shadow.checksum)
        self.counters.demotions_without_copy += 1

    def _defer_shadowed(self, node: RadixNode, tier: Tier) -> _Shadowed | None:
        """Reserve ``node``'s demotion onto its shadow in ``tier``, applied later with a
        transfer's pages: marked moving and its HBM page held meanwhile, as a copied page is."""
        shadow = self._take_shadow(node, tier)
        if shadow is None:
            return None
        self._set_moving(node, True)
        self.hbm.acquire(PageId(node.page))
        return _Shadowed(shadow, PageId(node.page))

    def _apply_shadowed(self, entry: _Shadowed) -> bool:
        """Demote a reserved node onto its shadow if it is still idle in HBM with nothing
        faster below it; otherwise it stays (its shadow with it) or, gone, the copy is freed.
        True when it moved."""
        shadow, node = entry.shadow, entry.shadow.node
        self._set_moving(node, False)
        still_here = self.index.get(node.key) is node and node.tier is Tier.HBM and node.page == entry.hbm_page
        idle = still_here and self.hbm.ref_count(entry.hbm_page) == 1 and not node.pins
        self.hbm.release(entry.hbm_page)
        if idle and all(c.tier >= shadow.tier for c in node.children.values()):
            self._onto_shadow(shadow)
            return True
        if still_here:  # picked up meanwhile, or a child stayed: still identical to its copy
            self._add_shadow(shadow)
            self.index.requeue(node)
        else:
            self._release_copy(shadow.tier, shadow.page)
        return False

    def capacity(self, tier: Tier) -> int:
        """Pages (slots on NVMe) this tier has; 0 when it is not configured."""
        if tier is Tier.NVME:
            return 0 if self.nvme is None else self.nvme.num_slots
        pool = self.hbm if tier is Tier.HBM else self.dram
        return 0 if pool is None else pool.num_pages

    def _allocate(self, tier: Tier, *, make_room: bool = True) -> int | None:
        """A destination page/slot in ``tier``, making room there by moving or dropping
        (only a free one without ``make_room``)."""
        for _ in range(2):
            if tier is Tier.DRAM and self.dram is not None:
                page = self.dram.allocate()
                if page is None and self._drop_oldest_shadow(Tier.DRAM):
                    page = self.dram.allocate()
                if page is not None:
                    return page
            elif tier is Tier.NVME and self.nvme is not None:
                slot = self.nvme.allocate()
                if slot is None and self._drop_oldest_shadow(Tier.NVME):
                    slot = self.nvme.allocate()
                if slot is not None:
                    return slot
            elif tier is Tier.HBM:
                page = self.hbm.allocate()
                if page is not None:
                    return page
            if not make_room or not self._make_room(tier):
                return None
        return None

    def _make_room(self, tier: Tier) -> bool:
        if tier is Tier.HBM:
            return self.free_hbm_page()
        victims = self.index.pop_victims(tier, 1)
        if not victims:
            return False
        victim = victims[0]
        if tier is Tier.DRAM and self._move_now(victim, Tier.NVME, TransferReason.EVICTION, allow_room=True):
            return True
        if self.index.holds_pin(victim):
            self.index.requeue(victim)
            return False
        self.counters.pages_dropped += self.index.drop_subtree(victim)
        return True

    # ---- synchronous moves ----------------------------------------------------------
    def free_hbm_page(self) -> bool:
        """Free one HBM page for an allocation that found none: a clean page goes back onto its
        copy below (``reclaim_clean``), else the policy's next victim is spilled (``spill``).
        Victims ``spill`` keeps are handed back to the index. False when nothing could go."""
        kept: list[RadixNode] = []
        try:
            while True:
                if self.reclaim_clean():
                    return True
                victims = self.index.pop_victims(Tier.HBM, 1)
                if not victims:
                    return False
                if self.spill(victims[0]):
                    return True
                kept.append(victims[0])
        finally:
            for node in kept:
                self.index.requeue(node)

    def spill(self, node: RadixNode) -> bool:
        """Free an HBM victim's page now (allocation fallback): move it down a tier, or
        drop it with its subtree when no lower tier has room or works. False (keep it)
        when that subtree holds a pinned page, or while a prefetch allocates, a page it spares
        (``start_prefetch``)."""
        if node.key in self._spared:
            return False
        for tier in (Tier.DRAM, Tier.NVME):
            if self._move_now(node, tier, TransferReason.EVICTION, allow_room=True):
                return True
        if self.index.holds_pin(node):
            return False
        self.counters.pages_dropped += self.index.drop_subtree(node)
        return True

    def move_to_free(self, node: RadixNode, dst: Tier) -> bool:
        """Move an evictable ``node`` down to ``dst`` now, only into a free page there (nothing
        in ``dst`` is moved or dropped to make room: quota enforcement, ``kvtier.cache.quotas``)."""
        return self._move_now(node, dst, TransferReason.EVICTION, allow_room=False)

    def is_usable(self, tier: Tier) -> bool:
        return self.capacity(tier) > 0 and time.monotonic() >= self._failing_until.get(tier, 0.0)

    def _mark_failing(self, tier: Tier) -> None:
        self._failing_until[tier] = time.monotonic() + self.config.failure_backoff_s

    def _move_now(self, node: RadixNode, dst: Tier, reason: TransferReason, *, allow_room: bool) -> bool:
        """Move ``node`` down to ``dst`` before returning: onto its shadow there, else through a
        transfer run on this thread (``TransferEngine.run``) and applied once acknowledged."""
        # A child may not sit in a faster tier than its parent: with DRAM full of pinned
        # or moving pages, an HBM page with a DRAM child cannot skip to NVMe.
        if not self.is_usable(dst) or any(c.tier < dst for c in node.children.values()):
            return False
        if (shadow := self._take_shadow(node, dst)) is not None:
            self._onto_shadow(shadow)
            return True
        self._set_moving(node, True)  # not a victim while we make room below
        try:
            target = self._allocate(dst, make_room=allow_room)
            if target is None:
                return False
            checksum = None if node.tier is Tier.HBM else node.checksum
            if self.config.simulate:
                if dst is Tier.DRAM:
                    self._adopt_dram(PageId(target))
            else:
                done = self._copy_now(node, dst, target, reason)
                if not done.is_ok:  # disk full or failing: drop instead
                    self.counters.disk_full_events += 1
                    self._mark_failing(dst)
                    log.warning("%s write failed, dropping instead: %s", dst.label, done.error)
                    if not done.dst_released:
                        self._free_target(dst, target)
                    return False
                if node.tier is Tier.HBM:
                    checksum = done.checksums[0]
                if dst is Tier.DRAM:
                    self._adopt_dram_copy(PageId(target), checksum)
                self.counters.spill_link_wait_s += done.link_wait_s
            self.counters.moved(node.tier, dst, 1, self.page_bytes)
            src = node.tier
            self._set_moving(node, False)
            self.index.move(node, dst, target, checksum)
            log.debug("moved page %s %s -> %s", short(node.key), src.label, dst.label)
            return True
        finally:
            self._set_moving(node, False)

    def _copy_now(self, node: RadixNode, dst: Tier, target: int, reason: TransferReason) -> TransferDone:
        """Copy ``node``'s page into ``target`` in ``dst`` on this thread; its acknowledgement."""
        if node.tier is Tier.DRAM:
            assert self.dram is not None
            self.dram.set_checksums([PageId(node.page)], [node.checksum or 0])
        fields = self._nvme_fields([node]) if dst is Tier.NVME else {}
        return self.transfers.run(node.tier, dst, [(node.page, target)], reason, **fields)

    @staticmethod
    def _nvme_fields(nodes: Sequence[RadixNode]) -> dict:
        """What a transfer to NVMe stores in each slot's header, so a restart can re-index it."""
        return dict(
            keys=[n.key for n in nodes],
            namespaces=[n.namespace or b"\0" * 16 for n in nodes],
            parents=[n.parent.key if n.parent else None for n in nodes],
            tokens=[n.tokens for n in nodes],
        )

    def _adopt_dram_copy(self, page: PageId, checksum: int | None) -> None:
        """A page copied down into DRAM: its checksum recorded, then the index's (``_adopt_dram``)."""
        assert self.dram is not None
        self.dram.set_checksums([page], [checksum or 0])
        self._adopt_dram(page)

    def _adopt_dram(self, page: PageId) -> None:
        """The index now owns this DRAM page (allocated with one reference)."""
        assert self.dram is not None
        self.dram.mark_cached(page)
        self.dram.release(page)

    # ---- asynchronous demotion --------------------------------------------------------
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

    def demote(self, src: Tier, dst: Tier, num_pages: int, reason: TransferReason, *, dirty_only: bool = False) -> int:
        """Start moving up to ``num_pages`` of ``src``'s coldest idle pages to ``dst``; returns
        how many are leaving (or, demoted onto their DRAM copy, already left). ``dirty_only``:
        only pages with no copy below (a clean page is reclaimed when its room is needed)."""
        if dirty_only:
            picked: list[RadixNode] = []
            clean: list[RadixNode] = []
            while len(picked) < num_pages:
                popped = self.index.pop_victims(src, num_pages - len(picked))
                if not popped:
                    break
                for node in popped:
                    (clean if self._shadow_of(node.key) is not None else picked).append(node)
            for node in clean:
                self.index.requeue(node)
            victims = self._with_ancestors(picked, src, num_pages, dirty_only=True)
        else:
            victims = self._with_ancestors(self.index.pop_victims(src, num_pages), src, num_pages)
        nodes, dsts = [], []
        shadowed: list[_Shadowed] = []
        for node in victims:
            if src is Tier.HBM and (entry := self._defer_shadowed(node, dst)) is not None:
                shadowed.append(entry)
                continue
            self._set_moving(node, True)
            target = self._allocate(dst)
            if target is None:
                self._set_moving(node, False)
                self.index.requeue(node)
                break
            nodes.append(node)
            dsts.append(target)
        for node in victims[len(nodes) + len(shadowed) :]:
            self.index.requeue(node)
        if not nodes:  # nothing to copy: what has a copy below goes at once
            return sum(self._apply_shadowed(entry) for entry in shadowed)
        self._submit_demotion(nodes, dsts, src, dst, reason, shadowed=shadowed)
        return len(nodes) + len(shadowed)

    def _submit_demotion(
        self, nodes: list[RadixNode], dsts: list[int], src: Tier, dst: Tier, reason: TransferReason,
        ticket: MoveTicket | None = None, *, shadowed: list[_Shadowed] | None = None,
    ) -> TransferId:
        """Copy ``nodes`` (marked moving, deepest first) into the allocated ``dsts``."""
        src_pool = self.hbm if src is Tier.HBM else self.dram
        assert src_pool is not None
        for node in nodes:  # held until applied: not freed or reused under the copy
            src_pool.acquire(PageId(node.page))
        kwargs = self._nvme_fields(nodes) if dst is Tier.NVME else {}
        if src is Tier.DRAM:
            assert self.dram is not None
            self.dram.set_checksums([PageId(n.page) for n in nodes], [n.checksum or 0 for n in nodes])
        transfer = self.transfers.submit(src, dst, list(zip([n.page for n in nodes], dsts, strict=True)), reason, **kwargs)
        self._pending[transfer.transfer_id] = _Pending(nodes, dsts, src, dst, ticket, shadowed=shadowed or [])
        if ticket is not None:
            ticket.transfer_ids.append(transfer.transfer_id)
            ticket.num_open += 1
        return transfer.transfer_id

    def _with_ancestors(self, victims: list[RadixNode], tier: Tier, limit: int, *, dirty_only: bool = False) -> list[RadixNode]:
        """Extend leaf victims upwards: a parent whose same-tier children all go in this
        batch can go too. Deepest first, so applying in order never puts a child above
        its parent's tier."""
        chosen = {n.key: n for n in victims}
        for leaf in victims:
            node = leaf.parent
            while node is not None and len(chosen) < limit and node.key not in chosen:
                same_or_faster = [c for c in node.children.values() if c.tier <= tier]
                if (
                    node.tier is not tier
                    or node.pins
                    or node.moving
                    or (tier is Tier.HBM and self.hbm.ref_count(PageId(node.page)) > 0)
                    or any(c.key not in chosen for c in same_or_faster)
                    or (dirty_only and self._shadow_of(node.key) is not None)
                ):
                    break
                chosen[node.key] = node
                node = node.parent
        return sorted(chosen.values(), key=lambda n: -n.depth)

    def num_leaving(self, tier: Tier) -> int:
        """Pages of ``tier`` in background transfers to a slower tier: freed there once applied."""
        return sum(len(p.nodes) + len(p.shadowed) for p in self._pending.values() if p.src is tier and p.dst > tier)

    def wait_leaving(self, tier: Tier, timeout_s: float = 30.0) -> None:
        """Block, applying transfers as they complete, until no background transfer out of
        ``tier`` is left (or ``timeout_s`` passed): the pages they carry are free once applied.
        For an allocation that found every idle page on its way down (decision 0012)."""
        deadline = time.monotonic() + timeout_s
        while any(p.src is tier for p in self._pending.values()):
            left_s = deadline - time.monotonic()
            if left_s <= 0 or not self.poll(timeout_s=left_s):
                break
        self.poll()

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

    def _apply_demotion(self, pending: _Pending, done: TransferDone) -> int:
        """Point the index at the pages that arrived and are still idle; returns how many."""
        src_pool = self.hbm if pending.src is Tier.HBM else self.dram
        assert src_pool is not None
        moved = copied = 0
        # Deepest first across the copied pages and those going back onto their DRAM copy: a
        # page may leave its tier only once nothing below it is faster than its target.
        order: list[tuple[int, int | None, _Shadowed | None]] = [
            (-n.depth, i, None) for i, n in enumerate(pending.nodes)]
        order += [(-entry.shadow.node.depth, None, entry) for entry in pending.shadowed]
        order.sort(key=lambda o: o[0])
        for _, index, entry in order:
            if entry is not None:
                moved += self._apply_shadowed(entry)
                continue
            assert index is not None
            i, node, target = index, pending.nodes[index], pending.dsts[index]
            self._set_moving(node, False)
            still_here = self.index.get(node.key) is node and node.tier is pending.src
            # Our own hold is the only reference: no sequence picked the page up meanwhile, and
            # nobody pinned it to its tier meanwhile (a session's hold or a prefetch recalled it).
            idle = still_here and src_pool.ref_count(PageId(node.page)) == 1 and not node.pins
            src_pool.release(PageId(node.page))
            # A child that stayed behind (reused meanwhile) keeps its parent in this tier.
            children_below = all(c.tier >= pending.dst for c in node.children.values())
            checksum = done.checksums[i] if i < len(done.checksums) else node.checksum
            if done.is_ok and idle and children_below:
                if pending.dst is Tier.DRAM:
                    self._adopt_dram_copy(PageId(target), checksum)
                self.index.move(node, pending.dst, target, checksum)
                moved += 1
                copied += 1
                continue
            if (still_here and done.is_ok and pending.src is Tier.HBM and pending.dst is Tier.DRAM
                    and self._shadow_of(node.key) is None):
                # It stays, and the copy that arrived intact is its shadow (decision 0012): when
                # it does leave, it goes back onto it without a second copy.
                self._adopt_dram_copy(PageId(target), checksum)
                self._add_shadow(_Shadow(node, Tier.DRAM, target, checksum))
            elif not (done.dst_released and pending.dst is Tier.NVME):
                self._free_target(pending.dst, target)
            if still_here:
                if done.is_ok:
                    self.counters.demotions_abandoned += 1
                    self.counters.demotions_kept += src_pool.ref_count(PageId(node.page)) == 0
                self.index.requeue(node)
        if copied:
            self.counters.moved(pending.src, pending.dst, copied, self.page_bytes)
        if done.error is not None:
            self.counters.disk_full_events += 1
            self._mark_failing(pending.dst)
            log.warning("demotion %s -> %s failed: %s", pending.src.label, pending.dst.label, done.error)
        return moved

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

    def demote_all(self, dst: Tier) -> int:
        """Move every idle cached page above ``dst`` down to it, synchronously (drain, tests)."""
        if dst is Tier.DRAM:
            steps = [(Tier.HBM, Tier.DRAM)]
        elif self.dram is not None:
            steps = [(Tier.HBM, Tier.DRAM), (Tier.DRAM, Tier.NVME)]
        else:
            steps = [(Tier.HBM, Tier.NVME)]
        moved = 0
        for src, to in steps:
            while victims := self.index.pop_victims(src, 1):
                if not self._move_now(victims[0], to, TransferReason.DRAIN, allow_room=True):
                    self.index.requeue(victims[0])
                    break
                moved += 1
        return moved

    # ---- commanded moves (controller Demote / Prefetch) ---------------------------------
    def demote_pages(self, nodes: Sequence[RadixNode], dst: Tier) -> MoveOutcome:
        """``start_demotion`` and wait until it is applied (tests, tools)."""
        return self.wait_for(self.start_demotion(nodes, dst))

    def prefetch(self, chain: Sequence[RadixNode]) -> MoveOutcome:
        """``start_prefetch`` and wait until it is applied (tests, tools)."""
        return self.wait_for(self.start_prefetch(chain))

    def wait_for(self, ticket: MoveTicket) -> MoveOutcome:
        """Block (applying every transfer that completes meanwhile) until ``ticket`` is done."""
        while not ticket.is_done:
            if not self.poll(timeout_s=WAIT_STEP_S) and not self.transfers.num_pending and not ticket.is_done:
                raise IntegrityError(f"move ticket has {ticket.num_open} open transfers but none is pending")
        return ticket.outcome

    def start_demotion(self, nodes: Sequence[RadixNode], dst: Tier) -> MoveTicket:
        """Start moving the idle ones of ``nodes`` down to ``dst``; applied when all arrived.

        Deepest first: a page may only leave its tier once nothing below it is faster than
        ``dst`` (its children go in the same ticket or are there already). A page held by a
        running sequence, pinned, already moving, or with a held page below it stays and is
        counted as skipped, as is one for which ``dst`` has no room; a page a sequence picks
        up before the copy lands stays too (counted when applied). Pages already in ``dst``
        or below are neither moved nor skipped. Paced by the transfer engine's budget.
        """
        ticket = MoveTicket(is_promotion=False)
        chosen: set[PageKey] = set()
        groups: dict[Tier, tuple[list[RadixNode], list[int]]] = {}
        shadowed: list[_Shadowed] = []
        for node in sorted(nodes, key=lambda n: -n.depth):
            if node.tier >= dst:
                continue
            if self._may_leave(node, dst, chosen) and (entry := self._defer_shadowed(node, dst)):
                chosen.add(node.key)
                shadowed.append(entry)
                continue
            target = self._reserve_below(node, dst, chosen)
            if target is None:
                ticket.num_skipped += 1
                continue
            chosen.add(node.key)
            group = groups.setdefault(node.tier, ([], []))
            group[0].append(node)
            group[1].append(target)
        if shadowed and not groups:  # nothing to copy: onto their copies at once
            moved = sum(self._apply_shadowed(entry) for entry in shadowed)
            ticket.num_moved += moved
            ticket.num_skipped += len(shadowed) - moved
            shadowed = []
        # Shadowed pages go with the part applied last (the HBM one, else the DRAM one: parts
        # apply slower sources first), after every page below them has landed.
        last = Tier.HBM if Tier.HBM in groups else Tier.DRAM
        for src, (group_nodes, dsts) in groups.items():
            self._submit_demotion(group_nodes, dsts, src, dst, TransferReason.PARK, ticket,
                                  shadowed=shadowed if src is last else None)
        if not ticket.num_open:
            self._finish(ticket)
        return ticket

    def _may_leave(self, node: RadixNode, dst: Tier, chosen: set[PageKey]) -> bool:
        """Whether a commanded demotion may take ``node`` down to ``dst`` (``chosen``: the
        pages below it already going in the same ticket)."""
        return not (
            self.index.get(node.key) is not node
            or node.pins
            or node.moving
            or (node.tier is Tier.HBM and self.hbm.ref_count(PageId(node.page)) > 0)
            or not self.is_usable(dst)
            or any(c.tier < dst and c.key not in chosen for c in node.children.values())
        )

    def _reserve_below(self, node: RadixNode, dst: Tier, chosen: set[PageKey]) -> int | None:
        """A destination in ``dst`` for ``node`` (then marked moving), or None: it stays."""
        if not self._may_leave(node, dst, chosen):
            return None
        self._set_moving(node, True)  # not a victim while we make room below
        target = self._allocate(dst)
        if target is None:
            self._set_moving(node, False)
            self.index.requeue(node)
        return target

    def start_prefetch(
        self, chain: Sequence[RadixNode], *, for_request: bool = False, spared: Collection[PageKey] = (),
    ) -> MoveTicket:
        """Start promoting the lower-tier pages of ``chain`` (root first) into HBM, where they
        stay cached and idle once applied (``for_request``: a request waits for them, the engine
        loop's promotion before admission, so a promotion on hit at its priority). Stops at the
        first page below HBM that a transfer is moving (between lower tiers, or up already): a
        child may not rise above its parent. Pages left below (no room, a page moving) are
        skipped; so are those whose transfer fails or is cancelled.

        A page of the chain still in HBM but on its way down (a watermark demotion that picked
        it a moment before) is recalled, not a stop: the pin on the chain's deepest HBM page
        keeps it (and so every ancestor in the same demotion) in HBM when that transfer lands.
        The caller's own pin takes over once the ticket is applied (a session's hold, a waiting
        request's pin); a caller that pins nothing lets it go down after all.

        ``spared``: keys of HBM pages the allocations for this prefetch must not take (the engine
        loop passes those brought up for sessions due back no later than this one: they would go
        down unused, and come up again or be promoted on arrival; decision 0008). Pages with no
        room but theirs are skipped, as with no room at all."""
        ticket = MoveTicket(is_promotion=True)
        num_below = sum(1 for n in chain if n.tier is not Tier.HBM)
        lower: list[RadixNode] = []
        hold: RadixNode | None = None  # the deepest of the chain's pages already in HBM
        for node in chain:
            if node.tier is Tier.HBM:
                # On its way down or not, it stays: the pin below recalls a demotion in flight
                # (``_apply_demotion`` leaves a pinned page where it is).
                hold = node
                continue
            if node.moving:  # on its way between lower tiers: nothing below it may rise above it
                break
            lower.append(node)
        if self.config.simulate:  # completes at once (no bytes to copy)
            if hold is not None:
                self.index.pin(hold.key)
            promoted = self._promote_now(lower)
            if hold is not None:
                self.index.unpin(hold.key)
            self._settle_prefetched(promoted)
            ticket.num_moved, ticket.num_skipped = len(promoted), num_below - len(promoted)
            ticket.promoted = [n.key for n in promoted]
            self._finish(ticket)
            return ticket
        # Making room for the pages coming up must not spill their ancestors (idle, and leaves
        # in HBM while their children are below): a child may not rise above its parent. One
        # pin on the deepest holds the chain above it (leaves go first) until the ticket is applied.
        if hold is not None and lower:
            self.index.pin(hold.key)
            ticket.hold = hold
        self._spared = spared
        try:
            pages = self._allocate_hbm(lower)
        finally:
            self._spared = ()
        lower = lower[: len(pages)]
        ticket.num_skipped = num_below - len(lower)
        groups: dict[Tier, list[int]] = {}
        for i, node in enumerate(lower):
            groups.setdefault(node.tier, []).append(i)
        for tier, idx in groups.items():  # DRAM (the parents) before NVMe
            if tier is Tier.DRAM:
                assert self.dram is not None
                self.dram.set_checksums([PageId(lower[i].page) for i in idx], [lower[i].checksum or 0 for i in idx])
            nodes = [lower[i] for i in idx]
            dsts = [int(pages[i]) for i in idx]
            # Above background demotions in the lanes; below a request's promotion on hit.
            transfer = self.transfers.submit(
                tier, Tier.HBM, list(zip([n.page for n in nodes], dsts, strict=True)),
                TransferReason.PROMOTION_ON_HIT if for_request else TransferReason.PREFETCH,
                priority=10 if for_request else 5,
            )
            self._pending[transfer.transfer_id] = _Pending(nodes, dsts, tier, Tier.HBM, ticket)
            ticket.transfer_ids.append(transfer.transfer_id)
            ticket.num_open += 1
        if not ticket.num_open:
            self._release_hold(ticket)
            self._finish(ticket)
        return ticket

    def _allocate_hbm(self, nodes: list[RadixNode]) -> list[PageId]:
        """HBM pages for ``nodes`` (a chain, parents first), as many as there is room for.
        ``nodes`` are marked moving (not victims while we make room); those that get a page
        stay so, the rest are victims again."""
        for node in nodes:
            self._set_moving(node, True)
        pages: list[PageId] = []
        for _ in nodes:
            page = self._allocate(Tier.HBM)
            if page is None:
                break
            pages.append(PageId(page))
        for node in nodes[len(pages) :]:  # staying below: a victim again (a pop skipped it)
            self._set_moving(node, False)
            self.index.requeue(node)
        return pages

    def _release_hold(self, ticket: MoveTicket) -> None:
        hold, ticket.hold = ticket.hold, None
        if hold is not None and self.index.get(hold.key) is hold and hold.pins > 0:
            self.index.unpin(hold.key)

    def _apply_prefetch(self, ticket: MoveTicket, parts: list[_Pending]) -> None:
        """Point the index at the pages that arrived intact, parents first; stop at the first
        that did not (cancelled, failed, a checksum mismatch: that page and its subtree are
        dropped, as on a promotion on hit)."""
        promoted: list[RadixNode] = []
        failed_at: RadixNode | None = None
        is_stopped = False
        for part in sorted(parts, key=lambda p: int(p.src)):
            done = part.done
            assert done is not None
            verified = done.verified if done.verified is not None else [done.is_ok] * len(part.nodes)
            num_ok = 0
            for j, (node, page) in enumerate(zip(part.nodes, part.dsts, strict=True)):
                self._set_moving(node, False)
                in_place = self.index.get(node.key) is node and node.tier is part.src
                arrived = done.status is TransferStatus.OK and verified[j]
                num_ok += arrived
                parent_in_hbm = node.parent is None or node.parent.tier is Tier.HBM
                if not is_stopped and in_place and arrived and parent_in_hbm:
                    self._move_up(node, page)
                    promoted.append(node)
                    continue
                self.hbm.release(PageId(page))
                if in_place:
                    self.index.requeue(node)
                    if not is_stopped and done.status is TransferStatus.OK and not verified[j]:
                        failed_at = node
                is_stopped = True
            self.counters.moved(part.src, Tier.HBM, num_ok, self.page_bytes)
        if failed_at is not None and self.index.get(failed_at.key) is failed_at:
            self.counters.checksum_failures += 1
            self.counters.pages_dropped += self.index.drop_subtree(failed_at)
            log.warning("page %s failed its checksum on prefetch; dropped", short(failed_at.key))
        self._release_hold(ticket)
        self._settle_prefetched(promoted)
        ticket.num_moved = len(promoted)
        ticket.promoted = [n.key for n in promoted]
        ticket.num_skipped += sum(len(p.nodes) for p in parts) - len(promoted)

    def _settle_prefetched(self, promoted: list[RadixNode]) -> None:
        # A prefetch is a use to come (the session returns soon): counted as one, so the pages
        # are not the first victims of the next demotion with an access clock as old as the
        # pause. Touched while still held, they enter the eviction heap with the new clock.
        self.index.touch(promoted)
        for node in promoted:  # each arrived with one reference (its allocation); the cache keeps it
            self.hbm.release(PageId(node.page))

    def _prefetches_of(self, nodes: Sequence[RadixNode]) -> list[MoveTicket]:
        keys = {n.key for n in nodes}
        tickets: dict[int, MoveTicket] = {}
        for part in self._pending.values():
            if part.ticket is not None and part.ticket.is_promotion and any(n.key in keys for n in part.nodes):
                tickets[id(part.ticket)] = part.ticket
        return list(tickets.values())

    def cancel_prefetches(self, nodes: Sequence[RadixNode]) -> int:
        """Cancel the prefetches in flight for any of ``nodes`` and apply them now: pages of a
        transfer that completed first land, the others stay below. Returns how many."""
        tickets = self._prefetches_of(nodes)
        for ticket in tickets:
            for transfer_id in ticket.transfer_ids:
                self.transfers.cancel(transfer_id)
        for ticket in tickets:
            self.wait_for(ticket)
        return len(tickets)

    # ---- promotion --------------------------------------------------------------------
    def promote(self, nodes: Sequence[RadixNode]) -> list[RadixNode]:
        """Bring matched lower-tier pages (a chain, parents first) into HBM, verified.

        Returns the leading nodes now in HBM, each with one reference held for the
        caller. A page that fails its checksum is dropped with its subtree; nodes after
        it are not returned (the caller recomputes from there). Pages a prefetch is
        bringing up are waited for (and count as promoted: the request waited for them),
        never copied twice.
        """
        if not nodes:
            return []
        start = time.perf_counter()
        arrived: list[RadixNode] = []
        if prefetches := self._prefetches_of(nodes):
            for ticket in prefetches:
                self.wait_for(ticket)
            # What landed now leads the chain in HBM; a page the prefetch left below (or that a
            # failed checksum dropped, with what hangs below it) ends what it brought.
            remaining: list[RadixNode] = []
            for node in nodes:
                if self.index.get(node.key) is not node:
                    break
                if node.tier is Tier.HBM and not remaining:
                    self.hbm.acquire(PageId(node.page))
                    arrived.append(node)
                else:
                    remaining.append(node)
            self.counters.promotion_wait_s += time.perf_counter() - start
            self.counters.promoted_pages += len(arrived)
            nodes = remaining
        return arrived + self._promote_now(nodes)

    def _promote_now(self, nodes: Sequence[RadixNode]) -> list[RadixNode]:
        """``promote`` for pages no transfer is bringing up: copy them now and wait."""
        if not nodes:
            return []
        start = time.perf_counter()
        pages = self._allocate_hbm(list(nodes))
        for node in nodes[: len(pages)]:
            self._set_moving(node, False)
        nodes = list(nodes[: len(pages)])
        promoted: list[RadixNode] = []
        failed_at: RadixNode | None = None
        groups: dict[Tier, list[int]] = {}
        for i, node in enumerate(nodes):
            groups.setdefault(node.tier, []).append(i)
        ok = [False] * len(nodes)
        for tier, idx in groups.items():
            if self.config.simulate:  # no bytes to copy: every page arrives intact
                for i in idx:
                    ok[i] = True
            else:
                if tier is Tier.DRAM:
                    assert self.dram is not None
                    self.dram.set_checksums([PageId(nodes[i].page) for i in idx], [nodes[i].checksum or 0 for i in idx])
                transfer = self.transfers.submit(
                    tier, Tier.HBM, [(nodes[i].page, pages[i]) for i in idx], TransferReason.PROMOTION_ON_HIT,
                    priority=10, awaited=True,
                )
                done = self.transfers.result(transfer.transfer_id)
                verified = done.verified or [done.is_ok] * len(idx)
                for j, i in enumerate(idx):
                    ok[i] = done.status is TransferStatus.OK and verified[j]
            self.counters.moved(tier, Tier.HBM, sum(ok[i] for i in idx), self.page_bytes)
        for i, node in enumerate(nodes):
            if ok[i] and failed_at is None:
                self._move_up(node, pages[i])
                promoted.append(node)
            else:
                self.hbm.release(pages[i])
                if failed_at is None:
                    failed_at = node
        if failed_at is not None and self.index.get(failed_at.key) is failed_at:
            self.counters.checksum_failures += 1
            self.counters.pages_dropped += self.index.drop_subtree(failed_at)
            log.warning("page %s failed its checksum on promotion; dropped and recomputed", short(failed_at.key))
        self.counters.promotion_wait_s += time.perf_counter() - start
        self.counters.promoted_pages += len(promoted)
        return promoted

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
                node = self.index.insert(
                    key, page.parent_key, page.slot, page.tokens or (), page.namespace,
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
            shadows = [sh.page for sh in all_shadows if sh.tier is Tier.DRAM]
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
