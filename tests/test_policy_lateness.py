"""Where each tool's prefetches aim (kvtier/policy/lateness.py): lateness spent by equal hazard,
checked against the closed-form expected HBM time of a lognormal return, and the budget a
tenant's mix of parks gives. Plain durations in ms and shares, no Redis."""

from __future__ import annotations

import math
import random

import pytest

from kvtier.domain.errors import InvalidArgument
from kvtier.policy.lateness import LatenessParams, equal_hazard_aims, tenant_aims
from kvtier.policy.prediction import ToolModel

UNIT = __import__("statistics").NormalDist()
BUDGET, FLOOR, CAP = 0.05, 0.01, 0.15


def lognormal(median_ms: float, sigma: float, default_q: float = BUDGET) -> ToolModel:
    """A tool's model whose default aim is its ``default_q`` point."""
    return ToolModel(math.log(median_ms), sigma, median_ms * math.exp(sigma * UNIT.inv_cdf(default_q)))


def expected_hold_ms(model: ToolModel, q: float) -> float:
    """E[(R − t)+] for R lognormal and t its q point: how long pages prefetched for t wait."""
    t = model.quantile_ms(q)
    d2 = (model.mean - math.log(t)) / model.sd
    return math.exp(model.mean + model.sd**2 / 2) * UNIT.cdf(d2 + model.sd) - t * UNIT.cdf(d2)


def hazard(model: ToolModel, q: float) -> float:
    z = UNIT.inv_cdf(q)
    return UNIT.pdf(z) / (model.sd * model.quantile_ms(q) * (1 - q))


# The agent workload's tools a tenant parks (search is short enough to stay in HBM).
TOOLS = {"code_exec": lognormal(1_200, 0.5), "browse": lognormal(2_500, 0.4), "test_suite": lognormal(10_000, 0.4)}


def pooled(mix, aims, budget=BUDGET):
    return sum(w * aims.get(t, budget) for t, w in mix.items()) / sum(mix.values())


def held(mix, aims):
    return sum(w * expected_hold_ms(TOOLS[t], aims[t]) for t, w in mix.items())


def test_equal_hazard_keeps_the_pooled_late_share_and_holds_less_than_any_other_split():
    mix = {"code_exec": 3.0, "browse": 1.0, "test_suite": 2.0}
    aims = equal_hazard_aims(mix, TOOLS, BUDGET, FLOOR, CAP)
    assert pooled(mix, aims) == pytest.approx(BUDGET, abs=2e-4) and pooled(mix, aims) <= BUDGET + 1e-9
    # Long tools aim later, short ones earlier.
    assert aims["code_exec"] < aims["browse"] < BUDGET < aims["test_suite"] <= CAP
    inside = [t for t, q in aims.items() if FLOOR < q < CAP]
    assert len(inside) >= 2
    rates = [hazard(TOOLS[t], aims[t]) for t in inside]
    assert max(rates) / min(rates) == pytest.approx(1.0, abs=0.03)
    uniform = held(mix, dict.fromkeys(mix, BUDGET))
    best = held(mix, aims)
    assert best < 0.95 * uniform
    # No other split of the same budget within the bounds holds less (random feasible ones:
    # move lateness from one tool to another, pooled share unchanged).
    rng = random.Random(3)
    names = list(mix)
    for _ in range(300):
        a, b = rng.sample(names, 2)
        step = rng.uniform(-0.03, 0.03)
        other = dict(aims)
        other[a] += step / mix[a]
        other[b] -= step / mix[b]
        if not all(FLOOR <= q <= CAP for q in other.values()):
            continue
        assert held(mix, other) >= best - 1e-6 * best


def test_one_tool_has_no_one_to_trade_with():
    mix = {"code_exec": 1.0, "test_suite": 1.0}
    assert equal_hazard_aims(mix, {"test_suite": TOOLS["test_suite"]}, BUDGET, FLOOR, CAP) == {"test_suite": BUDGET}
    # Weights of tools outside the models do not count.
    aims = equal_hazard_aims({**mix, "other": 5.0}, {t: TOOLS[t] for t in mix}, BUDGET, FLOOR, CAP)
    assert (aims["code_exec"] + aims["test_suite"]) / 2 == pytest.approx(BUDGET, abs=2e-4)


def test_aims_stay_within_the_bounds_and_never_spend_more_than_the_budget():
    far = {"blink": lognormal(50, 0.3), "week": lognormal(600_000, 0.3)}
    mix = {"blink": 1.0, "week": 1.0}
    aims = equal_hazard_aims(mix, far, BUDGET, FLOOR, CAP)
    assert aims["blink"] == pytest.approx(FLOOR) and FLOOR <= aims["week"] <= CAP
    assert pooled(mix, aims) <= BUDGET + 1e-9
    mostly_long = equal_hazard_aims({"blink": 1.0, "week": 99.0}, far, BUDGET, FLOOR, CAP)
    assert mostly_long["week"] == pytest.approx((100 * BUDGET - FLOOR) / 99, abs=2e-4)
    with pytest.raises(InvalidArgument):
        equal_hazard_aims(mix, far, 0.3, FLOOR, CAP)


def test_tenant_aims_spend_what_the_default_aims_spend_by_the_mix():
    # Default aims at each tool's 2 % and 4 % points, parked 1 : 3: the budget is 3.5 %.
    models = {"code_exec": lognormal(1_200, 0.5, default_q=0.02), "test_suite": lognormal(10_000, 0.4, default_q=0.04)}
    aims = tenant_aims({"code_exec": 1, "test_suite": 3}, models, LatenessParams())
    assert (aims["code_exec"] + 3 * aims["test_suite"]) / 4 == pytest.approx(0.035, abs=2e-4)
    assert aims["code_exec"] < 0.02 and aims["test_suite"] > 0.04


@pytest.mark.parametrize(("counts", "models"), [
    ({"code_exec": 2}, {"code_exec": TOOLS["code_exec"]}),  # one tool: no one to trade with
    ({"code_exec": 1, "browse": 1}, {"code_exec": TOOLS["code_exec"], "browse": ToolModel(7.0, 0.0, 900.0)}),  # no spread
    ({"code_exec": 1}, {"code_exec": TOOLS["code_exec"], "browse": TOOLS["browse"]}),  # browse never parked
])
def test_tenant_aims_need_two_parked_tools_with_a_spread(counts, models):
    assert tenant_aims(counts, models, LatenessParams()) == {}
