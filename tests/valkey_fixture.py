"""A real Redis-protocol server for tests: one per session, a clean database per test.

By default one bundled ``valkey-server`` (``kvtier.runtime.embedded_redis``) is started for the whole
session. ``KVTIER_TEST_REDIS_URL=redis://host:port/db`` points the tests at an existing server
instead (e.g. Redis 7); its database is flushed before every test, so never give it one that
holds data you want to keep. ``KVTIER_TEST_REDIS_URL=redis+cluster://host:port,...`` points them at
a Redis Cluster, and ``KVTIER_TEST_REDIS_URL=cluster`` starts one on loopback for the session
(three masters with a replica each, ``loadtests/redis_cluster.py``; skipped without
``redis-server``). Tests take clients from ``connect`` so either kind works.
"""

from __future__ import annotations

import os
import random
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis
from redis.cluster import ClusterNode

from kvtier.controller.redis_connect import RedisClient, cluster_seeds, connect, is_cluster_url
from kvtier.domain.errors import Unavailable
from kvtier.runtime.embedded_redis import EmbeddedRedis
from loadtests.redis_cluster import LocalRedisCluster, find_binaries, missing_reason

ENV_URL = "KVTIER_TEST_REDIS_URL"


def sync_client(url: str) -> redis.Redis | redis.RedisCluster:
    """A synchronous client of ``url`` (one server or a ``redis+cluster://`` cluster)."""
    if not is_cluster_url(url):
        return redis.Redis.from_url(url)
    first, seeds = cluster_seeds(url)
    return redis.RedisCluster.from_url(first, startup_nodes=[ClusterNode(h, p) for h, p in seeds])


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    external = os.environ.get(ENV_URL)
    if external == "cluster":
        if find_binaries() is None:
            pytest.skip(missing_reason())
        with LocalRedisCluster(tmp_path_factory.mktemp("redis-cluster")) as cluster:
            yield cluster.url
        return
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
    client = sync_client(redis_url)
    try:
        client.flushdb()  # on a cluster: every primary
        client.script_flush()
    finally:
        client.close()
    return redis_url


@pytest.fixture
async def redis_client(flushed_redis_url: str) -> AsyncIterator[RedisClient]:
    """An async client (bytes replies) on a freshly flushed database."""
    client = connect(flushed_redis_url)
    try:
        yield client
    finally:
        await client.aclose()


__all__ = ["connect", "flushed_redis_url", "redis_client", "redis_url", "sync_client"]


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
