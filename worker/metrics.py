"""The worker's metrics (DESIGN §9): pages per tier, cache hits, recomputation, tier
traffic, transfer latency, eviction-induced first-token latency, TTFT and TPOT.

Gauges read the occupancy the engine thread last published (``EngineLoop.latest_load``)
and plain counters, so a scrape never walks engine structures another thread mutates.
Per-request values are recorded once, when the request finishes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from opentelemetry.metrics import CallbackOptions, Observation

from kvtier.telemetry import LATENCY_BUCKETS_S, Telemetry
from kvtier.transfer import TransferDone

if TYPE_CHECKING:
    from kvtier.engine.engine import GenerationResult
    from kvtier.worker.engine_loop import EngineLoop


class WorkerMetrics:
    def __init__(self, telemetry: Telemetry, loop: EngineLoop, worker_id: str) -> None:
        self.loop = loop
        self.engine = loop.engine
        self.attrs = {"worker": worker_id}
        m = telemetry.meter
        self.prefix_hit_tokens = m.create_counter(
            "kvtier.prefix_hit_tokens", unit="{token}", description="prompt tokens served from the cache"
        )
        self.prompt_tokens = m.create_counter("kvtier.prompt_tokens", unit="{token}", description="prompt tokens")
        self.recomputed_tokens = m.create_counter(
            "kvtier.recomputed_tokens",
            unit="{token}",
            description="tokens whose KV was computed again (after preemption or a failed checksum)",
        )
        self.promoted_tokens = m.create_counter(
            "kvtier.promoted_tokens", unit="{token}", description="cached tokens copied up into HBM before prefill"
        )
        self.generated_tokens = m.create_counter("kvtier.generated_tokens", unit="{token}", description="output")
        self.requests = m.create_counter("kvtier.requests", unit="{request}", description="finished requests")
        self.reuse_depth = m.create_histogram(
            "kvtier.reuse_depth",
            unit="{page}",
            description="cached pages matched per request (prefix reuse depth)",
            explicit_bucket_boundaries_advisory=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096),
        )
        self.ttft = m.create_histogram(
            "kvtier.ttft", unit="s", description="time to first token, worker side",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_S,
        )
        self.tpot = m.create_histogram(
            "kvtier.time_per_output_token", unit="s", description="mean time per output token after the first",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_S,
        )
        self.eviction_wait = m.create_histogram(
            "kvtier.eviction_induced_ttft",
            unit="s",
            description="first-token delay spent promoting evicted pages back into HBM",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_S,
        )
        self.transfer_latency = m.create_histogram(
            "kvtier.transfer_latency", unit="s", description="queue + copy time of one tier transfer",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_S,
        )
        m.create_observable_gauge(
            "kvtier.pages", callbacks=[self._pages], unit="{page}",
            description="pages per tier and state (free, cached, in_use, pinned)",
        )
        m.create_observable_gauge(
            "kvtier.bytes_per_active_token", callbacks=[self._bytes_per_active_token], unit="By",
            description="HBM bytes held by running sequences per token they hold",
        )
        m.create_observable_counter(
            "kvtier.allocation_waits", callbacks=[self._allocation_waits], unit="{event}",
            description="admissions that had to wait for pages",
        )
        m.create_observable_counter(
            "kvtier.preemptions", callbacks=[self._preemptions], unit="{event}", description="sequences preempted"
        )
        m.create_observable_counter(
            "kvtier.tier_bytes_moved", callbacks=[self._bytes_moved], unit="By",
            description="bytes moved between tiers, by source and destination",
        )
        m.create_observable_counter(
            "kvtier.checksum_failures", callbacks=[self._checksum_failures], unit="{page}",
            description="pages rejected on promotion because their bytes did not match their checksum",
        )
        m.create_observable_counter(
            "kvtier.pages_dropped", callbacks=[self._pages_dropped], unit="{page}",
            description="cached pages dropped because no lower tier had room or worked",
        )
        if self.engine.tiers is not None:
            self.engine.tiers.transfers.on_done = self._transfer_done

    # ---- recorded per request ---------------------------------------------------------
    def record_request(self, result: GenerationResult, ttft_s: float, decode_s: float) -> None:
        a = self.attrs
        self.prompt_tokens.add(len(result.prompt_token_ids), a)
        self.prefix_hit_tokens.add(result.num_cached_tokens, a)
        for tier, n in result.promoted_tokens_by_tier.items():
            self.promoted_tokens.add(n, {**a, "tier": tier.label})
        needed = len(result.prompt_token_ids) - result.num_cached_tokens + max(len(result.token_ids) - 1, 0)
        self.recomputed_tokens.add(max(0, result.num_computed_tokens - needed), a)
        self.generated_tokens.add(len(result.token_ids), a)
        self.requests.add(1, {**a, "finish_reason": result.finish_reason.value})
        self.reuse_depth.record(result.num_cached_tokens // self.engine.pool.page_size, a)
        self.ttft.record(ttft_s, a)
        if len(result.token_ids) > 1:
            self.tpot.record(decode_s / (len(result.token_ids) - 1), a)
        if result.promotion_wait_s:
            self.eviction_wait.record(result.promotion_wait_s, a)

    def _transfer_done(self, done: TransferDone) -> None:  # transfer worker thread
        t = done.transfer
        self.transfer_latency.record(done.latency_s, {**self.attrs, "src": t.src_tier.label, "dst": t.dst_tier.label})

    # ---- observed at scrape -----------------------------------------------------------
    def _pages(self, _: CallbackOptions) -> Iterable[Observation]:
        for occ in self.loop.latest_load.tiers:
            tier = occ.tier.label
            for state, value in (
                ("free", occ.free_pages),
                ("cached", occ.cached_pages),
                ("in_use", occ.in_use_pages),
                ("pinned", occ.pinned_pages),
            ):
                yield Observation(value, {**self.attrs, "tier": tier, "state": state})

    def _bytes_per_active_token(self, _: CallbackOptions) -> Iterable[Observation]:
        running = list(self.engine.scheduler.running)
        tokens = sum(s.num_tokens for s in running)
        pages = sum(len(s.pages) for s in running)
        if tokens:
            yield Observation(pages * self.engine.geometry.page_bytes / tokens, self.attrs)

    def _allocation_waits(self, _: CallbackOptions) -> Iterable[Observation]:
        yield Observation(self.engine.scheduler.num_admission_waits, self.attrs)

    def _preemptions(self, _: CallbackOptions) -> Iterable[Observation]:
        yield Observation(self.engine.scheduler.num_preemptions, self.attrs)

    def _bytes_moved(self, _: CallbackOptions) -> Iterable[Observation]:
        tiers = self.engine.tiers
        if tiers is None:
            return
        # The manager counts every move it applied: spills, background demotions, promotions.
        for (src, dst), n in list(tiers.counters.bytes_moved.items()):
            yield Observation(n, {**self.attrs, "src": src.label, "dst": dst.label})

    def _checksum_failures(self, _: CallbackOptions) -> Iterable[Observation]:
        tiers = self.engine.tiers
        yield Observation(0 if tiers is None else tiers.counters.checksum_failures, self.attrs)

    def _pages_dropped(self, _: CallbackOptions) -> Iterable[Observation]:
        tiers = self.engine.tiers
        yield Observation(0 if tiers is None else tiers.counters.pages_dropped, self.attrs)
