"""A running worker's Prometheus endpoint, scraped over HTTP: the DESIGN §9 families exist
with units, move after requests, and carry no token ids; tenant quota and namespace TTL
counters; GPU gauges from NVML (a fake NVML here: no GPU on the test machine) and the
degrade path without one."""

from __future__ import annotations

import dataclasses
import logging
import re
import time
import urllib.request
from types import SimpleNamespace

import pynvml
import pytest
import pytest_asyncio

from kvtier.cache.quotas import QuotaTable
from kvtier.cache.ttls import TtlTable
from kvtier.client import AsyncClient
from kvtier.domain.hashing import namespace_digest
from kvtier.domain.records import SessionId
from kvtier.domain.tiers import Tier
from kvtier.engine import Engine, SamplingParams
from kvtier.policy.holds import ExpectedReturn
from kvtier.runtime.telemetry import Telemetry
from kvtier.tiers.manager import TierConfig
from kvtier.worker import holds as holds_module
from kvtier.worker.metrics import GpuMetrics
from kvtier.worker.servicer import serve_worker
from kvtier.worker.session_ref import SessionRef, hold_id

from hf_checkpoints import build_checkpoint
from polling import wait_for

in_module_loop = pytest.mark.asyncio(loop_scope="module")

# OpenTelemetry appends real units (seconds, bytes) to the Prometheus names; counts whose
# unit is an annotation ({token}, {page}) keep the bare name.
FAMILIES = [
    "kvtier_pages",
    "kvtier_prefix_hit_tokens_total",
    "kvtier_prompt_tokens_total",
    "kvtier_recomputed_tokens_total",
    "kvtier_generated_tokens_total",
    "kvtier_reuse_depth_bucket",
    "kvtier_ttft_seconds_bucket",
    "kvtier_time_per_output_token_seconds_bucket",
    "kvtier_allocation_waits_total",
    "kvtier_preemptions_total",
    "kvtier_session_holds_total",
    "kvtier_session_hold_pages",
    "kvtier_tier_bytes_moved_bytes_total",
    "kvtier_demotions_without_copy_total",
    "kvtier_demotions_abandoned_total",
    "kvtier_checksum_failures_total",
    "kvtier_pages_dropped_total",
    "kvtier_eviction_induced_ttft_seconds_bucket",
    "kvtier_transfer_latency_seconds_bucket",
]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(tmp_path_factory):
    ckpt = build_checkpoint(tmp_path_factory.mktemp("metrics") / "llama", "llama", seed=3)
    engine = Engine.from_pretrained(ckpt, page_size=4, num_pages=128, tier_config=TierConfig(dram_pages=64))
    telemetry = Telemetry("kvtier-worker-test", port=0)
    server = await serve_worker(engine, worker_id="w-metrics", telemetry=telemetry)
    yield server, engine, telemetry
    await server.stop(0)
    telemetry.close()


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def value(text: str, family: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(family + "{") and not line.startswith(family + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@in_module_loop
async def test_metrics_exist_with_units_and_move_after_requests(served):
    server, engine, telemetry = served
    ns = engine.namespace
    prompt = [(7 * i) % 256 for i in range(30)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    async with AsyncClient() as client:
        await client.complete(ns, prompt, params, worker=server.address)
        before = scrape(telemetry.port)
        # Demote the cached pages, then reuse them: a prefix hit served from DRAM.
        await server.loop.call(lambda: engine.tiers.demote_all(Tier.DRAM))
        _, final = await client.complete(ns, prompt[:24] + [1, 2], params, worker=server.address)
    after = scrape(telemetry.port)
    for family in FAMILIES:
        assert re.search(rf"^{family}[{{ ]", after, re.M), f"{family} missing from the scrape"
    assert "# HELP kvtier_eviction_induced_ttft_seconds first-token delay" in after
    assert final.usage.cached_tokens == 24 and final.usage.promoted_tokens == 24
    assert value(after, "kvtier_prefix_hit_tokens_total") - value(before, "kvtier_prefix_hit_tokens_total") == 24
    assert value(after, "kvtier_requests_total", finish_reason="length") == 2
    assert value(after, "kvtier_tier_bytes_moved_bytes_total", src="hbm", dst="dram") > 0
    assert value(after, "kvtier_tier_bytes_moved_bytes_total", src="dram", dst="hbm") == 6 * engine.geometry.page_bytes
    assert value(after, "kvtier_eviction_induced_ttft_seconds_count") == 1
    assert value(after, "kvtier_pages", tier="hbm", state="free") > 0
    assert re.search(r'^kvtier_pages\{[^}]*state="cached"[^}]*tier="dram"', after, re.M), "DRAM occupancy not exported"
    # No raw content: the scrape names no prompt tokens, only counts and ids.
    assert "prompt=" not in after and "token_ids" not in after


@in_module_loop
async def test_resume_ttft_counts_a_sessions_next_turns_by_whether_they_promoted(served):
    """kvtier.resume_ttft: a turn of a session whose last turn ran here, split by whether it
    waited for pages from a lower tier; a session's first turn and a request without a
    session are not resumes."""
    server, engine, telemetry = served
    ns = engine.namespace
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    family = "kvtier_resume_ttft_seconds_count"
    before = scrape(telemetry.port)
    async with AsyncClient() as client:
        history = [(17 * i + 3) % 256 for i in range(18)]
        out, _ = await client.complete(ns, history, params, worker=server.address, session_id="s-resume")
        await client.complete(ns, [9, 8, 7, 6, 5], params, worker=server.address)  # no session
        history += out + [40, 41]
        out, final = await client.complete(ns, history, params, worker=server.address, session_id="s-resume")
        assert final.usage.promoted_tokens == 0
        mid = scrape(telemetry.port)
        await server.loop.call(lambda: engine.tiers.demote_all(Tier.DRAM))
        history += out + [42]
        _, final = await client.complete(ns, history, params, worker=server.address, session_id="s-resume")
        assert final.usage.promoted_tokens > 0
    after = scrape(telemetry.port)
    assert "# HELP kvtier_resume_ttft_seconds time to first token of a session's next turn" in after
    assert value(mid, family, promoted="false") - value(before, family, promoted="false") == 1
    assert value(mid, family, promoted="true") == value(before, family, promoted="true")
    assert value(after, family, promoted="true") - value(mid, family, promoted="true") == 1
    assert value(after, family, promoted="false") == value(mid, family, promoted="false")


@in_module_loop
async def test_session_holds_are_counted_by_outcome(served, monkeypatch):
    """Holds of prefetched sessions: taken, displaced by one due back sooner, refused at the cap,
    yielded when room is needed now, retaken when the room is back; the scrape counts each by
    outcome."""

    server, engine, telemetry = served
    ns = engine.namespace
    digest = namespace_digest(ns)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    async with AsyncClient() as client:
        for session, step in (("s-soon", 11), ("s-late", 13)):  # 4 private pages each, in HBM
            await client.complete(ns, [(step * i + 5) % 256 for i in range(17)], params,
                                  worker=server.address, session_id=session)
    loop = server.loop
    monkeypatch.setattr(holds_module, "MAX_HELD_FRACTION", 6 / engine.pool.num_pages)  # one session's pages
    before = scrape(telemetry.port)
    await loop.prefetch(digest, (), "s-late", hold_s=30.0, due_s=20.0)  # taken
    # Its chain (the shared-nothing prompt's pages) is what holds keep now, against the cap.
    held = await loop.call(loop.holds.count_held_pages)
    assert held >= 4
    await wait_for(lambda: value(scrape(telemetry.port), "kvtier_session_hold_pages", kind="held") == held,
                   what="the held pages published")
    assert value(scrape(telemetry.port), "kvtier_session_hold_pages", kind="cap") == 6
    await loop.prefetch(digest, (), "s-soon", hold_s=30.0, due_s=1.0)  # taken: s-late displaced
    await loop.prefetch(digest, (), "s-late", hold_s=30.0, due_s=20.0)  # refused: s-soon is due first
    assert await loop.call(loop.holds.yield_weakest)  # room needed now: s-soon yields
    # HBM has room to spare here, so s-soon's hold is retaken at once (``_retake``).
    await wait_for(lambda: loop.holds.is_held("s-soon"), what="the yielded hold retaken")
    after = scrape(telemetry.port)

    def delta(outcome: str) -> float:
        family = "kvtier_session_holds_total"
        return value(after, family, outcome=outcome) - value(before, family, outcome=outcome)

    assert {o: delta(o) for o in holds_module.HOLD_OUTCOMES} == {
        "taken": 3, "unheld": 0, "refused": 1, "displaced": 1, "yielded": 1, "retaken": 1}
    for session in ("s-soon", "s-late"):  # nothing held or waiting to be retaken is left behind
        await loop.drop_session(digest, session)
    assert not loop.holds.snapshot().held and not loop.holds.snapshot().lapsed


@in_module_loop
async def test_demotions_a_hold_recalled_and_those_onto_a_kept_copy_are_counted(served):
    """A session's pages on their way down when its hold comes (issue #7, decision 0008 revision
    6): the copies made for nothing are counted as abandoned (reason kept, none reused), and once
    the session is parked after all its pages go down onto those copies without a byte moved."""
    import asyncio

    from kvtier.domain.hashing import page_keys

    server, engine, telemetry = served
    ns = engine.namespace
    digest = namespace_digest(ns)
    prompt = [(7 * i + 3) % 256 for i in range(17)]  # 4 full private pages
    async with AsyncClient() as client:
        await client.complete(ns, prompt, SamplingParams(max_tokens=2, ignore_eos=True),
                              worker=server.address, session_id="s-recall")
    loop = server.loop
    chain = [engine.index.get(k) for k in page_keys(digest, prompt, 4)]
    assert all(n is not None and n.tier is Tier.HBM for n in chain)
    before = scrape(telemetry.port)
    held: asyncio.Future = asyncio.get_running_loop().create_future()

    def demote_then_hold() -> None:  # one engine-thread turn: the copy cannot land in between
        assert engine.tiers.start_demotion(chain, Tier.DRAM).num_open > 0
        loop.commands.prefetch(digest, (), "s-recall", 30.0, held, expected=ExpectedReturn(time.time() * 1000.0 + 1000.0))

    await loop.call(demote_then_hold)
    await held
    await loop.call(engine.tiers.wait_idle)
    assert [n.tier for n in chain] == [Tier.HBM] * 4
    mid = scrape(telemetry.port)
    assert value(mid, "kvtier_demotions_abandoned_total", reason="kept") - value(
        before, "kvtier_demotions_abandoned_total", reason="kept") == 4
    assert value(mid, "kvtier_demotions_abandoned_total", reason="reused") == value(
        before, "kvtier_demotions_abandoned_total", reason="reused")
    await loop.unpin(hold_id(SessionRef(digest, SessionId("s-recall"))))  # the session is back
    await loop.demote(digest, (), "s-recall", Tier.DRAM)  # and pauses again: onto the kept copies
    assert [n.tier for n in chain] == [Tier.DRAM] * 4
    after = scrape(telemetry.port)
    assert value(after, "kvtier_demotions_without_copy_total") - value(mid, "kvtier_demotions_without_copy_total") == 4
    await loop.drop_session(digest, "s-recall")


# ---- tenant quotas and namespace TTLs --------------------------------------------------------
QUOTA_FAMILIES = [
    "kvtier_quota_pages_demoted_total",
    "kvtier_quota_pages_dropped_total",
    "kvtier_quota_stuck_total",
    "kvtier_quota_evictions_total",
    "kvtier_quota_tenant_pages",
    "kvtier_quota_limit_pages",
    "kvtier_quota_overage_pages",
    "kvtier_ttl_expired_pages_total",
]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def limited(tmp_path_factory):
    ckpt = build_checkpoint(tmp_path_factory.mktemp("limits") / "llama", "llama", seed=4)
    clock_offset_s = [0.0]
    engine = Engine.from_pretrained(
        ckpt, page_size=4, num_pages=64, tier_config=TierConfig(dram_pages=32),
        tenant_quotas=QuotaTable.from_setting({"acme": {"hbm": 2}}),
        namespace_ttls=TtlTable.from_setting([{"tenant": "globex", "ttl_s": 60}]),
    )
    engine.index.clock = lambda: time.monotonic() + clock_offset_s[0]  # TTLs without sleeping
    telemetry = Telemetry("kvtier-worker-limits", port=0)
    server = await serve_worker(engine, worker_id="w-limits", telemetry=telemetry)
    yield server, engine, telemetry, clock_offset_s
    await server.stop(0)
    telemetry.close()


@in_module_loop
async def test_quota_and_ttl_counters_are_exported_by_tenant_and_move(limited):
    server, engine, telemetry, clock_offset_s = limited
    acme = dataclasses.replace(engine.namespace, tenant="acme")
    globex = dataclasses.replace(engine.namespace, tenant="globex")
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    prompt = [(5 * i + 3) % 256 for i in range(14)]  # with the output: 4 full pages cached
    before = scrape(telemetry.port)
    for family in QUOTA_FAMILIES:
        assert re.search(rf"^{family}[{{ ]", before, re.M), f"{family} missing before any request"
    assert value(before, "kvtier_quota_limit_pages", tenant="acme", tier="hbm") == 2
    async with AsyncClient() as client:
        await client.complete(acme, prompt, params, worker=server.address)
        await client.complete(globex, prompt, params, worker=server.address)
    # Over its HBM quota, acme's deepest pages went down to DRAM (the engine thread, after the step).
    await server.loop.call(engine.enforce_limits)
    await server.loop.stats()  # the load the scrape reads is published after each iteration
    after = scrape(telemetry.port)
    assert value(after, "kvtier_quota_pages_demoted_total") == 2
    assert value(after, "kvtier_quota_tenant_pages", tenant="acme", tier="hbm") == 2
    assert value(after, "kvtier_quota_tenant_pages", tenant="acme", tier="dram") == 2
    assert value(after, "kvtier_quota_overage_pages", tenant="acme", tier="hbm") == 0
    assert value(after, "kvtier_quota_evictions_total", owner="foreign") == 0
    assert value(after, "kvtier_ttl_expired_pages_total") == 0
    assert "globex" not in after  # not configured and not over a quota: no series of its own

    clock_offset_s[0] = 120.0  # globex's pages are now past their 60 s TTL
    assert await server.loop.call(engine.enforce_limits) == 4
    expired = scrape(telemetry.port)
    assert value(expired, "kvtier_ttl_expired_pages_total") == 4
    assert "# HELP kvtier_ttl_expired_pages_total cached pages dropped because their namespace's TTL" in expired


# ---- GPU (NVML) ---------------------------------------------------------------------------------
class FakeNvml:
    """The slice of pynvml GpuMetrics calls, over two fake devices (NVML is outside the system)."""

    NVMLError = pynvml.NVMLError
    NVML_PCIE_UTIL_TX_BYTES = pynvml.NVML_PCIE_UTIL_TX_BYTES
    NVML_PCIE_UTIL_RX_BYTES = pynvml.NVML_PCIE_UTIL_RX_BYTES

    def __init__(self, *, init_error: int | None = None, pcie_supported: bool = True) -> None:
        self.init_error = init_error
        self.pcie_supported = pcie_supported
        self.uuids = ["GPU-aaaa", "GPU-bbbb"]

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)

    def nvmlDeviceGetCount(self) -> int:
        return len(self.uuids)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        if not 0 <= index < len(self.uuids):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return index

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> int:
        return self.uuids.index(uuid)

    def nvmlDeviceGetIndex(self, handle: int) -> int:
        return handle

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(used=(handle + 1) * (1 << 30), total=80 * (1 << 30), free=0)

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(gpu=40 + handle, memory=0)

    def nvmlDeviceGetPcieThroughput(self, handle: int, counter: int) -> int:
        if not self.pcie_supported:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return 1000 if counter == pynvml.NVML_PCIE_UTIL_TX_BYTES else 3000  # KiB/s


def gpu_scrape(nvml, env) -> tuple[GpuMetrics | None, str]:
    telemetry = Telemetry("kvtier-gpu-test", port=0)
    try:
        gpus = GpuMetrics.start(telemetry.meter, {"worker": "w-gpu"}, nvml, env=env)
        return gpus, scrape(telemetry.port)
    finally:
        telemetry.close()


def test_gpu_gauges_come_from_nvml_for_the_visible_devices():
    gpus, text = gpu_scrape(FakeNvml(), env={"CUDA_VISIBLE_DEVICES": "GPU-bbbb"})
    assert gpus is not None and list(gpus.handles) == ["1"]
    assert value(text, "kvtier_gpu_memory_used_bytes", gpu="1", worker="w-gpu") == 2 * (1 << 30)
    assert value(text, "kvtier_gpu_memory_total_bytes", gpu="1") == 80 * (1 << 30)
    assert value(text, "kvtier_gpu_utilization_percent", gpu="1") == 41
    assert value(text, "kvtier_gpu_pcie_throughput_bytes_per_second", gpu="1", direction="tx") == 1000 * 1024
    assert value(text, "kvtier_gpu_pcie_throughput_bytes_per_second", gpu="1", direction="rx") == 3000 * 1024
    assert 'gpu="0"' not in text  # not visible to this process
    assert "# HELP kvtier_gpu_memory_used_bytes device memory in use" in text

    _, every = gpu_scrape(FakeNvml(pcie_supported=False), env={})
    assert value(every, "kvtier_gpu_memory_used_bytes", gpu="0") == 1 << 30
    assert value(every, "kvtier_gpu_memory_used_bytes", gpu="1") == 2 << 30
    # A device without PCIe counters leaves that family out; the others stay.
    assert "kvtier_gpu_pcie_throughput_bytes_per_second{" not in every


def test_without_nvml_there_are_no_gpu_families_and_one_info_line(caplog):
    caplog.set_level(logging.INFO, logger="kvtier")
    gpus, text = gpu_scrape(FakeNvml(init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED), env={})
    assert gpus is None and "kvtier_gpu" not in text
    notes = [r for r in caplog.records if r.name == "kvtier.worker.metrics"]
    assert len(notes) == 1 and notes[0].levelno == logging.INFO and "no GPU metrics" in notes[0].getMessage()
    caplog.clear()
    # This process, with the real pynvml: a machine without a GPU degrades the same way.
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        gpus, text = gpu_scrape(pynvml, env={})
        assert gpus is None and "kvtier_gpu" not in text
        assert len([r for r in caplog.records if r.name == "kvtier.worker.metrics"]) == 1
    else:
        pynvml.nvmlShutdown()
        gpus, text = gpu_scrape(pynvml, env={})
        assert gpus is not None and value(text, "kvtier_gpu_memory_total_bytes") > 0


@in_module_loop
async def test_pages_brought_up_for_a_session_and_those_its_turn_did_not_find_in_hbm_are_counted(served):
    """``kvtier.session_prefetch_pages``: a prefetch brings a session's pages up; they go down
    again before its turn (the watermark needed the room), so the turn finds them below: every
    move was wasted, and the worker says so, whatever the directory still showed."""
    server, engine, telemetry = served
    ns = engine.namespace
    digest = namespace_digest(ns)
    prompt = [(5 * i + 2) % 256 for i in range(17)]  # 4 full private pages
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    loop = server.loop
    async with AsyncClient() as client:
        tokens, _ = await client.complete(ns, prompt, params, worker=server.address, session_id="s-wasted")
        await loop.call(lambda: engine.tiers.demote_all(Tier.DRAM))
        moved = (await loop.prefetch(digest, (), "s-wasted")).num_moved
        assert moved >= 4
        await loop.demote(digest, (), "s-wasted", Tier.DRAM)
        before = scrape(telemetry.port)
        await client.complete(ns, prompt + tokens, params, worker=server.address, session_id="s-wasted")
    after = scrape(telemetry.port)

    def delta(kind: str) -> float:
        family = "kvtier_session_prefetch_pages_total"
        return value(after, family, kind=kind) - value(before, family, kind=kind)

    assert (delta("moved"), delta("wasted")) == (moved, moved)
    assert "# HELP kvtier_session_prefetch_pages_total" in after
