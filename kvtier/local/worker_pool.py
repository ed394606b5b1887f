"""Workers spread over a Ray cluster's nodes, each pinned to its node.

    plan_slots(nodes, workers_per_node)  ─► one WorkerSlot per (node, local index): one per
                                            GPU on a GPU node, one (or workers_per_node) on a
                                            CPU node; nodes without a CPU to give (a Ray head
                                            started with num-cpus 0) get none
    start_slot_worker(config, slot)      ─► a WorkerActor on exactly that node
                                            (NodeAffinitySchedulingStrategy, not soft)
    WorkerPool.run(stop)                 ─► ``kvtier worker-pool``: keeps one detached, named
                                            actor per slot, adopts the ones a previous pool
                                            left, restarts lost ones, places new nodes' slots

``kvtier up --ray-address`` uses the plan and the start (its workers die with it); the Helm
chart's Ray head runs the pool. A slot's worker listens on ``port + index`` and
``metrics_port + index`` (ports 0 stay 0) and keeps NVMe files in ``nvme_dir/gpu<index>``,
so the workers of one node never collide (``slot_config``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.domain.errors import ConfigError, FailedPrecondition
from kvtier.runtime.config import WorkerConfig, load_config
from kvtier.runtime.log import get_logger

log = get_logger("kvtier.local.worker_pool")

RAY_NAMESPACE = "kvtier"
"""The Ray namespace of the pool's named actors (a restarted pool finds them there)."""


@dataclass(frozen=True, slots=True)
class RayNode:
    node_id: str
    address: str  # the node's IP as Ray reports it
    num_cpus: float
    num_gpus: int


@dataclass(frozen=True, slots=True)
class WorkerSlot:
    """Where one worker runs: a node (None: wherever Ray puts it) and its index there."""

    node_id: str | None
    node_address: str
    index: int
    uses_gpu: bool

    @property
    def worker_id(self) -> str:
        """Stable for the slot: the pool names the actor after it and adopts it by that name."""
        return f"worker-{self.node_id[:12]}-{self.index}" if self.node_id else f"worker-{self.index}"


def ray_nodes(raw: Iterable[dict[str, Any]] | None = None) -> list[RayNode]:
    """The live nodes of the connected Ray cluster (``ray.nodes()``), or of ``raw`` entries."""
    if raw is None:
        import ray

        raw = ray.nodes()
    return [
        RayNode(n["NodeID"], n.get("NodeManagerAddress", ""), float(n.get("Resources", {}).get("CPU", 0)),
                int(n.get("Resources", {}).get("GPU", 0)))
        for n in raw if n.get("Alive")
    ]


def plan_slots(nodes: Iterable[RayNode], *, workers_per_node: int | None = None) -> list[WorkerSlot]:
    """One slot per GPU on GPU nodes, ``workers_per_node`` (default 1) on CPU-only nodes.

    On a GPU node ``workers_per_node`` caps the count (each worker takes a whole GPU). Every
    worker takes one CPU, so a node contributes at most as many slots as it has CPUs. Slots are
    ordered by node address and id, then index, so every pool plans the same list.
    """
    if workers_per_node is not None and workers_per_node < 1:
        raise ConfigError(f"workers_per_node must be >= 1, got {workers_per_node}", field="workers_per_node")
    slots: list[WorkerSlot] = []
    for node in sorted(nodes, key=lambda n: (n.address, n.node_id)):
        if node.num_gpus >= 1:
            count = node.num_gpus if workers_per_node is None else min(workers_per_node, node.num_gpus)
        else:
            count = workers_per_node or 1
        count = min(count, int(node.num_cpus))
        slots += [WorkerSlot(node.node_id, node.address, i, node.num_gpus >= 1) for i in range(count)]
    return slots


def slot_config(config: WorkerConfig, slot: WorkerSlot) -> WorkerConfig:
    """``config`` for the worker in ``slot``: its own ports and NVMe directory, its device."""
    changes: dict[str, Any] = {}
    if config.port:
        changes["port"] = config.port + slot.index
    if config.metrics_port:
        changes["metrics_port"] = config.metrics_port + slot.index
    if config.nvme_dir is not None:
        changes["nvme_dir"] = config.nvme_dir / f"gpu{slot.index}"
    if config.device == "auto":
        changes["device"] = "cuda" if slot.uses_gpu else "cpu"
    return dataclasses.replace(config, **changes) if changes else config


def _node_affinity(slot: WorkerSlot) -> dict[str, Any]:
    if slot.node_id is None:
        return {}
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(slot.node_id, soft=False)}


def start_slot_worker(
    config: WorkerConfig,
    slot: WorkerSlot,
    *,
    name: str | None = None,
    detached: bool = False,
    max_restarts: int = 0,
    heartbeat_interval_s: float = 1.0,
    timeout_s: float = 600.0,
) -> tuple[Any, str]:
    """A ``WorkerActor`` for ``slot`` on its node, through every start-up phase; (actor, address)."""
    import ray

    from kvtier.worker.actor import WorkerActor, actor_options, run_phases

    options = actor_options(config, max_restarts=max_restarts, name=name) | _node_affinity(slot)
    if detached:
        options["lifetime"] = "detached"
    actor = ray.remote(**options)(WorkerActor).remote(
        config, worker_id=slot.worker_id, heartbeat_interval_s=heartbeat_interval_s)
    return actor, run_phases(actor, timeout_s=timeout_s)


