"""When will a paused session's tool return? (DESIGN §5 decision 8)

One estimator per (tenant, tool): an exponentially decayed histogram over
log2(duration_ms), 16 bins per octave from 1 ms to 2^27 ms (~37 h), so a quantile read
by interpolating inside one bin is off by at most ~2 %. Decay is by observation count
(half-life ``half_life_obs``): after a shift in the distribution, the old shape weighs
half as much every ``half_life_obs`` returns, so quantiles follow the new one.

Decay without rewriting every bin: observation ``n`` adds ``2^(n / half_life)`` to its
bin instead of multiplying the others by ``2^(-1 / half_life)``. Quantiles only need the
bins' ratios, so the two are the same; when the growing weight nears float range, every
bin is scaled down once (a full rewrite every ~half_life × 900 observations).

Persistence: a Redis hash per (tenant, tool) under ``kvt:tool:<blake2b(tenant, tool)>``
(fields ``tenant``, ``tool``, ``n`` and ``b<bin>``), written through on every
observation and loaded by ``load()`` at start, so a controller restart (or a standby
taking over) keeps the history. Bounded: tool names come from callers, so a tenant keeps at
most ``max_tools_per_tenant`` histories (learning a new tool past that forgets the tenant's
least recently observed one, in memory and in Redis), and a history not observed for
``history_ttl_s`` expires from Redis.

Prediction, best source first: history once it holds ``min_samples`` (effective)
observations; else the caller's ``expected_ms``; else ``default_ms``. A caller estimate
still wins when given, but history supplies its spread (``quantile_hi_ms``).

The low quantile is what the orchestrator schedules prefetches for, so it must not be
optimistic with a short history: with 20 observations the empirical 5 % point is about the
smallest one seen, and the next duration falls below it about as often as the quantile
promises, with nothing to spare. ``quantile_lo_ms`` is therefore the lower of the empirical
quantile and a lognormal *prediction* bound fitted to the same history,

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
"""

from __future__ import annotations

import collections
import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from statistics import NormalDist

import redis.asyncio as aredis

from kvtier.domain.errors import InvalidArgument
from kvtier.domain.records import PredictionSource
from kvtier.runtime.log import get_logger

log = get_logger("kvtier.controller.predictor")

KEY_PREFIX = "kvt:tool:"
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
        return 2.0 ** (n / self.half_life_obs)

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
                return lo * (hi / lo) ** frac
            seen += w
        return bin_range_ms(max(self.bins))[1]


def student_t_quantile(q: float, dof: float) -> float:
    """Student's t quantile by the Cornish-Fisher expansion around the normal one (within
    ~1 % for dof >= 3 at the 5 %/95 % points; no scipy on the controller)."""
    z = NormalDist().inv_cdf(q)
    dof = max(dof, 1.0)
    return z + (z**3 + z) / (4 * dof) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * dof**2)


def history_key(tenant: str, tool: str) -> str:
    digest = hashlib.blake2b(f"{len(tenant)}:{tenant}\0{tool}".encode(), digest_size=12).hexdigest()
    return KEY_PREFIX + digest


