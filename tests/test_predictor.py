"""The tool-return predictor against a real valkey: convergence to a known lognormal,
adaptation after a shift, caller estimates and defaults, persistence across instances. The
model's arithmetic alone is tested in tests/test_policy_prediction.py."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from kvtier.controller.predictor import ToolReturnPredictor, history_key
from kvtier.domain.errors import InvalidArgument
from kvtier.domain.records import PredictionSource
from kvtier.policy.prediction import PredictorParams


def lognormal_ms(rng: random.Random, median_ms: float, sigma: float) -> float:
    return math.exp(rng.gauss(math.log(median_ms), sigma))


async def feed(predictor, tenant, tool, rng, median_ms, sigma, n):
    for _ in range(n):
        await predictor.observe(tenant, tool, lognormal_ms(rng, median_ms, sigma))


async def test_converges_to_a_lognormal_and_adapts_after_a_shift(redis_client):
    rng = random.Random(7)
    predictor = ToolReturnPredictor(redis_client)
    await feed(predictor, "acme", "search", rng, 1_000.0, 0.5, 400)
    p = predictor.predict("acme", "search")
    assert p.source is PredictionSource.HISTORY
    assert abs(p.return_in_ms - 1_000.0) / 1_000.0 < 0.10
    # 5 % / 99 % points of a lognormal(σ = 0.5): median × e^(−1.645 σ) ≈ 439, × e^(2.326 σ) ≈ 3200 ms.
    assert abs(p.quantile_lo_ms - 439.0) / 439.0 < 0.2 and abs(p.quantile_hi_ms - 3200.0) / 3200.0 < 0.2
    assert p.confidence > 0.8

    # The spread of the long returns (sigma of ln duration, from the 99 % point): the worker
    # ranks an overdue session's hold by it.
    assert predictor.spread(p) == pytest.approx(0.5, rel=0.2)
    assert predictor.spread(replace(p, quantile_hi_ms=p.return_in_ms)) is None

    # The tool gets 4x slower: after a few half-lives the old shape no longer matters.
    await feed(predictor, "acme", "search", rng, 4_000.0, 0.5, 300)
    shifted = predictor.predict("acme", "search")
    assert abs(shifted.return_in_ms - 4_000.0) / 4_000.0 < 0.10


async def test_caller_estimate_default_and_per_key_isolation(redis_client):
    predictor = ToolReturnPredictor(redis_client, PredictorParams(default_ms=2_000.0, min_samples=2.5))
    cold = predictor.predict("acme", "search")
    assert cold.source is PredictionSource.DEFAULT and cold.return_in_ms == 2_000.0
    assert predictor.spread(cold) == pytest.approx(predictor.params.default_sigma)
    assert cold.quantile_lo_ms < 2_000.0 < cold.quantile_hi_ms

    estimate = predictor.predict("acme", "search", expected_ms=300)
    assert estimate.source is PredictionSource.CALLER_ESTIMATE and estimate.return_in_ms == 300.0

    for d in (100.0, 200.0, 400.0):
        await predictor.observe("acme", "search", d)
    assert predictor.predict("acme", "search").source is PredictionSource.HISTORY
    # The caller's estimate still wins, with the spread history shows (lo < est < hi).
    with_history = predictor.predict("acme", "search", expected_ms=300)
    assert with_history.source is PredictionSource.CALLER_ESTIMATE and with_history.return_in_ms == 300.0
    assert with_history.quantile_lo_ms < 300.0 < with_history.quantile_hi_ms
    # Another tenant, another tool: no history of their own.
    assert predictor.predict("other", "search").source is PredictionSource.DEFAULT
    assert predictor.predict("acme", "browse").source is PredictionSource.DEFAULT

    with pytest.raises(InvalidArgument):
        await predictor.observe("acme", "search", -1.0)


async def test_a_tenant_keeps_a_bounded_number_of_tool_histories(redis_client):
    """Tool names come from callers (one with a request id in it makes a new tool each call):
    past ``max_tools_per_tenant`` a new tool's history replaces the tenant's least recently
    observed one, in memory and in Redis; other tenants keep theirs; every history written
    expires from Redis after ``history_ttl_s`` without an observation."""
    params = PredictorParams(min_samples=1.0, max_tools_per_tenant=3, history_ttl_s=3_600.0)
    predictor = ToolReturnPredictor(redis_client, params)
    for tool in ("a", "b", "c"):
        await predictor.observe("acme", tool, 100.0)
    await predictor.observe("other", "a", 100.0)
    await predictor.observe("acme", "a", 120.0)  # a is now the most recently observed
    await predictor.observe("acme", "d", 100.0)  # over the bound: b goes
    assert predictor.history("acme", "b") is None
    assert await redis_client.exists(history_key("acme", "b")) == 0
    assert predictor.predict("acme", "b").source is PredictionSource.DEFAULT
    for tool in ("a", "c", "d"):
        assert predictor.history("acme", tool) is not None
        assert 0 < await redis_client.pttl(history_key("acme", tool)) <= 3_600_000
    assert predictor.history("other", "a") is not None
    # A new predictor on the same Redis loads the bounded set and keeps bounding it.
    reloaded = ToolReturnPredictor(redis_client, params)
    assert await reloaded.load() == 4
    await reloaded.observe("acme", "e", 100.0)
    assert sum(reloaded.history("acme", t) is not None for t in "abcde") == 3
    assert reloaded.history("acme", "e") is not None
    with pytest.raises(InvalidArgument):
        PredictorParams(max_tools_per_tenant=0)


async def test_history_survives_a_new_predictor_on_the_same_redis(redis_client):
    rng = random.Random(3)
    first = ToolReturnPredictor(redis_client)
    await feed(first, "acme", "search:v2", rng, 800.0, 0.4, 60)
    await feed(first, "beta", "search", rng, 5_000.0, 0.4, 60)
    before = first.predict("acme", "search:v2")

    second = ToolReturnPredictor(redis_client)
    assert await second.load() == 2
    after = second.predict("acme", "search:v2")
    assert after.source is PredictionSource.HISTORY
    assert after.return_in_ms == pytest.approx(before.return_in_ms)
    assert after.quantile_hi_ms == pytest.approx(before.quantile_hi_ms)
    assert second.predict("beta", "search").return_in_ms == pytest.approx(first.predict("beta", "search").return_in_ms)
    # It keeps learning where the first left off.
    await second.observe("acme", "search:v2", 800.0)
    assert second.history("acme", "search:v2").num_observations == 61
    assert await redis_client.hget(history_key("acme", "search:v2"), "n") == b"61"


async def test_the_prefetch_quantile_is_the_configured_low_one(redis_client):
    rng = random.Random(5)
    predictor = ToolReturnPredictor(redis_client)
    await feed(predictor, "acme", "run_tests", rng, 2_000.0, 0.4, 30)
    p = predictor.predict("acme", "run_tests")
    history = predictor.history("acme", "run_tests")
    assert p.quantile_lo_ms == pytest.approx(history.lower_bound_ms(PredictorParams().lo_quantile))
    assert p.quantile_lo_ms < history.quantile_ms(0.10) < p.return_in_ms
    cold = ToolReturnPredictor(redis_client, PredictorParams(lo_quantile=0.05, default_sigma=0.5))
    # No history: the lognormal default's 5 % point, median × e^(−1.645 σ).
    assert cold.predict("acme", "other", expected_ms=1_000).quantile_lo_ms == pytest.approx(439.5, rel=0.01)
