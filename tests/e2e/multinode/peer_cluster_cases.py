"""Peer fetch on a three-node Ray cluster (``ray.cluster_utils.Cluster``: three raylets, three
object stores, on this machine), one worker actor pinned to each node by a node resource, a
real controller and Valkey directory.

Run in its own pytest process by tests/e2e/test_peer_cluster.py (Ray allows one ``ray.init``
per process, and the suite shares one local instance); the name keeps the main run from
collecting it. By hand: ``python -m pytest tests/e2e/multinode/peer_cluster_cases.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from typing import Any

import pytest
import pytest_asyncio
import ray
import torch
from ray.cluster_utils import Cluster

from kvtier.client import AsyncClient
from kvtier.domain.errors import PermissionDenied
from kvtier.domain.hashing import NamespaceIdentity, namespace_digest, page_keys, root_key
from kvtier.domain.records import (
    GenerateFinal,
    GenerateRequest,
    LookupRequest,
    PeerFetch,
    TokenChunk,
    TokenPrefix,
    WorkerId,
)
from kvtier.domain.tiers import Tier
from kvtier.engine import SamplingParams
from kvtier.rpc._gen import worker_pb2, worker_pb2_grpc
from kvtier.rpc.convert.worker import (
    from_proto_generate_event,
    from_proto_integrity_result,
    to_proto_generate_request,
)
from kvtier.rpc.tls import secure_or_insecure_channel
from kvtier.runtime.config import WorkerConfig
from kvtier.worker.actor import WorkerActor, actor_options, run_phases
from kvtier.worker.peer_pages import ExportRequest, verify_group

from hf_checkpoints import build_checkpoint, load_hf
from live_controller import controller_at
from polling import eventually

pytestmark = pytest.mark.asyncio(loop_scope="module")

NODES = ("a", "b", "c")
PAGE = 4
STEPS = 8
OBJECT_STORE_BYTES = 80 << 20  # Ray's floor is 75 MiB
# The holder's exports cross an emulated link of 8 pages/s (2 KiB pages of the tiny checkpoint):
# a 10-page fetch is in flight for over a second, so the holder can be killed in the middle of it.
PAGE_BYTES = 2 * 2 * PAGE * 2 * 16 * 4  # layers × (K, V) × tokens × KV heads × head dim × fp32


def prompt(seed: int, num_tokens: int = 41) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(num_tokens)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-llama", "llama", seed=0)


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    return load_hf(checkpoint)


def oracle(hf_model, tokens: list[int]) -> list[int]:
    out = hf_model.generate(torch.tensor([tokens]), max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False)
    return out[0, len(tokens):].tolist()


@pytest.fixture(scope="module")
def cluster():
    nodes = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=1, resources={"node_a": 1}, object_store_memory=OBJECT_STORE_BYTES, include_dashboard=False))
    for name in NODES[1:]:
        nodes.add_node(num_cpus=1, resources={f"node_{name}": 1}, object_store_memory=OBJECT_STORE_BYTES)
    ray.init(address=nodes.address)
    nodes.wait_for_nodes()
    yield nodes
    ray.shutdown()
    nodes.shutdown()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def controller(redis_url, tmp_path_factory):
    # Long leases: between tests this loop is idle, and no heartbeat is read.
    async with controller_at(redis_url, tmp_path_factory.mktemp("controller"), lease_ttl_s=60.0,
                             heartbeat_interval_s=0.5) as server:
        yield server


@dataclasses.dataclass
class Worker:
    worker_id: str
    actor: Any
    address: str
    config: WorkerConfig


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def workers(cluster, controller, checkpoint, tmp_path_factory):
    started = {}
    for node in NODES:
        worker_id = f"w{node}"
        config = WorkerConfig(model=str(checkpoint), device="cpu", page_size=PAGE, hbm_bytes=128 * PAGE_BYTES,
                              controller_address=controller.address, state_dir=tmp_path_factory.mktemp(worker_id),
                              emulated_peer_link_bytes_per_s=8 * PAGE_BYTES)
        options = {**actor_options(config, max_restarts=1, name=worker_id), "resources": {f"node_{node}": 1}}
        actor = ray.remote(**options)(WorkerActor).remote(config, worker_id=worker_id, heartbeat_interval_s=0.5)
        started[node] = (worker_id, actor, config)
    addresses = await asyncio.gather(*(asyncio.to_thread(run_phases, actor, timeout_s=240)
                                       for _, actor, _ in started.values()))
    result = {node: Worker(worker_id, actor, address, config)
              for (node, (worker_id, actor, config)), address in zip(started.items(), addresses, strict=True)}
    await eventually(lambda: all(controller.registry.get(WorkerId(w.worker_id)) for w in result.values()),
                     timeout_s=60, what="every worker registered")
    yield result
    for w in result.values():
        ray.kill(w.actor, no_restart=True)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(workers) -> NamespaceIdentity:
    """The namespace identity the workers serve (tenant unset)."""
    return await workers["a"].actor.namespace.remote()


async def generate(worker: Worker, namespace, tokens, fetch_from: str | None = None, timeout_s: float = 120):
    request = GenerateRequest(namespace=namespace, prompt_token_ids=tuple(tokens),
                              sampling=SamplingParams(max_tokens=STEPS, ignore_eos=True),
                              peer_fetch=PeerFetch(WorkerId(fetch_from)) if fetch_from else None)
    out: list[int] = []
    final = None
    async with secure_or_insecure_channel(worker.address, None) as channel:
        async for message in worker_pb2_grpc.WorkerStub(channel).Generate(to_proto_generate_request(request),
                                                                         timeout=timeout_s):
            event = from_proto_generate_event(message)
            if isinstance(event, TokenChunk):
                out.extend(event.token_ids)
            else:
                final = event
    assert isinstance(final, GenerateFinal)
    return out, final.usage


async def assert_clean(worker: Worker):
    async with secure_or_insecure_channel(worker.address, None) as channel:
        result = from_proto_integrity_result(
            await worker_pb2_grpc.WorkerStub(channel).CheckIntegrity(worker_pb2.CheckIntegrityRequest(), timeout=30))
    assert result.is_ok, result.problems


def node_of(actor) -> str:
    states = ray._private.state.actors()  # the GCS actor table: where each actor was placed
    return states[actor._actor_id.hex()]["Address"]["NodeID"]


async def holders(controller, namespace, tokens) -> dict[str, int]:
    result = await controller.router.lookup(LookupRequest(namespace, TokenPrefix(tuple(tokens))), None)
    return {m.worker_id: m.matched_tokens.total_tokens for m in result.matches}


async def test_workers_are_pinned_one_per_node(workers):
    assert len({node_of(w.actor) for w in workers.values()}) == 3


async def test_prefix_computed_on_a_is_fetched_by_b_and_the_directory_lists_both(
        workers, controller, served, hf_model):
    a, b = workers["a"], workers["b"]
    namespace, tokens = served, prompt(1)
    expected = oracle(hf_model, tokens)
    assert (await generate(a, namespace, tokens))[0] == expected
    out, usage = await generate(b, namespace, tokens, fetch_from=a.worker_id)
    assert out == expected
    assert usage.cached_tokens >= 40 and usage.recomputed_tokens == 0  # every full page was fetched
    both = await eventually(lambda: _both(controller, namespace, tokens, a, b), timeout_s=30,
                            what="the directory lists both holders")
    assert both == {a.worker_id: 40, b.worker_id: 40}
    await assert_clean(a)
    await assert_clean(b)


async def _both(controller, namespace, tokens, a, b):
    found = await holders(controller, namespace, tokens)
    return found if found.get(a.worker_id) == 40 and found.get(b.worker_id) == 40 else None


async def test_a_flipped_byte_in_a_group_pulled_across_nodes_is_caught(workers, served):
    """The group crosses from node A's object store to this driver (node A's raylet, another
    process); one flipped byte fails exactly that page's check, and the pages before it pass."""
    a = workers["a"]
    namespace, tokens = served, prompt(1)
    digest = _digest(namespace)
    keys = tuple(page_keys(digest, tokens, PAGE))
    group = await a.actor.export_pages.remote(ExportRequest(digest, keys))
    assert group.num_pages == 10 and verify_group(group, keys, root_key(digest)).problem is None
    data = group.data.copy()
    data[6, 77] ^= 0x01
    verified = verify_group(dataclasses.replace(group, data=data), keys, root_key(digest))
    assert verified.num_pages == 6 and "checksum" in (verified.problem or "")


