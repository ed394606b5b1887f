"""Routing arithmetic with hand-computed expectations (controller/router.py): tier weights, load
penalty, affinity stickiness and its overload escape; plus the registry's compatibility rule and
the degraded path when Redis cannot be reached (a client aimed at a closed port)."""

from __future__ import annotations

import socket

import pytest
import redis.asyncio as aredis
from grpc_health.v1.health import aio as health_aio

from kvtier.controller.registry import Registry
from kvtier.controller.resync import DirectoryAccess
from kvtier.controller.router import (
    Candidate,
    Router,
    RouterParams,
    WorkerLoad,
    is_overloaded,
    load_penalty,
    prefix_page_keys,
    prefix_value,
    rank_workers,
    served_models,
    unserved_reason,
)
from kvtier.domain.errors import NotFound, Unavailable
from kvtier.domain.hashing import NamespaceIdentity, namespace_digest, page_keys
from kvtier.domain.records import (
    BootId,
    Heartbeat,
    ModelFacts,
    ModelIdentity,
    PageKeyPrefix,
    Registration,
    RouteRequest,
    SessionId,
    TierOccupancy,
    TokenPrefix,
    TokensByTier,
    WorkerId,
)
from kvtier.domain.tiers import Tier

PARAMS = RouterParams()  # HBM 1.0, DRAM 0.8, NVMe 0.5; 256 / queued, 16 / running, 512 at no HBM left
A, B, C = WorkerId("a"), WorkerId("b"), WorkerId("c")


def idle(worker: WorkerId, **load) -> Candidate:
    return Candidate(worker, f"{worker}:1", WorkerLoad(**load))


def order(ranked) -> list[str]:
    return [r.worker_id for r in ranked]


def test_prefix_value_weighs_each_tier():
    assert prefix_value(TokensByTier(hbm_tokens=8, dram_tokens=4, nvme_tokens=4), PARAMS) == pytest.approx(
        8 * 1.0 + 4 * 0.8 + 4 * 0.5
    )  # 13.2
    custom = RouterParams(tier_weights={Tier.HBM: 2.0})  # a tier without a weight is worth 0
    assert prefix_value(TokensByTier(hbm_tokens=3, dram_tokens=100), custom) == 6.0


def test_load_penalty_counts_queue_running_and_hbm_pressure():
    # 2 queued, 3 running, 5 of 100 HBM pages available (free 2 + cached 3): 5 % < 10 %,
    # pressure = 1 - 0.05 / 0.10 = 0.5.
    load = WorkerLoad(queue_depth=2, num_running_seqs=3, hbm_total_pages=100, hbm_available_pages=5)
    assert load_penalty(load, PARAMS) == pytest.approx(2 * 256 + 3 * 16 + 0.5 * 512)  # 816
    assert load_penalty(WorkerLoad(hbm_total_pages=100, hbm_available_pages=10), PARAMS) == 0
    assert load_penalty(WorkerLoad(hbm_total_pages=100, hbm_available_pages=0), PARAMS) == 512
    assert load_penalty(WorkerLoad(), PARAMS) == 0  # no heartbeat yet: no HBM figures, no pressure


def test_ranking_by_score_tier_weights_and_load():
    matched = {
        A: TokensByTier(hbm_tokens=8, dram_tokens=4, nvme_tokens=4),  # 13.2
        B: TokensByTier(hbm_tokens=12),  # 12.0
        C: TokensByTier(dram_tokens=16),  # 12.8
    }
    ranked = rank_workers([idle(A), idle(B), idle(C)], matched, PARAMS)
    assert order(ranked) == ["a", "c", "b"]
    assert [r.score for r in ranked] == pytest.approx([13.2, 12.8, 12.0])
    assert ranked[0].matched_tokens == matched[A] and ranked[0].address == "a:1"

    # One queued request (256 tokens) outweighs a 200-token HBM prefix: idle and empty wins.
    matched = {A: TokensByTier(hbm_tokens=200)}
    ranked = rank_workers([idle(A, queue_depth=1), idle(B)], matched, PARAMS)
    assert order(ranked) == ["b", "a"]
    assert [r.score for r in ranked] == pytest.approx([0.0, 200 - 256])


def test_ties_go_to_the_shorter_queue_then_the_worker_id():
    params = RouterParams(queue_penalty_tokens=0.0)
    ranked = rank_workers([idle(C, queue_depth=1), idle(B), idle(A)], {}, params)
    assert order(ranked) == ["a", "b", "c"]


