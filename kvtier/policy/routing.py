"""Routing rank: how candidate workers are scored by cached prefix, tier and load (DESIGN §3).

Score of worker w for a request (all terms in *prompt tokens*, so they compare)::

    value(w)   = Σ_tier weight[tier] × matched_tokens[tier](w)       weights: HBM 1.0, DRAM 0.8, NVMe 0.5
    penalty(w) = queue_penalty_tokens   × queue_depth(w)               256 per queued request
               + running_penalty_tokens × running_seqs(w)              16 per running sequence
               + hbm_pressure_tokens    × max(0, 1 − avail(w) / low_hbm_fraction)   512 at 0 % available
    score(w)   = value(w) − penalty(w)

``matched_tokens`` is the longest prefix the worker holds, contiguously from the first page,
by the fastest tier of each page (read from the directory). ``avail`` is the share of the
worker's HBM pages a new request can get without preempting anyone: (free + cached) / total,
as of its last heartbeat (1.0 before the first one). A worker is *overloaded* when
``queue_depth >= overload_queue_depth`` or ``avail < overload_hbm_fraction``.

Ranking: the session's worker first (``is_affinity``) while it is live, serves the namespace
and is not overloaded; then by score, then by queue depth, then by worker id. Every live
worker that serves the namespace is listed, so a client can fall back down the list.

Without a directory answer every ``matched_tokens`` is empty: the ranking is affinity, then
least loaded. Derivation and examples: ``docs/decisions/0003-controller.md``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields

from kvtier.domain.records import RankedWorker, TokensByTier, WorkerCosts, WorkerId
from kvtier.domain.tiers import Tier


@dataclass(frozen=True, slots=True)
class RouterParams:
    """The constants of the score (module docstring). Token-denominated penalties."""

    tier_weights: Mapping[Tier, float] = field(
        default_factory=lambda: {Tier.HBM: 1.0, Tier.DRAM: 0.8, Tier.NVME: 0.5}
    )
    queue_penalty_tokens: float = 256.0
    running_penalty_tokens: float = 16.0
    hbm_pressure_tokens: float = 512.0
    low_hbm_fraction: float = 0.10
    overload_queue_depth: int = 8
    overload_hbm_fraction: float = 0.02
    lookup_timeout_s: float = 0.5  # a directory read slower than this routes degraded
    # Rank by estimated time to first token (the cost model below) and plan peer fetches.
    rank_by_ttft: bool = False


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    queue_depth: int = 0
    num_running_seqs: int = 0
    hbm_total_pages: int = 0  # 0: not reported yet
    hbm_available_pages: int = 0  # free + cached

    @property
    def hbm_available_fraction(self) -> float:
        return self.hbm_available_pages / self.hbm_total_pages if self.hbm_total_pages else 1.0


@dataclass(frozen=True, slots=True)
class Candidate:
    worker_id: WorkerId
    address: str
    load: WorkerLoad = WorkerLoad()


def prefix_value(matched: TokensByTier, params: RouterParams) -> float:
    return sum(params.tier_weights.get(t, 0.0) * matched.for_tier(t) for t in Tier)


def load_penalty(load: WorkerLoad, params: RouterParams) -> float:
    pressure = max(0.0, 1.0 - load.hbm_available_fraction / params.low_hbm_fraction)
    return (
        params.queue_penalty_tokens * load.queue_depth
        + params.running_penalty_tokens * load.num_running_seqs
        + params.hbm_pressure_tokens * pressure
    )


def is_overloaded(load: WorkerLoad, params: RouterParams) -> bool:
    return (
        load.queue_depth >= params.overload_queue_depth
        or load.hbm_available_fraction < params.overload_hbm_fraction
    )


def rank_workers(
    candidates: Sequence[Candidate],
    matched: Mapping[WorkerId, TokensByTier],
    params: RouterParams,
    affinity: WorkerId | None = None,
) -> tuple[RankedWorker, ...]:
    """Candidates best first (module docstring); ``matched`` lacks workers that hold nothing."""
    sticky = next(
        (c.worker_id for c in candidates if c.worker_id == affinity and not is_overloaded(c.load, params)),
        None,
    )
    ranked = []
    for c in candidates:
        tokens = matched.get(c.worker_id, TokensByTier())
        score = prefix_value(tokens, params) - load_penalty(c.load, params)
        ranked.append((c.worker_id != sticky, -score, c.load.queue_depth, c.worker_id, c, tokens, score))
    ranked.sort(key=lambda r: r[:4])
    return tuple(
        RankedWorker(
            worker_id=c.worker_id,
            address=c.address,
            score=score,
            matched_tokens=tokens,
            is_affinity=c.worker_id == affinity,
        )
        for *_, c, tokens, score in ranked
    )


# -- the time-to-first-token cost model (peer fetch) ---------------------------------------------
#
# For each candidate worker w and a prompt of P tokens whose longest cached prefix across the
# deployment is H tokens (held by some peer), with w itself holding L ≤ H of them:
#
#     queue(w)     = (queued(w) + running(w)) × ms_per_request(w)  measured wait per request ahead
#                    + routed(w) × prefill_ms_per_token            tokens of requests on their way
#     promote(w)   = Σ_{tier below HBM} bytes(L_tier) / promote_bps[tier]
#     fetch(w)     = fetch_setup_ms + bytes(H − L) / fetch_bps     only a peer holds these
#     prefill(w)   = (P − covered) × prefill_ms_per_token
#     ttft(w)      = queue + promote + min(fetch + prefill(P − H), prefill(P − L))
#
# The min is the fetch-or-recompute choice: a short missing stretch costs less to recompute
# than the fixed set-up of a fetch. Every rate is measured by the worker and reported over
# the WorkerLink (``WorkerCosts``); a worker that has not measured one yet reports 0 and the
# defaults of ``CostParams`` stand in.


@dataclass(frozen=True, slots=True)
class CostParams:
    """Stand-ins for rates a worker has not measured yet, and the page size in bytes per token."""

    bytes_per_token: float
    prefill_ms_per_token: float = 0.5
    fetch_bytes_per_s: float = 1e9
    fetch_setup_ms: float = 5.0
    dram_promote_bytes_per_s: float = 10e9
    nvme_promote_bytes_per_s: float = 2e9
    ms_per_queued_request: float = 50.0

    def resolve(self, costs: WorkerCosts) -> WorkerCosts:
        """``costs`` with every unmeasured (≤ 0) rate replaced by this stand-in."""
        def pick(name: str) -> float:
            value = float(getattr(costs, name))
            return value if value > 0 else float(getattr(self, name))

        return WorkerCosts(**{f.name: pick(f.name) for f in fields(WorkerCosts)})


@dataclass(frozen=True, slots=True)
class CostCandidate:
    worker_id: WorkerId
    load: WorkerLoad
    held: TokensByTier  # the longest prefix this worker holds, contiguously from the first page
    costs: WorkerCosts = WorkerCosts()
    routed_tokens: int = 0  # what requests sent since its last load report will prefill there


@dataclass(frozen=True, slots=True)
class FetchPlan:
    """Fetch pages ``[first_page, first_page + num_pages)`` of the prompt from ``peer`` first."""

    peer: WorkerId
    first_page: int
    num_pages: int


@dataclass(frozen=True, slots=True)
class TtftEstimate:
    worker_id: WorkerId
    ttft_ms: float
    queue_ms: float
    promote_ms: float
    fetch_ms: float
    prefill_ms: float
    fetch: FetchPlan | None = None


def estimate_ttft(
    candidate: CostCandidate, prompt_tokens: int, page_size: int, params: CostParams,
    holder: WorkerId | None = None, holder_tokens: int = 0,
) -> TtftEstimate:
    """TTFT of running the prompt on ``candidate`` (module comment above); ``holder`` is the
    peer holding the longest prefix, ``holder_tokens`` long (whole pages)."""
    costs = params.resolve(candidate.costs)
    queue_ms = ((candidate.load.queue_depth + candidate.load.num_running_seqs) * costs.ms_per_queued_request
                + candidate.routed_tokens * costs.prefill_ms_per_token)
    held = candidate.held
    promote_ms = 1000.0 * params.bytes_per_token * (
        held.dram_tokens / costs.dram_promote_bytes_per_s + held.nvme_tokens / costs.nvme_promote_bytes_per_s)
    local = held.total_tokens
    # The last prompt token is always computed (its logits), so at most prompt − 1 are reused.
    reusable = max(prompt_tokens - 1, 0)
    local = min(local, reusable)
    recompute_ms = (prompt_tokens - local) * costs.prefill_ms_per_token
    best = TtftEstimate(candidate.worker_id, queue_ms + promote_ms + recompute_ms, queue_ms, promote_ms,
                        0.0, recompute_ms)
    missing_pages = min(holder_tokens, reusable) // page_size - local // page_size
    if holder is None or holder == candidate.worker_id or missing_pages <= 0:
        return best
    fetched = missing_pages * page_size
    fetch_ms = costs.fetch_setup_ms + 1000.0 * fetched * params.bytes_per_token / costs.fetch_bytes_per_s
    prefill_ms = (prompt_tokens - local // page_size * page_size - fetched) * costs.prefill_ms_per_token
    ttft = queue_ms + promote_ms + fetch_ms + prefill_ms
    if ttft >= best.ttft_ms:
        return best
    plan = FetchPlan(peer=holder, first_page=local // page_size, num_pages=missing_pages)
    return TtftEstimate(candidate.worker_id, ttft, queue_ms, promote_ms, fetch_ms, prefill_ms, plan)


def choose_by_ttft(
    candidates: Sequence[CostCandidate], prompt_tokens: int, page_size: int, params: CostParams,
) -> tuple[TtftEstimate, ...]:
    """Every candidate's estimate, least TTFT first (ties: fewer queued, then worker id). The
    peer each one would fetch from is the candidate holding the longest prefix."""
    holder = max(candidates, key=lambda c: (c.held.total_tokens, -c.load.queue_depth, c.worker_id), default=None)
    holder_tokens = holder.held.total_tokens if holder is not None else 0
    holder_id = holder.worker_id if holder is not None and holder_tokens else None
    estimates = [(estimate_ttft(c, prompt_tokens, page_size, params, holder_id, holder_tokens), c)
                 for c in candidates]
    estimates.sort(key=lambda e: (e[0].ttft_ms, e[1].load.queue_depth, e[1].worker_id))
    return tuple(e for e, _ in estimates)