async def test_another_namespaces_pages_are_refused(workers, served):
    a = workers["a"]
    namespace, tokens = served, prompt(1)
    keys = tuple(page_keys(_digest(namespace), tokens, PAGE))
    other = _digest(dataclasses.replace(served, tenant="globex"))
    with pytest.raises(ray.exceptions.RayTaskError) as excinfo:
        await a.actor.export_pages.remote(ExportRequest(other, keys))
    assert isinstance(excinfo.value.cause, PermissionDenied)


async def test_holder_killed_mid_fetch_means_recompute_and_nothing_leaks(workers, controller, served,
                                                                        hf_model):
    a, c = workers["a"], workers["c"]
    namespace, tokens = served, prompt(2)
    expected = oracle(hf_model, tokens)
    assert (await generate(a, namespace, tokens))[0] == expected
    fetching = asyncio.create_task(generate(c, namespace, tokens, fetch_from=a.worker_id, timeout_s=60))
    await asyncio.sleep(0.5)  # the 10-page export takes 1.25 s over the emulated link
    assert not fetching.done()
    ray.kill(a.actor, no_restart=False)  # Ray restarts the process; its cache is gone
    out, usage = await fetching
    assert out == expected and usage.cached_tokens == 0, "computed on c, nothing fetched"
    await assert_clean(c)
    a.address = await asyncio.to_thread(run_phases, a.actor, timeout_s=240)
    await assert_clean(a)


