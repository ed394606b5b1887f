"""``kvtier worker-pool`` with auth on a real Ray instance (``kvtier/local/worker_pool.py``,
``kvtier/local/worker_ids.py``): workers take their ids from a tokens directory, read their
token on their node and register with a controller that admits each id only for its token.
The id rules themselves are table tests in ``tests/test_worker_pool.py``."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import ray

from kvtier.client import AsyncClient
from kvtier.controller.server import serve_controller
from kvtier.local.stack import ensure_local_tokens
from kvtier.local.worker_pool import WorkerPool
from kvtier.runtime.config import ControllerConfig, WorkerConfig

from polling import eventually


@pytest.mark.slow
async def test_pool_workers_register_under_auth_with_ids_of_the_tokens_directory(local_ray, tmp_path: Path):
    """Real Ray (the session's one node, two slots), a controller with a token table, workers
    that read their token on their node: a slot takes worker-0, the other has no id (none
    free) and no worker; a restarted pool adopts worker-0; a token added to the directory
    brings the second slot up under worker-1, registered with the controller."""
    auth = ensure_local_tokens(tmp_path / "state", ["worker-0", "worker-1"])
    tokens_dir = tmp_path / "worker-tokens"
    tokens_dir.mkdir()
    (tokens_dir / "worker-0").write_text(auth.worker_token_files["worker-0"].read_text())
    controller = await serve_controller(ControllerConfig(
        port=0, state_dir=tmp_path / "state", lease_ttl_s=3.0, auth_token_file=auth.table_file))
    namespace = f"kvtier-pool-test-{os.getpid()}"
    base = WorkerConfig(controller_address=controller.address, hbm_bytes=8 << 20, dram_bytes=16 << 20,
                        state_dir=tmp_path / "state", auth_tokens_file=auth.table_file)
    pools: list[WorkerPool] = []

    def new_pool() -> WorkerPool:
        pools.append(WorkerPool(base, workers_per_node=2, worker_tokens_dir=tokens_dir, namespace=namespace,
                                heartbeat_interval_s=0.5))
        return pools[-1]

    async def registered() -> list[str]:
        async with AsyncClient(controller.address, token=auth.admin_token) as client:
            return sorted(w.worker_id for w in await client.list_workers())

    try:
        first = new_pool()
        assert await asyncio.to_thread(first.reconcile) == ["worker-0"]
        (waiting,) = first.status().slots_without_id
        assert waiting.index == 1 and list(first.status().workers) == ["worker-0"]
        await eventually(lambda: _equal(registered(), ["worker-0"]), 120, "worker-0 registered")
        actor_id = first.workers["worker-0"].actor._actor_id

        second = new_pool()  # a restarted pool: adopts worker-0 in its slot, still none for the other
        assert await asyncio.to_thread(second.reconcile) == ["worker-0"]
        assert second.workers["worker-0"].actor._actor_id == actor_id
        assert second.workers["worker-0"].slot == first.workers["worker-0"].slot
        assert [s.index for s in second.status().slots_without_id] == [1]

        (tokens_dir / "worker-1").write_text(auth.worker_token_files["worker-1"].read_text())
        assert await asyncio.to_thread(second.reconcile) == ["worker-1"]
        assert second.status().slots_without_id == () and second.workers["worker-1"].slot.index == 1
        await eventually(lambda: _equal(registered(), ["worker-0", "worker-1"]), 120, "both registered")
    finally:
        for pool in pools:
            for worker in pool.workers.values():
                ray.kill(worker.actor, no_restart=True)
        await controller.stop(0)


async def _equal(got, expected) -> bool:
    return await got == expected
