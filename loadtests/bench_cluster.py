"""Three Ray nodes, one worker each: routing with and without peer fetch on a skewed workload.

    python -m loadtests.bench_cluster [--json] [--requests 48] [--concurrency 8] [--prefix-tokens 2048]

A ``ray.cluster_utils.Cluster`` of three nodes on this machine, one worker actor pinned to each
(a random-weight Llama of the built-in tiny shape, 4,096 positions, pages of 16 tokens), a
controller and Valkey in this process. Tenants each have one long hot prefix (a document or a
system prompt of ``--prefix-tokens`` tokens), computed first on node A's worker, which then
holds them all; requests are the hot prefix plus a short question, 80 % to tenant 0. Three
routings, each on fresh namespaces (its own tenant names), same requests:

* (a) ``round_robin``: no directory, workers in turn;
* (b) ``directory``: Route's score ranking (decision 0003): the holder, or recompute elsewhere
  once its queue penalty outweighs the prefix;
* (c) ``peer_fetch``: Route by estimated TTFT (``route_by_ttft``), with the fetch plan.

Per routing: TTFT p50 / p99, tokens/s, recomputed prompt tokens (prompt − cached, summed),
bytes moved between workers, how many requests went where (``picks``: the worker, ``+fetch``
with a fetch plan) and where the slowest ones spent their time (``slowest``: Route, the
worker's own time to first token with any fetch, Route's estimate). Routed requests go
straight to the Route's first pick with its fetch plan. ``fetch_over_prefill_2k``: node B's worker fetching a 2,048-token
prefix from node A's worker (pull, verify, install; pages in A's HBM, host memory on this CPU
machine, as DRAM is) over the prefill of the same prompt on an idle worker.

The machine this runs on is shared and has 2 cores for three workers, the controller and the
clients: every number measures contention as much as kvtier (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

NODES = ("a", "b", "c")
PAGE = 16
OBJECT_STORE_BYTES = 200 << 20


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray
    from ray.cluster_utils import Cluster

    from kvtier.client import AsyncClient
    from kvtier.controller.server import serve_controller
    from kvtier.domain.records import WorkerId
    from kvtier.engine import SamplingParams
    from kvtier.engine.model.loader import TINY_LLAMA_CONFIG, write_random_checkpoint
    from kvtier.runtime.config import ControllerConfig, WorkerConfig
    from kvtier.worker.actor import WorkerActor, actor_options, run_phases

    state = Path(tempfile.mkdtemp(prefix="kvtier-bench-cluster-"))
    checkpoint = state / "tiny-4k"
    write_random_checkpoint(checkpoint, {**TINY_LLAMA_CONFIG, "max_position_embeddings": 4096}, seed=0)
    cluster = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=1, resources={"node_a": 1}, object_store_memory=OBJECT_STORE_BYTES, include_dashboard=False))
    for name in NODES[1:]:
        cluster.add_node(num_cpus=1, resources={f"node_{name}": 1}, object_store_memory=OBJECT_STORE_BYTES)
    ray.init(address=cluster.address)
    cluster.wait_for_nodes()
    controller = await serve_controller(ControllerConfig(port=0, state_dir=state / "controller", lease_ttl_s=30.0,
                                                         heartbeat_interval_s=0.5))
    actors = {}
    try:
        for node in NODES:
            config = WorkerConfig(model=str(checkpoint), device="cpu", page_size=PAGE, hbm_bytes=256 << 20,
                                  controller_address=controller.address, state_dir=state / node)
            options = {**actor_options(config, max_restarts=0, name=f"w{node}"), "resources": {f"node_{node}": 1}}
            actors[node] = ray.remote(**options)(WorkerActor).remote(config, worker_id=f"w{node}",
                                                                      heartbeat_interval_s=0.5)
        addresses = dict(zip(NODES, await asyncio.gather(
            *(asyncio.to_thread(run_phases, a, timeout_s=600) for a in actors.values())), strict=True))
        while not all(controller.registry.get(WorkerId(f"w{n}")) for n in NODES):
            await asyncio.sleep(0.1)
        served = await actors["a"].namespace.remote()
        rng = random.Random(args.seed)
        prefixes = [[rng.randrange(512) for _ in range(args.prefix_tokens)] for _ in range(args.tenants)]
        sampling = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
        report: dict[str, Any] = {"requests": args.requests, "concurrency": args.concurrency,
                                  "prefix_tokens": args.prefix_tokens, "tenants": args.tenants}

        async with AsyncClient(controller.address, timeout_s=300) as client:
            # fetch_over_prefill_2k: a prefill on idle C, then B fetching the same pages from A. Every
            # worker runs one request first: the first forward pass of a process pays its warm-up.
            probe_ns = dataclasses.replace(served, tenant="probe")
            for address in addresses.values():
                await _complete(client, probe_ns, [rng.randrange(512) for _ in range(300)], sampling, address)
            probe = [rng.randrange(512) for _ in range(2049)]
            final = await _complete(client, probe_ns, probe, sampling, addresses["a"])
            cold = await _complete(client, probe_ns, probe, sampling, addresses["c"])
            outcome = await actors["b"].fetch_from_peer.remote(probe_ns, probe, "wa", 60.0)
            report["fetch_2k_ms"] = round(outcome.elapsed_s * 1000, 2)
            report["prefill_2k_ms"] = round(cold.ttft_ms, 2)
            report["fetch_over_prefill_2k"] = round(outcome.elapsed_s * 1000 / cold.ttft_ms, 3)
            report["fetch_2k_bytes"] = outcome.num_bytes
            del final

            for mode in ("round_robin", "directory", "peer_fetch"):
                controller.router.params = dataclasses.replace(controller.router.params,
                                                               rank_by_ttft=mode == "peer_fetch")
                namespaces = [dataclasses.replace(served, tenant=f"{mode}-{t}") for t in range(args.tenants)]
                for ns, prefix in zip(namespaces, prefixes, strict=True):  # the first holder: A
                    await _complete(client, ns, [*prefix, 1], sampling, addresses["a"])
                await asyncio.sleep(1.5)  # page events reach the directory; heartbeats carry the costs
                before = await _moved(actors)
                report[mode] = await _load(client, mode, namespaces, prefixes, sampling, addresses, args)
                report[mode]["bytes_moved"] = await _moved(actors) - before
    finally:
        for actor in actors.values():
            ray.kill(actor, no_restart=True)
        await controller.stop(0)
        ray.shutdown()
        cluster.shutdown()
    report["load_1min"] = os.getloadavg()[0]
    b, c = report["directory"], report["peer_fetch"]
    a = report["round_robin"]
    report["ratios"] = {
        "p99_ttft_c_over_b": round(c["ttft_p99_ms"] / b["ttft_p99_ms"], 3) if b["ttft_p99_ms"] else None,
        "recomputed_c_over_a": round(c["recomputed_tokens"] / a["recomputed_tokens"], 3)
        if a["recomputed_tokens"] else None,
        "fetch_over_prefill_2k": report["fetch_over_prefill_2k"],
    }
    return report


async def _complete(client, namespace, prompt, sampling, worker):  # noqa: ANN001, ANN202
    from kvtier.domain.records import GenerateFinal

    final = None
    async for event in client.generate(namespace, prompt, sampling, worker=worker):
        if isinstance(event, GenerateFinal):
            final = event
    assert final is not None
    return final


async def _moved(actors) -> int:  # noqa: ANN001
    stats = await asyncio.gather(*(a.peer_stats.remote() for a in actors.values()))
    return sum(s["fetched_bytes"] for s in stats)


async def _load(client, mode, namespaces, prefixes, sampling, addresses, args) -> dict[str, Any]:  # noqa: ANN001
    rng = random.Random(args.seed + 1)
    jobs = []
    for _ in range(args.requests):
        t = 0 if rng.random() < 0.8 else rng.randrange(1, args.tenants)
        jobs.append((t, [*prefixes[t], *(rng.randrange(512) for _ in range(32))]))
    order = list(addresses.values())
    queue: asyncio.Queue[tuple[int, int, list[int]]] = asyncio.Queue()
    for i, (t, prompt) in enumerate(jobs):
        queue.put_nowait((i, t, prompt))
    served: list[dict[str, Any]] = []

    async def client_loop() -> None:
        while not queue.empty():
            i, t, prompt = queue.get_nowait()
            started = time.perf_counter()
            if mode == "round_robin":
                pick = {"worker": order[i % len(order)], "fetch": False, "estimated_ms": 0.0}
                plan = None
            else:
                best = (await client.route(namespaces[t], prompt)).workers[0]
                pick = {"worker": best.address, "fetch": best.fetch is not None,
                        "estimated_ms": round(best.estimated_ttft_ms, 1)}
                plan = best.fetch
            routed = time.perf_counter()
            first, final = await _generate(client, namespaces[t], prompt, sampling, pick["worker"], plan)
            served.append({**pick, "ttft_ms": ((first or time.perf_counter()) - started) * 1000,
                           "route_ms": (routed - started) * 1000, "worker_ttft_ms": final.ttft_ms,
                           "recomputed": final.usage.prompt_tokens - final.usage.cached_tokens,
                           "generated": final.usage.generated_tokens})

    started = time.perf_counter()
    await asyncio.gather(*(client_loop() for _ in range(args.concurrency)))
    elapsed = time.perf_counter() - started
    names = {address: f"w{node}" for node, address in addresses.items()}
    ttfts = [r["ttft_ms"] for r in served]
    generated = sum(r["generated"] for r in served)
    return {"ttft_p50_ms": round(statistics.median(ttfts), 2), "ttft_p99_ms": round(percentile(ttfts, 0.99), 2),
            "tokens_per_s": round((generated + sum(len(p) for _, p in jobs)) / elapsed, 1),
            "generated_tokens_per_s": round(generated / elapsed, 1),
            "recomputed_tokens": sum(r["recomputed"] for r in served),
            "picks": _picks(served, names), "slowest": _slowest(served, names)}


async def _generate(client, namespace, prompt, sampling, address, plan):  # noqa: ANN001, ANN202
    """Generate on ``address`` with the Route's fetch plan: the first token's time and the final event."""
    from kvtier.domain.records import GenerateRequest, TokenChunk
    from kvtier.rpc._gen import worker_pb2_grpc
    from kvtier.rpc.convert.worker import from_proto_generate_event, to_proto_generate_request

    request = GenerateRequest(namespace=namespace, prompt_token_ids=tuple(prompt), sampling=sampling,
                              peer_fetch=plan)
    first = final = None
    stub = worker_pb2_grpc.WorkerStub(client._channel(address))
    async for message in stub.Generate(to_proto_generate_request(request), timeout=300):
        event = from_proto_generate_event(message)
        if isinstance(event, TokenChunk):
            first = first or time.perf_counter()
        else:
            final = event
    assert final is not None
    return first, final


def _picks(served: list[dict[str, Any]], names: dict[str, str]) -> dict[str, int]:
    """Requests per pick: the worker, with ``+fetch`` when it fetched from a peer first."""
    picks: dict[str, int] = {}
    for r in served:
        key = names[r["worker"]] + ("+fetch" if r["fetch"] else "")
        picks[key] = picks.get(key, 0) + 1
    return dict(sorted(picks.items()))


def _slowest(served: list[dict[str, Any]], names: dict[str, str], n: int = 4) -> list[dict[str, Any]]:
    """The ``n`` slowest first tokens: where each was sent and where its time went (Route; on the
    worker from arrival to first token, the fetch included; the rest is the network and gRPC)."""
    slow = sorted(served, key=lambda r: r["ttft_ms"], reverse=True)[:n]
    return [{"worker": names[r["worker"]], "fetch": r["fetch"], "estimated_ms": r["estimated_ms"],
             "ttft_ms": round(r["ttft_ms"], 1), "route_ms": round(r["route_ms"], 1),
             "worker_ttft_ms": round(r["worker_ttft_ms"], 1), "recomputed": r["recomputed"]} for r in slow]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prefix-tokens", type=int, default=2048)
    parser.add_argument("--tenants", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    report = asyncio.run(run(args))
    print(json.dumps(report, indent=2) if args.json else "\n".join(f"{k}: {v}" for k, v in report.items()))
    return report


if __name__ == "__main__":
    main()
