"""A worker with ``--kv-cache-dtype fp8``: its flags, its HBM sizing in FP8 bytes (scales included),
and Generate over gRPC on loopback against the fake-quantized float oracle."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import grpc
import grpc.aio
import pytest
import pytest_asyncio
import torch
from test_fp8_cache import FakeQuantBackend

from kvtier.domain.errors import ConfigError
from kvtier.domain.geometry import load_geometry
from kvtier.domain.records import GenerateFinal, GenerateRequest, TokenChunk
from kvtier.engine import Engine, SamplingParams
from kvtier.rpc._gen import worker_pb2_grpc
from kvtier.rpc.convert.worker import from_proto_generate_event, to_proto_generate_request
from kvtier.rpc.status import FIELD_METADATA_KEY
from kvtier.runtime.config import WorkerConfig
from kvtier.worker.actor import WorkerActor, worker_args
from kvtier.worker.servicer import serve_worker

from hf_checkpoints import build_checkpoint

ASYNC = pytest.mark.asyncio(loop_scope="module")
PS = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-llama", "llama", seed=0)


@pytest.fixture
def restore_logging():
    """The actor configures process logging (it owns its process); undo that for other tests."""
    root, kvtier_logger = logging.getLogger(), logging.getLogger("kvtier")
    saved = (list(root.handlers), root.level, kvtier_logger.level)
    yield
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    kvtier_logger.setLevel(saved[2])


def test_flags_take_fp8_and_a_lower_tier_dtype() -> None:
    args = worker_args(["--kv-cache-dtype", "fp8", "--lower-tier-dtype", "same"], env={})
    assert args.config.kv_cache_dtype == "fp8" and args.config.lower_tier_dtype == "same"
    with pytest.raises(ConfigError) as caught:
        worker_args(["--lower-tier-dtype", "int4"], env={})
    assert caught.value.field == "lower_tier_dtype" and "--lower-tier-dtype" in caught.value.message


@pytest.mark.parametrize(
    ("kv", "lower", "name"),
    [("fp8", "same", "fp8_e4m3@page-head"), ("fp8_e5m2", "same", "fp8_e5m2@page-head"),
     ("fp32", "fp8", "fp32/fp8_e4m3@page-head")],
)
def test_hbm_and_lower_tiers_are_sized_in_their_exact_page_bytes(
    checkpoint: Path, tmp_path: Path, restore_logging, kv, lower, name
) -> None:
    config = WorkerConfig(
        device="cpu", model=checkpoint, hbm_bytes=1 << 20, dram_bytes=1 << 20, page_size=16,
        kv_cache_dtype=kv, lower_tier_dtype=lower, state_dir=tmp_path,
    )
    actor = WorkerActor(config, worker_id="w-fp8", connect_controller=False)
    actor.init_device()
    actor.load_model()
    pools = actor.allocate_pools()
    geometry = load_geometry(checkpoint)
    fp8_bytes = geometry.page_bytes("fp8", 16)  # the planner's number: codes + fp32 scales
    scales = 4 * geometry.num_layers * 2 * geometry.num_kv_heads
    assert fp8_bytes == geometry.num_layers * 2 * 16 * geometry.num_kv_heads * geometry.head_dim + scales
    hbm_bytes = fp8_bytes if lower == "same" else geometry.page_bytes("fp32", 16)
    assert pools["kv_dtype"] == name and actor.namespace().kv_dtype == name
    assert pools["page_bytes"] == hbm_bytes and pools["num_pages"] == (1 << 20) // hbm_bytes
    assert pools["lower_page_bytes"] == fp8_bytes and pools["dram_pages"] == (1 << 20) // fp8_bytes


def test_fp4_is_refused_at_start_naming_the_field(tmp_path: Path, restore_logging) -> None:
    actor = WorkerActor(WorkerConfig(device="cpu", kv_cache_dtype="fp4", state_dir=tmp_path), connect_controller=False)
    with pytest.raises(ConfigError) as caught:
        actor.init_device()
    assert caught.value.field == "kv_cache_dtype"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fp8_worker(checkpoint):
    engine = Engine.from_pretrained(checkpoint, page_size=PS, num_pages=128, kv_cache_dtype="fp8")
    server = await serve_worker(engine, worker_id="w-fp8")
    channel = grpc.aio.insecure_channel(server.address)
    yield server, worker_pb2_grpc.WorkerStub(channel)
    await channel.close()
    await server.stop(0)


def _request(namespace, prompt, max_tokens):
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return to_proto_generate_request(GenerateRequest(namespace=namespace, prompt_token_ids=tuple(prompt), sampling=sampling))


async def _collect(stub, message):
    tokens, final = [], None
    async for msg in stub.Generate(message):
        event = from_proto_generate_event(msg)
        if isinstance(event, TokenChunk):
            tokens.extend(event.token_ids)
        else:
            final = event
    assert isinstance(final, GenerateFinal)
    return tokens, final


@ASYNC
async def test_generate_through_the_worker_equals_the_fake_quantized_oracle(checkpoint, fp8_worker) -> None:
    server, stub = fp8_worker
    oracle = Engine.from_pretrained(checkpoint, page_size=PS, num_pages=128)
    oracle.backend = oracle.runner.backend = FakeQuantBackend()
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompt = torch.randint(0, 256, (21,), generator=torch.Generator().manual_seed(11)).tolist()
    want = oracle.generate([prompt], params)[0].token_ids
    tokens, final = await _collect(stub, _request(server.engine.namespace, prompt, 12))
    assert tokens == want and final.usage.cached_tokens == 0
    # The same prompt again reads its FP8 pages from the cache and gives the same tokens.
    tokens, final = await _collect(stub, _request(server.engine.namespace, prompt, 12))
    assert tokens == want and final.usage.cached_tokens == 20


@ASYNC
async def test_a_float_namespace_is_not_served_by_an_fp8_worker(fp8_worker) -> None:
    server, stub = fp8_worker
    namespace = dataclasses.replace(server.engine.namespace, kv_dtype="bf16")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _collect(stub, _request(namespace, [1, 2, 3, 4, 5], 2))
    assert caught.value.code() is grpc.StatusCode.NOT_FOUND
    trailers = dict(caught.value.trailing_metadata() or ())
    assert trailers.get(FIELD_METADATA_KEY) == "namespace.kv_dtype"
