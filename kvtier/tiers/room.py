"""Room-making and synchronous moves of the tier manager: destinations in a tier (made room for by
moving or dropping), clean pages reclaimed, victims spilled one tier down through a transfer run on
the engine thread (``TransferEngine.run``), quota moves and drains."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Collection, Iterator, Sequence
from typing import Any

from kvtier.cache.page_pool import PageId
from kvtier.cache.radix import RadixIndex, RadixNode
from kvtier.domain.hashing import PageKey, short
from kvtier.domain.tiers import Tier
from kvtier.tiers.counters import TierCounters
from kvtier.tiers.pools import TierPools
from kvtier.tiers.shadows import Shadows
from kvtier.tiers.transfer import TransferDone, TransferReason
from kvtier.tiers.transfer_engine import TransferEngine

log = logging.getLogger("kvtier.domain.tiers")


def nvme_fields(nodes: Sequence[RadixNode]) -> dict[str, Any]:
    """What a transfer to NVMe stores in each slot's header, so a restart can re-index it."""
    return dict(
        keys=[n.key for n in nodes],
        namespaces=[n.namespace or b"\0" * 16 for n in nodes],
        parents=[n.parent.key if n.parent else None for n in nodes],
        tokens=[n.tokens for n in nodes],
    )


class RoomMaker:
    """Destinations in a tier, made room for by moving or dropping, and synchronous moves down,
    over the tier manager's pools, shadows and transfer engine. While a prefetch allocates, the
    HBM pages it must not take are ``sparing``'s (``TierManager.start_prefetch``)."""

    def __init__(
        self, index: RadixIndex, pools: TierPools, shadows: Shadows, transfers: TransferEngine,
        counters: TierCounters, *, simulate: bool, page_bytes: int,
    ) -> None:
        self._index = index
        self._pools = pools
        self._shadows = shadows
        self._transfers = transfers
        self._counters = counters
        self._simulate = simulate
        self._page_bytes = page_bytes
        self._spared: Collection[PageKey] = ()

    @contextlib.contextmanager
    def sparing(self, keys: Collection[PageKey]) -> Iterator[None]:
        """While inside, reclaims and spills pass over the HBM pages of ``keys``."""
        self._spared = keys
        try:
            yield
        finally:
            self._spared = ()

    def reclaim_clean(self, *, search: int = 32) -> bool:
        """Free one HBM page at no copy: the coldest of the ``search`` coldest idle pages whose
        copy below is intact goes back onto it (while a prefetch allocates, not one it spares:
        ``start_prefetch``). False when none of them has one, or the manager is simulated."""
        if self._shadows.clean is None or self._shadows.clean.count() == 0:
            return False  # an idle HBM leaf with a copy below would be clean: there is none to find
        skipped: list[RadixNode] = []
        chosen: RadixNode | None = None
        while chosen is None and len(skipped) < search:
            popped = self._index.pop_victims(Tier.HBM, 1)
            if not popped:
                break
            if self._shadows.of(popped[0].key) is not None and popped[0].key not in self._spared:
                chosen = popped[0]
            else:
                skipped.append(popped[0])
        for node in skipped:
            self._index.requeue(node)
        if chosen is None:
            return False
        # Onto a copy no slower than its children: an HBM leaf may still have a child in DRAM,
        # and a page never sits below a child's tier.
        shadow = self._shadows.take(chosen, Tier.DRAM)
        if shadow is None and all(c.tier >= Tier.NVME for c in chosen.children.values()):
            shadow = self._shadows.take(chosen, Tier.NVME)
        if shadow is None:
            self._index.requeue(chosen)
            return False
        self._shadows.onto(shadow)
        return True

    def allocate(self, tier: Tier, *, make_room: bool = True) -> int | None:
        """A destination page/slot in ``tier``, making room there by moving or dropping
        (only a free one without ``make_room``)."""
        for _ in range(2):
            if tier is Tier.DRAM and self._pools.dram is not None:
                page = self._pools.dram.allocate()
                if page is None and self._shadows.drop_oldest(Tier.DRAM):
                    page = self._pools.dram.allocate()
                if page is not None:
                    return page
            elif tier is Tier.NVME and self._pools.nvme is not None:
                slot = self._pools.nvme.allocate()
                if slot is None and self._shadows.drop_oldest(Tier.NVME):
                    slot = self._pools.nvme.allocate()
                if slot is not None:
                    return slot
            elif tier is Tier.HBM:
                page = self._pools.hbm.allocate()
                if page is not None:
                    return page
            if not make_room or not self._make_room(tier):
                return None
        return None

    def _make_room(self, tier: Tier) -> bool:
        if tier is Tier.HBM:
            return self.free_hbm_page()
        victims = self._index.pop_victims(tier, 1)
        if not victims:
            return False
        victim = victims[0]
        if tier is Tier.DRAM and self.move_now(victim, Tier.NVME, TransferReason.EVICTION, allow_room=True):
            return True
        dropped = self._index.drop_or_requeue(victim)
        self._counters.pages_dropped += dropped
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
                victims = self._index.pop_victims(Tier.HBM, 1)
                if not victims:
                    return False
                if self.spill(victims[0]):
                    return True
                kept.append(victims[0])
        finally:
            for node in kept:
                self._index.requeue(node)

    def spill(self, node: RadixNode) -> bool:
        """Free an HBM victim's page now (allocation fallback): move it down a tier, or
        drop it with its subtree when no lower tier has room or works. False (keep it)
        when that subtree holds a pinned page, or while a prefetch allocates, a page it spares
        (``start_prefetch``)."""
        if node.key in self._spared:
            return False
        for tier in (Tier.DRAM, Tier.NVME):
            if self.move_now(node, tier, TransferReason.EVICTION, allow_room=True):
                return True
        if self._index.holds_pin(node):
            return False
        self._counters.pages_dropped += self._index.drop_subtree(node)
        return True

    def move_to_free(self, node: RadixNode, dst: Tier) -> bool:
        """Move an evictable ``node`` down to ``dst`` now, only into a free page there (nothing
        in ``dst`` is moved or dropped to make room: quota enforcement, ``kvtier.cache.quotas``)."""
        return self.move_now(node, dst, TransferReason.EVICTION, allow_room=False)

    def move_now(self, node: RadixNode, dst: Tier, reason: TransferReason, *, allow_room: bool) -> bool:
        """Move ``node`` down to ``dst`` before returning: onto its shadow there, else through a
        transfer run on this thread (``TransferEngine.run``) and applied once acknowledged."""
        # A child may not sit in a faster tier than its parent: with DRAM full of pinned
        # or moving pages, an HBM page with a DRAM child cannot skip to NVMe.
        if not self._pools.is_usable(dst) or any(c.tier < dst for c in node.children.values()):
            return False
        if (shadow := self._shadows.take(node, dst)) is not None:
            self._shadows.onto(shadow)
            return True
        self._shadows.set_moving(node, True)  # not a victim while we make room below
        try:
            target = self.allocate(dst, make_room=allow_room)
            if target is None:
                return False
            checksum = None if node.tier is Tier.HBM else node.checksum
            if self._simulate:
                if dst is Tier.DRAM:
                    self._pools.adopt_dram(PageId(target))
            else:
                done = self._copy_now(node, dst, target, reason)
                if not done.is_ok:  # disk full or failing: drop instead
                    self._counters.disk_full_events += 1
                    self._pools.mark_failing(dst)
                    log.warning("%s write failed, dropping instead: %s", dst.label, done.error)
                    if not done.dst_released:
                        self._pools.free_target(dst, target)
                    return False
                if node.tier is Tier.HBM:
                    checksum = done.checksums[0]
                if dst is Tier.DRAM:
                    self._pools.adopt_dram_copy(PageId(target), checksum)
                self._counters.spill_link_wait_s += done.link_wait_s
            self._counters.moved(node.tier, dst, 1, self._page_bytes)
            src = node.tier
            self._shadows.set_moving(node, False)
            self._index.move(node, dst, target, checksum)
            log.debug("moved page %s %s -> %s", short(node.key), src.label, dst.label)
            return True
        finally:
            self._shadows.set_moving(node, False)

    def _copy_now(self, node: RadixNode, dst: Tier, target: int, reason: TransferReason) -> TransferDone:
        """Copy ``node``'s page into ``target`` in ``dst`` on this thread; its acknowledgement."""
        if node.tier is Tier.DRAM:
            assert self._pools.dram is not None
            self._pools.dram.set_checksums([PageId(node.page)], [node.checksum or 0])
        fields = nvme_fields([node]) if dst is Tier.NVME else {}
        return self._transfers.run(node.tier, dst, [(node.page, target)], reason, **fields)

    def demote_all(self, dst: Tier) -> int:
        """Move every idle cached page above ``dst`` down to it, synchronously (drain, tests)."""
        if dst is Tier.DRAM:
            steps = [(Tier.HBM, Tier.DRAM)]
        elif self._pools.dram is not None:
            steps = [(Tier.HBM, Tier.DRAM), (Tier.DRAM, Tier.NVME)]
        else:
            steps = [(Tier.HBM, Tier.NVME)]
        moved = 0
        with self._index.all_evictable():  # a drain takes reserved pages too
            for src, to in steps:
                while victims := self._index.pop_victims(src, 1):
                    if not self.move_now(victims[0], to, TransferReason.DRAIN, allow_room=True):
                        self._index.requeue(victims[0])
                        break
                    moved += 1
        return moved