def _digest(namespace):
    return namespace_digest(namespace)


async def test_route_in_the_cluster_ranks_by_estimated_ttft(workers, controller, served):
    """With ``route_by_ttft`` the controller's ranking carries estimates from the rates the
    workers measured and reported on their heartbeats."""
    controller.router.params = dataclasses.replace(controller.router.params, rank_by_ttft=True)
    namespace, tokens = served, prompt(1)
    await eventually(lambda: all((e := controller.registry.get(WorkerId(w.worker_id))) and e.costs
                                 and e.costs.prefill_ms_per_token > 0
                                 for w in (workers["b"], workers["c"])),
                     timeout_s=30, what="measured prefill costs on heartbeats")
    async with AsyncClient(controller.address) as client:
        decision = await client.route(namespace, tokens)
    assert all(w.estimated_ttft_ms > 0 for w in decision.workers)
    assert [w.estimated_ttft_ms for w in decision.workers] == sorted(w.estimated_ttft_ms for w in decision.workers)


async def test_a_drained_workers_pinned_prefix_is_a_hit_on_a_peer_on_another_node(
        workers, controller, served, hf_model):
    """The controller moves the pin's pages from the draining worker to a peer on another node
    (the receiver pulls them through the object store), then the drain empties the worker."""
    b = workers["b"]
    namespace, tokens = served, prompt(3)
    expected = oracle(hf_model, tokens)
    assert (await generate(b, namespace, tokens))[0] == expected
    await eventually(lambda: _held_by(controller, namespace, tokens, {b.worker_id}), timeout_s=30,
                     what="the prefix listed on b")
    async with AsyncClient(controller.address) as client:
        pin = await client.pin(namespace, TokenPrefix(tuple(tokens[:40])), Tier.HBM)
        assert pin.num_pinned_pages == 10
        await client.drain(b.worker_id)
    found = await eventually(lambda: _moved(controller, namespace, tokens, b), timeout_s=120,
                             what="the pinned prefix on a peer and gone from b")
    receiver = next(w for w in workers.values() if w.worker_id in found)
    assert node_of(receiver.actor) != node_of(b.actor)
    out, usage = await generate(receiver, namespace, tokens)
    assert out == expected
    assert usage.cached_tokens >= 40 and usage.recomputed_tokens == 0
    await assert_clean(receiver)
    await assert_clean(b)


async def _held_by(controller, namespace, tokens, workers):
    found = await holders(controller, namespace, tokens)
    return {w for w, n in found.items() if n == 40} == workers


async def _moved(controller, namespace, tokens, drained):
    found = {w for w, n in (await holders(controller, namespace, tokens)).items() if n == 40}
    return found if found and drained.worker_id not in found else None
