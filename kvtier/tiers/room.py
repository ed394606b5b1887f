"""Room-making and synchronous moves of the tier manager: destinations in a tier (made room for by
moving or dropping), clean pages reclaimed, victims spilled one tier down through a transfer run on
the engine thread (``TransferEngine.run``), quota moves and drains."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from kvtier.cache.page_pool import PageId
from kvtier.cache.radix import RadixNode
from kvtier.domain.hashing import short
from kvtier.domain.tiers import Tier
from kvtier.tiers.transfer import TransferDone, TransferReason

log = logging.getLogger("kvtier.domain.tiers")


class RoomMaking:
    """Room-making of ``TierManager``, which holds the pools and the transfer engine."""

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
        # Onto a copy no slower than its children: an HBM leaf may still have a child in DRAM,
        # and a page never sits below a child's tier.
        shadow = self._take_shadow(chosen, Tier.DRAM)
        if shadow is None and all(c.tier >= Tier.NVME for c in chosen.children.values()):
            shadow = self._take_shadow(chosen, Tier.NVME)
        if shadow is None:
            self.index.requeue(chosen)
            return False
        self._onto_shadow(shadow)
        return True

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
        dropped = self.index.drop_or_requeue(victim)
        self.counters.pages_dropped += dropped
        return dropped > 0

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

    def demote_all(self, dst: Tier) -> int:
        """Move every idle cached page above ``dst`` down to it, synchronously (drain, tests)."""
        if dst is Tier.DRAM:
            steps = [(Tier.HBM, Tier.DRAM)]
        elif self.dram is not None:
            steps = [(Tier.HBM, Tier.DRAM), (Tier.DRAM, Tier.NVME)]
        else:
            steps = [(Tier.HBM, Tier.NVME)]
        moved = 0
        with self.index.all_evictable():  # a drain takes reserved pages too
            for src, to in steps:
                while victims := self.index.pop_victims(src, 1):
                    if not self._move_now(victims[0], to, TransferReason.DRAIN, allow_room=True):
                        self.index.requeue(victims[0])
                        break
                    moved += 1
        return moved
