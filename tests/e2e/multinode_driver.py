"""Run by ``tests/e2e/test_multinode.py`` in its own process (Ray allows one ``ray.init`` per
process, and the suite shares one local instance): a three-node Ray cluster on this machine
(``ray.cluster_utils.Cluster``: each node its own raylet and object store, told apart by a
custom resource ``node_a``/``node_b``/``node_c``), then

1. ``start_local_stack(ray_address=...)`` as ``kvtier up --ray-address`` runs it: its workers;
2. a ``WorkerPool`` pass against a fresh controller (``kvtier worker-pool``); then a fourth
   node (``node_d``) joins and a second pool adopts the first one's detached workers and
   starts one on the new node.

Prints one JSON line: for each phase, the node (by custom resource) Ray reports each worker
actor on, the workers the controller routes to, and for the second pool what it adopted.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import ray
from ray._private.state import actors as actor_table
from ray.cluster_utils import Cluster

NODE_NAMES = ("node_a", "node_b", "node_c", "node_d")


def node_names() -> dict[str, str]:
    """Ray node id -> the node's custom resource name."""
    return {n["NodeID"]: next(k for k in n["Resources"] if k in NODE_NAMES) for n in ray.nodes() if n["Alive"]}


def placement(actor_ids: list[str]) -> list[str]:
    """The node (by name) Ray's actor table places each actor on, in order."""
    names, table = node_names(), actor_table()
    return [names[table[a]["Address"]["NodeID"]] for a in actor_ids]


async def routable(address: str, namespace, token: str | None = None, expected: int = 3) -> list[str]:
    """The workers Route ranks, once ``expected`` registered (or after 60 s)."""
    from kvtier.client import AsyncClient

    async with AsyncClient(address, token=token) as client:
        for _ in range(600):
            found = sorted(w.worker_id for w in (await client.route(namespace, [0])).workers)
            if len(found) >= expected:
                break
            await asyncio.sleep(0.1)
    return found


async def main(cluster: Cluster, state_dir: Path) -> dict:
    from kvtier.controller.server import serve_controller
    from kvtier.local.stack import StackOptions, start_local_stack
    from kvtier.local.worker_pool import RAY_NAMESPACE, WorkerPool
    from kvtier.runtime.config import ControllerConfig, WorkerConfig
    from kvtier.worker.actor import call_actor

    out: dict = {}
    # `kvtier up --ray-address`: workers spread one per node (no GPUs), pinned by node.
    stack = await start_local_stack(StackOptions(
        state_dir=state_dir / "up", ray_address=cluster.address, auth=True, controller_port=0,
        hbm_bytes=8 << 20, dram_bytes=16 << 20, lease_ttl_s=3.0))
    try:
        out["up"] = {
            "workers": [w.worker_id for w in stack.workers],
            "nodes": placement([w.actor._actor_id.hex() for w in stack.workers]),
            "routable": await routable(stack.controller_address, stack.namespace, stack.admin_token),
        }
    finally:
        await stack.stop()

    # `kvtier worker-pool`: detached workers per node, adopted by a restarted pool.
    controller = await serve_controller(ControllerConfig(port=0, state_dir=state_dir / "pool", lease_ttl_s=3.0))
    try:
        base = WorkerConfig(controller_address=controller.address, hbm_bytes=8 << 20, dram_bytes=16 << 20,
                            state_dir=state_dir / "pool")
        first = WorkerPool(base, heartbeat_interval_s=0.5)
        started = await asyncio.to_thread(first.reconcile)
        ids = [first.workers[w].actor._actor_id.hex() for w in started]
        namespace = await asyncio.to_thread(call_actor, first.workers[started[0]].actor, "namespace")
        out["pool"] = {"workers": started, "nodes": placement(ids),
                       "routable": await routable(controller.address, namespace)}
        # A node joins; a restarted pool adopts the three workers and starts the new node's.
        # (In this thread: Ray's node start sets a signal handler. The loop stalls meanwhile.)
        cluster.add_node(num_cpus=1, resources={"node_d": 1}, object_store_memory=80 << 20)
        second = WorkerPool(base, heartbeat_interval_s=0.5)
        brought_up = await asyncio.to_thread(second.reconcile)
        joined = [w for w in brought_up if w not in started]
        out["pool"]["adopted"] = [w for w in brought_up if w in started]
        out["pool"]["same_actors"] = sorted(second.workers[w].actor._actor_id.hex() for w in started) == sorted(ids)
        out["pool"]["joined_nodes"] = placement([second.workers[w].actor._actor_id.hex() for w in joined])
        for worker in second.workers.values():
            ray.kill(worker.actor)
    finally:
        await controller.stop(0)
    out["ray_namespace"] = RAY_NAMESPACE
    return out


if __name__ == "__main__":
    state = Path(sys.argv[1])
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"node_a": 1}, "object_store_memory": 80 << 20, "include_dashboard": False})
    for name in NODE_NAMES[1:3]:
        cluster.add_node(num_cpus=1, resources={name: 1}, object_store_memory=80 << 20)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="kvtier", log_to_driver=False)
    try:
        result = asyncio.run(main(cluster, state))
    finally:
        ray.shutdown()
        cluster.shutdown()
    print("RESULT " + json.dumps(result), flush=True)
