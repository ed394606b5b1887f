"""Eviction as a learned choice among experts (DESIGN §5 decision 15; decision 0014).

Numbers in, numbers out: times are access ticks (the index counts one per lookup and one
per page inserted), costs are ratios. The cache layer (``kvtier.cache.eviction.ExpertPolicy``) feeds it.

Every expert scores a cached page in the same unit, ticks, and a higher score keeps the
page longer; each score is fixed between two uses of the page, so an index can queue it:

    LRU        last                                      (recency alone)
    FREQUENCY  last + min(Ī × log2(uses), C)             (each doubling of uses buys a mean gap)
    VALUE      last + min(Ī × log2(uses) × cost, C)      (the same, weighed by restore cost)
    REUSE      last − min(gap, C)                        (the page's own predicted reuse gap)
    TURNOVER   last + C × log2(uses)                     (each doubling of uses buys a cache turnover)

``last`` is the tick of the page's last use, ``uses`` how often it was used, this use
included (kept after an eviction, so a page that comes back is known), ``Ī`` the mean gap
between uses over all pages, ``cost`` the page's restore cost relative to the mean, ``C``
the capacity in pages, and ``gap`` the page's predicted time between uses: the moving mean
of its own gaps once it has one, else its parent's (the next turn of a conversation, or an
agent back from its tool, comes back about as late as its prefix last did; a shared prompt
with many followers has a short gap), else the mean gap of all pages twice over (a page
never seen again is the common case). REUSE evicts the page whose next use is furthest
away by its own history. The bound ``C`` keeps the first four scores within one cache turnover of
``last``; TURNOVER is the frequency expert in the unit of a turnover, so a page used 2ᵏ
times stays through k turnovers without a use (a shared document or few-shot prompt outlives
a stream of one-shot questions; a stale one ages out).

The learner (``ExpertLearner``) runs each expert on a miniature cache: the pages whose key
falls in a fixed hash sample, at the sampled share of the real capacity (as SHARDS sizes
miss-ratio curves). Each sampled use is a hit or a miss for each miniature. A paired test
compares each challenger with the leader on the same uses (a moving mean of leader's miss
− challenger's miss, and its variance): the challenger leads once its advantage passes a
margin and ``z`` standard errors, after a loss window of evidence since the last change.
The live priority is the leader's score; LRU leads until another expert is measured
better. The guarantee is empirical, not a regret bound: the live cache follows an expert
only while its miniature misses significantly less than the leader's.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum


class Expert(IntEnum):
    LRU = 0
    FREQUENCY = 1
    VALUE = 2
    REUSE = 3
    TURNOVER = 4


NUM_EXPERTS = len(Expert)
# The learner's experts unless told otherwise (decision 0014: with FREQUENCY and VALUE as well,
# the lead changes often enough on the Mooncake trace at 1k blocks to fall below LRU).
DEFAULT_EXPERTS: tuple[Expert, ...] = (Expert.LRU, Expert.REUSE, Expert.TURNOVER)


@dataclass(slots=True)
class Usage:
    """One page's use history: the tick of its last use, its uses, its moving reuse gap."""

    last: int
    uses: int = 1
    gap: float = 0.0  # ticks; 0 until a gap was seen or inherited
    gap_seen: bool = False


class UsageHistory:
    """Use history per page key, kept past eviction for the most recent ``max_keys`` keys."""

    def __init__(self, max_keys: int, *, gap_weight: float = 0.5) -> None:
        if max_keys < 1:
            raise ValueError(f"max_keys must be >= 1, got {max_keys}")
        self.max_keys = max_keys
        self.gap_weight = gap_weight  # weight of the newest gap in a page's moving mean
        self.mean_gap = 0.0  # moving mean of every observed gap
        self._usage: OrderedDict[bytes, Usage] = OrderedDict()

    def get(self, key: bytes) -> Usage | None:
        return self._usage.get(key)

    def observe(self, key: bytes, parent: bytes | None, tick: int) -> Usage:
        """Record one use of ``key`` at ``tick``; returns its updated history."""
        usage = self._usage.get(key)
        if usage is None:
            usage = Usage(last=tick)
            parent_usage = self._usage.get(parent) if parent is not None else None
            if parent_usage is not None and parent_usage.gap_seen:
                usage.gap = parent_usage.gap
            self._usage[key] = usage
            if len(self._usage) > self.max_keys:
                self._usage.popitem(last=False)
            return usage
        if tick > usage.last:
            gap = float(tick - usage.last)
            usage.gap = gap if not usage.gap_seen else usage.gap + self.gap_weight * (gap - usage.gap)
            usage.gap_seen = True
            self.mean_gap += 0.01 * (gap - self.mean_gap)
            usage.uses += 1
            usage.last = tick
        self._usage.move_to_end(key)
        return usage


def expert_scores(
    usage: Usage, *, mean_gap: float, cost_ratio: float = 1.0, max_offset: float = math.inf
) -> tuple[float, float, float, float, float]:
    """The five experts' scores of a page (ticks; higher is kept longer), by ``Expert``.

    The first four move ``last`` by at most ``max_offset`` ticks either way; TURNOVER moves it
    by ``max_offset`` per doubling of uses (a page used 2ᵏ times outlives k cache turnovers
    unused), so it takes a finite ``max_offset``."""
    last = float(usage.last)
    mean = max(mean_gap, 1.0)
    frequency = mean * math.log2(usage.uses)  # uses counts this one: the first use buys nothing
    gap = usage.gap if usage.gap > 0 else 2.0 * mean
    return (
        last,
        last + min(frequency, max_offset),
        last + min(frequency * cost_ratio, max_offset),
        last - min(gap, max_offset),
        last + max_offset * math.log2(usage.uses) if usage.uses > 1 else last,
    )


