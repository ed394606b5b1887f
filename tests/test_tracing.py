"""Spans (kvtier.runtime.tracing) from a real worker and a real controller, into an in-memory exporter:
``generate`` with its admission / promote / prefill / decode children, ``transfer`` per job,
``route`` in the controller; the run id is the final event's; a caller's ``traceparent``
parents them; no attribute carries token ids; nothing is recorded with tracing off; and
an OTLP endpoint without the exporter package stops start-up naming the setting."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging

import grpc.aio
import pytest
import pytest_asyncio
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvtier.client import AsyncClient
from kvtier.controller.server import serve_controller
from kvtier.domain.errors import ConfigError, Unavailable
from kvtier.domain.records import GenerateFinal, GenerateRequest, RouteRequest, TokenPrefix
from kvtier.domain.tiers import Tier
from kvtier.engine import Engine, SamplingParams
from kvtier.engine.model.loader import TINY_LLAMA_CONFIG, write_random_checkpoint
from kvtier.rpc._gen import router_pb2_grpc, worker_pb2_grpc
from kvtier.rpc.convert.router import to_proto_route_request
from kvtier.rpc.convert.worker import from_proto_generate_event, to_proto_generate_request
from kvtier.runtime import tracing
from kvtier.runtime.config import ControllerConfig
from kvtier.runtime.telemetry import Telemetry
from kvtier.tiers.manager import TierConfig
from kvtier.worker.link import WorkerLink
from kvtier.worker.servicer import serve_worker

in_module_loop = pytest.mark.asyncio(loop_scope="module")

PAGE_SIZE = 4
PROMPT = [211, 7, 93, 140, 58, 17, 222, 101, 66, 180, 35, 249, 12, 171]  # 3 full pages + 2
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = (("traceparent", f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"),)
PHASES = ("admission", "promote", "prefill", "decode")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", TINY_LLAMA_CONFIG, seed=0)


@pytest.fixture
def restore_logging():
    """The controller's main configures process logging; undo that for other tests."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    kvtier_level = logging.getLogger("kvtier").level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    logging.getLogger("kvtier").setLevel(kvtier_level)


@pytest.fixture(scope="module")
def spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider)
    yield exporter
    tracing.install(None)
    provider.shutdown()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def worker(checkpoint, spans):
    engine = Engine.from_pretrained(
        checkpoint, page_size=PAGE_SIZE, num_pages=64, tier_config=TierConfig(dram_pages=64)
    )
    server = await serve_worker(engine, worker_id="w-trace")
    yield server
    await server.stop(0)


async def complete(server, prompt, *, metadata=None) -> tuple[list[int], GenerateFinal]:
    """Generate over the worker's real gRPC stream, with optional call metadata."""
    request = GenerateRequest(
        namespace=server.engine.namespace, prompt_token_ids=tuple(prompt),
        sampling=SamplingParams(max_tokens=4, ignore_eos=True),
    )
    tokens: list[int] = []
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        async for msg in stub.Generate(to_proto_generate_request(request), metadata=metadata):
            event = from_proto_generate_event(msg)
            if isinstance(event, GenerateFinal):
                return tokens, event
            tokens.extend(event.token_ids)
    raise AssertionError("the stream ended without a final event")


def of_run(exporter: InMemorySpanExporter, run_id: str) -> dict[str, ReadableSpan]:
    found = [s for s in exporter.get_finished_spans() if (s.attributes or {}).get(tracing.RUN_ID) == run_id]
    by_name = {s.name: s for s in found}
    assert len(by_name) == len(found), f"a span name repeats for run {run_id}: {[s.name for s in found]}"
    return by_name


def assert_no_token_ids(span_list, *token_lists) -> None:
    for span in span_list:
        for key, value in (span.attributes or {}).items():
            # Scalars only: a token list cannot hide in a sequence attribute.
            assert isinstance(value, str | int | float | bool), f"{span.name}.{key} is a sequence"
            for tokens in token_lists:
                for rendering in (str(tokens), " ".join(map(str, tokens)), ",".join(map(str, tokens))):
                    assert rendering not in str(value), f"{span.name}.{key} carries token ids"


