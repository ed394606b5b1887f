"""A real controller on loopback and real WorkerLinks to it, for tests of the controller's
services against in-process workers (``serve_worker``)."""

from __future__ import annotations

import contextlib

from kvtier.client import AsyncClient
from kvtier.controller.server import serve_controller
from kvtier.domain.tiers import Tier
from kvtier.runtime.config import ControllerConfig
from kvtier.worker.link import WorkerLink

from polling import wait_for


@contextlib.asynccontextmanager
async def controller_at(redis_url, tmp_path, orchestrator_params=None, **config):
    config = ControllerConfig(port=0, state_dir=tmp_path, **{"lease_ttl_s": 1.0, "heartbeat_interval_s": 0.5,
                                                             **config})
    server = await serve_controller(config, redis_url=redis_url, orchestrator_params=orchestrator_params)
    try:
        yield server
    finally:
        await server.stop(0)


@contextlib.asynccontextmanager
async def linked(controller, *servers):
    links = [
        WorkerLink(s.loop, controller_address=controller.address, worker_id=s.worker_id, address=s.address,
                   boot_id=s.boot_id, heartbeat_interval_s=0.1, batch_interval_s=0.02, max_backoff_s=0.2,
                   peers=s.servicer.peers)
        for s in servers
    ]
    for link in links:
        link.start()
    try:
        await wait_for(lambda: all(controller.registry.get(s.worker_id) and
                                   controller.registry.is_live(controller.registry.get(s.worker_id))
                                   for s in servers), what="registration")
        await wait_for(lambda: controller.links.counters["snapshots.applied"] >= len(servers),
                       what="connect snapshots")
        yield links
    finally:
        for link in links:
            await link.stop()


@contextlib.asynccontextmanager
async def orchestrated(worker, redis_url, tmp_path, params=None, **config):
    """A controller whose orchestrator runs with ``params``, ``worker`` linked to it, and a
    client: ready once a heartbeat has shown the worker's DRAM tier (sessions can park there)."""
    async with controller_at(redis_url, tmp_path, params, **config) as controller, linked(controller, worker):
        entry = lambda: controller.registry.get(worker.worker_id)  # noqa: E731
        await wait_for(lambda: entry() is not None and any(t.tier is Tier.DRAM for t in entry().tiers),
                       what="registration and a heartbeat with the DRAM tier")
        async with AsyncClient(controller.address) as client:
            yield controller, client
