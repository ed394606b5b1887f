"""Copies below of promoted pages (shadows, decision 0012; ``kvtier.tiers.manager``'s doc): an HBM page
promoted from DRAM or NVMe keeps the page or slot it came from, and leaves onto it again without a copy.
The clean HBM pages (free to take at no copy) are the idle ones with such a copy, so the clean set
lives here too."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from kvtier.cache.clean_pages import CleanPages
from kvtier.cache.page_pool import PageId
from kvtier.cache.radix import RadixIndex, RadixNode
from kvtier.domain.errors import IntegrityError
from kvtier.domain.hashing import PageKey, short
from kvtier.domain.tiers import Tier
from kvtier.tiers.counters import TierCounters
from kvtier.tiers.nvme.format import SlotId
from kvtier.tiers.pools import TierPools


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


class Shadows:
    """The shadows of one tier manager, oldest first per tier (an allocation there takes the
    oldest; a key has at most one), and the clean HBM pages they make (``clean``; None when
    simulated: no copies are kept). A shadow is used only while its node is still that key's
    node, in HBM; the index's hooks free it when the node is dropped or leaves HBM another way."""

    def __init__(self, index: RadixIndex, pools: TierPools, counters: TierCounters, *, simulate: bool) -> None:
        self._index = index
        self._pools = pools
        self._counters = counters
        self._simulate = simulate
        self._shadows: dict[Tier, OrderedDict[PageKey, Shadow]] = {Tier.DRAM: OrderedDict(), Tier.NVME: OrderedDict()}
        self._keep: RadixNode | None = None  # a promotion in progress keeps its page below
        # HBM pages free to take at no copy, kept as they change
        self.clean = None if simulate else CleanPages(index, self.has_copy, self.copied_nodes)
        index.release_lower = self._release_lower
        index.on_remove.append(self.free)
        index.on_move.append(self._on_moved)

    def keys(self) -> set[PageKey]:
        """Keys of the pages with a shadow, any tier."""
        return {key for shadows in self._shadows.values() for key in shadows}

    def num_reclaimable(self) -> int:
        """HBM pages an allocation can have without copying a byte: the free ones, and the idle
        ones whose copy below is intact (clean) with nothing under them in HBM that must stay
        (leaves leave first: a clean page above a held or uncopied page is not free to take).
        Exact at every call, and O(what changed since the last one) (``kvtier.cache.clean_pages``)."""
        return self._pools.hbm.num_free + (0 if self.clean is None else self.clean.count())

    def is_clean(self, node: RadixNode) -> bool:
        """Whether ``node`` is one of the clean HBM pages ``num_reclaimable`` counts."""
        return self.clean is not None and self.clean.contains(node)

    def set_moving(self, node: RadixNode, moving: bool) -> None:
        node.moving = moving
        self.touch(node)

    def touch(self, node: RadixNode) -> None:
        """``node``'s copy below or moving flag changed: the clean set looks at it again."""
        if self.clean is not None:
            self.clean.touch(node)

    def _release_lower(self, node: RadixNode) -> None:
        if node is self._keep:  # promoted: the copy below stays, identical (module doc)
            self._keep = None
            self.add(Shadow(node, node.tier, node.page, node.checksum))
            return
        self._pools.release_copy(node.tier, node.page)

    def move_up(self, node: RadixNode, page: int) -> None:
        """Point ``node`` at its new HBM page; the page it leaves below stays as its shadow."""
        self._keep = node if node.tier is not Tier.HBM and not self._simulate else None
        try:
            self._index.move(node, Tier.HBM, page)
        finally:
            self._keep = None

    def count(self, tier: Tier) -> int:
        """Pages of ``tier`` that are copies of HBM pages (``kvtier.tiers.manager``'s doc): cached, and free to take."""
        shadows = self._shadows.get(tier)
        return 0 if shadows is None else len(shadows)

    def add(self, shadow: Shadow) -> None:
        self._shadows[shadow.tier][shadow.node.key] = shadow
        self.touch(shadow.node)

    def of(self, key: PageKey) -> Shadow | None:
        return self._shadows[Tier.DRAM].get(key) or self._shadows[Tier.NVME].get(key)

    def has_copy(self, node: RadixNode) -> bool:
        shadow = self.of(node.key)
        return shadow is not None and shadow.node is node

    def copied_nodes(self) -> list[RadixNode]:
        return [shadow.node for shadows in self._shadows.values() for shadow in shadows.values()]

    def _pop(self, shadow: Shadow) -> Shadow:
        self.touch(shadow.node)
        return self._shadows[shadow.tier].pop(shadow.node.key)

    def _on_moved(self, node: RadixNode, old: Tier) -> None:
        if old is Tier.HBM:  # left HBM other than onto its shadow: the copy is of no more use
            self.free(node)

    def free(self, node: RadixNode) -> None:
        """Free ``node``'s shadow, if it has one (it is dropped, or left HBM another way)."""
        shadow = self.of(node.key)
        if shadow is not None and shadow.node is node:
            self._pop(shadow)
            self._pools.release_copy(shadow.tier, shadow.page)

    def drop_oldest(self, tier: Tier) -> bool:
        """Free the oldest shadow in ``tier`` (an allocation there found no free page)."""
        if not self._shadows[tier]:
            return False
        _, shadow = self._shadows[tier].popitem(last=False)
        self.touch(shadow.node)
        self._pools.release_copy(shadow.tier, shadow.page)
        return True

    def take(self, node: RadixNode, tier: Tier) -> Shadow | None:
        """``node``'s copy in ``tier`` (it must be that key's node, in HBM), removed from the
        shadows (the caller applies or frees it); None when it has none there."""
        shadow = self._shadows[tier].get(node.key)
        if (shadow is None or shadow.node is not node
                or self._index.get(node.key) is not node or node.tier is not Tier.HBM):
            return None
        return self._pop(shadow)

    def onto(self, shadow: Shadow) -> None:
        """Move its node back onto the shadow: no bytes copied."""
        self._index.move(shadow.node, shadow.tier, shadow.page, shadow.checksum)
        self._counters.demotions_without_copy += 1

    def defer(self, node: RadixNode, tier: Tier) -> Shadowed | None:
        """Reserve ``node``'s demotion onto its shadow in ``tier``, applied later with a
        transfer's pages: marked moving and its HBM page held meanwhile, as a copied page is."""
        shadow = self.take(node, tier)
        if shadow is None:
            return None
        self.set_moving(node, True)
        self._pools.hbm.acquire(PageId(node.page))
        return Shadowed(shadow, PageId(node.page))

    def apply(self, entry: Shadowed) -> bool:
        """Demote a reserved node onto its shadow if it is still idle in HBM with nothing
        faster below it; otherwise it stays (its shadow with it) or, gone, the copy is freed.
        True when it moved."""
        shadow, node = entry.shadow, entry.shadow.node
        hbm = self._pools.hbm
        self.set_moving(node, False)
        still_here = self._index.get(node.key) is node and node.tier is Tier.HBM and node.page == entry.hbm_page
        idle = still_here and hbm.ref_count(entry.hbm_page) == 1 and not node.pins
        hbm.release(entry.hbm_page)
        if idle and all(c.tier >= shadow.tier for c in node.children.values()):
            self.onto(shadow)
            return True
        if still_here:  # picked up meanwhile, or a child stayed: still identical to its copy
            self.add(shadow)
            self._index.requeue(node)
        else:
            self._pools.release_copy(shadow.tier, shadow.page)
        return False

    def check_integrity(self, in_flight: Iterable[Shadowed]) -> None:
        """Every shadow belongs to its key's node, in HBM, and its page or slot holds that page;
        DRAM's cached pages are the index's plus the shadows (``in_flight``: those reserved by
        demotions not applied yet)."""
        if self.clean is not None:
            self.clean.check()
        dram, nvme = self._pools.dram, self._pools.nvme
        if dram is not None:
            held = sum(1 for n in self._index.nodes() if n.tier is Tier.DRAM)
            all_shadows = [*self._shadows[Tier.DRAM].values(), *(e.shadow for e in in_flight)]
            shadows = [PageId(sh.page) for sh in all_shadows if sh.tier is Tier.DRAM]
            cached = sum(1 for p in range(dram.num_pages) if dram.is_cached(PageId(p)))
            if held + len(shadows) != cached:
                raise IntegrityError(
                    f"DRAM caches {cached} pages but the index places {held} there and {len(shadows)} are shadows")
            if len(set(shadows)) != len(shadows) or not all(dram.is_cached(p) for p in shadows):
                raise IntegrityError("a DRAM shadow page is shared or not cached")
        for key, shadow in [*self._shadows[Tier.DRAM].items(), *self._shadows[Tier.NVME].items()]:
            if shadow.node.key != key or self._index.get(key) is not shadow.node or shadow.node.tier is not Tier.HBM:
                raise IntegrityError(f"shadow of page {short(key)} outlived its HBM page")
            if shadow.tier is Tier.NVME:
                assert nvme is not None
                stored = nvme.entry(SlotId(shadow.page))
                if stored is None or stored[0] != key:
                    raise IntegrityError(f"nvme shadow slot {shadow.page} does not hold page {short(key)}")
        if self._shadows[Tier.DRAM].keys() & self._shadows[Tier.NVME].keys():
            raise IntegrityError("a page has shadows in two tiers")
