"""Quotas under concurrency (decision 0009, Reservations): a tenant over its HBM quota cannot
take another tenant's pages that are within that tenant's quota, however many of its
sequences run at once. A real worker (gRPC on loopback, the tiny Llama checkpoint, a DRAM
tier); what stays in HBM is read as a client sees it: the next request's cached tokens by
tier, and the worker's CheckIntegrity."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest
import pytest_asyncio

from kvtier.cache.quotas import QuotaTable
from kvtier.client import AsyncClient
from kvtier.engine import Engine, SamplingParams
from kvtier.engine.model.loader import TINY_LLAMA_CONFIG, write_random_checkpoint
from kvtier.tiers.manager import TierConfig
from kvtier.worker.servicer import serve_worker

PS = 16
ONE = SamplingParams(max_tokens=1, ignore_eos=True)
A_PAGES = 80  # 1,280 tokens, within A's quota
B_TOKENS = 1500
NUM_B_STREAMS = 8
_rng = random.Random(42)

pytestmark = pytest.mark.asyncio(loop_scope="module")


def fresh(num_tokens: int) -> list[int]:
    return [_rng.randrange(3, 512) for _ in range(num_tokens)]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def worker(tmp_path_factory):
    ckpt = write_random_checkpoint(tmp_path_factory.mktemp("reservation-ckpt") / "tiny", TINY_LLAMA_CONFIG, seed=0)
    # 256 HBM pages: A's 80 plus room for about one of B's 95-page sequences at a time, so B's
    # eight at once press on everything; B's own pages over its quota go to DRAM.
    engine = Engine.from_pretrained(
        ckpt, page_size=PS, num_pages=256, eviction_policy="lru", tier_config=TierConfig(dram_pages=1024),
        tenant_quotas=QuotaTable.from_setting({"qa": {"hbm": 96}, "qb": {"hbm": 16}}),
    )
    server = await serve_worker(engine, worker_id="w-reserve")
    try:
        yield server
    finally:
        await server.stop(0)


async def test_an_over_quota_tenants_concurrent_streams_leave_the_other_tenants_pages_in_hbm(worker):
    ns = lambda tenant: dataclasses.replace(worker.engine.namespace, tenant=tenant)  # noqa: E731
    a_prompt = fresh(A_PAGES * PS + 1)  # 80 full pages cached, the extra token private
    async with AsyncClient(worker.address) as client:
        async def complete(tenant: str, prompt: list[int]):
            return (await client.complete(ns(tenant), prompt, ONE, worker=worker.address, deadline_s=300))[1]

        first = await complete("qa", a_prompt)
        assert first.usage.cached_tokens == 0
        results = await asyncio.gather(*(complete("qb", fresh(B_TOKENS)) for _ in range(NUM_B_STREAMS)))
        assert all(r.usage.generated_tokens == 1 for r in results)  # every B stream finished
        again = await complete("qa", a_prompt)
        assert again.usage.cached_tokens_by_tier.hbm_tokens == A_PAGES * PS, again.usage
        report = await client.check_integrity(worker.address)
        assert report.is_ok, [r.problem for r in report.reports if r.problem]
