"""The router's shell (controller/router.py): prefix page keys, the registry's compatibility rule
and the degraded path when Redis cannot be reached (a client aimed at a closed port). The score's
arithmetic is tested in tests/test_policy_routing.py."""

from __future__ import annotations

import socket

import pytest
import redis.asyncio as aredis
from grpc_health.v1.health import aio as health_aio

from kvtier.controller.registry import Registry
from kvtier.controller.resync import DirectoryAccess
from kvtier.controller.router import Router, prefix_page_keys, served_models, unserved_reason
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
    WorkerId,
)
from kvtier.domain.tiers import Tier
from kvtier.policy.routing import RouterParams

PARAMS = RouterParams()


def order(ranked) -> list[str]:
    return [r.worker_id for r in ranked]

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
        assert registry.affinity(("", SessionId("s"))) == "b"
        registry.heartbeat(WorkerId("b"), 1, Heartbeat(2, (hbm,), queue_depth=3))
        decision = await router.route(request, caller=None)
        assert order(decision.workers) == ["b", "c", "a"] and decision.workers[0].is_affinity
    finally:
        await access.close()
        await client.aclose()