class ToolReturnPredictor:
    """Per-(tenant, tool) predictions of tool durations, persisted in Redis."""

    def __init__(
        self, client: aredis.Redis, params: PredictorParams | None = None,
        *, on_error: Callable[[Exception], None] | None = None,
    ) -> None:
        self.client = client
        self.params = params or PredictorParams()
        self._on_error = on_error
        self._histories: dict[tuple[str, str], ToolHistory] = {}
        # Per tenant, its tools from least to most recently observed (``max_tools_per_tenant``).
        self._recency: dict[str, collections.OrderedDict[str, None]] = {}

    def history(self, tenant: str, tool: str) -> ToolHistory | None:
        return self._histories.get((tenant, tool))

    async def load(self) -> int:
        """Read every stored history (start-up, leadership gained); returns how many."""
        loaded = 0
        async for key in self.client.scan_iter(match=KEY_PREFIX + "*", count=500):
            raw = await self.client.hgetall(key)
            fields = {k.decode(): v.decode() for k, v in raw.items()}
            if "tenant" not in fields or "tool" not in fields:
                continue
            history = ToolHistory(fields["tenant"], fields["tool"], self.params.half_life_obs,
                                  num_observations=int(fields.get("n", "0")))
            history.bins = {int(k[1:]): float(v) for k, v in fields.items() if k.startswith("b")}
            self._histories[(history.tenant, history.tool)] = history
            self._recency.setdefault(history.tenant, collections.OrderedDict())[history.tool] = None
            loaded += 1
        log.info("tool histories loaded", extra={"num_histories": loaded})
        return loaded

    async def observe(self, tenant: str, tool: str, duration_ms: float) -> None:
        """Record one measured tool duration and write it through to Redis."""
        if not duration_ms >= 0:
            raise InvalidArgument(f"a tool duration must be >= 0 ms, got {duration_ms}", field="duration_ms")
        recency = self._recency.setdefault(tenant, collections.OrderedDict())
        forgotten: list[str] = []
        history = self._histories.get((tenant, tool))
        if history is None:
            while len(recency) >= self.params.max_tools_per_tenant:
                old, _ = recency.popitem(last=False)
                del self._histories[(tenant, old)]
                forgotten.append(history_key(tenant, old))
            if forgotten:
                log.info("tool histories forgotten: the tenant keeps at most max_tools_per_tenant", extra={
                    "tenant": tenant, "num_forgotten": len(forgotten),
                    "max_tools_per_tenant": self.params.max_tools_per_tenant})
            history = self._histories[(tenant, tool)] = ToolHistory(tenant, tool, self.params.half_life_obs)
        recency[tool] = None
        recency.move_to_end(tool)
        b, weight, rescaled = history.observe(duration_ms)
        key = history_key(tenant, tool)
        mapping: dict[str, str | float | int] = {"tenant": tenant, "tool": tool, "n": history.num_observations}
        try:
            async with self.client.pipeline(transaction=True) as pipe:
                if forgotten:
                    pipe.delete(*forgotten)
                if rescaled:
                    pipe.delete(key)
                    mapping.update({f"b{k}": repr(v) for k, v in history.bins.items()})
                else:
                    mapping[f"b{b}"] = repr(weight)
                pipe.hset(key, mapping=mapping)
                pipe.pexpire(key, max(1, round(self.params.history_ttl_s * 1000)))
                await pipe.execute()
        except Exception as exc:  # the in-memory history still serves; Redis catches up next time
            if self._on_error is None:
                raise
            self._on_error(exc)

    def predict(
        self, tenant: str, tool: str | None, expected_ms: float | None = None, *, aim: float | None = None
    ) -> Prediction:
        """``aim``: for a tool with a trusted history, ``quantile_lo_ms`` is this quantile of
        its ``model`` (the prefetch's aim, ``controller/lateness.py``) instead of the bound at
        ``lo_quantile``; never past the median."""
        p = self.params
        if aim is not None and not 0 < aim < 0.5:
            raise InvalidArgument(f"aim {aim} outside (0, 0.5)", field="aim")
        history = self._histories.get((tenant, tool or ""))
        trusted = history is not None and history.effective_samples >= p.min_samples
        if trusted:
            assert history is not None
            median = history.quantile_ms(0.5)
            lo = history.lower_bound_ms(p.lo_quantile) if aim is None else self._model_of(history).quantile_ms(aim)
            lo, hi = min(lo, median), history.upper_bound_ms(p.hi_quantile)
            n = history.effective_samples
            confidence = n / (n + p.min_samples)
        if expected_ms is not None:
            if trusted:  # the caller knows this call; history knows how wrong estimates run
                return Prediction(float(expected_ms), expected_ms * lo / median, expected_ms * hi / median,
                                  max(0.5, confidence), PredictionSource.CALLER_ESTIMATE)
            return self._lognormal(float(expected_ms), 0.5, PredictionSource.CALLER_ESTIMATE)
        if trusted:
            return Prediction(median, lo, hi, confidence, PredictionSource.HISTORY)
        return self._lognormal(p.default_ms, 0.1, PredictionSource.DEFAULT)

    def model(self, tenant: str, tool: str, min_samples: float = 0.0) -> ToolModel | None:
        """``ToolModel`` of a history worth ``min_samples`` returns (and the params'), else None."""
        history = self._histories.get((tenant, tool))
        if history is None or history.effective_samples < max(min_samples, self.params.min_samples):
            return None
        return self._model_of(history)

    def _model_of(self, history: ToolHistory) -> ToolModel:
        n = history.effective_samples
        mean, sd = history.log_moments()
        default_aim_ms = min(history.lower_bound_ms(self.params.lo_quantile), history.quantile_ms(0.5))
        return ToolModel(mean, sd * math.sqrt(1.0 + 1.0 / n), default_aim_ms)

    def spread(self, prediction: Prediction) -> float | None:
        """The sigma (of ln duration) of the log-normal whose ``hi_quantile`` point is
        ``prediction``'s high quantile, given its median: the spread of the long returns, which
        ranks a prefetched session's hold once it is overdue (the worker's ``ExpectedReturn``).
        None when the prediction has no spread above its median."""
        median, hi = prediction.return_in_ms, prediction.quantile_hi_ms
        if not (median > 0.0 and hi > median):
            return None
        return math.log(hi / median) / NormalDist().inv_cdf(self.params.hi_quantile)

    def _lognormal(self, median_ms: float, confidence: float, source: PredictionSource) -> Prediction:
        unit = NormalDist()
        sigma = self.params.default_sigma
        lo = median_ms * math.exp(unit.inv_cdf(self.params.lo_quantile) * sigma)
        hi = median_ms * math.exp(unit.inv_cdf(self.params.hi_quantile) * sigma)
        return Prediction(median_ms, lo, hi, confidence, source)