def test_affinity_is_sticky_while_its_worker_is_not_overloaded():
    matched = {A: TokensByTier(hbm_tokens=64), C: TokensByTier(hbm_tokens=32)}
    ranked = rank_workers([idle(A), idle(B), idle(C)], matched, PARAMS, affinity=B)
    assert order(ranked) == ["b", "a", "c"]
    assert [r.is_affinity for r in ranked] == [True, False, False]
    # Some load does not move the session (B scores 7 * -256 and still comes first) ...
    ranked = rank_workers([idle(A), idle(B, queue_depth=7), idle(C)], matched, PARAMS, affinity=B)
    assert order(ranked) == ["b", "a", "c"] and ranked[0].score == -7 * 256


def test_affinity_escapes_an_overloaded_or_missing_worker():
    matched = {A: TokensByTier(hbm_tokens=64)}
    # ... an overloaded worker does: a queue of 8 ...
    assert is_overloaded(WorkerLoad(queue_depth=8), PARAMS)
    ranked = rank_workers([idle(A), idle(B, queue_depth=8)], matched, PARAMS, affinity=B)
    assert order(ranked) == ["a", "b"] and [r.is_affinity for r in ranked] == [False, True]
    # ... or under 2 % of its HBM pages available (1 of 100) ...
    full = idle(B, hbm_total_pages=100, hbm_available_pages=1)
    assert is_overloaded(full.load, PARAMS)
    assert order(rank_workers([idle(A), full], matched, PARAMS, affinity=B)) == ["a", "b"]
    # ... and a worker that is gone is simply not a candidate.
    ranked = rank_workers([idle(A), idle(C)], matched, PARAMS, affinity=B)
    assert order(ranked) == ["a", "c"] and not any(r.is_affinity for r in ranked)


def test_token_and_page_key_prefixes_look_up_the_same_keys_under_the_derived_namespace():
    namespace = NamespaceIdentity(model_id="m", page_size=4, tenant="t")
    tokens = tuple(range(10))
    digest, keys = prefix_page_keys(namespace, TokenPrefix(tokens))
    assert digest == namespace_digest(namespace)
    assert keys == page_keys(digest, tokens, 4) and len(keys) == 2  # the partial tail gets no key
    assert prefix_page_keys(namespace, PageKeyPrefix(tuple(keys))) == (digest, keys)


def registration(worker: str, *, model_id="m", page_size=4, kv_dtype="fp32", adapters=(), weights_digest="",
                 rope_config="", facts=None) -> Registration:
    return Registration(
        worker_id=WorkerId(worker), address=f"{worker}:1", boot_id=BootId("boot"),
        model=ModelIdentity(model_id=model_id, kv_dtype=kv_dtype, weights_digest=weights_digest,
                            rope_config=rope_config),
        page_size=page_size, capacities=(), adapters=tuple(adapters), facts=facts,
    )


def registry_of(*registrations: Registration) -> Registry:
    registry = Registry(lease_ttl_s=10.0)
    for link_id, reg in enumerate(registrations):
        registry.connect(reg, link_id)
    return registry


SERVED = dict(model_id="m", weights_digest="52db", rope_config="{}", kv_dtype="fp32", page_size=4)


@pytest.mark.parametrize(("sent", "field", "served"), [
    (dict(model_id="other"), "namespace.model_id", "'m'"),
    (dict(weights_digest=""), "namespace.weights_digest", "'52db'"),
    (dict(rope_config=""), "namespace.rope_config", "'{}'"),
    (dict(kv_dtype="bf16"), "namespace.kv_dtype", "'fp32'"),
    (dict(page_size=16), "namespace.page_size", "4"),
    (dict(adapter="sql"), "namespace.adapter", "none"),
])
def test_a_namespace_no_worker_serves_is_not_found_naming_the_field_and_the_served_value(sent, field, served):
    live = registry_of(registration("a", weights_digest="52db", rope_config="{}")).live_workers()
    err = unserved_reason(NamespaceIdentity(**{**SERVED, **sent}), live)
    assert isinstance(err, NotFound) and err.field == field
    assert served in err.message
    assert "ListModels" in err.message or field == "namespace.adapter"  # adapters are not namespace defaults


def test_no_live_worker_or_only_draining_ones_is_unavailable():
    namespace = NamespaceIdentity(**SERVED)
    err = unserved_reason(namespace, [])
    assert isinstance(err, Unavailable) and "no live worker" in err.message
    registry = registry_of(registration("a", weights_digest="52db", rope_config="{}"))
    registry.get(WorkerId("a")).is_draining = True
    err = unserved_reason(namespace, registry.live_workers())
    assert isinstance(err, Unavailable) and "draining" in err.message


