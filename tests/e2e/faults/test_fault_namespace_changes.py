"""No stale prefix survives a change of what produced it: a tokenizer upgrade, a model
(weights) upgrade with pages persisted on NVMe across the restart, a policy change
(``Admin.Invalidate``), and a revoked frontend token.

Each change keeps the old pages cached somewhere (HBM, NVMe, the directory); the test
checks they are never served again to the changed namespace or the revoked caller, while
an unchanged control still hits. And as after every fault: oracle, no leak, a directory
that converges to the inventories.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import pytest_asyncio
import redis
import yaml
from fault_harness import (
    HEARTBEAT_S,
    LEASE_TTL_S,
    PAGE_SIZE,
    Oracle,
    assert_converged,
    assert_no_leak,
    cancel_leftovers,
    complete_checked,
    free_port,
    greedy,
    prompts,
    redis_reader,
    routed_workers,
    start_local_worker,
    start_valkey,
    stop_controller,
    within,
)

from kvtier.client import AsyncClient
from kvtier.controller.server import serve_controller
from kvtier.domain.errors import Unauthenticated
from kvtier.domain.hashing import namespace_digest, page_keys
from kvtier.domain.records import DemoteCommand, InvalidationScope, WorkerId
from kvtier.domain.tiers import Tier
from kvtier.engine import Engine
from kvtier.engine.model.loader import TINY_LLAMA_CONFIG, write_random_checkpoint
from kvtier.rpc.auth import TokenTableFile, hash_token, new_token
from kvtier.runtime.config import ControllerConfig
from kvtier.tiers.manager import TierConfig

pytestmark = pytest.mark.asyncio(loop_scope="module")
STEPS = 6


@dataclasses.dataclass
class Stack:
    controller: object
    worker: object
    client: AsyncClient
    reader: object
    root: object

    def ns(self, tenant, **changes):
        return dataclasses.replace(self.worker.engine.namespace, tenant=tenant, **changes)

    async def matched(self, ns, prompt) -> int:
        decision = await within(self.client.route(ns, prompt), 30, "Route")
        return sum(w.matched_tokens.hbm_tokens + w.matched_tokens.dram_tokens + w.matched_tokens.nvme_tokens
                   for w in decision.workers)

    async def wait_matched(self, ns, prompt, want: int) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while (got := await self.matched(ns, prompt)) != want:
            assert loop.time() < deadline, f"Route matched {got} tokens, expected {want}"
            await asyncio.sleep(0.05)

    async def check(self, *digests) -> None:
        await assert_no_leak(self.client, self.worker.address)
        await assert_converged(self.reader, lambda: _expected(self.worker), digests=list(digests))


async def _expected(worker):
    return [await worker.expected()]


async def _start_worker(checkpoint, controller, root, worker_id="w-ns"):
    tiers = TierConfig(nvme_slots=64, nvme_dir=root / "nvme")
    engine = Engine.from_pretrained(checkpoint, page_size=PAGE_SIZE, num_pages=128, tier_config=tiers)
    return await start_local_worker(engine, controller.address, worker_id)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(fault_checkpoint, redis_url, tmp_path_factory):
    flush = redis.Redis.from_url(redis_url)
    flush.flushdb()
    flush.close()
    root = tmp_path_factory.mktemp("namespace-faults")
    config = ControllerConfig(port=0, state_dir=root, lease_ttl_s=LEASE_TTL_S, heartbeat_interval_s=HEARTBEAT_S)
    controller = await serve_controller(config, redis_url=redis_url, controller_id="ctl-ns")
    worker = await _start_worker(fault_checkpoint, controller, root)
    client = AsyncClient(controller.address, timeout_s=30)
    reader_client, reader = await redis_reader(redis_url)
    s = Stack(controller, worker, client, reader, root)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while not controller.registry.live_workers():
        assert loop.time() < deadline, "the worker never registered"
        await asyncio.sleep(0.05)
    yield s
    await client.close()
    await s.worker.stop()
    await stop_controller(controller)
    await reader_client.aclose()
    await cancel_leftovers()


async def test_a_tokenizer_upgrade_never_reuses_the_old_tokenizers_pages(stack, oracle):
    old = stack.ns("tok")
    new = stack.ns("tok", tokenizer_digest="tokenizer-v2")
    prompt = prompts(1, 21, seed=50)[0]
    await complete_checked(stack.client, oracle, old, prompt, STEPS)
    await stack.wait_matched(old, prompt, 20)
    assert await stack.matched(new, prompt) == 0, "Route offered the old tokenizer's prefix"
    _, final = await complete_checked(stack.client, oracle, new, prompt, STEPS)
    assert final.usage.cached_tokens == 0, "the old tokenizer's pages were reused"
    _, control = await complete_checked(stack.client, oracle, old, prompt, STEPS)
    assert control.usage.cached_tokens == 20, "the unchanged namespace still hits"
    await stack.check(namespace_digest(old), namespace_digest(new))


async def test_a_policy_change_invalidates_the_namespace_and_nothing_stale_is_reused(stack, oracle):
    ns = stack.ns("policy")
    prompt = prompts(1, 21, seed=52)[0]
    await complete_checked(stack.client, oracle, ns, prompt, STEPS)
    await stack.wait_matched(ns, prompt, 20)
    result = await within(stack.client.invalidate(InvalidationScope(namespace=ns), reason="policy v2"), 30,
                          "Invalidate")
    assert result.policy_epoch >= 1 and result.num_workers_notified == 1
    await stack.wait_matched(ns, prompt, 0)
    _, final = await complete_checked(stack.client, oracle, ns, prompt, STEPS)
    assert final.usage.cached_tokens == 0, "a page of the invalidated epoch was reused"
    await stack.wait_matched(ns, prompt, 20)  # the new epoch caches afresh
    await stack.check(namespace_digest(ns), namespace_digest(dataclasses.replace(ns, policy_epoch=result.policy_epoch)))


async def test_a_model_upgrade_never_reuses_pages_persisted_by_the_old_weights(stack, oracle, tmp_path):
    old = stack.ns("upgrade")
    prompt = prompts(1, 21, seed=51)[0]
    await complete_checked(stack.client, oracle, old, prompt, STEPS)
    digest = namespace_digest(old)
    command = DemoteCommand(digest, tuple(page_keys(digest, prompt, PAGE_SIZE)[:1]), Tier.NVME)
    ack = await within(stack.controller.send_command(WorkerId(stack.worker.worker_id), command), 30, "Demote")
    assert ack.error_code is None and ack.num_pages >= 5, ack

    # The same model id, new weights (a fine-tune): the worker restarts on the same NVMe files.
    upgraded = write_random_checkpoint(tmp_path / "tiny", TINY_LLAMA_CONFIG, seed=1, init_std=0.2)
    await stack.worker.stop()
    stack.worker = await _start_worker(upgraded, stack.controller, stack.root)
    new = stack.ns("upgrade")
    assert new.model_id == old.model_id and new.weights_digest != old.weights_digest
    restored = stack.worker.engine.index.count_by_tier()[Tier.NVME]
    assert restored >= 5, "the old weights' pages are still on disk, restored under their namespace"
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while stack.worker.worker_id not in await routed_workers(stack.client, new, prompt):
        assert loop.time() < deadline, "the upgraded worker never registered"
        await asyncio.sleep(0.05)
    assert await stack.matched(new, prompt) == 0, "Route offered a prefix computed by the old weights"
    _, final = await complete_checked(stack.client, Oracle(upgraded), new, prompt, STEPS)
    assert final.usage.cached_tokens == 0 and final.usage.promoted_tokens == 0
    with pytest.raises(Exception) as refused:  # the old weights' namespace is not served any more
        await stack.client.complete(old, prompt, deadline_s=30, worker=stack.worker.address)
    assert getattr(refused.value, "field", None) == "namespace.weights_digest"
    await stack.check(digest, namespace_digest(new))


def _greedy(steps):
    return greedy(steps)


async def test_a_revoked_frontend_token_gets_no_more_hits(fault_checkpoint, oracle, tmp_path):
    tokens = {name: new_token() for name in ("admin", "worker", "acme-1", "acme-2")}
    roles = {"admin": ("admin", []), "worker": ("worker", []), "acme-1": ("frontend", ["acme"]),
             "acme-2": ("frontend", ["acme"])}

    def write_table(names):
        entries = [{"name": n, "role": roles[n][0], "sha256": hash_token(tokens[n]),
                    **({"tenants": roles[n][1]} if roles[n][1] else {}),
                    **({"worker_id": "w-auth"} if n == "worker" else {})} for n in names]
        table.write_text(yaml.safe_dump({"tokens": entries}))

    table = tmp_path / "tokens.yaml"
    write_table(tokens)
    valkey = start_valkey(tmp_path / "valkey", free_port())  # its own: the module's controller leads the other
    config = ControllerConfig(port=0, state_dir=tmp_path, lease_ttl_s=LEASE_TTL_S, heartbeat_interval_s=HEARTBEAT_S,
                              auth_token_file=table)
    controller = await serve_controller(config, redis_url=valkey.url, controller_id="ctl-auth")
    engine = Engine.from_pretrained(fault_checkpoint, page_size=PAGE_SIZE, num_pages=128)
    worker = await start_local_worker(
        engine, controller.address, "w-auth", token=tokens["worker"],
        server_options={"tokens": TokenTableFile(table, reload_interval_s=0.2)},
    )
    reader_client, reader = await redis_reader(valkey.url)
    ns = dataclasses.replace(engine.namespace, tenant="acme")
    prompt = prompts(1, 21, seed=53)[0]
    clients = {n: AsyncClient(controller.address, token=tokens[n], timeout_s=30) for n in tokens}
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while not controller.registry.live_workers():
            assert loop.time() < deadline, "the worker never registered"
            await asyncio.sleep(0.05)
        revoked, kept = clients["acme-1"], clients["acme-2"]
        await complete_checked(revoked, oracle, ns, prompt, STEPS)
        deadline = loop.time() + 10
        while (await revoked.route(ns, prompt)).workers[0].matched_tokens.hbm_tokens != 20:
            assert loop.time() < deadline, "the directory never listed the prefix"
            await asyncio.sleep(0.05)

        write_table([n for n in tokens if n != "acme-1"])  # revoke acme-1
        deadline = loop.time() + 10
        while True:
            try:
                await revoked.route(ns, prompt)
            except Unauthenticated:
                break
            assert loop.time() < deadline, "the revoked token still routes"
            await asyncio.sleep(0.1)
        with pytest.raises(Unauthenticated):
            await within(revoked.complete(ns, prompt, _greedy(STEPS), deadline_s=30, worker=worker.address), 30,
                         "a generation with a revoked token")
        # The pages are still cached for the tenant's other callers: only the revoked one lost them.
        _, final = await complete_checked(kept, oracle, ns, prompt, STEPS)
        assert final.usage.cached_tokens == 20
        await assert_no_leak(clients["admin"], worker.address)
        await assert_converged(reader, lambda: _expected(worker), digests=[namespace_digest(ns)])
    finally:
        for client in clients.values():
            await client.close()
        await worker.stop()
        await stop_controller(controller)
        await reader_client.aclose()
        valkey.stop()
