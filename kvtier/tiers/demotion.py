"""Demotions of the tier manager: background watermark demotion and the controller's commanded ones
(``start``), submitted as transfers and applied to the index once they land."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvtier.cache.page_pool import PageId
from kvtier.cache.radix import RadixIndex, RadixNode
from kvtier.domain.hashing import PageKey
from kvtier.domain.tiers import Tier
from kvtier.tiers.counters import TierCounters
from kvtier.tiers.moves import MovesInFlight, MoveTicket, PendingMove, finish
from kvtier.tiers.pools import TierPools
from kvtier.tiers.room import RoomMaker, nvme_fields
from kvtier.tiers.shadows import Shadow, Shadowed, Shadows
from kvtier.tiers.transfer import TransferDone, TransferId, TransferReason
from kvtier.tiers.transfer_engine import TransferEngine

log = logging.getLogger("kvtier.domain.tiers")


class Demotions:
    """Demotions of one tier manager: picks the pages, allocates their destinations
    (``RoomMaker``), submits the copies and adds them to the moves in flight; the manager
    hands each back (``apply``) once its transfer completed."""

    def __init__(
        self, index: RadixIndex, pools: TierPools, shadows: Shadows, room: RoomMaker, transfers: TransferEngine,
        in_flight: MovesInFlight, counters: TierCounters, *, page_bytes: int,
    ) -> None:
        self._index = index
        self._pools = pools
        self._shadows = shadows
        self._room = room
        self._transfers = transfers
        self._in_flight = in_flight
        self._counters = counters
        self._page_bytes = page_bytes

    def demote(self, src: Tier, dst: Tier, num_pages: int, reason: TransferReason, *, dirty_only: bool = False) -> int:
        """Start moving up to ``num_pages`` of ``src``'s coldest idle pages to ``dst``; returns
        how many are leaving (or, demoted onto their DRAM copy, already left). ``dirty_only``:
        only pages with no copy below (a clean page is reclaimed when its room is needed)."""
        if dirty_only:
            picked: list[RadixNode] = []
            clean: list[RadixNode] = []
            while len(picked) < num_pages:
                popped = self._index.pop_victims(src, num_pages - len(picked))
                if not popped:
                    break
                for node in popped:
                    (clean if self._shadows.of(node.key) is not None else picked).append(node)
            for node in clean:
                self._index.requeue(node)
            victims = self._with_ancestors(picked, src, num_pages, dirty_only=True)
        else:
            victims = self._with_ancestors(self._index.pop_victims(src, num_pages), src, num_pages)
        nodes, dsts = [], []
        shadowed: list[Shadowed] = []
        for node in victims:
            if src is Tier.HBM and (entry := self._shadows.defer(node, dst)) is not None:
                shadowed.append(entry)
                continue
            self._shadows.set_moving(node, True)
            target = self._room.allocate(dst)
            if target is None:
                self._shadows.set_moving(node, False)
                self._index.requeue(node)
                break
            nodes.append(node)
            dsts.append(target)
        for node in victims[len(nodes) + len(shadowed) :]:
            self._index.requeue(node)
        if not nodes:  # nothing to copy: what has a copy below goes at once
            return sum(self._shadows.apply(entry) for entry in shadowed)
        self._submit(nodes, dsts, src, dst, reason, shadowed=shadowed)
        return len(nodes) + len(shadowed)

    def _submit(
        self, nodes: list[RadixNode], dsts: list[int], src: Tier, dst: Tier, reason: TransferReason,
        ticket: MoveTicket | None = None, *, shadowed: list[Shadowed] | None = None,
    ) -> TransferId:
        """Copy ``nodes`` (marked moving, deepest first) into the allocated ``dsts``."""
        src_pool = self._pools.hbm if src is Tier.HBM else self._pools.dram
        assert src_pool is not None
        for node in nodes:  # held until applied: not freed or reused under the copy
            src_pool.acquire(PageId(node.page))
        kwargs = nvme_fields(nodes) if dst is Tier.NVME else {}
        if src is Tier.DRAM:
            assert self._pools.dram is not None
            self._pools.dram.set_checksums([PageId(n.page) for n in nodes], [n.checksum or 0 for n in nodes])
        transfer = self._transfers.submit(src, dst, list(zip([n.page for n in nodes], dsts, strict=True)), reason, **kwargs)
        self._in_flight.add(transfer.transfer_id, PendingMove(nodes, dsts, src, dst, ticket, shadowed=shadowed or [],
                                                              srcs=[n.page for n in nodes]))
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
                    or (tier is Tier.HBM and self._pools.hbm.ref_count(PageId(node.page)) > 0)
                    or any(c.key not in chosen for c in same_or_faster)
                    or (dirty_only and self._shadows.of(node.key) is not None)
                ):
                    break
                chosen[node.key] = node
                node = node.parent
        return sorted(chosen.values(), key=lambda n: -n.depth)

    def apply(self, pending: PendingMove, done: TransferDone) -> int:
        """Point the index at the pages that arrived and are still idle; returns how many."""
        src_pool = self._pools.hbm if pending.src is Tier.HBM else self._pools.dram
        assert src_pool is not None
        moved = copied = 0
        # Deepest first across the copied pages and those going back onto their DRAM copy: a
        # page may leave its tier only once nothing below it is faster than its target.
        order: list[tuple[int, int | None, Shadowed | None]] = [
            (-n.depth, i, None) for i, n in enumerate(pending.nodes)]
        order += [(-entry.shadow.node.depth, None, entry) for entry in pending.shadowed]
        order.sort(key=lambda o: o[0])
        for _, index, entry in order:
            if entry is not None:
                moved += self._shadows.apply(entry)
                continue
            assert index is not None
            i, node, target = index, pending.nodes[index], pending.dsts[index]
            self._shadows.set_moving(node, False)
            still_here = self._index.get(node.key) is node and node.tier is pending.src
            # Our own hold is the only reference: no sequence picked the page up meanwhile, and
            # nobody pinned it to its tier meanwhile (a session's hold or a prefetch recalled it).
            held = PageId(pending.srcs[i]) if pending.srcs else PageId(node.page)
            idle = still_here and src_pool.ref_count(held) == 1 and not node.pins
            src_pool.release(held)
            # A child that stayed behind (reused meanwhile) keeps its parent in this tier.
            children_below = all(c.tier >= pending.dst for c in node.children.values())
            checksum = done.checksums[i] if i < len(done.checksums) else node.checksum
            if done.is_ok and idle and children_below:
                if pending.dst is Tier.DRAM:
                    self._pools.adopt_dram_copy(PageId(target), checksum)
                self._index.move(node, pending.dst, target, checksum)
                moved += 1
                copied += 1
                continue
            if (still_here and done.is_ok and pending.src is Tier.HBM and pending.dst is Tier.DRAM
                    and self._shadows.of(node.key) is None):
                # It stays, and the copy that arrived intact is its shadow (decision 0012): when
                # it does leave, it goes back onto it without a second copy.
                self._pools.adopt_dram_copy(PageId(target), checksum)
                self._shadows.add(Shadow(node, Tier.DRAM, target, checksum))
            elif not (done.dst_released and pending.dst is Tier.NVME):
                self._pools.free_target(pending.dst, target)
            if still_here:
                if done.is_ok:
                    self._counters.demotions_abandoned += 1
                    self._counters.demotions_kept += src_pool.ref_count(PageId(node.page)) == 0
                self._index.requeue(node)
        if copied:
            self._counters.moved(pending.src, pending.dst, copied, self._page_bytes)
        if done.error is not None:
            self._counters.disk_full_events += 1
            self._pools.mark_failing(pending.dst)
            log.warning("demotion %s -> %s failed: %s", pending.src.label, pending.dst.label, done.error)
        return moved

    def start(self, nodes: Sequence[RadixNode], dst: Tier) -> MoveTicket:
        """Start moving the idle ones of ``nodes`` down to ``dst`` (the controller's Demote); applied
        when all arrived.

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
        shadowed: list[Shadowed] = []
        for node in sorted(nodes, key=lambda n: -n.depth):
            if node.tier >= dst:
                continue
            if self._may_leave(node, dst, chosen) and (entry := self._shadows.defer(node, dst)):
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
            moved = sum(self._shadows.apply(entry) for entry in shadowed)
            ticket.num_moved += moved
            ticket.num_skipped += len(shadowed) - moved
            shadowed = []
        # Shadowed pages go with the part applied last (the HBM one, else the DRAM one: parts
        # apply slower sources first), after every page below them has landed.
        last = Tier.HBM if Tier.HBM in groups else Tier.DRAM
        for src, (group_nodes, dsts) in groups.items():
            self._submit(group_nodes, dsts, src, dst, TransferReason.PARK, ticket,
                                  shadowed=shadowed if src is last else None)
        if not ticket.num_open:
            finish(ticket)
        return ticket

    def _may_leave(self, node: RadixNode, dst: Tier, chosen: set[PageKey]) -> bool:
        """Whether a commanded demotion may take ``node`` down to ``dst`` (``chosen``: the
        pages below it already going in the same ticket)."""
        return not (
            self._index.get(node.key) is not node
            or node.pins
            or node.moving
            or (node.tier is Tier.HBM and self._pools.hbm.ref_count(PageId(node.page)) > 0)
            or not self._pools.is_usable(dst)
            or any(c.tier < dst and c.key not in chosen for c in node.children.values())
        )

    def _reserve_below(self, node: RadixNode, dst: Tier, chosen: set[PageKey]) -> int | None:
        """A destination in ``dst`` for ``node`` (then marked moving), or None: it stays."""
        if not self._may_leave(node, dst, chosen):
            return None
        self._shadows.set_moving(node, True)  # not a victim while we make room below
        target = self._room.allocate(dst)
        if target is None:
            self._shadows.set_moving(node, False)
            self._index.requeue(node)
        return target
