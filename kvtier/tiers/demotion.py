"""Demotions of the tier manager: background watermark demotion and the controller's commanded ones
(``start_demotion``), submitted as transfers and applied to the index once they land."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from kvtier.cache.page_pool import PageId
from kvtier.cache.radix import RadixNode
from kvtier.domain.hashing import PageKey
from kvtier.domain.tiers import Tier
from kvtier.tiers.moves import MoveOutcome, MoveTicket, PendingMove
from kvtier.tiers.shadows import Shadow, Shadowed
from kvtier.tiers.transfer import TransferDone, TransferId, TransferReason

log = logging.getLogger("kvtier.domain.tiers")


class Demotions:
    """Demotions of ``TierManager``, which holds the pending transfers (``_pending``)."""

    _pending: dict[TransferId, PendingMove]  # set by TierManager.__init__

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
        shadowed: list[Shadowed] = []
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
        ticket: MoveTicket | None = None, *, shadowed: list[Shadowed] | None = None,
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
        self._pending[transfer.transfer_id] = PendingMove(nodes, dsts, src, dst, ticket, shadowed=shadowed or [],
                                                          srcs=[n.page for n in nodes])
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

    def _apply_demotion(self, pending: PendingMove, done: TransferDone) -> int:
        """Point the index at the pages that arrived and are still idle; returns how many."""
        src_pool = self.hbm if pending.src is Tier.HBM else self.dram
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
                moved += self._apply_shadowed(entry)
                continue
            assert index is not None
            i, node, target = index, pending.nodes[index], pending.dsts[index]
            self._set_moving(node, False)
            still_here = self.index.get(node.key) is node and node.tier is pending.src
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
                self._add_shadow(Shadow(node, Tier.DRAM, target, checksum))
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
        shadowed: list[Shadowed] = []
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

    def demote_pages(self, nodes: Sequence[RadixNode], dst: Tier) -> MoveOutcome:
        """``start_demotion`` and wait until it is applied (tests, tools)."""
        return self.wait_for(self.start_demotion(nodes, dst))
