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
from dataclasses import dataclass, field

from kvtier.domain.records import RankedWorker, TokensByTier, WorkerId
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
