"""Redis clients from a URL: one server, or a Redis Cluster when the scheme says so.

    redis://[user:password@]host:port[/db]          one server (rediss:// with TLS, unix:// a socket)
    redis+cluster://[user:password@]host:port[,host:port...][?options]
                                                     Redis Cluster; every listed node is a seed
    rediss+cluster://...                             Redis Cluster over TLS

A cluster client (``redis.asyncio.RedisCluster``) learns the topology from any reachable seed
and follows slot moves and failovers itself. Every multi-key script and transaction of the
controller stays in one slot: a namespace's keys share the hash tag ``{<namespace hex>}``
(``controller/directory.py``), the controller-wide keys share ``{g}`` (``controller/leader.py``),
and a session's or tool history's transaction touches its one key.

``server_identity`` names the data set a client reads: the server's ``run_id``, or for a
cluster the ``run_id`` of every primary. It changes when a server restarts and when a replica
takes over from a failed primary; replication is asynchronous, so in both cases writes the
controller saw acknowledged may be gone, and ``controller/resync.py`` rebuilds the directory
from the workers' inventories.
"""

from __future__ import annotations

from typing import Any, TypeAlias
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aredis
from redis.asyncio.cluster import ClusterNode
from redis.exceptions import RedisClusterException, RedisError

from kvtier.domain.errors import ConfigError

RedisClient: TypeAlias = "aredis.Redis | aredis.RedisCluster"
"""What the controller's stores take: a client of one server or of a cluster."""

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}

REDIS_ERRORS: tuple[type[BaseException], ...] = (RedisError, RedisClusterException, OSError)
"""What a Redis call raises when the server (or a cluster's slot) is unreachable or slow:
TimeoutError is an OSError; a cluster with a slot no primary serves raises a
``RedisClusterException`` (``SlotNotCoveredError``, ``RedisClusterUnreachableError``)."""


def is_cluster_url(url: str) -> bool:
    return urlsplit(url).scheme in CLUSTER_SCHEMES


def cluster_seeds(url: str) -> tuple[str, list[tuple[str, int]]]:
    """The first seed's plain URL (credentials, TLS and options kept) and every seed's address."""
    parts = urlsplit(url)
    credentials, _, hosts = parts.netloc.rpartition("@")
    seeds: list[tuple[str, int]] = []
    for item in hosts.split(","):
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"Redis Cluster URL {parts.scheme}://...{item}: every seed must be host:port "
                              "(e.g. redis+cluster://10.0.0.1:6379,10.0.0.2:6379)", field="redis_url")
        seeds.append((host.strip("[]"), int(port)))
    if parts.path not in ("", "/", "/0"):
        raise ConfigError(f"Redis Cluster has only database 0; drop {parts.path!r} from the URL", field="redis_url")
    netloc = f"{credentials}@{hosts.split(',')[0]}" if credentials else hosts.split(",")[0]
    return urlunsplit((CLUSTER_SCHEMES[parts.scheme], netloc, "", parts.query, "")), seeds


def connect(url: str, **options: Any) -> RedisClient:
    """A client for ``url``; ``options`` (timeouts, ``retry``) go to the redis-py client.

    Nothing is sent yet: a cluster client reads the topology on its first command."""
    if not is_cluster_url(url):
        return aredis.Redis.from_url(url, **options)
    first, seeds = cluster_seeds(url)
    return aredis.RedisCluster.from_url(first, startup_nodes=[ClusterNode(h, p) for h, p in seeds], **options)


async def server_identity(client: RedisClient) -> str:
    """The ``run_id`` of the server, or the sorted ``run_id``s of a cluster's primaries."""
    if isinstance(client, aredis.RedisCluster):
        infos = await client.info("server", target_nodes=aredis.RedisCluster.PRIMARIES)
        if "run_id" in infos:  # one primary: redis-py answers with its INFO alone
            return str(infos["run_id"])
        return ",".join(sorted(str(info.get("run_id", "")) for info in infos.values()))
    info = await client.info("server")
    return str(info.get("run_id", ""))
