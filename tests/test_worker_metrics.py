"""A running worker's Prometheus endpoint, scraped over HTTP: the DESIGN §9 families exist
with units, move after requests, and carry no token ids."""

from __future__ import annotations

import re
import urllib.request

import pytest
import pytest_asyncio

from kvtier.client import AsyncClient
from kvtier.engine import Engine, SamplingParams
from kvtier.telemetry import Telemetry
from kvtier.tier_manager import TierConfig
from kvtier.tiers import Tier
from kvtier.worker.servicer import serve_worker

from hf_checkpoints import build_checkpoint

pytestmark = pytest.mark.asyncio(loop_scope="module")

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
    "kvtier_tier_bytes_moved_bytes_total",
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


async def test_metrics_exist_with_units_and_move_after_requests(served):
    server, engine, telemetry = served
    ns = engine.namespace
    prompt = [(7 * i) % 256 for i in range(30)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    async with AsyncClient() as client:
        await client.complete(ns, prompt, params, worker=server.address)
        before = scrape(telemetry.port)
        # Demote the cached pages, then reuse them: a prefix hit served from DRAM.
        await server.loop._call(lambda: engine.tiers.demote_all(Tier.DRAM))
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
