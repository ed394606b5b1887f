"""Tenant isolation through the real key derivation and the real directory (DESIGN §5 decision 3,
§8): two tenants cache *identical* prompts on two workers, and 100,000 randomized lookups
never find a page of the other tenant, while every lookup finds exactly what its own
tenant cached (so a lookup path that ignored the tenant, or matched nothing, would fail)."""

from __future__ import annotations

import asyncio
import random

from kvtier.controller.directory import Directory
from kvtier.controller.directory_records import Outcome
from kvtier.domain.hashing import NamespaceIdentity, namespace_digest, page_keys, root_key
from kvtier.domain.records import PageEvent, WorkerId
from kvtier.domain.tiers import Tier

PAGE_SIZE = 4
NUM_LOOKUPS = 100_000
NUM_PROMPTS = 64
SYSTEM_PAGES = 6
CONCURRENCY = 64
BASE = NamespaceIdentity(model_id="tiny", weights_digest="w", page_size=PAGE_SIZE)
TENANTS = {"acme": WorkerId("w-acme"), "globex": WorkerId("w-globex")}
# Both tenants hold the shared middle third of the prompts: identical token ids in both.
HELD = {"acme": range(0, 40), "globex": range(24, 64)}


def make_prompts(rng: random.Random) -> list[list[int]]:
    system = [rng.randrange(32_000) for _ in range(SYSTEM_PAGES * PAGE_SIZE)]
    return [system + [rng.randrange(32_000) for _ in range(rng.randint(1, 6) * PAGE_SIZE)]
            for _ in range(NUM_PROMPTS)]


def _ns(tenant: str) -> NamespaceIdentity:
    return NamespaceIdentity(model_id=BASE.model_id, weights_digest=BASE.weights_digest,
                             page_size=PAGE_SIZE, tenant=tenant)


async def test_100k_randomized_lookups_with_identical_prompts_never_cross_tenants(redis_client):
    rng = random.Random(20240905)
    directory = Directory(redis_client, lease_ttl_ms=600_000)
    for worker in TENANTS.values():
        assert (await directory.register_worker(worker)).outcome is Outcome.OK
    prompts = make_prompts(rng)
    digests = {t: namespace_digest(_ns(t)) for t in TENANTS}
    held = {}
    for tenant in TENANTS:
        held[tenant] = await cache_pages(directory, tenant, prompts, digests[tenant])
    assert not held["acme"] & held["globex"]  # identical prompts, disjoint keys

    # Key chains are derived per lookup (the real derivation, on randomly truncated prompts).
    queries = []
    for _ in range(NUM_LOOKUPS):
        tenant = rng.choice(("acme", "globex"))
        prompt = prompts[rng.randrange(NUM_PROMPTS)]
        num_pages = rng.randint(1, len(prompt) // PAGE_SIZE)
        queries.append((tenant, prompt[: num_pages * PAGE_SIZE]))

    num_cross = num_hits = num_wrong_depth = 0
    for start in range(0, NUM_LOOKUPS, CONCURRENCY):
        batch = queries[start : start + CONCURRENCY]
        chains = [page_keys(digests[t], tokens, PAGE_SIZE) for t, tokens in batch]
        results = await asyncio.gather(*(directory.lookup(digests[t], keys)
                                          for (t, _), keys in zip(batch, chains, strict=True)))
        for (tenant, _), keys, result in zip(batch, chains, results, strict=True):
            expected = next((i for i, k in enumerate(keys) if k not in held[tenant]), len(keys))
            num_cross += sum(m.worker != TENANTS[tenant] for m in result.matches)
            num_wrong_depth += result.matched_depth != expected
            num_hits += result.matched_depth > 0
    assert num_cross == 0
    assert num_wrong_depth == 0
    # Every query shares the system prompt its tenant cached, so every lookup hits.
    assert num_hits == NUM_LOOKUPS


async def cache_pages(directory: Directory, tenant: str, prompts: list[list[int]], digest: bytes) -> set[bytes]:
    events, held = [], set()
    for i in HELD[tenant]:
        keys = page_keys(digest, prompts[i], PAGE_SIZE)
        for depth, key in enumerate(keys, start=1):
            if key not in held:
                held.add(key)
                parent = keys[depth - 2] if depth > 1 else root_key(digest)
                events.append(PageEvent.insert(digest, key, parent, depth, Tier.HBM))
    result = await directory.apply_events(TENANTS[tenant], 1, events)
    assert result.outcome is Outcome.OK and result.num_applied == len(events) and not result.rejected
    return held
