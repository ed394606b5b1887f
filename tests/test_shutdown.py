"""Stopping a controller or a worker finishes every step even when one fails or the stop is
cancelled (``kvtier.runtime.shutdown.run_steps``): real servers on loopback, a real valkey-server.

A stop that gave up half-way would leave the gRPC server running on a bound port (and a
finalizer would later try to shut it down on a closed event loop)."""

from __future__ import annotations

import asyncio
import logging

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtier.controller.server import serve_controller
from kvtier.engine import Engine
from kvtier.runtime.config import ControllerConfig
from kvtier.runtime.shutdown import run_steps, run_steps_sync
from kvtier.worker.servicer import serve_worker

from hf_checkpoints import build_checkpoint


async def health_code(address: str) -> grpc.StatusCode:
    """OK when ``address`` answers a health check; the call's error code otherwise."""
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
        except grpc.aio.AioRpcError as err:
            return err.code()
    return grpc.StatusCode.OK


async def test_run_steps_runs_every_step_and_raises_the_first_failure(caplog):
    ran = []

    def sync_ok():
        ran.append("sync")

    async def fails(what):
        ran.append(what)
        raise RuntimeError(what)

    async def async_ok():
        await asyncio.sleep(0)
        ran.append("async")

    with caplog.at_level(logging.ERROR), pytest.raises(RuntimeError, match="first"):
        await run_steps([("a", lambda: fails("first")), ("b", sync_ok), ("c", lambda: fails("second")),
                         ("d", async_ok)], log=logging.getLogger("test"), what="the stop")
    assert ran == ["first", "sync", "second", "async"]
    failed = [r.getMessage() for r in caplog.records]
    assert failed == ["the stop: a failed; going on with the rest", "the stop: c failed; going on with the rest"]


def test_run_steps_sync_runs_every_step_and_raises_the_first_failure(caplog):
    ran = []

    def fails(what):
        ran.append(what)
        raise OSError(what)

    with caplog.at_level(logging.ERROR), pytest.raises(OSError, match="link"):
        run_steps_sync([("link", lambda: fails("link")), ("server", lambda: ran.append("server")),
                        ("telemetry", lambda: fails("telemetry"))], log=logging.getLogger("test"), what="shutdown")
    assert ran == ["link", "server", "telemetry"]
    assert len(caplog.records) == 2


async def test_a_cancelled_step_lets_the_rest_run_and_the_stop_ends_cancelled():
    ran = []
    entered = asyncio.Event()

    async def slow():
        entered.set()
        await asyncio.sleep(30)
        ran.append("slow finished")

    async def after():
        await asyncio.sleep(0)
        ran.append("after")

    task = asyncio.create_task(run_steps([("slow", slow), ("after", after)], log=logging.getLogger("test"),
                                         what="the stop"))
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert ran == ["after"]


async def test_a_controller_stop_cancelled_midway_still_stops_serving(flushed_redis_url, tmp_path):
    controller = await serve_controller(ControllerConfig(port=0, state_dir=tmp_path), redis_url=flushed_redis_url)
    assert await health_code(controller.address) is grpc.StatusCode.OK
    stopping = asyncio.create_task(controller.stop(grace_s=0))
    await asyncio.sleep(0)  # the stop is under way: past the health flip, inside the orchestrator's stop
    assert stopping.cancel(), "the stop finished before it could be cancelled; the test proves nothing"
    with pytest.raises(asyncio.CancelledError):
        await stopping
    # The server was stopped all the same: nothing listens on its port any more.
    assert await health_code(controller.address) is grpc.StatusCode.UNAVAILABLE


async def test_a_worker_stop_cancelled_midway_still_stops_the_engine_thread(tmp_path):
    checkpoint = build_checkpoint(tmp_path / "tiny", "llama", seed=0)
    worker = await serve_worker(Engine.from_pretrained(checkpoint, page_size=4, num_pages=32), worker_id="w-stop")
    assert worker.loop.is_alive
    stopping = asyncio.create_task(worker.stop(grace_s=5))
    await asyncio.sleep(0)  # the stop is under way: inside the gRPC server's stop
    assert stopping.cancel(), "the stop finished before it could be cancelled; the test proves nothing"
    with pytest.raises(asyncio.CancelledError):
        await stopping
    assert not worker.loop.is_alive
    assert await health_code(worker.address) is grpc.StatusCode.UNAVAILABLE