def test_served_models_group_workers_by_namespace_fields_with_their_facts():
    facts = ModelFacts(vocab_size=512, max_context_tokens=2048, eos_token_ids=(2,), has_chat_template=True)
    registry = registry_of(
        registration("a", weights_digest="52db", facts=facts),
        registration("b", weights_digest="52db", adapters=("sql",), facts=facts),
        registration("c", model_id="m", page_size=16),
        registration("d", model_id="alpha"),
    )
    registry.connect(registration("e", model_id="zeta"), 9)
    registry.get(WorkerId("e")).is_draining = True
    models = served_models(registry.live_workers(), tenant="acme")
    assert [(m.namespace.model_id, m.namespace.page_size, m.num_workers) for m in models] == [
        ("alpha", 4, 1), ("m", 4, 2), ("m", 16, 1)]
    m4 = models[1]
    assert m4.namespace == NamespaceIdentity(model_id="m", weights_digest="52db", kv_dtype="fp32", page_size=4,
                                             tenant="acme")
    assert m4.facts == facts and m4.adapters == ("sql",)
    assert models[2].facts is None  # a worker that reported none


async def test_route_fails_with_the_reason_when_no_worker_serves_the_namespace():
    registry = registry_of(registration("a", weights_digest="52db", rope_config="{}"))
    router = Router(registry, DirectoryAccess.__new__(DirectoryAccess), PARAMS)
    request = RouteRequest(NamespaceIdentity(**{**SERVED, "weights_digest": ""}), TokenPrefix((1, 2, 3, 4)))
    with pytest.raises(NotFound, match="namespace.weights_digest is ''") as excinfo:
        await router.route(request, caller=None)
    assert excinfo.value.field == "namespace.weights_digest"


def test_registry_lists_live_compatible_workers_only():
    now = [0.0]
    registry = Registry(lease_ttl_s=1.0, clock_s=lambda: now[0])
    for link_id, reg in enumerate([
        registration("ok"),
        registration("lora", adapters=("sql",)),
        registration("other-model", model_id="m2"),
        registration("other-page-size", page_size=8),
        registration("other-dtype", kv_dtype="bf16"),
        registration("gone"),
    ]):
        registry.connect(reg, link_id)
    registry.disconnect(WorkerId("gone"), 5)
    namespace = NamespaceIdentity(model_id="m", page_size=4, tenant="anyone", tokenizer_digest="any")
    assert [e.worker_id for e in registry.candidates(namespace)] == ["lora", "ok"]
    with_adapter = NamespaceIdentity(model_id="m", page_size=4, adapter="sql")
    assert [e.worker_id for e in registry.candidates(with_adapter)] == ["lora"]
    now[0] = 0.9
    registry.heartbeat(WorkerId("ok"), 0, Heartbeat(seq=1, tiers=()))
    registry.heartbeat(WorkerId("lora"), 999, Heartbeat(seq=1, tiers=()))  # a replaced stream: ignored
    now[0] = 1.5  # "lora" last seen at 0, past its 1 s lease
    assert [e.worker_id for e in registry.candidates(namespace)] == ["ok"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_route_without_redis_is_degraded_by_load_and_keeps_affinity():
    client = aredis.Redis.from_url(f"redis://127.0.0.1:{free_port()}", socket_connect_timeout=0.2)
    access = DirectoryAccess(client, controller_id="c", address="c:1", lease_ttl_ms=1000,
                             health=health_aio.HealthServicer())
    try:
        await access.campaign_once()  # fails: nobody listens there
        assert not access.is_reachable and not access.is_leader
        registry = Registry(lease_ttl_s=10.0)
        hbm = TierOccupancy(Tier.HBM, total_pages=100, free_pages=50, cached_pages=0, in_use_pages=50)
        for link_id, (worker, queue_depth) in enumerate([("a", 2), ("b", 0), ("c", 1)]):
            registry.connect(registration(worker), link_id)
            registry.heartbeat(WorkerId(worker), link_id, Heartbeat(1, (hbm,), queue_depth=queue_depth))
        router = Router(registry, access, PARAMS)
        namespace = NamespaceIdentity(model_id="m", page_size=4)
        request = RouteRequest(namespace, TokenPrefix(tuple(range(16))), SessionId("s"))
        decision = await router.route(request, caller=None)
        assert decision.is_degraded and "directory unreachable" in decision.degraded_reason
        assert order(decision.workers) == ["b", "c", "a"]  # least loaded first
        assert registry.affinity(SessionId("s")) == "b"
        registry.heartbeat(WorkerId("b"), 1, Heartbeat(2, (hbm,), queue_depth=3))
        decision = await router.route(request, caller=None)
        assert order(decision.workers) == ["b", "c", "a"] and decision.workers[0].is_affinity
    finally:
        await access.close()
        await client.aclose()
