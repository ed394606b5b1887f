"""Serving benchmark on the local stack (built-in model): TTFT, TPOT, tokens/s, Route latency.

    python -m loadtests.bench_serving [--json] [--quick] [--busy]

Starts Valkey, Ray, the controller and one worker on loopback (the same code as
``kvtier up``), then for 1, 8 and 32 concurrent sessions runs bounded rounds of
requests through the client. Baseline in the same run: a gRPC health-check round trip
to the controller, against which ``Route`` latency is compared (target <= 1.5x).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtier.client import AsyncClient
from kvtier.domain.params import SamplingParams
from kvtier.domain.records import TokenChunk
from kvtier.local.stack import StackOptions, start_local_stack
from loadtests.busy import add_busy_flag, busy_core


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def _health_vs_route(address: str, client: AsyncClient, namespace, vocab: int, n: int) -> dict:
    channel = grpc.aio.insecure_channel(address)
    stub = health_pb2_grpc.HealthStub(channel)
    prompt = [random.Random(1).randrange(vocab) for _ in range(256)]
    health, route = [], []
    for _ in range(10):  # warm both paths
        await stub.Check(health_pb2.HealthCheckRequest(service=""))
        await client.route(namespace, prompt)
    for _ in range(n):  # interleaved, so load lands on both alike
        t = time.perf_counter()
        await stub.Check(health_pb2.HealthCheckRequest(service=""))
        health.append(time.perf_counter() - t)
        t = time.perf_counter()
        await client.route(namespace, prompt)
        route.append(time.perf_counter() - t)
    await channel.close()
    return {
        "health_p50_ms": statistics.median(health) * 1e3,
        "route_p50_ms": statistics.median(route) * 1e3,
        "route_p99_ms": _pct(route, 0.99) * 1e3,
        "route_p50_over_health_p50": statistics.median(route) / statistics.median(health),
    }


async def _one_request(client: AsyncClient, namespace, prompt: list[int], max_tokens: int) -> tuple[float, float, int]:
    start = time.perf_counter()
    first = last = None
    count = 0
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    async for event in client.generate(namespace, prompt, params):
        if isinstance(event, TokenChunk):
            now = time.perf_counter()
            first = first or now
            last = now
            count += len(event.token_ids)
    assert first is not None and last is not None
    tpot = (last - first) / max(count - 1, 1)
    return first - start, tpot, count


async def _concurrency(client, namespace, vocab: int, sessions: int, rounds: int, max_tokens: int) -> dict:
    rng = random.Random(sessions)
    system = [rng.randrange(vocab) for _ in range(128)]
    ttft, tpot = [], []
    generated = 0
    start = time.perf_counter()
    for _ in range(rounds):
        prompts = [system + [rng.randrange(vocab) for _ in range(32)] for _ in range(sessions)]
        results = await asyncio.gather(*(_one_request(client, namespace, p, max_tokens) for p in prompts))
        for t1, t2, n in results:
            ttft.append(t1)
            tpot.append(t2)
            generated += n
    elapsed = time.perf_counter() - start
    return {
        "sessions": sessions,
        "requests": len(ttft),
        "ttft_ms": {"p50": _pct(ttft, 0.5) * 1e3, "p99": _pct(ttft, 0.99) * 1e3},
        "tpot_ms": {"p50": _pct(tpot, 0.5) * 1e3, "p99": _pct(tpot, 0.99) * 1e3},
        "tokens_per_s": generated / elapsed,
    }


LEVELS = (1, 8, 32)  # concurrent sessions


async def run(quick: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-") as tmp:
        stack = await start_local_stack(StackOptions(state_dir=Path(tmp), num_workers=1))
        try:
            return await measure(stack.controller_address, stack.namespace, stack.vocab_size, quick=quick)
        finally:
            await stack.stop()


async def measure(
    address: str, namespace, vocab: int, *, quick: bool, levels=LEVELS, client: AsyncClient | None = None
) -> dict:
    """The benchmark against a running controller (``kvtier bench`` uses this); ``client``
    carries a token or TLS where the controller needs them. ``vocab`` bounds the token ids."""
    async with client or AsyncClient(address) as client:
        route = await _health_vs_route(address, client, namespace, vocab, 100 if quick else 400)
        results = [
            await _concurrency(
                client, namespace, vocab, n, rounds=2 if quick else 4, max_tokens=16 if quick else 32,
            )
            for n in levels
        ]
    return {
        "route_p50_over_health_p50": route["route_p50_over_health_p50"],
        "ttft_ms": {str(lv["sessions"]): lv["ttft_ms"] for lv in results},
        "tpot_ms": {str(lv["sessions"]): lv["tpot_ms"] for lv in results},
        "tokens_per_s": {str(lv["sessions"]): lv["tokens_per_s"] for lv in results},
        "route": route,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtests.bench_serving", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true")
    add_busy_flag(parser)
    args = parser.parse_args(argv)
    with busy_core(args.busy):
        result = asyncio.run(run(args.quick))
    result["busy"] = args.busy
    if args.json:
        print(json.dumps(result, indent=2))
        return
    r = result["route"]
    print(
        f"Route p50 {r['route_p50_ms']:.3f} ms vs health p50 {r['health_p50_ms']:.3f} ms -> "
        f"{r['route_p50_over_health_p50']:.2f}x (target <= 1.5x)"
    )
    for n in result["ttft_ms"]:
        t, p = result["ttft_ms"][n], result["tpot_ms"][n]
        print(
            f"{n:>2} sessions: TTFT p50 {t['p50']:.1f} p99 {t['p99']:.1f} ms, TPOT p50 {p['p50']:.1f} "
            f"p99 {p['p99']:.1f} ms, {result['tokens_per_s'][n]:.1f} tokens/s"
        )


if __name__ == "__main__":
    main()
