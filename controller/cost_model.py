"""Route by estimated time to first token: the registry's live numbers fed to the pure cost
model (``kvtier.policy.routing.choose_by_ttft``), the result as a ranking with fetch plans.

What each candidate contributes, as of its last heartbeat: its queued and running requests
(plus the tokens that the Routes that picked it since will prefill there), the prefix it holds
by tier (the directory), and the rates it measured on itself (``WorkerCosts``: prefill per
token, fetch bandwidth and set-up, promotion bandwidth, wait per request ahead). Bytes per
token come from its registration (HBM capacity bytes over pages over page size). A rate not
measured yet takes ``CostParams``' stand-in.

The session's worker stays first while it is not overloaded (as with the score ranking): its
history is there, and the estimate does not see a session's future turns.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvtier.controller.registry import WorkerEntry
from kvtier.domain.records import PeerFetch, RankedWorker, TokensByTier, WorkerCosts, WorkerId
from kvtier.domain.tiers import Tier
from kvtier.policy.routing import (
    Candidate,
    CostCandidate,
    CostParams,
    RouterParams,
    choose_by_ttft,
    is_overloaded,
)

FALLBACK_BYTES_PER_TOKEN = 131072.0  # a worker that registered no HBM capacity: Llama-3-8B in bf16


def bytes_per_token(capacity_bytes: int, capacity_pages: int, page_size: int) -> float:
    if capacity_bytes <= 0 or capacity_pages <= 0 or page_size <= 0:
        return FALLBACK_BYTES_PER_TOKEN
    return capacity_bytes / capacity_pages / page_size


def rank_by_ttft(
    candidates: Sequence[Candidate],
    matched: Mapping[WorkerId, TokensByTier],
    costs: Mapping[WorkerId, WorkerCosts],
    *,
    prompt_tokens: int,
    page_size: int,
    token_bytes: float,
    params: RouterParams,
    affinity: WorkerId | None = None,
    routed_tokens: Mapping[WorkerId, int] | None = None,
) -> tuple[RankedWorker, ...]:
    """Candidates least estimated TTFT first; a pick that counts on a peer's pages carries the
    fetch plan. ``score`` is minus the estimate, so higher is still better. ``routed_tokens``:
    tokens that requests on their way will prefill on each worker, queued ahead of this one."""
    routed = routed_tokens or {}
    by_id = {c.worker_id: c for c in candidates}
    estimates = choose_by_ttft(
        [CostCandidate(c.worker_id, c.load, matched.get(c.worker_id, TokensByTier()),
                       costs.get(c.worker_id, WorkerCosts()), routed.get(c.worker_id, 0)) for c in candidates],
        prompt_tokens, page_size, CostParams(bytes_per_token=token_bytes),
    )
    sticky = affinity if affinity in by_id and not is_overloaded(by_id[affinity].load, params) else None
    ordered = sorted(estimates, key=lambda e: e.worker_id != sticky)  # stable: the rest keep their order
    return tuple(
        RankedWorker(
            worker_id=e.worker_id,
            address=by_id[e.worker_id].address,
            score=-e.ttft_ms,
            matched_tokens=matched.get(e.worker_id, TokensByTier()),
            is_affinity=e.worker_id == affinity,
            fetch=None if e.fetch is None else PeerFetch(e.fetch.peer, e.fetch.first_page + e.fetch.num_pages),
            estimated_ttft_ms=e.ttft_ms,
        )
        for e in ordered
    )


def rank_entries_by_ttft(
    entries: Sequence[WorkerEntry], candidates: Sequence[Candidate], matched: Mapping[WorkerId, TokensByTier],
    *, prompt_tokens: int, page_size: int, params: RouterParams, affinity: WorkerId | None,
) -> tuple[RankedWorker, ...]:
    """``rank_by_ttft`` with each worker's measured costs and the bytes per token of its pages
    from the registry; the tokens the Routes that picked a worker since its last heartbeat will
    prefill there count as work queued ahead (Routes between two heartbeats would otherwise all
    see the same idle worker)."""
    costs = {e.worker_id: e.costs for e in entries if e.costs is not None}
    routed = {e.worker_id: e.routed_tokens for e in entries}
    token_bytes = max((entry_bytes_per_token(e) for e in entries), default=FALLBACK_BYTES_PER_TOKEN)
    return rank_by_ttft(candidates, matched, costs, prompt_tokens=prompt_tokens, page_size=page_size,
                        token_bytes=token_bytes, params=params, affinity=affinity, routed_tokens=routed)


def entry_bytes_per_token(entry: WorkerEntry) -> float:
    """Bytes per token of the worker's pages, from its registered HBM capacity."""
    for capacity in entry.registration.capacities:
        if capacity.tier is Tier.HBM:
            return bytes_per_token(capacity.capacity_bytes, capacity.capacity_pages, entry.registration.page_size)
    return FALLBACK_BYTES_PER_TOKEN
