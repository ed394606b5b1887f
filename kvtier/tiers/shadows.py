"""Copies below of promoted pages (shadows, decision 0012; ``kvtier.tiers.manager``'s doc): an HBM page
promoted from DRAM or NVMe keeps the page or slot it came from, and leaves onto it again without a copy."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.cache.page_pool import PageId
from kvtier.cache.radix import RadixNode
from kvtier.domain.hashing import PageKey
from kvtier.domain.tiers import Tier


@dataclass(frozen=True, slots=True)
class Shadow:
    """An HBM page's identical copy below: the DRAM page or NVMe slot it was promoted from."""

    node: RadixNode
    tier: Tier
    page: int
    checksum: int | None


@dataclass(frozen=True, slots=True)
class Shadowed:
    """A demotion onto a shadow, reserved until applied (the node's HBM page is held)."""

    shadow: Shadow
    hbm_page: PageId


class ShadowCopies:
    """The shadows of ``TierManager``, which holds the state (``_shadows``)."""

    def _move_up(self, node: RadixNode, page: int) -> None:
        """Point ``node`` at its new HBM page; the page it leaves below stays as its shadow."""
        self._keep_shadow = node if node.tier is not Tier.HBM and not self.config.simulate else None
        try:
            self.index.move(node, Tier.HBM, page)
        finally:
            self._keep_shadow = None

    def num_shadows(self, tier: Tier) -> int:
        """Pages of ``tier`` that are copies of HBM pages (``kvtier.tiers.manager``'s doc): cached, and free to take."""
        shadows = self._shadows.get(tier)
        return 0 if shadows is None else len(shadows)

    def _add_shadow(self, shadow: Shadow) -> None:
        self._shadows[shadow.tier][shadow.node.key] = shadow
        self._touch(shadow.node)

    def _shadow_of(self, key: PageKey) -> Shadow | None:
        return self._shadows[Tier.DRAM].get(key) or self._shadows[Tier.NVME].get(key)

    def _has_copy(self, node: RadixNode) -> bool:
        shadow = self._shadow_of(node.key)
        return shadow is not None and shadow.node is node

    def _copied_nodes(self) -> list[RadixNode]:
        return [shadow.node for shadows in self._shadows.values() for shadow in shadows.values()]

    def _pop_shadow(self, shadow: Shadow) -> Shadow:
        self._touch(shadow.node)
        return self._shadows[shadow.tier].pop(shadow.node.key)

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

    def _take_shadow(self, node: RadixNode, tier: Tier) -> Shadow | None:
        """``node``'s copy in ``tier`` (it must be that key's node, in HBM), removed from the
        shadows (the caller applies or frees it); None when it has none there."""
        shadow = self._shadows[tier].get(node.key)
        if (shadow is None or shadow.node is not node
                or self.index.get(node.key) is not node or node.tier is not Tier.HBM):
            return None
        return self._pop_shadow(shadow)

    def _onto_shadow(self, shadow: Shadow) -> None:
        self.index.move(shadow.node, shadow.tier, shadow.page, shadow.checksum)
        self.counters.demotions_without_copy += 1

    def _defer_shadowed(self, node: RadixNode, tier: Tier) -> Shadowed | None:
        """Reserve ``node``'s demotion onto its shadow in ``tier``, applied later with a
        transfer's pages: marked moving and its HBM page held meanwhile, as a copied page is."""
        shadow = self._take_shadow(node, tier)
        if shadow is None:
            return None
        self._set_moving(node, True)
        self.hbm.acquire(PageId(node.page))
        return Shadowed(shadow, PageId(node.page))

    def _apply_shadowed(self, entry: Shadowed) -> bool:
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