class MiniatureCache:
    """A cache of sampled keys ranked by one expert's score (lowest leaves first)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._score: dict[bytes, tuple[float, int]] = {}
        self._heap: list[tuple[float, int, bytes]] = []
        self._order = itertools.count()

    def access(self, key: bytes, score: float) -> bool:
        """Use ``key`` (which now scores ``score``); returns whether it was cached."""
        hit = key in self._score
        entry = (score, next(self._order))
        self._score[key] = entry
        heapq.heappush(self._heap, (entry[0], entry[1], key))
        if len(self._score) > self.capacity:
            self._evict_other(key)
        if len(self._heap) > 4 * self.capacity + 64:
            self._heap = [(s, o, k) for k, (s, o) in self._score.items()]
            heapq.heapify(self._heap)
        return hit

    def _evict_other(self, keep: bytes) -> None:
        """Drop the lowest-scored key other than ``keep`` (the one in use)."""
        spared = []
        while self._heap:
            entry = heapq.heappop(self._heap)
            score, order, victim = entry
            if self._score.get(victim) != (score, order):
                continue
            if victim == keep:
                spared.append(entry)
                continue
            del self._score[victim]
            break
        for entry in spared:
            heapq.heappush(self._heap, entry)

    def __len__(self) -> int:
        return len(self._score)


def sample_rate_for(capacity_pages: int, *, min_sampled_pages: int = 256) -> float:
    """Share of keys the miniatures follow: all of them for a small cache, down to 1/16,
    keeping at least ``min_sampled_pages`` pages in each miniature."""
    if capacity_pages <= min_sampled_pages:
        return 1.0
    return max(1 / 16, min_sampled_pages / capacity_pages)


class ExpertLearner:
    """Follows the expert whose miniature cache misses least, by a paired test against the
    leader; ``priority`` is the leader's score of a page."""

    def __init__(
        self,
        capacity_pages: int,
        *,
        experts: Sequence[Expert] = DEFAULT_EXPERTS,
        margin: float = 0.005,
        z: float = 5.0,
        loss_window: int | None = None,
        history_factor: int = 4,
    ) -> None:
        if capacity_pages < 1:
            raise ValueError(f"capacity_pages must be >= 1, got {capacity_pages}")
        if not experts:
            raise ValueError("an expert learner needs at least one expert")
        self.experts = tuple(experts)
        self.margin = margin  # a challenger leads once its moving miss rate is this much lower
        self.z = z
        self.sample_rate = sample_rate_for(capacity_pages)
        self._sample_below = round(self.sample_rate * 65536)
        sampled = max(1, round(capacity_pages * self.sample_rate))
        self.miniatures = [MiniatureCache(sampled) for _ in self.experts]
        # A loss is a moving miss rate over about two miniature turnovers of sampled uses.
        window = loss_window or 2 * sampled
        self._loss_step = 1.0 / max(1, window)
        self.losses = [0.0] * len(self.experts)
        # Scores stay within one capacity of ticks of ``last`` (``expert_scores``), and a
        # challenger is tested over one loss window before it may lead.
        self.max_offset = float(capacity_pages)
        self._warmup = window
        self._advantage = [0.0] * len(self.experts)  # moving (leader's miss − this expert's miss)
        self._advantage_sq = [0.0] * len(self.experts)
        self._num_compared = 0
        self.num_switches = 0
        self.leader = 0  # the first expert (LRU by default) until another is measured better
        self.history = UsageHistory(history_factor * capacity_pages + 1024)
        self.num_sampled = 0

    def is_sampled(self, key: bytes) -> bool:
        return int.from_bytes(key[:2], "little") < self._sample_below

    def observe(self, key: bytes, parent: bytes | None, tick: int, *, cost_ratio: float = 1.0) -> Usage:
        """One use of a page: update its history, and the miniatures when it is sampled."""
        usage = self.history.observe(key, parent, tick)
        if self.is_sampled(key):
            self.num_sampled += 1
            scores = self._scores(usage, cost_ratio)
            misses = [
                0.0 if miniature.access(key, scores[expert]) else 1.0
                for expert, miniature in zip(self.experts, self.miniatures, strict=True)
            ]
            self._compare(misses)
        return usage

    def _compare(self, misses: list[float]) -> None:
        """Paired test of each challenger against the leader on the same sampled uses; a
        challenger leads once its moving advantage passes ``margin`` and ``z`` standard errors."""
        step = self._loss_step
        leader_miss = misses[self.leader]
        for i, miss in enumerate(misses):
            self.losses[i] += step * (miss - self.losses[i])
            d = leader_miss - miss
            self._advantage[i] += step * (d - self._advantage[i])
            self._advantage_sq[i] += step * (d * d - self._advantage_sq[i])
        self._num_compared += 1
        if self._num_compared < self._warmup:
            return
        best = max(range(len(misses)), key=self._advantage.__getitem__)
        advantage = self._advantage[best]
        variance = max(self._advantage_sq[best] - advantage * advantage, 0.0)
        if advantage > self.margin and advantage > self.z * math.sqrt(variance * step / 2.0):
            self.leader = best
            self.num_switches += 1
            self._advantage = [0.0] * len(misses)
            self._advantage_sq = [0.0] * len(misses)
            self._num_compared = 0

    def _scores(self, usage: Usage, cost_ratio: float) -> tuple[float, float, float, float, float]:
        return expert_scores(
            usage, mean_gap=self.history.mean_gap, cost_ratio=cost_ratio, max_offset=self.max_offset
        )

    def priority(self, usage: Usage, *, cost_ratio: float = 1.0) -> float:
        scores = self._scores(usage, cost_ratio)
        return scores[self.experts[self.leader]]

    @property
    def leading(self) -> Expert:
        return self.experts[self.leader]
