"""When will a paused session's tool return: the duration model (DESIGN §5 decision 8).

One model per (tenant, tool): an exponentially decayed histogram over log2(duration_ms),
16 bins per octave from 1 ms to 2^27 ms (~37 h), so a quantile read by interpolating inside
one bin is off by at most ~2 %. Decay is by observation count (half-life ``half_life_obs``):
after a shift in the distribution, the old shape weighs half as much every
``half_life_obs`` returns, so quantiles follow the new one.

Decay without rewriting every bin: observation ``n`` adds ``2^(n / half_life)`` to its
bin instead of multiplying the others by ``2^(-1 / half_life)``. Quantiles only need the
bins' ratios, so the two are the same; when the growing weight nears float range, every
bin is scaled down once (a full rewrite every ~half_life × 900 observations).

Prediction, best source first: history once it holds ``min_samples`` (effective)
observations; else the caller's ``expected_ms``; else ``default_ms``. A caller estimate
still wins when given, but history supplies its spread (``quantile_hi_ms``).

The low quantile is what prefetches are scheduled for, so it must not be optimistic with
a short history: with 20 observations the empirical 5 % point is about the smallest one
seen, and the next duration falls below it about as often as the quantile promises, with
nothing to spare. ``quantile_lo_ms`` is therefore the lower of the empirical quantile and a
lognormal *prediction* bound fitted to the same history,

    exp(mean_ln − t(n_eff − 1, 1 − lo) × sd_ln × sqrt(1 + 1 / n_eff))

(Student's t for the next observation of a sample of n_eff, not z for a known distribution):
wider than the empirical point while history is short, the same once it is long.
Why 5 %: ``docs/decisions/0008-prefetch-timing.md``.

The high quantile is how long a prefetched session's pages are held in HBM for it, so it must
not be optimistic either: a return after it finds the hold lapsed and the prefetched pages
evicted (waste): holding to the q point wastes about 1 − q of what is prefetched before any
other cause, so with the ≤ 10 % waste target q is 99 %, not 90 %. ``quantile_hi_ms`` is the
mirror bound, the higher of the empirical 99 % point and the lognormal prediction bound. A
hold ends when the session is back, so holding to a high quantile costs HBM only for the few
returns that run long.

Everything here is arithmetic on durations in ms; storing histories is the controller's
(``controller/predictor.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import NormalDist

from kvtier.domain.errors import InvalidArgument
from kvtier.domain.records import PredictionSource

BINS_PER_OCTAVE = 16
NUM_BINS = 27 * BINS_PER_OCTAVE  # 1 ms .. 2^27 ms
# Weights grow as 2^(n / half_life); rescale before they leave float range (~2^1023).
MAX_LOG2_WEIGHT = 900.0


@dataclass(frozen=True, slots=True)
class Prediction:
    """``return_in_ms``: the expected wait (a median); ``quantile_lo_ms`` / ``quantile_hi_ms``:
    the wait is shorter than ``lo`` with probability ``lo_quantile`` (5 %) at most, longer
    than ``hi`` with probability 1 − ``hi_quantile`` (1 %) at most; ``confidence`` in [0, 1]."""

    return_in_ms: float
    quantile_lo_ms: float
    quantile_hi_ms: float
    confidence: float
    source: PredictionSource


@dataclass(frozen=True, slots=True)
class ToolModel:
    """A trusted history as the lognormal it predicts the next return from (mean and sd of
    ln(duration_ms), the sd widened for one more observation, x sqrt(1 + 1/n)), and where a
    prefetch aims without an aim of its own (``quantile_lo_ms`` at ``lo_quantile``)."""

    mean: float
    sd: float
    default_aim_ms: float

    def quantile_ms(self, q: float) -> float:
        return math.exp(self.mean + self.sd * NormalDist().inv_cdf(q))

    def cdf(self, duration_ms: float) -> float:
        return NormalDist(self.mean, self.sd).cdf(math.log(duration_ms)) if self.sd > 0 else 0.5


@dataclass(slots=True)
class PredictorParams:
    default_ms: float = 5_000.0  # no history and no caller estimate
    half_life_obs: float = 50.0  # observations after which old history weighs half
    min_samples: float = 5.0  # effective observations before history is trusted
    lo_quantile: float = 0.05  # prefetches aim here (decision 0008)
    hi_quantile: float = 0.99  # a prefetched session's pages are held in HBM until here (decision 0008)
    # Spread assumed without history: lognormal with this sigma (of ln duration).
    default_sigma: float = 0.7
    # Tool names come from callers: at most this many histories per tenant (the least recently
    # observed goes first), and a history unobserved this long expires from Redis.
    max_tools_per_tenant: int = 256
    history_ttl_s: float = 30 * 86_400.0

    def __post_init__(self) -> None:
        for name in ("default_ms", "half_life_obs", "min_samples", "default_sigma", "max_tools_per_tenant",
                     "history_ttl_s"):
            if not getattr(self, name) > 0:
                raise InvalidArgument(f"predictor {name} must be > 0, got {getattr(self, name)}", field=name)
        if not 0 < self.lo_quantile < 0.5 < self.hi_quantile < 1:
            raise InvalidArgument("predictor quantiles need 0 < lo < 0.5 < hi < 1", field="lo_quantile")


def bin_of(duration_ms: float) -> int:
    return min(NUM_BINS - 1, max(0, int(math.log2(max(duration_ms, 1.0)) * BINS_PER_OCTAVE)))


def bin_range_ms(index: int) -> tuple[float, float]:
    return 2.0 ** (index / BINS_PER_OCTAVE), 2.0 ** ((index + 1) / BINS_PER_OCTAVE)


@dataclass(slots=True)
class ToolHistory:
    """Decayed histogram of one (tenant, tool)'s durations (see the module doc)."""

    tenant: str
    tool: str
    half_life_obs: float
    num_observations: int = 0  # n: the next observation weighs 2^(n / half_life) (relative)
    bins: dict[int, float] = field(default_factory=dict)

    @property
    def total_weight(self) -> float:
        return sum(self.bins.values())

    @property
    def effective_samples(self) -> float:
        """Observations the decayed weight is worth (the latest counts 1)."""
        if not self.bins:
            return 0.0
        return self.total_weight / self._weight(self.num_observations - 1)

    def _weight(self, n: int) -> float:
        return float(2.0 ** (n / self.half_life_obs))

    def observe(self, duration_ms: float) -> tuple[int, float, bool]:
        """Add one duration; returns (bin, its new weight, whether every bin was rescaled)."""
        rescaled = False
        if self.num_observations / self.half_life_obs > MAX_LOG2_WEIGHT:
            scale = self._weight(self.num_observations)
            self.bins = {b: w / scale for b, w in self.bins.items() if w / scale > 1e-300}
            self.num_observations = 0
            rescaled = True
        b = bin_of(duration_ms)
        self.bins[b] = self.bins.get(b, 0.0) + self._weight(self.num_observations)
        self.num_observations += 1
        return b, self.bins[b], rescaled

    def log_moments(self) -> tuple[float, float]:
        """Weighted mean and standard deviation of ln(duration_ms), bins at their log midpoints."""
        if not self.bins:
            raise ValueError("moments of an empty history")
        total = self.total_weight
        mids = {b: (b + 0.5) / BINS_PER_OCTAVE * math.log(2.0) for b in self.bins}
        mean = sum(w * mids[b] for b, w in self.bins.items()) / total
        var = sum(w * (mids[b] - mean) ** 2 for b, w in self.bins.items()) / total
        return mean, math.sqrt(var)

    def lower_bound_ms(self, q: float) -> float:
        """A duration the next observation falls below with probability ~q: the lower of the
        empirical quantile and the lognormal prediction bound (module doc)."""
        return min(self.quantile_ms(q), self._prediction_bound_ms(q))

    def upper_bound_ms(self, q: float) -> float:
        """A duration the next observation exceeds with probability ~1 − q: the higher of the
        empirical quantile and the lognormal prediction bound (the mirror of ``lower_bound_ms``)."""
        return max(self.quantile_ms(q), self._prediction_bound_ms(q))

    def _prediction_bound_ms(self, q: float) -> float:
        """The q point of the lognormal prediction interval for the next observation."""
        n = max(self.effective_samples, 2.0)
        mean, sd = self.log_moments()
        return math.exp(mean + student_t_quantile(q, n - 1.0) * sd * math.sqrt(1.0 + 1.0 / n))

    def quantile_ms(self, q: float) -> float:
        """The q-quantile, interpolated in log space inside its bin."""
        if not self.bins:
            raise ValueError("quantile of an empty history")
        target = q * self.total_weight
        seen = 0.0
        for b in sorted(self.bins):
            w = self.bins[b]
            if seen + w >= target:
                lo, hi = bin_range_ms(b)
                frac = (target - seen) / w if w > 0 else 0.5
                return float(lo * (hi / lo) ** frac)
            seen += w
        return bin_range_ms(max(self.bins))[1]


