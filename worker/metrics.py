"""The worker's metrics (DESIGN §9): pages per tier, cache hits, recomputation, tier
traffic, transfer latency, eviction-induced first-token latency, TTFT and TPOT, tenant
quotas and namespace TTLs, and the GPU (NVML) when there is one.

Gauges read the occupancy the engine thread last published (``EngineLoop.latest_load``)
and plain counters, so a scrape never walks engine structures another thread mutates.
Per-request values are recorded once, when the request finishes. Attributes are the
worker id, tiers, states, outcomes, GPU index and tenant (bounded by the quota
configuration) — never token ids or text.

GPU gauges come from NVML (``nvidia-ml-py``): device memory, utilization and PCIe
throughput of the GPUs this process may use (``CUDA_VISIBLE_DEVICES``, else all). Without
a driver or a device, NVML fails to start: no GPU families, one info log line.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import pynvml
from opentelemetry.metrics import CallbackOptions, Observation

from kvtier.runtime.log import get_logger
from kvtier.runtime.telemetry import LATENCY_BUCKETS_S, Telemetry
from kvtier.tiers.transfer import TransferDone

if TYPE_CHECKING:
    from kvtier.engine.engine import GenerationResult
    from kvtier.worker.engine_loop import EngineLoop

log = get_logger("kvtier.worker.metrics")


class WorkerMetrics:
    def __init__(
        self, telemetry: Telemetry, loop: EngineLoop, worker_id: str, *, nvml: Any = pynvml
    ) -> None:
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
        self.resume_ttft = m.create_histogram(
            "kvtier.resume_ttft", unit="s",
            description="time to first token of a session's next turn (its last turn ran on this worker), "
            "by whether it waited for pages from a lower tier (promoted: true/false)",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_S,
        )
        self.eviction_wait = m.create_histogram(
            "kvtier.eviction_induced_ttft",
            unit="s",
            description="first-token delay spent promoting evicted pages back into HBM",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_S,
        )
        self.hold_deferral_wait = m.create_histogram(
            "kvtier.hold_deferral_wait", unit="s",
            description="time a request waited for room rather than displace session holds due back within a "
            "second, by how the wait ended (outcome=room: their turns came and went; timed_out: a hold yielded)",
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
            "kvtier.session_holds", callbacks=[self._session_holds], unit="{hold}",
            description="prefetched sessions' HBM holds by outcome: taken, unheld (no page in HBM), "
            "refused (at the cap), displaced (by a session due back sooner), yielded (room needed now), "
            "retaken (held again once room was back)",
        )
        m.create_observable_gauge(
            "kvtier.session_hold_pages", callbacks=[self._session_hold_pages], unit="{page}",
            description="HBM pages prefetched sessions' holds keep now (kind=held) and may keep together "
            "(kind=cap); held at the cap for long means HBM is short for the sessions due back",
        )
        m.create_observable_counter(
            "kvtier.session_prefetch_pages", callbacks=[self._session_prefetch_pages], unit="{page}",
            description="pages brought up into HBM for sessions due back (prefetches and retaken holds), counted "
            "when the session's next request arrives (kind=moved), and of those the moves wasted: pages below "
            "HBM again or gone by then, or brought up more than once, or the session ended (kind=wasted)",
        )
        m.create_observable_counter(
            "kvtier.tier_bytes_moved", callbacks=[self._bytes_moved], unit="By",
            description="bytes moved between tiers, by source and destination",
        )
        m.create_observable_counter(
            "kvtier.demotions_without_copy", callbacks=[self._counter("tiers", "demotions_without_copy")], unit="{page}",
            description="pages that left HBM onto their identical copy below, moving no bytes",
        )
        m.create_observable_counter(
            "kvtier.demotions_abandoned", callbacks=[self._demotions_abandoned], unit="{page}",
            description="pages copied down that stayed where they were once the copy landed (link bytes for "
            "nothing): reason=reused (a sequence took the page up meanwhile) or kept (a pin kept it: a session "
            "hold recalled it, an operator pinned it; the copy stays as its shadow when it went to DRAM)",
        )
        m.create_observable_counter(
            "kvtier.checksum_failures", callbacks=[self._counter("tiers", "checksum_failures")], unit="{page}",
            description="pages rejected on promotion because their bytes did not match their checksum",
        )
        m.create_observable_counter(
            "kvtier.pages_dropped", callbacks=[self._counter("tiers", "pages_dropped")], unit="{page}",
            description="cached pages dropped because no lower tier had room or worked",
        )
        self._quota_families(m)
        # None: no NVML (no driver or no device), so no GPU families.
        self.gpus = GpuMetrics.start(m, self.attrs, nvml)

    # ---- recorded per request ---------------------------------------------------------
    def record_request(self, result: GenerationResult, ttft_s: float, decode_s: float, *, resumed: bool = False) -> None:
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
        if resumed:  # the agent-session number issue #7 is judged by: prefetched in time, or not
            self.resume_ttft.record(ttft_s, {**a, "promoted": "true" if result.num_promoted_tokens else "false"})
        if len(result.token_ids) > 1:
            self.tpot.record(decode_s / (len(result.token_ids) - 1), a)
        if result.promotion_wait_s:
            self.eviction_wait.record(result.promotion_wait_s, a)

    def record_hold_deferral(self, wait_s: float, outcome: str) -> None:  # engine thread
        self.hold_deferral_wait.record(wait_s, {**self.attrs, "outcome": outcome})

    def transfer_done(self, done: TransferDone) -> None:  # transfer worker thread (EngineLoop routes it here)
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
                ("reclaimable", occ.reclaimable_pages),
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

    def _session_holds(self, _: CallbackOptions) -> Iterable[Observation]:
        for outcome, n in list(self.loop.holds.outcomes.items()):
            yield Observation(n, {**self.attrs, "outcome": outcome})

    def _session_hold_pages(self, _: CallbackOptions) -> Iterable[Observation]:
        yield Observation(self.loop.holds.num_held_pages, {**self.attrs, "kind": "held"})
        yield Observation(round(self.loop.holds.cap_pages), {**self.attrs, "kind": "cap"})

    def _session_prefetch_pages(self, _: CallbackOptions) -> Iterable[Observation]:
        yield Observation(self.loop.holds.session_prefetched_pages, {**self.attrs, "kind": "moved"})
        yield Observation(self.loop.holds.session_prefetch_wasted_pages, {**self.attrs, "kind": "wasted"})

    def _bytes_moved(self, _: CallbackOptions) -> Iterable[Observation]:
        tiers = self.engine.tiers
        if tiers is None:
            return
        # The manager counts every move it applied: spills, background demotions, promotions.
        for (src, dst), n in list(tiers.counters.bytes_moved.items()):
            yield Observation(n, {**self.attrs, "src": src.label, "dst": dst.label})

    def _counter(self, owner: str, name: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        """A callback observing counter ``name`` of the engine's ``owner`` (``tiers``, the tier
        manager; ``quotas``, the quota enforcer): 0 while the engine has none."""
        def observe(_: CallbackOptions) -> Iterable[Observation]:
            part = getattr(self.engine, owner)
            yield Observation(0 if part is None else getattr(part.counters, name), self.attrs)

        return observe

    def _demotions_abandoned(self, _: CallbackOptions) -> Iterable[Observation]:
        tiers = self.engine.tiers
        if tiers is None:
            return
        counters = tiers.counters
        yield Observation(counters.demotions_abandoned - counters.demotions_kept, {**self.attrs, "reason": "reused"})
        yield Observation(counters.demotions_kept, {**self.attrs, "reason": "kept"})

    # ---- tenant quotas and namespace TTLs (kvtier.cache.quotas, kvtier.cache.ttls) -------------------
    def _quota_families(self, m: Any) -> None:
        m.create_observable_counter(
            "kvtier.quota.pages_demoted", callbacks=[self._counter("quotas", "pages_demoted")], unit="{page}",
            description="cached pages moved one tier down to bring a tenant under its quota",
        )
        m.create_observable_counter(
            "kvtier.quota.pages_dropped", callbacks=[self._counter("quotas", "pages_dropped")], unit="{page}",
            description="cached pages dropped to bring a tenant under its quota (subtrees included)",
        )
        m.create_observable_counter(
            "kvtier.quota.stuck", callbacks=[self._counter("quotas", "num_stuck")], unit="{event}",
            description="enforcement passes that left a tenant over its quota (only held or pinned pages left)",
        )
        m.create_observable_counter(
            "kvtier.quota.evictions", callbacks=[self._quota_evictions], unit="{page}",
            description="pages a full pool took for an over-quota tenant's allocation, by owner "
            "(own: the tenant's page; foreign: another tenant's, all its own were in use)",
        )
        m.create_observable_gauge(
            "kvtier.quota.tenant_pages", callbacks=[self._tenant_pages], unit="{page}",
            description="cached pages per tenant and tier (configured tenants, and any tenant over its quota)",
        )
        m.create_observable_gauge(
            "kvtier.quota.limit_pages", callbacks=[self._tenant_limits], unit="{page}",
            description="a tenant's quota per tier, in pages (tiers without a limit are absent)",
        )
        m.create_observable_gauge(
            "kvtier.quota.overage_pages", callbacks=[self._tenant_overage], unit="{page}",
            description="cached pages above a tenant's quota now, per tier (0 when within it)",
        )
        m.create_observable_counter(
            "kvtier.ttl.expired_pages", callbacks=[self._ttl_expired], unit="{page}",
            description="cached pages dropped because their namespace's TTL passed",
        )

    def _quota_evictions(self, _: CallbackOptions) -> Iterable[Observation]:
        quotas = self.engine.quotas
        own, foreign = (0, 0) if quotas is None else (
            quotas.counters.num_own_evictions, quotas.counters.num_foreign_evictions)
        yield Observation(own, {**self.attrs, "owner": "own"})
        yield Observation(foreign, {**self.attrs, "owner": "foreign"})

    def _tenant_pages(self, _: CallbackOptions) -> Iterable[Observation]:
        for t in self.loop.latest_load.tenant_pages:
            yield Observation(t.num_pages, {**self.attrs, "tenant": t.tenant, "tier": t.tier.label})

    def _tenant_limits(self, _: CallbackOptions) -> Iterable[Observation]:
        for t in self.loop.latest_load.tenant_pages:
            if t.limit_pages is not None:
                yield Observation(t.limit_pages, {**self.attrs, "tenant": t.tenant, "tier": t.tier.label})

    def _tenant_overage(self, _: CallbackOptions) -> Iterable[Observation]:
        for t in self.loop.latest_load.tenant_pages:
            if t.limit_pages is not None:
                over = max(0, t.num_pages - t.limit_pages)
                yield Observation(over, {**self.attrs, "tenant": t.tenant, "tier": t.tier.label})

    def _ttl_expired(self, _: CallbackOptions) -> Iterable[Observation]:
        ttls = self.engine.ttls
        yield Observation(0 if ttls is None else ttls.num_expired, self.attrs)


# NVML reports PCIe throughput in KiB/s.
_KIB = 1024


class GpuMetrics:
    """GPU gauges read from NVML at scrape time (the scrape thread; NVML is thread-safe).

    ``start`` returns None when NVML does not start or sees no device; a call that fails
    later (a device lost, PCIe counters not supported) leaves that one observation out.
    """

    def __init__(self, nvml: Any, handles: Mapping[str, Any], attrs: Mapping[str, str]) -> None:
        self.nvml = nvml
        self.handles = dict(handles)  # gpu label (NVML index) -> device handle
        self.attrs = dict(attrs)

    @classmethod
    def start(
        cls, meter: Any, attrs: Mapping[str, str], nvml: Any = pynvml, *, env: Mapping[str, str] | None = None
    ) -> GpuMetrics | None:
        try:
            nvml.nvmlInit()
            handles = _visible_gpus(nvml, os.environ if env is None else env)
        except nvml.NVMLError as exc:
            log.info("no GPU metrics: NVML is not available", extra={"reason": str(exc)})
            return None
        if not handles:
            log.info("no GPU metrics: NVML sees no GPU this process may use")
            return None
        gpus = cls(nvml, handles, attrs)
        meter.create_observable_gauge(
            "kvtier.gpu.memory_used", callbacks=[gpus._memory_used], unit="By",
            description="device memory in use on the GPU (every process on it, driver reservations included), from NVML",
        )
        meter.create_observable_gauge(
            "kvtier.gpu.memory_total", callbacks=[gpus._memory_total], unit="By",
            description="device memory of the GPU, from NVML",
        )
        meter.create_observable_gauge(
            "kvtier.gpu.utilization", callbacks=[gpus._utilization], unit="%",
            description="share of the last sample period in which a kernel ran on the GPU, from NVML",
        )
        meter.create_observable_gauge(
            "kvtier.gpu.pcie_throughput", callbacks=[gpus._pcie], unit="By/s",
            description="PCIe traffic of the GPU by direction (tx: out of the GPU, rx: into it), "
            "over NVML's last 20 ms sample",
        )
        log.info("GPU metrics from NVML", extra={"gpus": ",".join(handles)})
        return gpus

    def _each(self, read: Any) -> Iterable[Observation]:
        for label, handle in self.handles.items():
            try:
                value = read(handle)
            except self.nvml.NVMLError as exc:
                log.debug("NVML read failed", extra={"gpu": label, "reason": str(exc)})
                continue
            yield Observation(value, {**self.attrs, "gpu": label})

    def _memory_used(self, _: CallbackOptions) -> Iterable[Observation]:
        return self._each(lambda h: self.nvml.nvmlDeviceGetMemoryInfo(h).used)

    def _memory_total(self, _: CallbackOptions) -> Iterable[Observation]:
        return self._each(lambda h: self.nvml.nvmlDeviceGetMemoryInfo(h).total)

    def _utilization(self, _: CallbackOptions) -> Iterable[Observation]:
        return self._each(lambda h: self.nvml.nvmlDeviceGetUtilizationRates(h).gpu)

    def _pcie(self, _: CallbackOptions) -> Iterable[Observation]:
        nvml = self.nvml
        for direction, counter in (("tx", nvml.NVML_PCIE_UTIL_TX_BYTES), ("rx", nvml.NVML_PCIE_UTIL_RX_BYTES)):
            for obs in self._each(lambda h, c=counter: nvml.nvmlDeviceGetPcieThroughput(h, c) * _KIB):
                yield Observation(obs.value, {**(obs.attributes or {}), "direction": direction})


def _visible_gpus(nvml: Any, env: Mapping[str, str]) -> dict[str, Any]:
    """NVML handles of the GPUs this process may use, by NVML index: ``CUDA_VISIBLE_DEVICES``
    (indices or ``GPU-`` UUIDs, as Ray and Kubernetes set it) when set, else every device."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
    else:
        handles = []
        for entry in (e.strip() for e in visible.split(",")):
            if not entry:
                continue
            if entry.isdigit():
                handles.append(nvml.nvmlDeviceGetHandleByIndex(int(entry)))
            elif entry.startswith(("GPU-", "MIG-")):
                handles.append(nvml.nvmlDeviceGetHandleByUUID(entry))
            else:
                break  # CUDA stops at the first invalid entry
    return {str(nvml.nvmlDeviceGetIndex(h)): h for h in handles}
