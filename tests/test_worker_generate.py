"""The worker's Generate path over real gRPC on loopback, against the transformers oracle:
streamed greedy tokens, prefix-cache accounting, cancellation and deadlines that leak no
page, and bad input answered with the right status while the server stays healthy."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time

import grpc
import grpc.aio
import pytest
import pytest_asyncio
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvtier.domain.records import GenerateFinal, GenerateRequest, TokenChunk
from kvtier.engine import Engine, FinishReason, SamplingParams, SchedulerConfig
from kvtier.rpc._gen import worker_pb2, worker_pb2_grpc
from kvtier.rpc.convert.limits import MAX_MESSAGE_BYTES
from kvtier.rpc.convert.worker import (
    from_proto_generate_event,
    from_proto_integrity_result,
    from_proto_worker_stats,
    to_proto_generate_request,
)
from kvtier.rpc.status import FIELD_METADATA_KEY
from kvtier.worker.servicer import WORKER_SERVICE, serve_worker

from hf_checkpoints import build_checkpoint, load_hf

pytestmark = pytest.mark.asyncio(loop_scope="module")

PAGE_SIZE = 4
CONTEXT = 512  # max_position_embeddings of the tiny checkpoint
VOCAB = 256
SMALL_POOL_PAGES = 24  # the small worker: at most 24 * 4 - 1 = 95 prompt tokens


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-llama", "llama", seed=0)


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    return load_hf(checkpoint)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def worker(checkpoint):
    engine = Engine.from_pretrained(checkpoint, page_size=PAGE_SIZE, num_pages=256)
    server = await serve_worker(engine, worker_id="w-main")
    yield server
    await server.stop(0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def small_worker(checkpoint):
    """A pool so small that concurrent requests preempt each other (reservation of one page)."""
    engine = Engine.from_pretrained(
        checkpoint,
        page_size=PAGE_SIZE,
        num_pages=SMALL_POOL_PAGES,
        scheduler_config=SchedulerConfig(output_reservation_tokens=4),
    )
    server = await serve_worker(engine, worker_id="w-small")
    yield server
    await server.stop(0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def channels(worker, small_worker):
    opts = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
    main = grpc.aio.insecure_channel(worker.address, options=opts)
    small = grpc.aio.insecure_channel(small_worker.address, options=opts)
    yield {"main": main, "small": small}
    await main.close()
    await small.close()


def stub(channels, which="main"):
    return worker_pb2_grpc.WorkerStub(channels[which])


def random_prompts(n, lens, seed):
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(lens[i % len(lens)])] for i in range(n)]


def request(server, prompt, max_tokens=8, **namespace_changes):
    namespace = dataclasses.replace(server.engine.namespace, **namespace_changes)
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return to_proto_generate_request(
        GenerateRequest(namespace=namespace, prompt_token_ids=tuple(prompt), sampling=sampling)
    )


async def collect(stub_, message, **kwargs):
    """All events of one stream, checking that chunk indices are contiguous."""
    tokens: list[int] = []
    final = None
    async for msg in stub_.Generate(message, **kwargs):
        event = from_proto_generate_event(msg)
        if isinstance(event, TokenChunk):
            assert final is None, "no token may follow the final event"
            assert event.index == len(tokens)
            tokens.extend(event.token_ids)
        else:
            final = event
    assert isinstance(final, GenerateFinal)
    return tokens, final


def hf_greedy(hf_model, prompt, steps):
    out = hf_model.generate(
        torch.tensor([prompt]), max_new_tokens=steps, min_new_tokens=steps, do_sample=False
    )
    return out[0, len(prompt) :].tolist()


async def wait_idle(stub_, timeout_s=10.0):
    """Poll Stats until no page is held and nothing is queued or running."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        stats = from_proto_worker_stats(await stub_.Stats(worker_pb2.StatsRequest()))
        (hbm,) = stats.tiers
        if hbm.in_use_pages == 0 and stats.queue_depth == 0 and stats.num_running_seqs == 0:
            return stats
        assert asyncio.get_running_loop().time() < deadline, f"pages still held: {stats}"
        await asyncio.sleep(0.02)