@in_module_loop
async def test_a_generation_has_phase_spans_under_generate_with_the_final_run_id(worker, spans):
    spans.clear()
    first_tokens, first = await complete(worker, PROMPT)
    # Demote the cached pages, then hit them: the second request promotes from DRAM.
    await worker.loop.call(lambda: worker.engine.tiers.demote_all(Tier.DRAM))
    tokens, final = await complete(worker, PROMPT[:12] + [3, 4])
    assert final.usage.promoted_tokens == 12 and first.run_id != final.run_id

    cold, warm = of_run(spans, first.run_id), of_run(spans, final.run_id)
    assert set(cold) == {"generate", "admission", "prefill", "decode"}  # nothing to promote
    assert set(warm) == {"generate", *PHASES}
    for run in (cold, warm):
        root = run["generate"]
        assert root.parent is None and root.attributes["kvtier.worker_id"] == "w-trace"
        assert root.attributes["kvtier.finish_reason"] == "length"
        assert root.attributes["kvtier.prompt_tokens"] == 14 and root.attributes["kvtier.generated_tokens"] == 4
        phases = [run[name] for name in PHASES if name in run]
        for span in phases:
            assert span.parent.span_id == root.context.span_id
            assert span.context.trace_id == root.context.trace_id
        # The phases tile the request in order: admission starts it, decode ends it.
        assert phases[0].start_time == root.start_time and phases[-1].end_time == root.end_time
        for before, after in zip(phases, phases[1:], strict=False):
            assert before.end_time == after.start_time
    assert warm["admission"].attributes["kvtier.cached_tokens"] == 12
    assert warm["promote"].attributes["kvtier.promoted_tokens"] == 12
    assert warm["promote"].attributes["kvtier.dram_tokens"] == 12
    assert warm["prefill"].attributes["kvtier.computed_prompt_tokens"] == 2

    # Every copy is a transfer job: demote_all's synchronous moves down (HBM -> DRAM), then the
    # promotion, one job of 3 pages.
    transfers = [s for s in spans.get_finished_spans() if s.name == "transfer"]
    ups = [s for s in transfers if s.attributes["kvtier.dst_tier"] == "hbm"]
    assert len(ups) == 1 and len(transfers) > 1
    assert all((s.attributes["kvtier.src_tier"], s.attributes["kvtier.dst_tier"]) == ("hbm", "dram")
               for s in transfers if s not in ups)
    promotion = ups[0]
    assert (promotion.attributes["kvtier.src_tier"], promotion.attributes["kvtier.dst_tier"]) == ("dram", "hbm")
    assert promotion.attributes["kvtier.reason"] == "promotion_on_hit"
    assert promotion.attributes["kvtier.num_pages"] == 3 and promotion.attributes["kvtier.status"] == "ok"
    assert promotion.attributes["kvtier.num_bytes"] == 3 * worker.engine.geometry.page_bytes
    assert all(tracing.RUN_ID not in s.attributes for s in transfers)  # a job, not a request
    assert_no_token_ids(spans.get_finished_spans(), PROMPT, first_tokens, tokens)


@in_module_loop
async def test_a_cancelled_generation_ends_its_spans(worker, spans):
    spans.clear()
    request = GenerateRequest(
        namespace=worker.engine.namespace, prompt_token_ids=(5, 6, 7, 8, 9),
        sampling=SamplingParams(max_tokens=200, ignore_eos=True),
    )
    async with contextlib.aclosing(worker.loop.submit(request)) as events:
        await anext(events)  # the first token: prefill done, decode under way
    roots = []
    for _ in range(200):  # the abort is posted to the engine thread; wait for its spans
        roots = [s for s in spans.get_finished_spans() if s.name == "generate"]
        if roots:
            break
        await asyncio.sleep(0.01)
    assert len(roots) == 1 and roots[0].attributes["kvtier.finish_reason"] == "aborted"
    run = of_run(spans, roots[0].attributes[tracing.RUN_ID])
    assert set(run) == {"generate", "admission", "prefill", "decode"}


