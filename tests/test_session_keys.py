"""Sessions are keyed by (tenant, id) everywhere (decision 0007): against a real controller
(gRPC on loopback, real Valkey) with authentication on, and a real worker linked to a
controller, another tenant naming a live session id learns nothing (no affinity), cannot
squat on it (the owner's Pause still works), and its Generate under that id leaves the
owner's pause and page moves alone; a session without a tenant is its credential's; each
tenant's live sessions are capped."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import pytest_asyncio

from kvtier.client import AsyncClient
from kvtier.domain.errors import NotFound, ResourceExhausted
from kvtier.domain.hashing import NamespaceIdentity, namespace_digest, page_keys
from kvtier.domain.records import BootId, ModelIdentity, Registration, SessionState, TierCapacity, WorkerId
from kvtier.domain.tiers import Tier
from kvtier.engine import Engine, SamplingParams
from kvtier.engine.model.loader import TINY_LLAMA_CONFIG, write_random_checkpoint
from kvtier.rpc.auth import hash_token
from kvtier.tiers.manager import TierConfig
from kvtier.worker.servicer import serve_worker

from live_controller import controller_at, orchestrated

TOKENS = {"fe-a": "kvt_keys-a", "fe-b": "kvt_keys-b", "ops": "kvt_keys-ops"}
NS = NamespaceIdentity(model_id="m", page_size=16)
GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)


def table(tmp_path):
    path = tmp_path / "tokens.yaml"
    path.write_text(
        "tokens:\n"
        + "".join(f"  - name: {name}\n    role: frontend\n    tenants: [{name[-1]}]\n    sha256: {hash_token(token)}\n"
                  for name, token in TOKENS.items() if name.startswith("fe-"))
        + f"  - name: ops\n    role: admin\n    sha256: {hash_token(TOKENS['ops'])}\n")
    return path


def serving(controller) -> None:
    """A worker serving NS, straight into the registry (Route ranks it; nothing dials it, and
    with no lower tier a Pause keeps the session's pages where they are)."""
    controller.registry.connect(Registration(
        worker_id=WorkerId("w"), address="127.0.0.1:1", boot_id=BootId("b"), model=ModelIdentity("m"),
        page_size=16, capacities=(TierCapacity(Tier.HBM, 1024, 1024 * 4096),)), link_id=1)


@contextlib.asynccontextmanager
async def tenants(redis_url, tmp_path, **config):
    """A controller with authentication on and a worker serving NS; clients of A, B and an admin."""
    async with controller_at(redis_url, tmp_path, auth_token_file=table(tmp_path), lease_ttl_s=600.0,
                             heartbeat_interval_s=1.0, **config) as controller:
        serving(controller)
        async with (AsyncClient(controller.address, token=TOKENS["fe-a"]) as a,
                    AsyncClient(controller.address, token=TOKENS["fe-b"]) as b,
                    AsyncClient(controller.address, token=TOKENS["ops"]) as ops):
            yield controller, a, b, ops


async def test_another_tenants_route_naming_a_live_session_id_gets_no_affinity(flushed_redis_url, tmp_path):
    async with tenants(flushed_redis_url, tmp_path) as (_, a, b, _ops):
        await a.route(NS, list(range(40)), "s-live")
        assert (await a.route(NS, list(range(40)), "s-live")).best.is_affinity  # A's own: affinity
        # B naming A's live id is answered as for an id nobody uses: no existence oracle.
        assert not (await b.route(NS, list(range(40)), "s-live")).best.is_affinity
        assert not (await b.route(NS, list(range(40)), "s-unused")).best.is_affinity


async def test_an_id_another_tenant_used_first_is_still_the_owners_to_pause_and_end(flushed_redis_url, tmp_path):
    async with tenants(flushed_redis_url, tmp_path) as (controller, a, b, _ops):
        # B used "s-squat" first (a Pause starts its session); A's later session of that id is A's own.
        assert (await b.pause("s-squat", tool="t")).state is SessionState.PAUSED
        await a.route(NS, list(range(40)), "s-squat")
        await controller.orchestrator.settled()
        assert (await a.pause("s-squat", tool="t")).state is SessionState.PAUSED
        # B's Route and End of that id act on B's own session; A's stays paused.
        await b.route(NS, list(range(40)), "s-squat")
        await controller.orchestrator.settled()
        assert (await b.end("s-squat")).state is SessionState.ENDED
        assert (await a.returning("s-squat")).state is SessionState.RESUMING


async def test_a_session_without_a_tenant_is_its_credentials(flushed_redis_url, tmp_path):
    async with tenants(flushed_redis_url, tmp_path) as (controller, _a, b, ops):
        await ops.route(NS, list(range(40)), "s-ops")  # an admin's Route: no tenant
        await controller.orchestrator.settled()
        with pytest.raises(NotFound):
            await b.end("s-ops")
        assert (await ops.end("s-ops")).state is SessionState.ENDED


async def test_each_tenant_may_have_so_many_live_sessions(flushed_redis_url, tmp_path):
    async with tenants(flushed_redis_url, tmp_path, max_sessions_per_tenant=3) as (controller, a, b, _ops):
        for i in range(3):
            await a.route(NS, [1, 2, 3], f"s-{i}")
        await a.route(NS, [1, 2, 3], "s-0")  # a live one goes on
        with pytest.raises(ResourceExhausted, match="max_sessions_per_tenant") as info:
            await a.route(NS, [1, 2, 3], "s-3")
        assert info.value.field == "session_id"
        with pytest.raises(ResourceExhausted):
            await a.pause("s-4", tool="t")
        await b.route(NS, [1, 2, 3], "s-3")  # another tenant's cap is its own
        await controller.orchestrator.settled()
        await a.end("s-1")
        await a.route(NS, [1, 2, 3], "s-3")


# --------------------------------------------------------------------------- the worker's session map

@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def worker(tmp_path_factory):
    ckpt = write_random_checkpoint(tmp_path_factory.mktemp("keys-ckpt") / "tiny", TINY_LLAMA_CONFIG, seed=0)
    engine = Engine.from_pretrained(ckpt, page_size=4, num_pages=256, tier_config=TierConfig(dram_pages=128))
    server = await serve_worker(engine, worker_id="w-keys")
    try:
        yield server
    finally:
        await server.stop(0)


@pytest.mark.asyncio(loop_scope="module")
async def test_another_tenants_generate_under_the_same_id_leaves_the_owners_pause_alone(
    worker, flushed_redis_url, tmp_path
):
    ns_a = dataclasses.replace(worker.engine.namespace, tenant="a")
    ns_b = dataclasses.replace(worker.engine.namespace, tenant="b")
    prompt = [5 + i for i in range(21)]  # 5 full pages
    async with orchestrated(worker, flushed_redis_url, tmp_path) as (controller, client):
        out, _ = await client.complete(ns_a, prompt, GREEDY, session_id="s-shared")
        # B sends one Generate straight to the worker under A's session id.
        await client.complete(ns_b, [300 + i for i in range(21)], GREEDY, session_id="s-shared",
                              worker=worker.address)
        await controller.orchestrator.settled()
        info = await client.pause("s-shared", tool="slow", expected_ms=60_000)
        assert info.parked_tier is Tier.DRAM, info  # A's pages went down: the worker found them
        keys = page_keys(namespace_digest(ns_a), prompt + out[:-1], 4)
        tiers = [worker.engine.index.get(k).tier for k in keys if worker.engine.index.get(k) is not None]
        assert tiers and set(tiers) == {Tier.DRAM}
        # B's session of that id is its own on the worker too: still there, still in HBM.
        assert await worker.loop.session_pages("s-shared", namespace_digest(ns_b)) is not None
        await client.end("s-shared")
