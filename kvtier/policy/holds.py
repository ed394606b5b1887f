"""Session-hold rules: ranking, displacement within the cap, yielding, deferral (pure arithmetic).

A session hold keeps a prefetched session's pages in HBM until the session is back. Holds are
predictions, so they are ranked by when their session is expected back, strongest (soonest)
first, and the weakest gives way first (Belady's order, by prediction)::

    rank_ms   expected back (the median of its return given it has not returned yet),
              or when the hold lapses when nothing predicts the return
    cap       pages holds may keep together; a new hold displaces holds ranked after it,
              weakest first, until it fits, or it is refused
    yield     room needed now (a waiting request, a preemption, a prefetch ranked sooner)
              releases the weakest hold, never that of the session the room is for

Every function takes plain numbers (milliseconds since the epoch, page counts, sets of page
keys) and returns numbers; none reads a clock or touches the engine. The worker's holds
component (``kvtier.worker.holds``) reads the clock and the radix index and acts on the result.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from statistics import NormalDist
from typing import Literal, TypeVar

K = TypeVar("K", bound=Hashable)

_UNIT_NORMAL = NormalDist()

# How a request's wait for holds due back soon ended: the room came without displacing them
# (``room``), or the deferral window ran out and a hold yielded (``timed_out``).
DeferralOutcome = Literal["room", "timed_out"]


def conditional_median_ms(median_ms: float, elapsed_ms: float, sigma: float) -> float:
    """Median of a log-normal duration (median ``median_ms``, sigma ``sigma`` of its log) given
    that it has lasted ``elapsed_ms`` already: the point where the survival is half of what it
    is now."""
    if median_ms <= 0.0 or elapsed_ms <= 0.0 or sigma <= 0.0:
        return max(median_ms, elapsed_ms)
    z = math.log(elapsed_ms / median_ms) / sigma
    if z < 6.0:
        z_half = _UNIT_NORMAL.inv_cdf(1.0 - (1.0 - _UNIT_NORMAL.cdf(z)) / 2.0)
    else:  # the survival is under 1e-9: a double cannot halve it, its tail can (ln S ~ -z^2 / 2)
        z_half = math.sqrt(z * z + 2.0 * math.log(2.0))
    return max(elapsed_ms, median_ms * math.exp(sigma * z_half))


@dataclass(frozen=True, slots=True)
class ExpectedReturn:
    """When a held session is expected back (wall-clock ms): the median of its predicted
    return (``due_at_ms``, the Prefetch's ``return_in_ms``) and, when the controller sent them
    (``away_ms``, ``return_spread``), when its pause began and the spread of the prediction
    (sigma of ln duration)."""

    due_at_ms: float
    away_since_ms: float | None = None
    spread: float | None = None

    def rank_ms(self, now_ms: float) -> float:
        """When the session is expected back, as of ``now_ms``: the median of its return given
        that it has not returned yet. Before ``due_at_ms`` that is barely later than the median
        (a session prefetched at its 5 % point: 1.03 x the median pause for sigma 0.4); past
        it, it moves out with the tail (at 1.2 x the median pause, sigma 0.4: 1.48 x). Without
        the spread, ``due_at_ms``: an overdue session then stays the first expected back,
        keeping its hold over sessions due in a second, until its hold lapses (decision 0008)."""
        if self.away_since_ms is None or self.spread is None:
            return self.due_at_ms
        median = self.due_at_ms - self.away_since_ms
        return self.away_since_ms + conditional_median_ms(median, now_ms - self.away_since_ms, self.spread)


def expected_return(now_ms: float, due_s: float, away_s: float | None = None,
                    spread: float | None = None) -> ExpectedReturn:
    """The expected return of a session due back in ``due_s`` as of ``now_ms``; with how long it
    has been away (``away_s``) and the prediction's ``spread``, ranked by its conditional median."""
    due_at_ms = now_ms + due_s * 1000.0
    if away_s is None or spread is None:
        return ExpectedReturn(due_at_ms)
    return ExpectedReturn(due_at_ms, now_ms - away_s * 1000.0, spread)


def hold_rank_ms(expected: ExpectedReturn | None, expires_at_ms: float | None, now_ms: float) -> float:
    """A hold's claim on HBM as of ``now_ms``, strongest (lowest) first: when its session is
    expected back, or without a prediction when the hold lapses (+inf: never). Whether the
    prefetch behind it copied pages up does not count: a page that leaves HBM goes back onto
    its copy below without a write (decision 0012), so a yielded hold costs one promotion
    whoever paid for the last one."""
    if expected is not None:
        return expected.rank_ms(now_ms)
    return math.inf if expires_at_ms is None else float(expires_at_ms)


@dataclass(frozen=True, slots=True)
class Displacement:
    """Whether a new hold fits the cap (``is_taken``) and the holds it displaces, weakest first
    (empty when it is refused: a refused hold displaces nothing)."""

    is_taken: bool
    displaced: tuple[Hashable, ...] = ()


def num_held(chains: Iterable[frozenset[Hashable]]) -> int:
    """Pages held by holds whose chains are ``chains`` (a prefix shared by sessions counts once)."""
    held: set[Hashable] = set()
    for chain in chains:
        held |= chain
    return len(held)


def fits_cap(new_chain: frozenset[Hashable], chains: Iterable[frozenset[Hashable]], cap_pages: float) -> bool:
    """Whether a hold on ``new_chain`` (the pages it keeps: the held page and its ancestors)
    fits ``cap_pages`` beside holds keeping ``chains``."""
    return num_held([new_chain, *chains]) <= cap_pages


def plan_displacement(
    new_rank_ms: float, new_chain: frozenset[Hashable],
    holds: Mapping[K, tuple[float, frozenset[Hashable]]], cap_pages: float,
) -> Displacement:
    """Place a new hold of rank ``new_rank_ms`` keeping ``new_chain`` among ``holds`` (by id:
    rank and chain), within ``cap_pages``: the holds ranked after it are displaced, weakest
    first, until it fits; when it does not fit with all of them gone, it is refused and
    nothing is displaced. Holds ranked at or before it are never displaced."""
    weaker = sorted((k for k, (rank, _) in holds.items() if rank > new_rank_ms),
                    key=lambda k: holds[k][0], reverse=True)
    displaced: list[K] = []
    kept = dict(holds)
    while not fits_cap(new_chain, (chain for _, chain in kept.values()), cap_pages) and len(displaced) < len(weaker):
        gone = weaker[len(displaced)]
        displaced.append(gone)
        del kept[gone]
    if not fits_cap(new_chain, (chain for _, chain in kept.values()), cap_pages):
        return Displacement(is_taken=False)
    return Displacement(is_taken=True, displaced=tuple(displaced))


def weakest_hold(ranks: Mapping[K, float], *, weaker_than_ms: float | None = None,
                 sparing: K | None = None) -> K | None:
    """The hold that yields first: the one ranked last; only among those ranked after
    ``weaker_than_ms`` when given, and never ``sparing`` (the hold of the session the room is
    for). None when no hold may yield."""
    candidates = [(rank, k) for k, rank in ranks.items()
                  if k != sparing and (weaker_than_ms is None or rank > weaker_than_ms)]
    if not candidates:
        return None
    return max(candidates)[1]  # ties: the greatest id, so the choice is stable


def is_due_soon(ranks: Iterable[float], before_ms: float) -> bool:
    """Whether a hold ranks at or before ``before_ms``: a request short of room waits for that
    session's turn to come and go rather than displace it."""
    return any(rank <= before_ms for rank in ranks)


def deferral_outcome(waited_in_all_s: float, defer_s: float) -> DeferralOutcome:
    """How a wait for holds due back soon ended, ``waited_in_all_s`` after the request began
    waiting: ``timed_out`` once the deferral window ``defer_s`` has passed, else ``room``."""
    return "timed_out" if waited_in_all_s >= defer_s else "room"


def retake_order(ranks: Mapping[K, float]) -> list[K]:
    """Lapsed holds in the order they are retaken: the session due back first first."""
    return sorted(ranks, key=ranks.__getitem__)


def can_retake(num_free: int, num_to_bring_up: int, reserve_pages: float) -> bool:
    """Whether a lapsed hold may bring ``num_to_bring_up`` pages back into HBM: only into free
    pages, leaving ``reserve_pages`` (the watermark's low mark) free for the next admission."""
    return num_free - num_to_bring_up >= reserve_pages
