"""The Redis directory against Redis itself: lookup latency vs PING, ingest rate, scaling, memory.

    python -m loadtests.bench_directory [--json] [--entries N] [--rounds N] [--busy]

Starts its own valkey-server on loopback (``kvtier.runtime.embedded_redis``) and measures, with one
``redis.asyncio`` client (hiredis) for everything so the baseline is fair:

* PING p50/p99 — the floor any single round trip pays from this client;
* ``lookup`` p50/p99 of 64-page prefixes (full hits, one worker) at 10k and at N entries
  (default 1M), interleaved block by block with PING so machine noise hits both alike; the
  headline ratio is the median over rounds of (lookup p50 / PING p50) of back-to-back blocks,
  printed with its range;
* batched ingest: page events per second through ``apply_events`` (4096-event INSERT batches,
  one batch in flight, Python-side packing included), measured while loading the N entries.
  Each batch alternates with its raw baseline: the same entries written as one HSET of the
  directory's page values (16-byte field, 29-byte value) and one SADD of the keys, pipelined in
  one round trip, its arguments built before the clock starts. The machine's limit for those bytes; the
  ratio (ingest rate / raw rate per back-to-back pair) is printed as a median with its range;
* bytes per (page, holder) entry: ``used_memory`` growth / entries while loading, less what
  the raw baseline's keys hold (``MEMORY USAGE ... SAMPLES 0``).

Targets (issue 5): lookup p50 <= 1.5x PING p50; ingest >= 50k events/s; lookup p50 at 1M
<= 1.2x at 10k; <= 250 bytes per entry. Loops are bounded by count and by time.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable

import redis.asyncio as aredis

from kvtier.controller.directory import Directory
from kvtier.controller.directory_records import Outcome
from kvtier.domain.records import PageEvent, WorkerId
from kvtier.domain.tiers import Tier
from kvtier.runtime.embedded_redis import EmbeddedRedis
from loadtests.busy import add_busy_flag, busy_core

NS = hashlib.blake2b(b"bench-directory", digest_size=16).digest()
DEPTH = 64
BATCH = 4096
WORKER = WorkerId("bench-worker")
TARGETS = {"lookup_p50_over_ping": 1.5, "ingest_events_per_s": 50_000, "lookup_p50_1m_over_10k": 1.2,
           "bytes_per_entry": 250}


def chain_keys(chain_id: int) -> list[bytes]:
    keys, parent = [], NS
    for depth in range(DEPTH):
        parent = hashlib.blake2b(parent + chain_id.to_bytes(8, "little") + bytes([depth]), digest_size=16).digest()
        keys.append(parent)
    return keys


def chain_events(chain_id: int, keys: list[bytes]) -> list[PageEvent]:
    tier = Tier.HBM if chain_id % 4 else Tier.DRAM
    return [PageEvent.insert(NS, k, keys[i - 1] if i else None, i + 1, tier) for i, k in enumerate(keys)]


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def timed_block(op: Callable[[], Awaitable[object]], count: int, max_s: float) -> list[float]:
    samples: list[float] = []
    deadline = time.perf_counter() + max_s
    for _ in range(count):
        start = time.perf_counter()
        await op()
        samples.append(time.perf_counter() - start)
        if start > deadline:
            break
    return samples


def median_range(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


async def ping_vs_lookup(client: aredis.Redis, directory: Directory, queries: list[list[bytes]],
                         rounds: int, per_round: int) -> dict[str, float]:
    """Alternating blocks of PING and lookup; returns p50/p99 in microseconds."""
    pick = random.Random(7)

    async def lookup() -> None:
        result = await directory.lookup(NS, queries[pick.randrange(len(queries))])
        assert result.matched_depth == DEPTH, result

    await timed_block(client.ping, 300, 1.0)  # warm-up (connections, scripts, caches)
    await timed_block(lookup, 300, 1.0)
    pings: list[float] = []
    lookups: list[float] = []
    ratios: list[float] = []
    for _ in range(rounds):
        ping_block = await timed_block(client.ping, per_round, 2.0)
        lookup_block = await timed_block(lookup, per_round, 2.0)
        ratios.append(percentile(lookup_block, 0.5) / percentile(ping_block, 0.5))
        pings += ping_block
        lookups += lookup_block
    us = 1e6
    return {"ping_p50_us": percentile(pings, 0.5) * us, "ping_p99_us": percentile(pings, 0.99) * us,
            "lookup_p50_us": percentile(lookups, 0.5) * us, "lookup_p99_us": percentile(lookups, 0.99) * us,
            "lookup_over_ping_median_of_rounds": statistics.median(ratios),
            "lookup_over_ping_min": min(ratios), "lookup_over_ping_max": max(ratios)}


RAW_HASH, RAW_SET = "bench:raw:pages", "bench:raw:index"
RAW_VALUE = bytes(16) + bytes(13)  # a page value's size: parent key + one holder record


def raw_commands(events: list[PageEvent]) -> tuple[tuple[object, ...], tuple[object, ...]]:
    """The raw baseline of one batch: its entries as one HSET and one SADD (module docstring)."""
    fields: list[object] = []
    for e in events:
        fields += (e.page_key, RAW_VALUE)
    return ("HSET", RAW_HASH, *fields), ("SADD", RAW_SET, *(e.page_key for e in events))


async def raw_write(client: aredis.Redis, commands: tuple[tuple[object, ...], ...]) -> float:
    async with client.pipeline(transaction=False) as pipe:
        for command in commands:
            pipe.execute_command(*command)
        t0 = time.perf_counter()
        await pipe.execute()
        return time.perf_counter() - t0


async def load_chains(directory: Directory, first_chain: int, num_chains: int, seq: list[int],
                      raw: aredis.Redis | None = None) -> tuple[float, float, list[float]]:
    """Inserts chains in 4096-event batches, each followed (or preceded, alternately) by its raw
    baseline when ``raw`` is given. Returns seconds inside apply_events, seconds of the raw
    writes, and (ingest rate / raw rate) per batch."""
    spent = raw_spent = 0.0
    ratios: list[float] = []
    per_batch = BATCH // DEPTH
    for n, start in enumerate(range(first_chain, first_chain + num_chains, per_batch)):
        events: list[PageEvent] = []
        for chain_id in range(start, min(start + per_batch, first_chain + num_chains)):
            events += chain_events(chain_id, chain_keys(chain_id))
        commands = raw_commands(events) if raw is not None else ()
        raw_s = await raw_write(raw, commands) if raw is not None and n % 2 else 0.0
        seq[0] += 1
        t0 = time.perf_counter()
        result = await directory.apply_events(WORKER, seq[0], events)
        apply_s = time.perf_counter() - t0
        assert result.outcome is Outcome.OK and result.num_applied == len(events), result
        if raw is not None and not n % 2:
            raw_s = await raw_write(raw, commands)
        spent += apply_s
        raw_spent += raw_s
        if raw is not None:
            ratios.append(raw_s / apply_s)  # equal batch sizes: rate ratio = time ratio inverted
    return spent, raw_spent, ratios


async def run(num_entries: int, rounds: int, per_round: int) -> dict[str, float | int | bool]:
    wall_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-dir-") as state, EmbeddedRedis(state) as server:
        client = aredis.Redis.from_url(server.url)
        try:
            directory = Directory(client, lease_ttl_ms=3_600_000)
            await directory.load_scripts()
            await directory.register_worker(WORKER)
            seq = [0]
            small_chains = 10_000 // DEPTH + 1
            await load_chains(directory, 0, small_chains, seq)
            queries = [chain_keys(c) for c in range(small_chains)]
            small = await ping_vs_lookup(client, directory, queries, rounds, per_round)

            big_chains = max(num_entries // DEPTH - small_chains, 0)
            mem_before = (await client.info("memory"))["used_memory"]
            load_s, raw_s, ingest_ratios = await load_chains(directory, small_chains, big_chains, seq, raw=client)
            raw_bytes = sum([await client.memory_usage(k, samples=0) or 0 for k in (RAW_HASH, RAW_SET)])
            mem_after = (await client.info("memory"))["used_memory"] - raw_bytes
            await client.unlink(RAW_HASH, RAW_SET)
            stats = await directory.stats(NS)
            num_chains = small_chains + big_chains
            queries = [chain_keys(c) for c in random.Random(3).sample(range(num_chains), min(2000, num_chains))]
            big = await ping_vs_lookup(client, directory, queries, rounds, per_round)
        finally:
            await client.aclose()

    loaded = big_chains * DEPTH
    out: dict[str, float | int | bool] = {
        # Median over rounds of (lookup p50 / PING p50) in back-to-back blocks: robust to drift.
        "lookup_p50_over_ping": small["lookup_over_ping_median_of_rounds"],
        "ingest_events_per_s": loaded / load_s if load_s else 0.0,
        "raw_hset_events_per_s": loaded / raw_s if raw_s else 0.0,
        **{f"ingest_over_raw_{k}": v for k, v in (median_range(ingest_ratios) if ingest_ratios else {}).items()},
        "lookup_p50_1m_over_10k": big["lookup_p50_us"] / small["lookup_p50_us"],
        "bytes_per_entry": (mem_after - mem_before) / loaded if loaded else 0.0,
        "lookup_p50_1m_over_10k_ping_normalized": (big["lookup_p50_us"] / big["ping_p50_us"])
        / (small["lookup_p50_us"] / small["ping_p50_us"]),
        "num_entries": stats.num_entries,
        "num_entries_small": small_chains * DEPTH,
        "prefix_pages": DEPTH,
        "rounds": rounds,
        "num_ingest_batches": len(ingest_ratios),
        "load_seconds": load_s,
        "used_memory_delta_bytes": mem_after - mem_before,
        "wall_seconds": time.perf_counter() - wall_start,
    }
    out |= {f"small_{k}": v for k, v in small.items()} | {f"big_{k}": v for k, v in big.items()}
    for name, limit in TARGETS.items():
        value = float(out[name])
        out[f"{name}_ok"] = value >= limit if name == "ingest_events_per_s" else value <= limit
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--entries", type=int, default=1_000_000, help="directory size for the scaling check")
    parser.add_argument("--rounds", type=int, default=7, help="alternating PING/lookup blocks per size")
    parser.add_argument("--per-round", type=int, default=800, help="operations per block")
    add_busy_flag(parser)
    args = parser.parse_args()
    with busy_core(args.busy):
        result = asyncio.run(run(args.entries, args.rounds, args.per_round))
    result["busy"] = args.busy
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
        return
    r = result
    print(f"PING p50/p99 (10k): {r['small_ping_p50_us']:.1f}/{r['small_ping_p99_us']:.1f} us")
    print(f"lookup {DEPTH} pages p50/p99 at {r['num_entries_small']:,} entries: "
          f"{r['small_lookup_p50_us']:.1f}/{r['small_lookup_p99_us']:.1f} us "
          f"(median per-round ratio {r['lookup_p50_over_ping']:.2f}x PING, range "
          f"{r['small_lookup_over_ping_min']:.2f}-{r['small_lookup_over_ping_max']:.2f} over "
          f"{r['rounds']} rounds; target <= 1.5)")
    print(f"lookup p50/p99 at {r['num_entries']:,} entries: {r['big_lookup_p50_us']:.1f}/"
          f"{r['big_lookup_p99_us']:.1f} us = {r['lookup_p50_1m_over_10k']:.2f}x the 10k p50 "
          f"({r['lookup_p50_1m_over_10k_ping_normalized']:.2f}x PING-normalized; target <= 1.2)")
    print(f"ingest: {r['ingest_events_per_s']:,.0f} page events/s (target >= 50,000); raw HSET+SADD of the "
          f"same entries {r['raw_hset_events_per_s']:,.0f}/s")
    if "ingest_over_raw_median" in r:
        print(f"  ingest / raw per interleaved batch: median {r['ingest_over_raw_median']:.2f}, range "
              f"{r['ingest_over_raw_min']:.2f}-{r['ingest_over_raw_max']:.2f} over {r['num_ingest_batches']} batches")
    print(f"memory: {r['bytes_per_entry']:.0f} bytes per (page, holder) entry (target <= 250)")
    met = [k for k in TARGETS if r[k + "_ok"]]
    print(f"wall time {r['wall_seconds']:.1f} s; targets met: {len(met)}/{len(TARGETS)}")


if __name__ == "__main__":
    main()
