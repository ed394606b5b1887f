"""A real Redis Cluster on loopback for tests and benchmarks: N masters with R replicas each.

Every node is a ``redis-server --cluster-enabled yes`` (Debian's ``/usr/bin/redis-server``, or
``KVTIER_REDIS_CLUSTER_SERVER``) in its own temporary directory, on a free port with an explicit
cluster-bus port (``cluster-port``, Redis 7+); the nodes are joined with
``redis-cli --cluster create ... --cluster-replicas R --cluster-yes``. Nodes die with the
thread that started them (``setpriv --pdeathsig``) and ``stop`` kills whatever is left, so a
crashed run leaves no servers behind.

``url`` is the ``redis+cluster://`` URL kvtier's controller takes (``controller/redis_connect.py``):
every node is a seed.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

ENV_SERVER = "KVTIER_REDIS_CLUSTER_SERVER"
HOST = "127.0.0.1"


def find_binaries() -> tuple[str, str] | None:
    """``(redis-server, redis-cli)``, or None when either is missing (tests skip then)."""
    server = os.environ.get(ENV_SERVER) or shutil.which("redis-server") or "/usr/bin/redis-server"
    cli = shutil.which("redis-cli") or str(Path(server).with_name("redis-cli"))
    if not (os.access(server, os.X_OK) and os.access(cli, os.X_OK)):
        return None
    return server, cli


def missing_reason() -> str:
    return (f"Redis Cluster tests need redis-server and redis-cli (apt-get install redis-server, "
            f"or set {ENV_SERVER}); not found")


def _free_ports(count: int) -> list[int]:
    """Distinct free ports below Linux's ephemeral range, so no outgoing connection takes one."""
    ports: list[int] = []
    for _ in range(2000):
        port = random.randrange(20000, 32000)
        if port in ports:
            continue
        with socket.socket() as sock:
            try:
                sock.bind((HOST, port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == count:
            return ports
    raise RuntimeError(f"no {count} free ports in 20000-32000")


@dataclass
class ClusterNode:
    port: int
    bus_port: int
    state_dir: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def client(self, timeout_s: float = 2.0) -> redis.Redis:
        return redis.Redis(HOST, self.port, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)

    def info(self, section: str) -> dict:
        with self.client() as client:
            return client.info(section)

    def cluster_state(self) -> str:
        with self.client() as client:
            return str(client.cluster("info").get("cluster_state"))

    def ping(self) -> bool:
        with self.client() as client:
            return bool(client.ping())


@dataclass
class LocalRedisCluster:
    """``start`` → ``url`` → ``kill(primary_of(key))`` / ``wait_for_failover`` → ``stop`` (or a context manager)."""

    root: Path
    num_masters: int = 3
    replicas_per_master: int = 1
    node_timeout_ms: int = 2000  # failover tests and benchmarks set their own
    nodes: list[ClusterNode] = field(default_factory=list)

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(n.address for n in self.nodes if n.is_running)

    def start(self, timeout_s: float = 60.0) -> str:
        binaries = find_binaries()
        if binaries is None:
            raise RuntimeError(missing_reason())
        server, cli = binaries
        count = self.num_masters * (1 + self.replicas_per_master)
        ports = _free_ports(2 * count)
        setpriv = shutil.which("setpriv")
        try:
            for i in range(count):
                node = ClusterNode(ports[i], ports[count + i], self.root / f"node-{ports[i]}")
                node.state_dir.mkdir(parents=True, exist_ok=True)
                command = [
                    server, "--port", str(node.port), "--cluster-port", str(node.bus_port), "--bind", HOST,
                    "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", str(self.node_timeout_ms), "--appendonly", "no", "--save", "",
                    "--daemonize", "no", "--dir", str(node.state_dir), "--logfile", "redis.log",
                ]
                node.process = subprocess.Popen(
                    [setpriv, "--pdeathsig", "TERM", *command] if setpriv else command,
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                    cwd=node.state_dir,
                )
                self.nodes.append(node)
            deadline = time.monotonic() + timeout_s
            for node in self.nodes:
                self._wait(node.ping, deadline, f"node {node.address} to answer PING")
            subprocess.run(
                [cli, "--cluster", "create", *(n.address for n in self.nodes),
                 "--cluster-replicas", str(self.replicas_per_master), "--cluster-yes"],
                check=True, capture_output=True, timeout=max(1.0, deadline - time.monotonic()),
            )
            self._wait(self._is_ready, deadline, "the cluster to cover every slot with synced replicas")
        except BaseException:
            self.stop()
            raise
        return self.url

    @staticmethod
    def _wait(check, deadline: float, what: str) -> None:
        error: BaseException | None = None
        while time.monotonic() < deadline:
            try:
                if check():
                    return
            except (redis.RedisError, OSError) as exc:
                error = exc
            time.sleep(0.05)
        raise RuntimeError(f"timed out waiting for {what} ({error})")

    def _is_ready(self) -> bool:
        """Every running node sees state ok and the expected primaries; every replica is in sync."""
        live = [n for n in self.nodes if n.is_running]
        if any(node.cluster_state() != "ok" for node in live):
            return False
        if len(self.primaries()) != self.num_masters:
            return False
        for node in live:
            replication = node.info("replication")
            if replication["role"] == "slave" and replication.get("master_link_status") != "up":
                return False
        return True

    @staticmethod
    def _slot_ranges(node: ClusterNode) -> list[tuple[int, int]]:
        """The slot ranges ``node`` serves as a primary (empty for a replica)."""
        with node.client() as client:
            if client.info("replication")["role"] != "master":
                return []
            lines = client.execute_command("CLUSTER", "NODES").decode().splitlines()
        myself = next(line for line in lines if "myself" in line)
        ranges = []
        for part in myself.split()[8:]:  # slot ranges follow the 8 fixed fields
            lo, _, hi = part.partition("-")
            if lo.isdigit():
                ranges.append((int(lo), int(hi or lo)))
        return ranges

    def primaries(self) -> list[ClusterNode]:
        """Running nodes that serve slots as primaries."""
        return [n for n in self.nodes if n.is_running and self._slot_ranges(n)]

    def primary_of(self, key: str) -> ClusterNode:
        """The running primary serving ``key``'s slot."""
        with self.primaries()[0].client() as client:
            slot = int(client.cluster("keyslot", key))
        for node in self.primaries():
            if any(lo <= slot <= hi for lo, hi in self._slot_ranges(node)):
                return node
        raise RuntimeError(f"no running primary serves slot {slot} of {key}")

    def kill(self, node: ClusterNode) -> None:
        """SIGKILL one node (its data is gone: no persistence)."""
        if node.process is not None and node.process.poll() is None:
            node.process.send_signal(signal.SIGKILL)
            node.process.wait(timeout=10)

    def wait_for_failover(self, timeout_s: float = 30.0) -> None:
        """Until the surviving nodes cover every slot again (a replica has been promoted)."""
        self._wait(self._covers_all_slots, time.monotonic() + timeout_s, "a replica to take over")

    def _covers_all_slots(self) -> bool:
        live = [n for n in self.nodes if n.is_running]
        return (all(n.cluster_state() == "ok" for n in live)
                and len(self.primaries()) == self.num_masters)

    def stop(self) -> None:
        for node in self.nodes:
            if node.process is not None and node.process.poll() is None:
                node.process.send_signal(signal.SIGKILL)
        for node in self.nodes:
            if node.process is not None:
                try:
                    node.process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
        self.nodes = []

    def __enter__(self) -> LocalRedisCluster:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
