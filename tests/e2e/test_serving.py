"""The whole serving path on real processes: Valkey, Ray worker actors, the controller,
gRPC on loopback, and the frontend client — outputs checked against transformers."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from pathlib import Path

import pytest
import ray
import torch

from kvtier.client import AsyncClient
from kvtier.domain.errors import Unavailable
from kvtier.domain.params import SamplingParams
from kvtier.local.stack import StackOptions, start_local_stack

from hf_checkpoints import hf_logits, load_hf

PAGE = 16


@pytest.fixture(scope="module")
def stack(local_ray, tmp_path_factory):
    state = tmp_path_factory.mktemp("stack")
    loop = asyncio.new_event_loop()
    s = loop.run_until_complete(
        start_local_stack(StackOptions(state_dir=state, num_workers=2, lease_ttl_s=1.5, max_restarts=0))
    )
    yield s, loop
    loop.run_until_complete(s.stop())
    leftovers = asyncio.all_tasks(loop)
    for task in leftovers:
        task.cancel()
    if leftovers:
        loop.run_until_complete(asyncio.gather(*leftovers, return_exceptions=True))
    loop.close()


@pytest.fixture(scope="module")
def oracle(stack):
    s, _ = stack
    return load_hf(Path(s.options.state_dir) / "models" / "tiny")


def run(stack, coro):
    return stack[1].run_until_complete(coro)


def greedy(hf, prompt: list[int], n: int) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(512) for _ in range(n)]


async def complete(client, ns, prompt, session=None, n=12):
    return await client.complete(ns, prompt, SamplingParams(max_tokens=n, ignore_eos=True), session_id=session)


def test_session_affinity_and_prefix_routing_match_the_oracle(stack, oracle):
    s, _ = stack
    ns = dataclasses.replace(s.namespace, tenant="acme")
    rng = random.Random(0)
    system = tokens(rng, 4 * PAGE)

    async def scenario():
        async with AsyncClient(s.controller_address) as client:
            turn1 = system + tokens(rng, 20)
            out1, final1 = await complete(client, ns, turn1, session="sess-1")
            first_worker = (await client.route(ns, turn1 + out1, session_id="sess-1")).workers[0]
            turn2 = turn1 + out1 + tokens(rng, 7)
            out2, final2 = await complete(client, ns, turn2, session="sess-1")
            # A new session of the same tenant sharing only the system prompt. Page events
            # reach the directory asynchronously (batched every ~50 ms): wait for them. The
            # polls name no session: a Route naming one makes its top worker the session's
            # affinity, and a poll before the events landed (worker-0 then scores only its
            # load) would tie sess-2 to the other worker for good.
            other = system + tokens(rng, 9)
            deadline = time.monotonic() + 5
            while True:
                decision = await client.route(ns, other)
                if decision.workers[0].matched_tokens.hbm_tokens or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.05)
            out3, final3 = await complete(client, ns, other, session="sess-2")
            return turn1, out1, final1, first_worker, turn2, out2, final2, other, decision, out3, final3

    turn1, out1, final1, first_worker, turn2, out2, final2, other, decision, out3, final3 = run(stack, scenario())
    assert first_worker.is_affinity
    full_pages = (len(turn1) + len(out1) - 1) // PAGE * PAGE  # K/V exists for all but the last token
    assert final2.usage.cached_tokens >= full_pages
    assert decision.workers[0].worker_id == first_worker.worker_id  # routed by the shared prefix
    assert decision.workers[0].matched_tokens.hbm_tokens == len(system)
    assert final3.usage.cached_tokens == len(system)
    for prompt, out in ((turn1, out1), (turn2, out2), (other, out3)):
        assert out == greedy(oracle, prompt, len(out))


def test_tenants_do_not_share_cached_prefixes(stack):
    s, _ = stack
    rng = random.Random(1)
    prompt = tokens(rng, 3 * PAGE + 5)

    async def scenario():
        async with AsyncClient(s.controller_address) as client:
            a = dataclasses.replace(s.namespace, tenant="tenant-a")
            b = dataclasses.replace(s.namespace, tenant="tenant-b")
            _, fa = await complete(client, a, prompt)
            routed_b = await client.route(b, prompt)
            _, fb = await complete(client, b, prompt)
            return fa, routed_b, fb

    fa, routed_b, fb = run(stack, scenario())
    assert fa.usage.cached_tokens == 0
    assert all(w.matched_tokens.hbm_tokens == 0 for w in routed_b.workers)
    assert fb.usage.cached_tokens == 0


def test_killed_worker_leaves_the_directory_and_requests_still_succeed(stack, oracle):
    s, _ = stack
    ns = dataclasses.replace(s.namespace, tenant="kill")
    rng = random.Random(2)
    prompt = tokens(rng, 2 * PAGE + 3)

    async def scenario():
        async with AsyncClient(s.controller_address) as client:
            await complete(client, ns, prompt)
            holder = (await client.route(ns, prompt)).workers[0]
            victim = next(w for w in s.workers if w.worker_id == holder.worker_id)
            # Kill it while a stream is open on it.
            stream = client.generate(ns, prompt, SamplingParams(max_tokens=400, ignore_eos=True), worker=holder.address)
            await stream.__anext__()
            ray.kill(victim.actor, no_restart=True)
            with pytest.raises(Unavailable):
                async for _ in stream:
                    pass
            deadline = time.monotonic() + 3 * 1.5 + 2
            while time.monotonic() < deadline:
                ranked = (await client.route(ns, prompt)).workers
                if all(w.worker_id != holder.worker_id for w in ranked):
                    break
                await asyncio.sleep(0.2)
            out, final = await complete(client, ns, prompt)
            return holder, ranked, out, final

    holder, ranked, out, final = run(stack, scenario())
    assert ranked and all(w.worker_id != holder.worker_id for w in ranked)
    assert out == greedy(oracle, prompt, len(out))
    assert final.usage.generated_tokens == len(out)
    s.workers[:] = [w for w in s.workers if w.worker_id != holder.worker_id]


def test_oracle_logits_of_built_in_model_match(stack, oracle):
    # The checkpoint the workers serve is the one transformers loads: same logits.
    from kvtier.engine import Engine

    s, _ = stack
    engine = Engine.from_pretrained(Path(s.options.state_dir) / "models" / "tiny", num_pages=64, record_logits=True)
    r = engine.generate([list(range(1, 40))], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    ref = hf_logits(oracle, r.prompt_token_ids + r.token_ids)
    torch.testing.assert_close(r.logits[0], ref[len(r.prompt_token_ids) - 1], atol=1e-4, rtol=0)