async def assert_consistent(stub_):
    result = from_proto_integrity_result(
        await stub_.CheckIntegrity(worker_pb2.CheckIntegrityRequest())
    )
    assert {r.component for r in result.reports} >= {"pool", "radix", "engine", "engine_loop"}
    assert result.is_ok, result.problems


async def assert_healthy(channel, server):
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", WORKER_SERVICE):
        response = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert response.status == health_pb2.HealthCheckResponse.SERVING
    tokens, final = await collect(
        worker_pb2_grpc.WorkerStub(channel), request(server, [3, 1, 4, 1, 5], max_tokens=2), timeout=30
    )
    assert len(tokens) == 2 and final.finish_reason is FinishReason.LENGTH


# --------------------------------------------------------------------------- tokens


async def test_streamed_greedy_tokens_equal_transformers(worker, channels, hf_model):
    steps = 24
    prompts = random_prompts(4, lens=(5, 16, 17, 33), seed=1)
    results = await asyncio.gather(
        *(collect(stub(channels), request(worker, p, max_tokens=steps), timeout=60) for p in prompts)
    )
    for prompt, (tokens, final) in zip(prompts, results, strict=True):
        assert tokens == hf_greedy(hf_model, prompt, steps)
        assert final.finish_reason is FinishReason.LENGTH
        usage = final.usage
        assert (usage.prompt_tokens, usage.generated_tokens) == (len(prompt), steps)
        assert usage.recomputed_tokens == 0 and usage.promoted_tokens == 0
        assert len(final.run_id) == 16 and int(final.run_id, 16) >= 0
        assert final.ttft_ms > 0
    assert len({final.run_id for _, final in results}) == len(prompts)
    assert len(set(map(tuple, (t for t, _ in results)))) > 1, "different prompts, different continuations"
    await wait_idle(stub(channels))
    await assert_consistent(stub(channels))


async def test_shared_prefix_reports_cached_full_pages(worker, channels, hf_model):
    base = random_prompts(1, lens=(14,), seed=2)[0]  # 3 full pages of 4 and 2 tokens
    _, first = await collect(stub(channels), request(worker, base, max_tokens=4), timeout=30)
    assert first.usage.cached_tokens == 0
    second_prompt = base[:12] + [7, 8, 9]
    tokens, second = await collect(stub(channels), request(worker, second_prompt, max_tokens=6), timeout=30)
    assert second.usage.cached_tokens == 12
    assert second.usage.cached_tokens_by_tier.hbm_tokens == 12
    assert second.usage.recomputed_tokens == 0
    assert tokens == hf_greedy(hf_model, second_prompt, 6)
    # Another tenant never shares those pages (the tenant is part of the namespace).
    _, other = await collect(
        stub(channels), request(worker, second_prompt, max_tokens=2, tenant="t2"), timeout=30
    )
    assert other.usage.cached_tokens == 0


async def test_preemption_keeps_tokens_and_reports_recomputed(small_worker, channels, hf_model):
    steps = 24
    prompts = random_prompts(8, lens=(6, 11, 9, 14), seed=5)
    results = await asyncio.gather(
        *(
            collect(stub(channels, "small"), request(small_worker, p, max_tokens=steps), timeout=60)
            for p in prompts
        )
    )
    for prompt, (tokens, _) in zip(prompts, results, strict=True):
        assert tokens == hf_greedy(hf_model, prompt, steps)
    assert sum(final.usage.recomputed_tokens for _, final in results) > 0, "the pool must force preemption"
    await wait_idle(stub(channels, "small"))
    await assert_consistent(stub(channels, "small"))


# --------------------------------------------------------------------------- cancellation


def slow_down(monkeypatch, engine, step_s):
    """The tiny model decodes hundreds of tokens per second; slow each step down so that
    cancellations and deadlines reliably fall mid-stream."""
    step = engine.step

    def slow_step(**kwargs):
        time.sleep(step_s)
        return step(**kwargs)

    monkeypatch.setattr(engine, "step", slow_step)