def _load_config_here(file: str) -> WorkerConfig:
    """Runs on the slot's node: its mounted file and its container's ``KVTIER_*`` environment."""
    return load_config(WorkerConfig, file=file)


def load_slot_config(file: Path | None, base: WorkerConfig, slot: WorkerSlot, timeout_s: float = 120.0) -> WorkerConfig:
    """The worker configuration as the slot's node sees ``file`` (a task pinned there; without a
    file, ``base``), with the slot's own ports and directories."""
    if file is None:
        return slot_config(base, slot)
    import ray

    task = ray.remote(num_cpus=0, max_retries=0, **_node_affinity(slot))(_load_config_here)
    loaded = ray.get(task.remote(str(file)), timeout=timeout_s)
    return slot_config(loaded, slot)


@dataclass(slots=True)
class PoolWorker:
    slot: WorkerSlot
    actor: Any
    address: str


class WorkerPool:
    """Keeps one detached, named worker actor per planned slot (``kvtier worker-pool``).

    ``reconcile`` is one pass: plan the slots of the live nodes, adopt or start each slot's
    actor, drive a restarted actor through its phases again, and forget slots whose node left.
    Not thread-safe; ``run`` calls it every ``interval_s`` until ``stop`` is set.
    """

    def __init__(
        self,
        base_config: WorkerConfig,
        *,
        config_file: Path | None = None,
        workers_per_node: int | None = None,
        max_restarts: int = 2,
        heartbeat_interval_s: float = 1.0,
    ) -> None:
        self.base_config = base_config
        self.config_file = config_file
        self.workers_per_node = workers_per_node
        self.max_restarts = max_restarts
        self.heartbeat_interval_s = heartbeat_interval_s
        self.workers: dict[str, PoolWorker] = {}

    def reconcile(self) -> list[str]:
        """One pass; returns the worker ids started or adopted in it (started in parallel)."""
        slots = plan_slots(ray_nodes(), workers_per_node=self.workers_per_node)
        planned = {s.worker_id: s for s in slots}
        for worker_id in [w for w in self.workers if w not in planned]:
            log.warning("worker's node left the cluster; forgetting it", extra={"worker_id": worker_id})
            del self.workers[worker_id]
        pending = [slot for worker_id, slot in planned.items()
                   if worker_id not in self.workers or not self._is_healthy(self.workers[worker_id])]
        if not pending:
            return []
        with concurrent.futures.ThreadPoolExecutor(len(pending), thread_name_prefix="kvtier-pool") as threads:
            brought_up = list(threads.map(self._bring_up, pending))
        for worker in brought_up:
            if worker is not None:
                self.workers[worker.slot.worker_id] = worker
        return [w.slot.worker_id for w in brought_up if w is not None]

    def _bring_up(self, slot: WorkerSlot) -> PoolWorker | None:
        """Adopt the slot's named actor (a previous pool's, or one Ray restarted) or start it."""
        import ray

        from kvtier.worker.actor import run_phases

        worker_id = slot.worker_id
        try:
            try:
                actor = ray.get_actor(worker_id, namespace=RAY_NAMESPACE)
            except ValueError:  # no such actor: start one
                config = load_slot_config(self.config_file, self.base_config, slot)
                actor, address = start_slot_worker(
                    config, slot, name=worker_id, detached=True, max_restarts=self.max_restarts,
                    heartbeat_interval_s=self.heartbeat_interval_s)
                log.info("worker started", extra={"worker_id": worker_id, "address": address,
                                                  "node": slot.node_address})
            else:
                address = run_phases(actor)  # idempotent: adopts a running one, restarts a fresh one
                log.info("worker adopted", extra={"worker_id": worker_id, "address": address})
        except Exception as exc:  # a slot that fails to start is retried on the next pass
            log.error("worker did not start; retrying on the next pass",
                      extra={"worker_id": worker_id, "error": str(exc)[:300]})
            return None
        return PoolWorker(slot, actor, address)

    def _is_healthy(self, worker: PoolWorker) -> bool:
        import ray

        from kvtier.worker.actor import call_actor

        try:
            call_actor(worker.actor, "check_health", timeout_s=30.0)
            return True
        except FailedPrecondition:  # Ray restarted the process: it needs its phases again
            return False
        except (ray.exceptions.RayError, TimeoutError) as exc:
            log.warning("worker unreachable", extra={"worker_id": worker.slot.worker_id, "error": str(exc)[:300]})
            return False

    def run(self, stop: threading.Event, *, interval_s: float = 10.0) -> None:
        while not stop.is_set():
            started = time.monotonic()
            try:
                self.reconcile()
            except Exception as exc:  # a bug or a Ray hiccup: keep supervising
                log.error("worker pool pass failed", exc_info=exc)
            stop.wait(max(0.0, interval_s - (time.monotonic() - started)))
