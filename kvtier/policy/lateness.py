"""Where each tool's prefetches aim: a tenant's lateness spent by equal hazard (decision 0008).

A prefetch aimed at the q point of its tool's return is late with probability q and, when on
time, holds the session's pages in HBM for E[(R − t_q)+] before they are used. Aiming every
tool at the same bound (the predictor's ``lo_quantile``, 5 %) spends lateness evenly, which
is not where it buys the most: a long tool's 5 % point lands its pages seconds before a
typical return, a short tool's a fraction of a second.

Minimising the expected HBM time held, Σ w_i E[(R_i − t_i)+], over aims t_i with the
tenant's expected late share fixed, Σ w_i F_i(t_i) = B × Σ w_i (w_i: how often tool i's
sessions were parked; F_i its return's distribution), gives (Lagrange; d/dt E[(R − t)+] =
−(1 − F(t)), d/dt F = f) the same *hazard* f_i(t_i) / (1 − F_i(t_i)) at every tool's aim.
A lognormal's hazard at its 5 % point is inversely proportional to its median, so long
tools aim later (their late share rises) and short tools earlier (theirs falls).

B is what the even aims spend: each tool's model (``ToolModel``: the lognormal its history
predicts the next return from) gives the probability of a return before its default aim
(the prediction bound at ``lo_quantile``, below 5 % while history is short), and B is their
mix-weighted mean. So the tenant's expected on-time share is the one it had; only where its
late prefetches fall moves. For the agent workload's parked tools (1.2, 2.5 and 10 s medians)
the model gives ~8 % less HBM time held overall and ~19 % less for the 10 s tool when the three
are parked equally often; on the workload's actual mix, half of it the 10 s tool, ~5 % and
~8 % (there is less short-tool lateness to trade). Measured: decision 0008.

Bounded: no tool aims earlier than ``floor`` or later than ``cap`` of its return (a tool's
users are never left with most of the lateness). Only tools whose history is worth
``min_samples`` (10) returns take part, and only once two of them are in the mix; any other
aims at the predictor's bound at ``lo_quantile``. The mix is the tenant's last ``window`` parks,
kept in memory by the controller (``controller/lateness.py``): after a restart every tool aims
at that bound while no parks have been seen.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from dataclasses import dataclass
from statistics import NormalDist

from kvtier.domain.errors import InvalidArgument
from kvtier.policy.prediction import ToolModel

_UNIT = NormalDist()
GRID_POINTS = 48  # aims evaluated per tool, log-spaced from floor to cap


@dataclass(frozen=True, slots=True)
class LatenessParams:
    by_hazard: bool = True  # False: every tool aims at the predictor's bound at lo_quantile
    floor: float = 0.01  # no tool aims earlier than its 1 % point
    cap: float = 0.15  # nor later than its 15 % point
    # A tool takes part once its history is worth this many returns (decayed: 20 observations
    # are worth ~17.6 at the predictor's half-life of 50; the lognormal's sd already widens
    # for a short history, sqrt(1 + 1/n)).
    min_samples: float = 10.0
    window: int = 256  # the tenant's mix: its last parks
    max_tenants: int = 4096  # mixes kept (the least recently parked tenant's goes first)

    def __post_init__(self) -> None:
        if not 0 < self.floor < self.cap < 0.5:
            raise InvalidArgument("lateness bounds need 0 < floor < cap < 0.5", field="lateness.floor")
        for name in ("min_samples", "window", "max_tenants"):
            if not getattr(self, name) > 0:
                raise InvalidArgument(f"{name} must be > 0", field=f"lateness.{name}")


class _Curve:
    """One tool's aims on the grid and the running maximum of the hazard up to each (so the
    aim for a hazard is the latest grid point before the hazard first exceeds it)."""

    def __init__(self, model: ToolModel, grid: list[float]) -> None:
        self.grid = grid
        self.max_hazard: list[float] = []
        top = 0.0
        for q in grid:
            z = _UNIT.inv_cdf(q)
            hazard = _UNIT.pdf(z) / (model.sd * model.quantile_ms(q) * (1.0 - q))
            top = max(top, hazard)
            self.max_hazard.append(top)

    def aim(self, hazard: float) -> float:
        i = bisect.bisect_right(self.max_hazard, hazard)
        if i == 0:
            return self.grid[0]
        if i == len(self.grid):
            return self.grid[-1]
        lo, hi = self.max_hazard[i - 1], self.max_hazard[i]
        frac = (math.log(hazard) - math.log(lo)) / (math.log(hi) - math.log(lo)) if hi > lo else 0.0
        return float(self.grid[i - 1] * (self.grid[i] / self.grid[i - 1]) ** frac)


def equal_hazard_aims(
    mix: dict[str, float], models: dict[str, ToolModel], budget: float, floor: float, cap: float
) -> dict[str, float]:
    """Each tool of ``models``' aim (a quantile of its return), at one hazard for all, such
    that their ``mix``-weighted mean is ``budget``; every aim within [floor, cap]."""
    if not floor <= budget <= cap:
        raise InvalidArgument(f"lateness budget {budget} outside [{floor}, {cap}]", field="budget")
    grid = [floor * (cap / floor) ** (k / (GRID_POINTS - 1)) for k in range(GRID_POINTS)]
    curves = {tool: _Curve(model, grid) for tool, model in models.items()}
    weight = {tool: mix.get(tool, 0.0) for tool in curves}
    if len(curves) < 2 or sum(weight.values()) <= 0:
        return dict.fromkeys(curves, budget)
    need = budget * sum(weight.values())

    def spent(log_hazard: float) -> float:
        h = math.exp(log_hazard)
        return sum(weight[tool] * curve.aim(h) for tool, curve in curves.items())

    lo = min(math.log(c.max_hazard[0]) for c in curves.values()) - 1.0
    hi = max(math.log(c.max_hazard[-1]) for c in curves.values()) + 1.0
    for _ in range(60):  # spent() rises with the hazard
        mid = (lo + hi) / 2.0
        if spent(mid) > need:
            hi = mid
        else:
            lo = mid
    h = math.exp(lo)  # the side that spends no more than the budget
    return {tool: curve.aim(h) for tool, curve in curves.items()}


def default_late_share(model: ToolModel) -> float:
    """The chance of a return before ``model``'s default aim, within [1e-4, 0.49]."""
    return min(max(model.cdf(model.default_aim_ms), 1e-4), 0.49)


def tenant_aims(counts: Mapping[str, float], models: Mapping[str, ToolModel], params: LatenessParams) -> dict[str, float]:
    """Each tool's aim for a tenant whose recent parks are ``counts`` (tool -> parks) and whose
    trusted histories are ``models``: the budget is what the default aims spend, mix-weighted
    (module doc); {} while fewer than two tools with a spread are in the mix."""
    usable = {t: m for t, m in models.items() if t in counts and m.sd > 0.0}
    if len(usable) < 2:
        return {}
    mix = {t: float(counts[t]) for t in usable}
    default = {t: default_late_share(m) for t, m in usable.items()}
    budget = sum(mix[t] * default[t] for t in usable) / sum(mix.values())
    floor, cap = min(params.floor, budget), max(params.cap, budget)
    return equal_hazard_aims(mix, usable, budget, floor, cap)
