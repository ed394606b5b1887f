"""Session-hold rules (``kvtier.policy.holds``) on plain numbers: milliseconds and page keys."""

from __future__ import annotations

import math

import pytest

from kvtier.policy.holds import (
    Displacement,
    ExpectedReturn,
    can_retake,
    conditional_median_ms,
    deferral_outcome,
    expected_return,
    fits_cap,
    hold_rank_ms,
    is_due_soon,
    num_held,
    plan_displacement,
    retake_order,
    weakest_hold,
)


def chain(*keys: int) -> frozenset[int]:
    return frozenset(keys)


@pytest.mark.parametrize(("median_ms", "elapsed_ms", "sigma", "low", "high"), [
    (1000.0, 518.0, 0.4, 1020.0, 1040.0),  # prefetched at its 5 % point: barely past the median
    (1000.0, 50.0, 0.4, 1000.0, 1000.1),  # just left: the median
    (1000.0, 1200.0, 0.4, 1470.0, 1490.0),  # overdue at 1.2 x: moves out with the tail
    (1000.0, 0.0, 0.4, 1000.0, 1000.0),  # not away yet: the median
    (1000.0, 3000.0, 0.0, 3000.0, 3000.0),  # no spread: never earlier than now
    (1000.0, 1e9, 0.4, 1e9, 1.01e9),  # far in the tail: finite, never before now
])
def test_the_conditional_median_moves_out_with_the_time_already_waited(median_ms, elapsed_ms, sigma, low, high):
    assert low <= conditional_median_ms(median_ms, elapsed_ms, sigma) <= high


def test_an_expected_return_without_a_spread_ranks_by_its_median():
    assert ExpectedReturn(5_000.0).rank_ms(now_ms=9_000.0) == 5_000.0
    assert expected_return(1_000.0, due_s=2.0) == ExpectedReturn(3_000.0)
    # Away 1 s of a 2 s pause (median 3 s): ranked by the conditional median, as of now.
    expected = expected_return(1_000.0, due_s=2.0, away_s=1.0, spread=0.4)
    assert expected == ExpectedReturn(3_000.0, 0.0, 0.4)
    assert 3_000.0 < expected.rank_ms(1_000.0) < 3_100.0
    assert expected.rank_ms(4_000.0) > 4_000.0  # overdue: later than now


@pytest.mark.parametrize(("expected", "expires_at_ms", "rank"), [
    (ExpectedReturn(2_000.0), 9_000.0, 2_000.0),  # a prediction ranks it
    (None, 9_000.0, 9_000.0),  # none: the hold's end
    (None, None, math.inf),  # neither: last
])
def test_a_hold_ranks_by_its_prediction_else_its_end(expected, expires_at_ms, rank):
    assert hold_rank_ms(expected, expires_at_ms, now_ms=1_000.0) == rank


def test_shared_prefix_pages_count_once_against_the_cap():
    assert num_held([chain(1, 2, 3), chain(1, 2, 4)]) == 4
    assert fits_cap(chain(1, 2, 5), [chain(1, 2, 3), chain(1, 2, 4)], cap_pages=5)
    assert not fits_cap(chain(6), [chain(1, 2, 3), chain(1, 2, 4)], cap_pages=4.5)


@pytest.mark.parametrize(("new_rank", "new_chain", "cap", "expected"), [
    # Fits beside both: nothing displaced.
    (1_500.0, chain(7, 8), 9, Displacement(True)),
    # Short by 2: the weakest (due at 3 s) goes first and that is enough.
    (1_500.0, chain(7, 8), 7, Displacement(True, ("late",))),
    # Short by 5: both holds ranked after it go, weakest first.
    (500.0, chain(7, 8, 9, 10, 11), 5, Displacement(True, ("late", "soon"))),
    # Ranked after "soon": only "late" may go, and that is not enough: refused, nothing displaced.
    (1_500.0, chain(7, 8, 9, 10, 11), 5, Displacement(False)),
    # Ranked last: displaces nobody, refused.
    (9_000.0, chain(7, 8), 7, Displacement(False)),
    # Its pages are already held (a shared prefix): it adds nothing and fits.
    (9_000.0, chain(1, 2), 7, Displacement(True)),
])
def test_a_new_hold_displaces_the_holds_due_back_later_weakest_first(new_rank, new_chain, cap, expected):
    holds = {"soon": (1_000.0, chain(1, 2, 3)), "late": (3_000.0, chain(4, 5, 6))}
    assert plan_displacement(new_rank, new_chain, holds, cap) == expected


@pytest.mark.parametrize(("weaker_than", "sparing", "expected"), [
    (None, None, "late"),  # the session due back last yields first
    (None, "late", "mid"),  # never the hold of the session the room is for
    (2_500.0, None, "late"),  # only holds ranked after the asker
    (3_000.0, None, None),  # none ranked after it: nothing yields
    (1_500.0, "late", "mid"),
])
def test_the_weakest_hold_yields(weaker_than, sparing, expected):
    ranks = {"soon": 1_000.0, "mid": 2_000.0, "late": 3_000.0}
    assert weakest_hold(ranks, weaker_than_ms=weaker_than, sparing=sparing) == expected


def test_ties_yield_the_same_hold_every_time():
    assert weakest_hold({"a": 1_000.0, "b": 1_000.0}) == "b"
    assert weakest_hold({}) is None


def test_due_soon_deferral_and_retake_order():
    assert is_due_soon([5_000.0, 1_900.0], before_ms=2_000.0)
    assert not is_due_soon([5_000.0], before_ms=2_000.0)
    assert deferral_outcome(waited_in_all_s=1.0, defer_s=2.0) == "room"
    assert deferral_outcome(waited_in_all_s=2.0, defer_s=2.0) == "timed_out"
    assert retake_order({"late": 3_000.0, "soon": 1_000.0, "never": math.inf}) == ["soon", "late", "never"]


@pytest.mark.parametrize(("num_free", "num_up", "reserve", "expected"), [
    (10, 4, 6.0, True),  # leaves the low mark free
    (10, 5, 6.0, False),  # would dig into it
    (3, 0, 6.0, False),  # already below it
])
def test_a_retake_uses_free_pages_above_the_reserve_only(num_free, num_up, reserve, expected):
    assert can_retake(num_free, num_up, reserve) is expected
