"""Promotions of the tier manager: on a hit (``promote``, waited for) and ahead of a return
(``start_prefetch``, applied with its ticket), each page verified against its checksum."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Sequence

from kvtier.cache.page_pool import PageId
from kvtier.cache.radix import RadixIndex, RadixNode
from kvtier.domain.hashing import PageKey, short
from kvtier.domain.tiers import Tier
from kvtier.tiers.counters import TierCounters
from kvtier.tiers.moves import MoveOutcome, MovesInFlight, MoveTicket, PendingMove, finish
from kvtier.tiers.pools import TierPools
from kvtier.tiers.room import RoomMaker
from kvtier.tiers.shadows import Shadows
from kvtier.tiers.transfer import TransferReason, TransferStatus
from kvtier.tiers.transfer_engine import TransferEngine

# Blocks, applying every transfer that completes meanwhile, until a ticket is done.
WaitFor = Callable[[MoveTicket], MoveOutcome]

log = logging.getLogger("kvtier.domain.tiers")


class Promotions:
    """Promotions of one tier manager: allocates HBM pages (``RoomMaker``), copies the pages
    up (a promotion on hit waits for its copy; a prefetch adds its parts to the moves in flight,
    and the manager hands its ticket back, ``apply``, once all of them completed). ``wait_for``:
    the manager's wait for a ticket, for a prefetch a promotion or a cancellation waits on."""

    def __init__(
        self, index: RadixIndex, pools: TierPools, shadows: Shadows, room: RoomMaker, transfers: TransferEngine,
        in_flight: MovesInFlight, counters: TierCounters, *, simulate: bool, page_bytes: int, wait_for: WaitFor,
    ) -> None:
        self._index = index
        self._pools = pools
        self._shadows = shadows
        self._room = room
        self._transfers = transfers
        self._in_flight = in_flight
        self._counters = counters
        self._simulate = simulate
        self._page_bytes = page_bytes
        self._wait_for = wait_for

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
                self._wait_for(ticket)
            # What landed now leads the chain in HBM; a page the prefetch left below (or that a
            # failed checksum dropped, with what hangs below it) ends what it brought.
            remaining: list[RadixNode] = []
            for node in nodes:
                if self._index.get(node.key) is not node:
                    break
                if node.tier is Tier.HBM and not remaining:
                    self._pools.hbm.acquire(PageId(node.page))
                    arrived.append(node)
                else:
                    remaining.append(node)
            self._counters.promotion_wait_s += time.perf_counter() - start
            self._counters.promoted_pages += len(arrived)
            nodes = remaining
        return arrived + self._promote_now(nodes)

    def _promote_now(self, nodes: Sequence[RadixNode]) -> list[RadixNode]:
        """``promote`` for pages no transfer is bringing up: copy them now and wait."""
        if not nodes:
            return []
        start = time.perf_counter()
        pages = self._allocate_hbm(list(nodes))
        for node in nodes[: len(pages)]:
            self._shadows.set_moving(node, False)
        nodes = list(nodes[: len(pages)])
        promoted: list[RadixNode] = []
        failed_at: RadixNode | None = None
        groups: dict[Tier, list[int]] = {}
        for i, node in enumerate(nodes):
            groups.setdefault(node.tier, []).append(i)
        ok = [False] * len(nodes)
        for tier, idx in groups.items():
            if self._simulate:  # no bytes to copy: every page arrives intact
                for i in idx:
                    ok[i] = True
            else:
                if tier is Tier.DRAM:
                    assert self._pools.dram is not None
                    self._pools.dram.set_checksums([PageId(nodes[i].page) for i in idx], [nodes[i].checksum or 0 for i in idx])
                transfer = self._transfers.submit(
                    tier, Tier.HBM, [(nodes[i].page, pages[i]) for i in idx], TransferReason.PROMOTION_ON_HIT,
                    priority=10, awaited=True,
                )
                done = self._transfers.result(transfer.transfer_id)
                verified = done.verified or [done.is_ok] * len(idx)
                for j, i in enumerate(idx):
                    ok[i] = done.status is TransferStatus.OK and verified[j]
            self._counters.moved(tier, Tier.HBM, sum(ok[i] for i in idx), self._page_bytes)
        for i, node in enumerate(nodes):
            if ok[i] and failed_at is None:
                self._shadows.move_up(node, pages[i])
                promoted.append(node)
            else:
                self._pools.hbm.release(pages[i])
                if failed_at is None:
                    failed_at = node
        if failed_at is not None and self._index.get(failed_at.key) is failed_at:
            self._counters.checksum_failures += 1
            self._counters.pages_dropped += self._index.drop_subtree(failed_at)
            log.warning("page %s failed its checksum on promotion; dropped and recomputed", short(failed_at.key))
        self._counters.promotion_wait_s += time.perf_counter() - start
        self._counters.promoted_pages += len(promoted)
        return promoted

    def _allocate_hbm(self, nodes: list[RadixNode]) -> list[PageId]:
        """HBM pages for ``nodes`` (a chain, parents first), as many as there is room for.
        ``nodes`` are marked moving (not victims while we make room); those that get a page
        stay so, the rest are victims again."""
        for node in nodes:
            self._shadows.set_moving(node, True)
        pages: list[PageId] = []
        for _ in nodes:
            page = self._room.allocate(Tier.HBM)
            if page is None:
                break
            pages.append(PageId(page))
        for node in nodes[len(pages) :]:  # staying below: a victim again (a pop skipped it)
            self._shadows.set_moving(node, False)
            self._index.requeue(node)
        return pages

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
        if self._simulate:  # completes at once (no bytes to copy)
            if hold is not None:
                self._index.pin(hold.key)
            promoted = self._promote_now(lower)
            if hold is not None:
                self._index.unpin(hold.key)
            self._settle_prefetched(promoted)
            ticket.num_moved, ticket.num_skipped = len(promoted), num_below - len(promoted)
            ticket.promoted = [n.key for n in promoted]
            finish(ticket)
            return ticket
        # Making room for the pages coming up must not spill their ancestors (idle, and leaves
        # in HBM while their children are below): a child may not rise above its parent. One
        # pin on the deepest holds the chain above it (leaves go first) until the ticket is applied.
        if hold is not None and lower:
            self._index.pin(hold.key)
            ticket.hold = hold
        with self._room.sparing(spared):
            pages = self._allocate_hbm(lower)
        lower = lower[: len(pages)]
        ticket.num_skipped = num_below - len(lower)
        groups: dict[Tier, list[int]] = {}
        for i, node in enumerate(lower):
            groups.setdefault(node.tier, []).append(i)
        for tier, idx in groups.items():  # DRAM (the parents) before NVMe
            if tier is Tier.DRAM:
                assert self._pools.dram is not None
                self._pools.dram.set_checksums([PageId(lower[i].page) for i in idx], [lower[i].checksum or 0 for i in idx])
            nodes = [lower[i] for i in idx]
            dsts = [int(pages[i]) for i in idx]
            # Above background demotions in the lanes; below a request's promotion on hit.
            transfer = self._transfers.submit(
                tier, Tier.HBM, list(zip([n.page for n in nodes], dsts, strict=True)),
                TransferReason.PROMOTION_ON_HIT if for_request else TransferReason.PREFETCH,
                priority=10 if for_request else 5,
            )
            self._in_flight.add(transfer.transfer_id, PendingMove(nodes, dsts, tier, Tier.HBM, ticket))
            ticket.transfer_ids.append(transfer.transfer_id)
            ticket.num_open += 1
        if not ticket.num_open:
            self._release_hold(ticket)
            finish(ticket)
        return ticket

    def _release_hold(self, ticket: MoveTicket) -> None:
        hold, ticket.hold = ticket.hold, None
        if hold is not None and self._index.get(hold.key) is hold and hold.pins > 0:
            self._index.unpin(hold.key)

    def apply(self, ticket: MoveTicket, parts: list[PendingMove]) -> None:
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
                self._shadows.set_moving(node, False)
                in_place = self._index.get(node.key) is node and node.tier is part.src
                arrived = done.status is TransferStatus.OK and verified[j]
                num_ok += arrived
                parent_in_hbm = node.parent is None or node.parent.tier is Tier.HBM
                if not is_stopped and in_place and arrived and parent_in_hbm:
                    self._shadows.move_up(node, page)
                    promoted.append(node)
                    continue
                self._pools.hbm.release(PageId(page))
                if in_place:
                    self._index.requeue(node)
                    if not is_stopped and done.status is TransferStatus.OK and not verified[j]:
                        failed_at = node
                is_stopped = True
            self._counters.moved(part.src, Tier.HBM, num_ok, self._page_bytes)
        if failed_at is not None and self._index.get(failed_at.key) is failed_at:
            self._counters.checksum_failures += 1
            self._counters.pages_dropped += self._index.drop_subtree(failed_at)
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
        self._index.touch(promoted)
        for node in promoted:  # each arrived with one reference (its allocation); the cache keeps it
            self._pools.hbm.release(PageId(node.page))

    def _prefetches_of(self, nodes: Sequence[RadixNode]) -> list[MoveTicket]:
        keys = {n.key for n in nodes}
        tickets: dict[int, MoveTicket] = {}
        for part in self._in_flight:
            if part.ticket is not None and part.ticket.is_promotion and any(n.key in keys for n in part.nodes):
                tickets[id(part.ticket)] = part.ticket
        return list(tickets.values())

    def cancel(self, nodes: Sequence[RadixNode]) -> int:
        """Cancel the prefetches in flight for any of ``nodes`` and apply them now: pages of a
        transfer that completed first land, the others stay below. Returns how many."""
        tickets = self._prefetches_of(nodes)
        for ticket in tickets:
            for transfer_id in ticket.transfer_ids:
                self._transfers.cancel(transfer_id)
        for ticket in tickets:
            self._wait_for(ticket)
        return len(tickets)