async def test_two_hundred_cancellations_leak_no_page(worker, channels, monkeypatch):
    slow_down(monkeypatch, worker.engine, 0.003)
    num_cancelled = worker.loop.runs.num_cancelled
    rng = random.Random(7)
    prompts = random_prompts(200, lens=(5, 9, 16, 23, 30), seed=7)
    limit = asyncio.Semaphore(16)

    async def open_read_cancel(prompt):
        async with limit:
            call = stub(channels).Generate(request(worker, prompt, max_tokens=200), timeout=60)
            for _ in range(rng.randint(1, 3)):
                event = from_proto_generate_event(await call.read())
                assert isinstance(event, TokenChunk)
            call.cancel()
            assert call.cancelled()

    await asyncio.gather(*(open_read_cancel(p) for p in prompts))
    await wait_idle(stub(channels))
    assert worker.loop.runs.num_cancelled - num_cancelled == len(prompts), "every stream was cut mid-generation"
    await assert_consistent(stub(channels))
    await assert_healthy(channels["main"], worker)


async def test_deadline_mid_stream_is_deadline_exceeded_and_frees_pages(worker, channels, monkeypatch):
    slow_down(monkeypatch, worker.engine, 0.01)
    num_cancelled = worker.loop.runs.num_cancelled
    prompt = random_prompts(1, lens=(8,), seed=9)[0]
    call = stub(channels).Generate(request(worker, prompt, max_tokens=500), timeout=0.5)
    num_tokens = 0
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in call:
            num_tokens += 1
    assert caught.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert 0 < num_tokens < 500, "the deadline must expire mid-stream"
    await wait_idle(stub(channels))
    assert worker.loop.runs.num_cancelled == num_cancelled + 1
    await assert_consistent(stub(channels))


# --------------------------------------------------------------------------- bad input


async def _expect_error(stub_, message, code, field):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await collect(stub_, message, timeout=30)
    err = caught.value
    assert err.code() is code, err.details()
    assert dict(err.trailing_metadata() or ()).get(FIELD_METADATA_KEY) == field
    return err.details()