def student_t_quantile(q: float, dof: float) -> float:
    """Student's t quantile by the Cornish-Fisher expansion around the normal one (within
    ~1 % for dof >= 3 at the 5 %/95 % points; no scipy on the controller)."""
    z = NormalDist().inv_cdf(q)
    dof = max(dof, 1.0)
    return z + (z**3 + z) / (4 * dof) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * dof**2)


def is_trusted(history: ToolHistory | None, params: PredictorParams, min_samples: float = 0.0) -> bool:
    """Whether ``history`` is worth ``min_samples`` returns and the params' ``min_samples``."""
    return history is not None and history.effective_samples >= max(min_samples, params.min_samples)


def tool_model(history: ToolHistory, params: PredictorParams) -> ToolModel:
    """The lognormal a non-empty history predicts the next return from (``ToolModel``)."""
    n = history.effective_samples
    mean, sd = history.log_moments()
    default_aim_ms = min(history.lower_bound_ms(params.lo_quantile), history.quantile_ms(0.5))
    return ToolModel(mean, sd * math.sqrt(1.0 + 1.0 / n), default_aim_ms)


def predict(
    history: ToolHistory | None, params: PredictorParams, expected_ms: float | None = None,
    *, aim: float | None = None,
) -> Prediction:
    """The next return of ``history``'s tool (best source first, module doc). ``aim``: for a
    trusted history, ``quantile_lo_ms`` is this quantile of its ``tool_model`` (the prefetch's
    aim, ``kvtier/policy/lateness.py``) instead of the bound at ``lo_quantile``; never past the
    median."""
    if aim is not None and not 0 < aim < 0.5:
        raise InvalidArgument(f"aim {aim} outside (0, 0.5)", field="aim")
    trusted = is_trusted(history, params)
    if trusted:
        assert history is not None
        median = history.quantile_ms(0.5)
        lo = history.lower_bound_ms(params.lo_quantile) if aim is None else tool_model(history, params).quantile_ms(aim)
        lo, hi = min(lo, median), history.upper_bound_ms(params.hi_quantile)
        n = history.effective_samples
        confidence = n / (n + params.min_samples)
    if expected_ms is not None:
        if trusted:  # the caller knows this call; history knows how wrong estimates run
            return Prediction(float(expected_ms), expected_ms * lo / median, expected_ms * hi / median,
                              max(0.5, confidence), PredictionSource.CALLER_ESTIMATE)
        return lognormal_prediction(float(expected_ms), 0.5, PredictionSource.CALLER_ESTIMATE, params)
    if trusted:
        return Prediction(median, lo, hi, confidence, PredictionSource.HISTORY)
    return lognormal_prediction(params.default_ms, 0.1, PredictionSource.DEFAULT, params)


def return_spread(prediction: Prediction, hi_quantile: float) -> float | None:
    """The sigma (of ln duration) of the log-normal whose ``hi_quantile`` point is
    ``prediction``'s high quantile, given its median: the spread of the long returns, which
    ranks a prefetched session's hold once it is overdue (the worker's ``ExpectedReturn``).
    None when the prediction has no spread above its median."""
    median, hi = prediction.return_in_ms, prediction.quantile_hi_ms
    if not (median > 0.0 and hi > median):
        return None
    return math.log(hi / median) / NormalDist().inv_cdf(hi_quantile)


def lognormal_prediction(
    median_ms: float, confidence: float, source: PredictionSource, params: PredictorParams
) -> Prediction:
    """A prediction without history: a lognormal of sigma ``default_sigma`` around ``median_ms``."""
    unit = NormalDist()
    sigma = params.default_sigma
    lo = median_ms * math.exp(unit.inv_cdf(params.lo_quantile) * sigma)
    hi = median_ms * math.exp(unit.inv_cdf(params.hi_quantile) * sigma)
    return Prediction(median_ms, lo, hi, confidence, source)
