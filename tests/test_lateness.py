"""Where each tool's prefetches aim (controller/lateness.py): the per-tenant mix of parks and the
budget behind it, and the predictor's side (a history's model, an aim) on a real valkey. The
equal-hazard arithmetic itself is tested in tests/test_policy_lateness.py."""

from __future__ import annotations

import math
import random

import pytest
from test_policy_lateness import BUDGET, TOOLS, lognormal

from kvtier.controller.lateness import LatenessBudget
from kvtier.controller.predictor import ToolReturnPredictor
from kvtier.domain.errors import InvalidArgument
from kvtier.policy.lateness import LatenessParams


def fixed_models(table):
    return lambda tenant, tool: table.get((tenant, tool))


def test_a_tenants_aims_follow_its_own_recent_parks():
    table = {("acme", t): m for t, m in TOOLS.items()}
    budget = LatenessBudget(LatenessParams(window=4), fixed_models(table))
    assert budget.aim("acme", "test_suite") is None  # no parks seen: the predictor's own bound
    budget.note_park("acme", "test_suite")
    assert budget.aim("acme", "test_suite") is None  # one tool: no one to trade with
    budget.note_park("acme", "code_exec")
    long, short = budget.aim("acme", "test_suite"), budget.aim("acme", "code_exec")
    assert short < BUDGET < long and (long + short) / 2 == pytest.approx(BUDGET, abs=2e-4)
    assert budget.aim("beta", "test_suite") is None  # another tenant's mix is its own
    assert budget.aim("acme", "never_parked") is None
    for _ in range(4):  # the window forgets code_exec
        budget.note_park("acme", "test_suite")
    assert budget.aim("acme", "test_suite") is None
    off = LatenessBudget(LatenessParams(by_hazard=False), fixed_models(table))
    off.note_park("acme", "test_suite")
    off.note_park("acme", "code_exec")
    assert off.aim("acme", "test_suite") is None and off.aim("acme", "code_exec") is None


def test_the_budget_is_what_the_default_aims_spend():
    """A short history's default aim (a prediction bound) lands below its 5 % point: the tenant
    spends what those aims spend, weighted by its mix, not the nominal 5 %."""
    table = {("acme", "code_exec"): lognormal(1_200, 0.5, default_q=0.02),
             ("acme", "test_suite"): lognormal(10_000, 0.4, default_q=0.04)}
    budget = LatenessBudget(LatenessParams(), fixed_models(table))
    for tool in ("code_exec", "test_suite", "test_suite", "test_suite"):
        budget.note_park("acme", tool)
    short, long = budget.aim("acme", "code_exec"), budget.aim("acme", "test_suite")
    assert (short + 3 * long) / 4 == pytest.approx((0.02 + 3 * 0.04) / 4, abs=2e-4)
    assert short < 0.02 and long > 0.04


def test_mixes_are_bounded_per_tenant_and_a_budget_outside_the_bounds_widens_them():
    table = {(f"t{i}", t): m for i in range(3) for t, m in TOOLS.items()}
    budget = LatenessBudget(LatenessParams(max_tenants=2), fixed_models(table))
    for tenant in ("t0", "t1", "t2"):
        budget.note_park(tenant, "test_suite")
        budget.note_park(tenant, "code_exec")
    assert budget.aim("t0", "test_suite") is None  # forgotten: the least recently parked
    assert budget.aim("t2", "test_suite") > BUDGET
    late = {("t0", t): lognormal(m, 0.4, default_q=0.2) for t, m in (("a", 1_000), ("b", 9_000))}
    wide = LatenessBudget(LatenessParams(), fixed_models(late))
    wide.note_park("t0", "a")
    wide.note_park("t0", "b")
    assert (wide.aim("t0", "a") + wide.aim("t0", "b")) / 2 == pytest.approx(0.2, abs=2e-4)
    with pytest.raises(InvalidArgument, match="floor"):
        LatenessParams(floor=0.2, cap=0.1)
    with pytest.raises(InvalidArgument, match="window"):
        LatenessParams(window=0)


async def test_the_predictor_gives_a_historys_model_and_aims_a_prediction_at_it(redis_client):
    rng = random.Random(11)
    predictor = ToolReturnPredictor(redis_client)
    assert predictor.model("acme", "build", 20) is None
    for _ in range(10):
        await predictor.observe("acme", "build", math.exp(rng.gauss(math.log(4_000), 0.4)))
    assert predictor.model("acme", "build", 20) is None  # worth ~9 returns: too few here
    for _ in range(30):
        await predictor.observe("acme", "build", math.exp(rng.gauss(math.log(4_000), 0.4)))
    history = predictor.history("acme", "build")
    model = predictor.model("acme", "build", 20)
    widened = math.sqrt(1 + 1 / history.effective_samples)
    assert (model.mean, model.sd / widened) == pytest.approx(history.log_moments())
    assert math.exp(model.mean) == pytest.approx(4_000, rel=0.2) and model.sd == pytest.approx(0.4, rel=0.35)
    plain = predictor.predict("acme", "build")
    assert model.default_aim_ms == pytest.approx(plain.quantile_lo_ms)
    assert model.cdf(model.default_aim_ms) < predictor.params.lo_quantile  # a short history's bound is wider
    late = predictor.predict("acme", "build", aim=0.12)
    assert late.quantile_lo_ms == pytest.approx(model.quantile_ms(0.12)) and late.quantile_lo_ms > plain.quantile_lo_ms
    assert (late.return_in_ms, late.quantile_hi_ms) == (plain.return_in_ms, plain.quantile_hi_ms)
    assert predictor.predict("acme", "build", aim=0.45).quantile_lo_ms <= plain.return_in_ms  # never past the median
    with pytest.raises(InvalidArgument, match="aim"):
        predictor.predict("acme", "build", aim=0.7)
    # A cold tool ignores the aim: no model to aim in.
    assert predictor.predict("acme", "cold", aim=0.12) == predictor.predict("acme", "cold")
