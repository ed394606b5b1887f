"""The tool-duration model (kvtier/policy/prediction.py): bins, rescaling, the prediction
bounds' miss rates on short histories, and predictions from each source. Durations in ms, no Redis."""

from __future__ import annotations

import math
import random

import pytest

from kvtier.domain.errors import InvalidArgument
from kvtier.domain.records import PredictionSource
from kvtier.policy.prediction import (
    NUM_BINS,
    Prediction,
    PredictorParams,
    ToolHistory,
    bin_of,
    predict,
    return_spread,
    tool_model,
)


def lognormal_ms(rng: random.Random, median_ms: float, sigma: float) -> float:
    return math.exp(rng.gauss(math.log(median_ms), sigma))


def history_of(*durations_ms: float) -> ToolHistory:
    history = ToolHistory("t", "x", half_life_obs=50.0)
    for d in durations_ms:
        history.observe(d)
    return history


def test_bins_cover_the_range():
    assert bin_of(0) == 0 and bin_of(1) == 0
    assert bin_of(2.0) == 16
    assert bin_of(1e12) == NUM_BINS - 1


def test_rescaling_keeps_quantiles():
    history = ToolHistory("t", "x", half_life_obs=1.0)
    rng = random.Random(1)
    for _ in range(1_000):  # 2^(n / 1) overflows long before 1000: rescaled on the way
        history.observe(lognormal_ms(rng, 100.0, 0.01))
    assert abs(history.quantile_ms(0.5) - 100.0) < 5.0
    assert history.num_observations < 1_000


def _miss_rates(seed: int, q: float, bound, missed) -> tuple[float, float]:
    """Over 2,000 histories of 20 lognormal observations: how often the next one is ``missed``
    by ``bound(history, q)`` and by the bare empirical q point."""
    rng = random.Random(seed)
    num_trials = 2_000
    by_bound = by_empirical = 0
    for _ in range(num_trials):
        history = ToolHistory("t", "x", half_life_obs=50.0)
        for _ in range(20):
            history.observe(lognormal_ms(rng, 1_000.0, 0.5))
        following = lognormal_ms(rng, 1_000.0, 0.5)
        by_bound += missed(following, bound(history, q))
        by_empirical += missed(following, history.quantile_ms(q))
    return by_bound / num_trials, by_empirical / num_trials


def test_the_low_quantile_is_not_optimistic_with_a_short_history():
    """Prefetches aim at ``quantile_lo_ms``: with 20 observations the next duration must fall
    below it at most ~5 % of the time. The bare empirical 5 % point of 20 samples (about the
    smallest seen) is undercut more often; the prediction bound is what keeps it honest."""
    bound, empirical = _miss_rates(11, 0.05, ToolHistory.lower_bound_ms, lambda x, b: x < b)
    assert bound <= 0.055
    assert empirical > bound


def test_the_high_quantile_is_not_optimistic_with_a_short_history():
    """A prefetched session's pages are held until ``quantile_hi_ms``: with 20 observations the
    next duration must run past it at most ~1 % of the time (a later return finds the hold
    lapsed and its pages evicted). The empirical 99 % point of 20 samples (the largest seen) is
    overrun more often."""
    bound, empirical = _miss_rates(12, 0.99, ToolHistory.upper_bound_ms, lambda x, b: x > b)
    assert bound <= 0.015
    assert empirical > bound


# No history, default params (5 s, sigma 0.7): the lognormal's 5 % and 99 % points around the median.
@pytest.mark.parametrize(("expected_ms", "median_ms", "lo_ms", "hi_ms", "source"), [
    (None, 5_000.0, 1_581.0, 25_479.7, PredictionSource.DEFAULT),
    (1_000, 1_000.0, 316.2, 5_095.9, PredictionSource.CALLER_ESTIMATE),
])
def test_without_history_the_prediction_is_a_lognormal_around_the_estimate(expected_ms, median_ms, lo_ms, hi_ms,
                                                                            source):
    p = predict(None, PredictorParams(), expected_ms)
    assert (p.return_in_ms, p.source) == (median_ms, source)
    assert (p.quantile_lo_ms, p.quantile_hi_ms) == pytest.approx((lo_ms, hi_ms), rel=1e-3)


def test_a_trusted_history_predicts_and_scales_a_callers_estimate():
    history = history_of(*[1_000.0] * 10, *[2_000.0] * 10)
    # Four returns are worth less than min_samples (5): not trusted yet.
    assert predict(history_of(1_000.0, 1_000.0, 1_000.0, 1_000.0), PredictorParams()).source is PredictionSource.DEFAULT
    p = predict(history, PredictorParams())
    assert p.source is PredictionSource.HISTORY
    assert p.quantile_lo_ms < p.return_in_ms < p.quantile_hi_ms and 1_000 <= p.return_in_ms <= 2_100
    # A caller's estimate wins, history gives it its spread (lo / median and hi / median kept).
    c = predict(history, PredictorParams(), expected_ms=10_000)
    assert c.source is PredictionSource.CALLER_ESTIMATE and c.return_in_ms == 10_000
    assert c.quantile_lo_ms / 10_000 == pytest.approx(p.quantile_lo_ms / p.return_in_ms)
    assert c.quantile_hi_ms / 10_000 == pytest.approx(p.quantile_hi_ms / p.return_in_ms)
    # An aim replaces the low bound by that quantile of the history's model, never past the median.
    model = tool_model(history, PredictorParams())
    assert predict(history, PredictorParams(), aim=0.1).quantile_lo_ms == pytest.approx(
        min(model.quantile_ms(0.1), p.return_in_ms))
    with pytest.raises(InvalidArgument, match="aim"):
        predict(history, PredictorParams(), aim=0.5)


@pytest.mark.parametrize(("median_ms", "hi_ms", "spread"), [
    (1_000.0, 1_000.0 * math.exp(2.3263), 1.0),  # the 99 % point one sigma of 2.326 above
    (1_000.0, 1_000.0 * math.exp(0.5 * 2.3263), 0.5),
    (1_000.0, 1_000.0, None),  # no spread above the median
    (0.0, 10.0, None),
])
def test_the_return_spread_is_the_sigma_whose_high_quantile_matches(median_ms, hi_ms, spread):
    prediction = Prediction(median_ms, 0.0, hi_ms, 1.0, PredictionSource.HISTORY)
    got = return_spread(prediction, 0.99)
    assert got == (None if spread is None else pytest.approx(spread, rel=1e-4))


@pytest.mark.parametrize("field", ["default_ms", "half_life_obs", "min_samples", "default_sigma"])
def test_params_name_the_field_they_refuse(field):
    with pytest.raises(InvalidArgument, match=field):
        PredictorParams(**{field: 0})
