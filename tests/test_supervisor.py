"""`kvtier up`'s supervisor on real Ray actors and a real Valkey: a restarted actor is followed
to its new address, a killed Valkey is started again on its port, and what cannot come back is
reported once, as such.

The actors here are stand-ins for workers (a Ray actor answering ``address()``): the supervisor
sees workers only through Ray's actor table and that one method.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from types import SimpleNamespace

import ray
import redis

from kvtier.local.stack import StackOptions, WorkerHandle
from kvtier.local.supervisor import StackSupervisor
from kvtier.runtime.embedded_redis import EmbeddedRedis


def stand_in_worker(**options):
    """A Ray actor answering ``address()``; defined here so Ray ships it by value (the test
    module is not importable in Ray's worker processes)."""

    class StandInWorker:
        def address(self) -> str:
            return f"127.0.0.1:{os.getpid()}"  # a restarted process answers with another address

        def pid(self) -> int:
            return os.getpid()

    return ray.remote(**options)(StandInWorker).remote()


def stack_of(actors: dict[str, object], *, valkey: EmbeddedRedis | None = None, max_restarts: int = 1):
    handles = [WorkerHandle(worker_id, ray.get(actor.address.remote(), timeout=120), actor)
               for worker_id, actor in actors.items()]
    return SimpleNamespace(workers=handles, options=StackOptions(max_restarts=max_restarts),
                           controller=SimpleNamespace(embedded_redis=valkey), problems={})


async def until_found(supervisor: StackSupervisor, subject: str, timeout_s: float = 120.0, want=lambda f: True):
    deadline = time.monotonic() + timeout_s
    while True:
        findings = [f for f in await supervisor.check_once() if f.subject == subject and want(f)]
        if findings:
            return findings
        assert time.monotonic() < deadline, f"no finding about {subject} within {timeout_s:.0f} s"
        await asyncio.sleep(0.5)


async def test_restarts_are_followed_valkey_is_brought_back_and_the_rest_reported_once(local_ray, tmp_path):
    restartable = stand_in_worker(max_restarts=1, max_task_retries=0)
    mortal = stand_in_worker(max_restarts=0)
    valkey = EmbeddedRedis(tmp_path / "valkey")
    valkey.start()
    stack = stack_of({"w-back": restartable, "w-gone": mortal}, valkey=valkey)
    supervisor = StackSupervisor(stack)
    try:
        assert await supervisor.check_once() == []  # all well: nothing to say
        old_address = stack.workers[0].address

        os.kill(ray.get(restartable.pid.remote()), signal.SIGKILL)
        (back,) = await until_found(supervisor, "w-back")
        assert back.is_recovered and stack.workers[0].address != old_address
        assert stack.workers[0].address in back.message

        ray.kill(mortal, no_restart=True)
        (gone,) = await until_found(supervisor, "w-gone")
        assert not gone.is_recovered and "will not restart it" in gone.message and "kvtier down" in gone.message
        assert [f for f in await supervisor.check_once() if f.subject == "w-gone"] == [], "reported once"

        # Valkey killed: started again on its port, with its password (clients keep their URL).
        url, pid = valkey.url, valkey.pid
        os.kill(pid, signal.SIGKILL)
        await until_found(supervisor, "valkey", want=lambda f: f.is_recovered)
        assert valkey.url == url and valkey.pid != pid
        client = redis.Redis.from_url(url)
        assert client.ping()
        client.close()

        # Killed with its port taken meanwhile: it cannot come back, and says so once.
        port = valkey.port
        os.kill(valkey.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while valkey.is_running:  # reaped, so its port is free for the squatter
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        with socket.socket() as squatter:
            squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            squatter.bind(("127.0.0.1", port))
            squatter.listen()
            (lost,) = await until_found(supervisor, "valkey")
            assert not lost.is_recovered and "did not start again" in lost.message and "kvtier down" in lost.message
            assert [f for f in await supervisor.check_once() if f.subject == "valkey"] == [], "reported once"
    finally:
        valkey.stop()
        for actor in (restartable, mortal):
            ray.kill(actor, no_restart=True)


async def test_run_reports_findings_and_rewrites_the_record(local_ray):
    mortal = stand_in_worker(max_restarts=0)
    stack = stack_of({"w-gone": mortal}, max_restarts=0)
    records = []
    stack.write_record = lambda: records.append(dict((w.worker_id, w.address) for w in stack.workers))
    seen = []
    task = asyncio.create_task(StackSupervisor(stack, interval_s=0.05).run(seen.append))
    try:
        ray.kill(mortal, no_restart=True)
        deadline = time.monotonic() + 120
        while not seen:
            assert time.monotonic() < deadline, "the supervisor reported nothing"
            await asyncio.sleep(0.1)
    finally:
        task.cancel()
    assert [f.subject for f in seen] == ["w-gone"] and records
    assert list(stack.problems) == ["w-gone"] and stack.problems["w-gone"] == seen[0].message
