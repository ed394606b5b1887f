"""How long the directory is unavailable when a Redis Cluster primary dies.

Each trial starts a fresh cluster (three masters, one replica each, on loopback;
``loadtests/redis_cluster.py``), keeps one Directory client busy with lookups and page events
on a namespace whose primary is then SIGKILLed, and measures from the kill to:

- ``promoted_s``: every surviving node reports the cluster ok with three primaries again;
- ``first_ok_s``: the first directory call on the killed primary's slot that succeeds
  (the client-visible outage; the controller's own Route is degraded for about this long,
  see ``tests/e2e/test_redis_cluster_failover.py``).

Redis Cluster's failover time is dominated by ``cluster-node-timeout`` (a primary is marked
failed after it), plus the replica's election delay (500 ms + up to 500 ms random + rank).

    python -m loadtests.bench_redis_failover --json [--trials 3] [--node-timeout-ms 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from kvtier.controller.directory import Directory
from kvtier.controller.directory_scripts import meta_key
from kvtier.controller.redis_connect import REDIS_ERRORS, connect
from kvtier.domain.hashing import NamespaceIdentity, namespace_digest, page_keys
from kvtier.domain.records import PageEvent, WorkerId
from kvtier.domain.tiers import Tier
from loadtests.redis_cluster import LocalRedisCluster


async def one_trial(root: Path, node_timeout_ms: int) -> dict[str, float]:
    cluster = LocalRedisCluster(root, node_timeout_ms=node_timeout_ms)
    cluster.start()
    client = connect(cluster.url, socket_timeout=1.0, socket_connect_timeout=0.5)
    try:
        directory = Directory(client)
        worker = WorkerId("w")
        await directory.register_worker(worker)
        digest = namespace_digest(NamespaceIdentity(model_id="m", tenant="bench"))
        keys = page_keys(digest, list(range(64)), 4)
        events = [PageEvent.insert(digest, k, keys[i - 1] if i else None, i + 1, Tier.HBM) for i, k in enumerate(keys)]
        await directory.apply_events(worker, 1, events)
        victim = cluster.primary_of(meta_key(digest))
        killed_at = time.monotonic()
        cluster.kill(victim)

        def wait_promoted() -> float:
            cluster.wait_for_failover(60.0)
            return time.monotonic()

        promoted = asyncio.create_task(asyncio.to_thread(wait_promoted))
        num_failed = 0
        while True:
            try:
                await directory.lookup(digest, keys)
                break
            except REDIS_ERRORS:
                num_failed += 1
                await asyncio.sleep(0.01)
        first_ok_s = time.monotonic() - killed_at
        promoted_s = await promoted - killed_at
        return {"promoted_s": round(promoted_s, 3), "first_ok_s": round(first_ok_s, 3),
                "num_failed_calls": num_failed}
    finally:
        await client.aclose()
        cluster.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--node-timeout-ms", type=int, default=1000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    trials = []
    for i in range(args.trials):
        with tempfile.TemporaryDirectory(prefix="kvtier-failover-") as root:
            trials.append(asyncio.run(one_trial(Path(root), args.node_timeout_ms)))
        if not args.json:
            print(f"trial {i + 1}: {trials[-1]}")
    summary = {
        "node_timeout_ms": args.node_timeout_ms,
        "trials": trials,
        "promoted_s_median": statistics.median(t["promoted_s"] for t in trials),
        "first_ok_s_median": statistics.median(t["first_ok_s"] for t in trials),
        "dynamo_valkey_ha_failover_s": 1.8,
    }
    print(json.dumps(summary, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
