"""A real Redis-protocol server for tests: one per session, a clean database per test.

By default one bundled ``valkey-server`` (``kvtier.runtime.embedded_redis``) is started for the whole
session. ``KVTIER_TEST_REDIS_URL=redis://host:port/db`` points the tests at an existing server
instead (e.g. Redis 7); its database is flushed before every test, so never give it one that
holds data you want to keep.
"""

from __future__ import annotations

import os
import random
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio as aredis

from kvtier.domain.errors import Unavailable
from kvtier.runtime.embedded_redis import EmbeddedRedis

ENV_URL = "KVTIER_TEST_REDIS_URL"


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    external = os.environ.get(ENV_URL)
    if external:
        yield external
        return
    server = EmbeddedRedis(tmp_path_factory.mktemp("valkey"))
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def flushed_redis_url(redis_url: str) -> str:
    """The session server's URL after FLUSHDB (and SCRIPT FLUSH, so NOSCRIPT paths get exercised)."""
    client = redis.Redis.from_url(redis_url)
    try:
        client.flushdb()
        client.script_flush()
    finally:
        client.close()
    return redis_url


@pytest.fixture
async def redis_client(flushed_redis_url: str) -> AsyncIterator[aredis.Redis]:
    """An async client (bytes replies) on a freshly flushed database."""
    client = aredis.Redis.from_url(flushed_redis_url)
    try:
        yield client
    finally:
        await client.aclose()


__all__ = ["flushed_redis_url", "redis_client", "redis_url"]


# -- a server a test stops and restarts itself -----------------------------------------------


def free_port() -> int:
    """A free port below Linux's ephemeral range (32768-60999), so no outgoing connection and no
    port-0 bind can take it while the test restarts a server on it (nor connect to itself there)."""
    for _ in range(200):
        port = random.randrange(20000, 32000)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError("no free port in 20000-32000")


def start_valkey(state_dir: Path, port: int) -> EmbeddedRedis:
    """Start valkey on ``port`` (again). EmbeddedRedis forks with a ``preexec_fn``, which now and
    then crashes the child (SIGSEGV before exec) in a process with many threads: try thrice."""
    for attempt in range(3):
        server = EmbeddedRedis(state_dir, port=port)
        try:
            server.start()
            return server
        except Unavailable:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")
