"""Room in HBM made in the background, before pages are needed there.

A request short of HBM room, or a commanded prefetch, would otherwise take its room by
spilling on the engine thread, which then waits on the link with every running sequence.
Here the coldest idle pages start down instead (a watermark demotion of dirty pages; clean
ones go back onto their copy below at no cost), and when they are not enough, session holds
yield, the weakest first (``Holds.yield_weakest``).
"""

from __future__ import annotations

from collections.abc import Callable

from kvtier.cache.radix import RadixNode
from kvtier.domain.tiers import Tier
from kvtier.engine.engine import Engine
from kvtier.policy.admission import shortfall
from kvtier.tiers.transfer import TransferReason
from kvtier.worker.holds import Holds, require_tiers
from kvtier.worker.session_ref import SessionRef


class Room:
    """Counts and makes free HBM room on ``engine``, yielding ``holds`` when it must."""

    def __init__(self, engine: Engine, holds: Holds) -> None:
        self._engine = engine
        self._holds = holds

    def free_hbm(self, *, sparing: float | None = None) -> int:
        """HBM pages free to take at no copy: free, or idle with an intact copy below
        (``TierManager.num_reclaimable``; ``sparing``: for a prefetch of that hold rank, less the
        clean pages brought up for sessions due back no later)."""
        tiers = self._engine.tiers
        if tiers is None:
            return self._engine.pool.num_free
        if sparing is None:
            return tiers.num_reclaimable()
        index = self._engine.index
        nodes = (index.get(key) for key in self._holds.spared(sparing))
        spared = sum(1 for node in nodes if node is not None and tiers.is_clean(node))
        return tiers.num_reclaimable() - spared

    def lower_tier(self) -> Tier | None:
        tiers = require_tiers(self._engine)
        return next((t for t in (Tier.DRAM, Tier.NVME) if tiers.is_usable(t)), None)

    def backlog_pages(self) -> int:
        """HBM pages the requests added to the engine and not yet admitted will take
        (``Engine.queued_demand``).

        Each was added because the free pages covered it, but a burst of them was measured
        against the same free pages; the ones the free pages no longer cover would take their
        room from session holds on the engine thread, whatever the hold's rank. Counted, such a
        request waits outside and its room is made here, holds yielding in rank order."""
        return sum(pages.num_pages for pages in self._engine.queued_demand())

    def short_for(self, num_tokens: int, num_output_left: int, chain: list[RadixNode]) -> int:
        """HBM pages admitting a request of ``num_tokens`` prompt tokens (``num_output_left`` to
        generate), of which ``chain`` is cached, would have to free by spilling on the engine
        thread. The pages it takes, its output's reservation included, are the engine's count
        (``kvtier.policy.admission``); the room is the worker's: the pages free to take at no
        copy, less those promised to the requests the engine has yet to admit (the scheduler's
        is every page it may take at all, evicting or spilling)."""
        pages = self._engine.admission_pages(num_tokens, num_output_left, chain)
        return shortfall(pages, self.free_hbm() - self.backlog_pages())

    def needs(self, num_pages: int, *, rank: float | None = None, session: SessionRef | None = None) -> bool:
        """Fewer than ``num_pages`` HBM pages free to take, and room for them on its way
        (``make``; ``rank``: that of the hold the pages will have; ``session``: whose pages they
        are, so its own hold never yields to them)."""
        short = num_pages - self.free_hbm(sparing=rank)
        return short > 0 and self.make(short, weaker_than=rank, sparing=session)

    def make(
        self, short: int, *, protect: Callable[[], None] | None = None, weaker_than: float | None = None,
        sparing: SessionRef | None = None,
    ) -> bool:
        """Free ``short`` HBM pages in the background: True when pages already leaving HBM cover
        them or a demotion started (``protect`` runs first); False when nothing can leave HBM now.

        The coldest idle pages go first. When they are not enough, session holds yield, the
        weakest first: the pages asked for are needed now (a request waiting for admission) or
        sooner (a prefetch for a session due back first: only holds ranked after ``weaker_than``
        yield to it), and never the hold of the session they are for, ``sparing`` (a top-up's
        prediction can rank a hair before the one its session is held by; a request's own pages
        are pinned by ``protect``, so its hold frees nothing)."""
        tiers = require_tiers(self._engine)
        more = short - tiers.num_leaving(Tier.HBM)  # pages on their way out free room too
        if more <= 0:
            return True
        lower = self.lower_tier()
        if lower is None:
            return False
        if protect is not None:
            protect()
        freed = tiers.demote(Tier.HBM, lower, more, TransferReason.WATERMARK, dirty_only=True)
        started, more = freed > 0, more - freed
        # A dirty-only demotion leaves the count as it is (its pages have no copy below, and the
        # clean pages above them stay behind them while they move): a yield's gain is its own.
        before = tiers.num_reclaimable() if more > 0 else 0
        while more > 0:
            if not self._holds.yield_weakest(weaker_than, sparing=sparing):
                break
            after = tiers.num_reclaimable()
            gained, before = after - before, after  # its clean pages are free to take now
            more -= gained
            freed = tiers.demote(Tier.HBM, lower, more, TransferReason.WATERMARK, dirty_only=True) if more > 0 else 0
            if freed == 0 and gained == 0:
                break  # the tier below is full, or the pages are on a move already
            started, more = True, more - freed
        return started