@in_module_loop
async def test_a_callers_traceparent_parents_generate_and_route(worker, spans, flushed_redis_url, tmp_path):
    spans.clear()
    _, final = await complete(worker, PROMPT, metadata=TRACEPARENT)
    root = of_run(spans, final.run_id)["generate"]
    assert format(root.context.trace_id, "032x") == TRACE_ID
    assert format(root.parent.span_id, "016x") == PARENT_SPAN_ID and root.parent.is_remote

    config = ControllerConfig(port=0, state_dir=tmp_path, lease_ttl_s=1.0, heartbeat_interval_s=0.5)
    controller = await serve_controller(config, redis_url=flushed_redis_url)
    link = WorkerLink(worker.loop, controller_address=controller.address, worker_id=worker.worker_id,
                      address=worker.address, boot_id=worker.boot_id, heartbeat_interval_s=0.1,
                      batch_interval_s=0.02, max_backoff_s=0.2)
    link.start()
    try:
        async with AsyncClient(controller.address) as client:
            for _ in range(500):
                with contextlib.suppress(Unavailable):  # no live worker until its registration is read
                    decision = await client.route(worker.engine.namespace, PROMPT)
                    if decision.workers:
                        break
                await asyncio.sleep(0.02)
            assert [w.worker_id for w in decision.workers] == ["w-trace"]
        request = RouteRequest(namespace=worker.engine.namespace, prefix=TokenPrefix(tuple(PROMPT)),
                               session_id="s-42")
        async with grpc.aio.insecure_channel(controller.address) as channel:
            await router_pb2_grpc.RouterStub(channel).Route(
                to_proto_route_request(request), metadata=TRACEPARENT)
    finally:
        await link.stop()
        await controller.stop(0)
    routes = [s for s in spans.get_finished_spans() if s.name == "route"]
    assert routes and all(s.attributes["kvtier.namespace.model_id"] == worker.engine.namespace.model_id
                          for s in routes)
    assert routes[-2].parent is None and routes[-2].attributes["kvtier.num_workers"] == 1
    traced = routes[-1]
    assert format(traced.context.trace_id, "032x") == TRACE_ID == format(root.context.trace_id, "032x")
    assert traced.attributes["kvtier.session_id"] == "s-42"
    assert traced.attributes["kvtier.worker_id"] == "w-trace" and traced.attributes["kvtier.degraded"] is False
    assert_no_token_ids(routes, PROMPT)


@in_module_loop
async def test_nothing_is_recorded_with_tracing_off(worker, spans):
    spans.clear()
    tracing.install(None)
    try:
        assert not tracing.is_enabled()
        _, final = await complete(worker, [9, 8, 7, 6, 5], metadata=TRACEPARENT)
        assert final.run_id
    finally:
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(spans))
        tracing.install(provider)
    assert spans.get_finished_spans() == ()


@pytest.mark.skipif(importlib.util.find_spec("opentelemetry.exporter.otlp") is not None,
                    reason="the OTLP exporter is installed")
def test_an_otlp_endpoint_without_the_exporter_package_stops_start_up(tmp_path, restore_logging, capsys):
    from kvtier.controller.__main__ import main as controller_main

    with pytest.raises(ConfigError) as caught:
        tracing.setup_process("kvtier-test", otlp_endpoint="http://127.0.0.1:4317")
    assert caught.value.field == "otlp_endpoint" and "kvtier[otlp]" in caught.value.message
    assert tracing.otlp_endpoint() is None  # nothing half set up
    with pytest.raises(ConfigError, match="otlp_endpoint"):
        Telemetry("kvtier-test", otlp_endpoint="http://127.0.0.1:4317")
    code = controller_main(["--port", "0", "--state-dir", str(tmp_path), "--otlp-endpoint", "http://127.0.0.1:4317"])
    err = capsys.readouterr().err
    assert code == 2 and "otlp_endpoint" in err and "kvtier[otlp]" in err and "Traceback" not in err
