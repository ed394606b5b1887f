"""A real Redis-protocol server for tests: one per session, a clean database per test.

By default one bundled ``valkey-server`` (``kvtier.embedded_redis``) is started for the whole
session. ``KVTIER_TEST_REDIS_URL=redis://host:port/db`` points the tests at an existing server
instead (e.g. Redis 7); its database is flushed before every test, so never give it one that
holds data you want to keep.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator

import pytest
import redis
import redis.asyncio as aredis

from kvtier.embedded_redis import EmbeddedRedis

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