@pytest.mark.parametrize(
    ("which", "prompt_len", "changes", "code", "field", "says"),
    [
        (
            "main",
            8,
            {"model_id": "llama-other"},
            grpc.StatusCode.NOT_FOUND,
            "namespace.model_id",
            "llama-other",
        ),
        ("main", 8, {"adapter": "lora-1"}, grpc.StatusCode.NOT_FOUND, "namespace.adapter", "lora-1"),
        ("main", 8, {"page_size": 16}, grpc.StatusCode.NOT_FOUND, "namespace.page_size", "4"),
        ("main", 8, {"kv_dtype": "bf16"}, grpc.StatusCode.NOT_FOUND, "namespace.kv_dtype", "fp32"),
        (
            "main",
            8,
            {"weights_digest": "0" * 32},
            grpc.StatusCode.NOT_FOUND,
            "namespace.weights_digest",
            "",
        ),
        ("main", 8, {"rope_config": ""}, grpc.StatusCode.NOT_FOUND, "namespace.rope_config", "ListModels"),
        ("main", CONTEXT + 40, {}, grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids", f"{CONTEXT} tokens"),
        (
            "small",
            120,
            {},
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "prompt_token_ids",
            "at most 95 prompt tokens",
        ),
    ],
    ids=["unknown-model", "unknown-adapter", "page-size", "kv-dtype", "weights", "rope", "context", "never-fits"],
)
async def test_bad_namespace_or_prompt_is_refused_and_server_stays_healthy(
    worker, small_worker, channels, which, prompt_len, changes, code, field, says
):
    server = worker if which == "main" else small_worker
    prompt = random_prompts(1, lens=(prompt_len,), seed=11)[0]
    details = await _expect_error(stub(channels, which), request(server, prompt, **changes), code, field)
    assert says in details
    await assert_healthy(channels[which], server)
    await wait_idle(stub(channels, which))


async def test_namespaces_per_tenant_are_bounded_and_an_invalidation_frees_them(worker, channels, monkeypatch):
    """Every distinct tokenizer digest a caller sends is a namespace the worker keeps state
    for: past the bound a new one is refused (RESOURCE_EXHAUSTED, field ``namespace``) while
    the tenant's known namespaces and other tenants keep working; invalidating the tenant
    frees the places once its pages are reclaimed."""
    import kvtier.engine.engine as engine_module
    from kvtier.domain.records import InvalidationScope

    monkeypatch.setattr(engine_module, "MAX_NAMESPACES_PER_TENANT", 3)
    prompt = [9, 8, 7, 6, 5]
    for i in range(3):
        tokens, _ = await collect(stub(channels), request(worker, prompt, 2, tenant="t-ns", tokenizer_digest=f"tok-{i}"))
        assert len(tokens) == 2
    details = await _expect_error(
        stub(channels), request(worker, prompt, 2, tenant="t-ns", tokenizer_digest="tok-3"),
        grpc.StatusCode.RESOURCE_EXHAUSTED, "namespace")
    assert "tokenizer_digest" in details and "t-ns" in details
    tokens, final = await collect(stub(channels), request(worker, prompt, 2, tenant="t-ns", tokenizer_digest="tok-1"))
    assert len(tokens) == 2 and final.usage.cached_tokens > 0  # a known namespace: served, its pages reused
    await assert_healthy(channels["main"], worker)  # the worker's own tenant is unaffected

    loop = worker.loop
    scope = InvalidationScope(tenant="t-ns")
    epoch = loop.epochs.max_epoch + 1
    loop.epochs.install(scope, epoch)  # as the controller's Invalidate does, then the drop below
    await loop.invalidate(scope, epoch)
    tokens, _ = await collect(stub(channels), request(worker, prompt, 2, tenant="t-ns", tokenizer_digest="tok-3"))
    assert len(tokens) == 2
    await wait_idle(stub(channels))
    await assert_consistent(stub(channels))


@pytest.mark.parametrize(
    ("tokens", "field"),
    [([5, VOCAB + 44, 7], "prompt_token_ids"), ([5, -3, 7], "prompt_token_ids[1]")],
    ids=["above-vocab", "negative"],
)
async def test_token_id_out_of_range_is_invalid_argument(worker, channels, tokens, field):
    message = request(worker, [1, 2, 3])
    del message.prompt_token_ids[:]
    message.prompt_token_ids.extend(tokens)
    details = await _expect_error(stub(channels), message, grpc.StatusCode.INVALID_ARGUMENT, field)
    assert str(VOCAB + 44) in details or "-3" in details
    await assert_healthy(channels["main"], worker)


async def test_reflection_lists_the_worker_and_health_services(channels):
    reflection = reflection_pb2_grpc.ServerReflectionStub(channels["main"])
    request_ = reflection_pb2.ServerReflectionRequest(list_services="")
    responses = [r async for r in reflection.ServerReflectionInfo(iter([request_]))]
    names = {s.name for s in responses[0].list_services_response.service}
    assert {WORKER_SERVICE, "grpc.health.v1.Health"} <= names


async def test_an_engine_bug_fails_streams_and_marks_the_worker_not_serving(checkpoint, caplog):
    engine = Engine.from_pretrained(checkpoint, page_size=PAGE_SIZE, num_pages=32)
    server = await serve_worker(engine, worker_id="w-broken")
    step = engine.step
    num_steps = 0

    def failing_step(**kwargs):
        nonlocal num_steps
        num_steps += 1
        if num_steps == 3:
            raise RuntimeError("kernel fault")
        return step(**kwargs)

    engine.step = failing_step
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub_ = worker_pb2_grpc.WorkerStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await collect(stub_, request(server, [1, 2, 3], max_tokens=20), timeout=30)
            assert caught.value.code() is grpc.StatusCode.UNAVAILABLE
            assert "internal error" in caught.value.details()
            health = health_pb2_grpc.HealthStub(channel)
            for _ in range(100):
                response = await health.Check(health_pb2.HealthCheckRequest(service=WORKER_SERVICE))
                if response.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                    break
                await asyncio.sleep(0.01)
            assert response.status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await collect(stub_, request(server, [1, 2, 3]), timeout=30)
            assert caught.value.code() is grpc.StatusCode.UNAVAILABLE
        assert not server.loop.is_alive
        assert any("kernel fault" in (r.exc_text or str(r.exc_info)) for r in caplog.records if r.exc_info)
    finally:
        await server.stop(0)
