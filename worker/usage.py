"""What one generation used, and its spans (counts only, never token ids).

Usage accounting (``kvtier.domain.records.Usage``; P prompt tokens, C cached, G generated)::

    prompt_tokens     = P
    cached_tokens     = C: prompt tokens served from the prefix cache at first admission
                        (a whole-prompt hit reports P - 1: the last position is recomputed
                        to get logits)
    promoted_tokens   = cached tokens copied up from DRAM/NVMe before prefill (a subset of cached)
    generated_tokens  = G
    recomputed_tokens = tokens whose K/V the model computed beyond what an uninterrupted
                        run needs, i.e. beyond the uncached prompt suffix (P - C) and the
                        decode steps (G - 1; the last sampled token is never fed back):
                            max(0, computed - (P - C) - max(G - 1, 0))
                        0 unless the request was preempted and had to rebuild K/V it once had.

Pages brought up before admission (``kvtier.worker.admission``) count as the engine's own
promotions: ``add_promotions`` folds them into the engine's result first.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from opentelemetry.context import Context

from kvtier.domain.records import GenerateFinal, GenerateRequest, RunId, TokensByTier, Usage
from kvtier.domain.tiers import Tier
from kvtier.engine.engine import GenerationResult
from kvtier.runtime import tracing
from kvtier.runtime.log import get_logger
from kvtier.tiers.transfer import TransferDone

log = get_logger("kvtier.worker.engine")


class WorkerRecorder(Protocol):
    """Where the worker's per-request metrics go (``kvtier.worker.metrics.WorkerMetrics``)."""

    def record_request(self, result: GenerationResult, ttft_s: float, decode_s: float, *,
                       resumed: bool = False) -> None: ...

    def record_hold_deferral(self, wait_s: float, outcome: str) -> None: ...

    def transfer_done(self, done: TransferDone) -> None: ...


def add_promotions(result: GenerationResult, promoted_tokens_by_tier: Mapping[Tier, int], wait_s: float) -> None:
    """Count tokens brought up before admission, and the wait for them, as the engine's own."""
    for tier, num in promoted_tokens_by_tier.items():
        result.promoted_tokens_by_tier[tier] = result.promoted_tokens_by_tier.get(tier, 0) + num
        result.num_promoted_tokens += num
    result.promotion_wait_s += wait_s


def usage_of(result: GenerationResult) -> Usage:
    num_prompt = len(result.prompt_token_ids)
    num_cached = result.num_cached_tokens
    num_generated = len(result.token_ids)
    needed = (num_prompt - num_cached) + max(num_generated - 1, 0)
    # Promotion works on whole pages; when every prompt page hit, the last prompt token
    # is recomputed, so the promoted count may exceed the cached count by up to a page.
    dram = min(result.promoted_tokens_by_tier.get(Tier.DRAM, 0), num_cached)
    nvme = min(result.promoted_tokens_by_tier.get(Tier.NVME, 0), num_cached - dram)
    return Usage(
        prompt_tokens=num_prompt,
        cached_tokens=num_cached,
        promoted_tokens=dram + nvme,
        recomputed_tokens=max(0, result.num_computed_tokens - needed),
        generated_tokens=num_generated,
        cached_tokens_by_tier=TokensByTier(hbm_tokens=num_cached - dram - nvme, dram_tokens=dram, nvme_tokens=nvme),
    )


def record_spans(
    run_id: RunId, request: GenerateRequest, result: GenerationResult, times: tracing.GenerationTimes,
    attributes: Mapping[str, str], parent: Context | None, usage: Usage | None = None,
) -> None:
    """The request's spans, from the timestamps it collected (counts only, no token ids)."""
    span_attributes: dict[str, str | int] = {
        **attributes,
        "kvtier.finish_reason": result.finish_reason.value,
        "kvtier.prompt_tokens": len(result.prompt_token_ids),
        "kvtier.generated_tokens": len(result.token_ids),
        "kvtier.num_preemptions": result.num_preemptions,
    }
    if request.request_id:
        span_attributes["kvtier.request_id"] = request.request_id
    if request.session_id:
        span_attributes["kvtier.session_id"] = request.session_id
    phases: dict[str, dict[str, str | int]] = {
        "admission": {"kvtier.cached_tokens": result.num_cached_tokens},
        "prefill": {"kvtier.computed_prompt_tokens": len(result.prompt_token_ids) - result.num_cached_tokens},
        "decode": {"kvtier.generated_tokens": len(result.token_ids)},
    }
    if usage is not None:
        by_tier = usage.cached_tokens_by_tier
        phases["promote"] = {
            "kvtier.promoted_tokens": usage.promoted_tokens,
            "kvtier.dram_tokens": by_tier.dram_tokens,
            "kvtier.nvme_tokens": by_tier.nvme_tokens,
        }
    tracing.record_generation(run_id, times, span_attributes, phase_attributes=phases, parent=parent)


def finish(
    run_id: RunId, request: GenerateRequest, result: GenerationResult, times: tracing.GenerationTimes, *,
    recorder: WorkerRecorder | None, span_attributes: Mapping[str, str], parent: Context | None,
    resumed: bool, admission_wait_s: float = 0.0, hold_wait_s: float = 0.0,
) -> GenerateFinal:
    """The final event of a finished generation, after its metrics, spans and log line
    (``resumed``: a session's next turn on this worker; the waits: outside the engine, and of
    that for holds due back soon)."""
    usage = usage_of(result)
    first = times.first_token_at if times.first_token_at is not None else times.finished_at
    ttft_ms = (first - times.submitted_at) * 1000.0
    if recorder is not None:
        recorder.record_request(result, ttft_ms / 1000.0, times.finished_at - first, resumed=resumed)
    if tracing.is_enabled():
        record_spans(run_id, request, result, times, span_attributes, parent, usage)
    log.info("generation finished", extra={
        "run_id": run_id, "finish_reason": result.finish_reason.value,
        "prompt_tokens": usage.prompt_tokens, "cached_tokens": usage.cached_tokens,
        "generated_tokens": usage.generated_tokens, "recomputed_tokens": usage.recomputed_tokens,
        "num_preemptions": result.num_preemptions, "ttft_ms": round(ttft_ms, 2),
        "admission_wait_ms": round(admission_wait_s * 1000.0, 2), "hold_wait_ms": round(hold_wait_s * 1000.0, 2)})
    return GenerateFinal(usage=usage, finish_reason=result.finish_reason, run_id=run_id, ttft_ms=ttft_ms)
