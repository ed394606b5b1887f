"""Workers spread over a Ray cluster's nodes, each pinned to its node.

    plan_slots(nodes, workers_per_node)  ─► one WorkerSlot per (node, local index): one per
                                            GPU on a GPU node, one (or workers_per_node) on a
                                            CPU node; nodes without a CPU to give (a Ray head
                                            started with num-cpus 0) get none
    start_slot_worker(config, slot)      ─► a WorkerActor on exactly that node
                                            (NodeAffinitySchedulingStrategy, not soft)
    WorkerPool.run(stop)                 ─► ``kvtier worker-pool``: keeps one detached, named
                                            actor per slot, adopts the ones a previous pool
                                            left, restarts lost ones, places new nodes' slots;
                                            with a tokens directory, ids come from it
                                            (``kvtier.local.worker_ids``)

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
from kvtier.local.worker_ids import SlotClaims, SlotKey, assign_worker_ids, list_worker_ids, unclaimed
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
        """Stable for the slot: the id of its worker unless the ids come from a tokens directory
        (``kvtier.local.worker_ids``); the actor is named after the id and adopted by it."""
        return f"worker-{self.node_id[:12]}-{self.index}" if self.node_id else f"worker-{self.index}"

    @property
    def key(self) -> SlotKey:
        return (self.node_id or "", self.index)


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
    worker_id: str | None = None,
    name: str | None = None,
    detached: bool = False,
    namespace: str | None = None,
    max_restarts: int = 0,
    heartbeat_interval_s: float = 1.0,
    timeout_s: float = 600.0,
) -> tuple[Any, str]:
    """A ``WorkerActor`` for ``slot`` on its node (its id ``worker_id``, default the slot's),
    through every start-up phase; (actor, address)."""
    import ray

    from kvtier.worker.actor import WorkerActor, actor_options, run_phases

    options = actor_options(config, max_restarts=max_restarts, name=name) | _node_affinity(slot)
    if detached:
        options["lifetime"] = "detached"
    if namespace is not None:
        options["namespace"] = namespace
    actor = ray.remote(**options)(WorkerActor).remote(
        config, worker_id=worker_id or slot.worker_id, heartbeat_interval_s=heartbeat_interval_s)
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


def _list_worker_ids_here(directory: str) -> list[str]:
    """Runs on a worker node, where the tokens directory is mounted."""
    return list_worker_ids(Path(directory))


def list_slot_worker_ids(directory: Path, slot: WorkerSlot, timeout_s: float = 120.0) -> list[str]:
    """The worker ids ``directory`` holds as ``slot``'s node sees it (a task pinned there)."""
    import ray

    task = ray.remote(num_cpus=0, max_retries=0, **_node_affinity(slot))(_list_worker_ids_here)
    return ray.get(task.remote(str(directory)), timeout=timeout_s)


@dataclass(slots=True)
class PoolWorker:
    worker_id: str
    slot: WorkerSlot
    actor: Any
    address: str


@dataclass(frozen=True, slots=True)
class PoolStatus:
    workers: dict[str, str]  # worker id -> address, the workers running after the last pass
    slots_without_id: tuple[WorkerSlot, ...]  # planned slots with no free worker id: no worker


class WorkerPool:
    """Keeps one detached, named worker actor per planned slot (``kvtier worker-pool``).

    ``reconcile`` is one pass: plan the slots of the live nodes, give each its worker id, adopt
    or start each slot's actor (named after the id), drive a restarted actor through its phases
    again, and forget slots whose node left. Without ``worker_tokens_dir`` a slot's id is its own
    (``WorkerSlot.worker_id``); with it, ids are the file names of that directory on the worker
    nodes, handed out by ``kvtier.local.worker_ids`` (claims kept in the Ray cluster), and each
    worker's ``auth_token_file`` is ``worker_tokens_dir/<id>``, read on its node: the pool itself
    never reads a token. Not thread-safe; ``run`` calls ``reconcile`` every ``interval_s``
    until ``stop`` is set.
    """

    def __init__(
        self,
        base_config: WorkerConfig,
        *,
        config_file: Path | None = None,
        workers_per_node: int | None = None,
        worker_tokens_dir: Path | None = None,
        namespace: str = RAY_NAMESPACE,
        max_restarts: int = 2,
        heartbeat_interval_s: float = 1.0,
    ) -> None:
        self.base_config = base_config
        self.config_file = config_file
        self.workers_per_node = workers_per_node
        self.worker_tokens_dir = worker_tokens_dir
        self.namespace = namespace
        self.max_restarts = max_restarts
        self.heartbeat_interval_s = heartbeat_interval_s
        self.workers: dict[str, PoolWorker] = {}
        self.slots_without_id: tuple[WorkerSlot, ...] = ()
        self._without_id_reason = ""
        self._claims = SlotClaims(namespace)

    def status(self) -> PoolStatus:
        return PoolStatus({w.worker_id: w.address for w in self.workers.values()}, self.slots_without_id)

    def reconcile(self) -> list[str]:
        """One pass; returns the worker ids started or adopted in it (started in parallel)."""
        slots = plan_slots(ray_nodes(), workers_per_node=self.workers_per_node)
        planned = self._worker_ids(slots)
        for worker_id in [w for w, worker in self.workers.items() if planned.get(worker.slot) != w]:
            log.warning("worker's node left the cluster; forgetting it", extra={"worker_id": worker_id})
            del self.workers[worker_id]
        pending = [(slot, worker_id) for slot, worker_id in planned.items()
                   if worker_id not in self.workers or not self._is_healthy(self.workers[worker_id])]
        if not pending:
            return []
        with concurrent.futures.ThreadPoolExecutor(len(pending), thread_name_prefix="kvtier-pool") as threads:
            brought_up = list(threads.map(lambda p: self._bring_up(*p), pending))
        for worker in brought_up:
            if worker is not None:
                self.workers[worker.worker_id] = worker
        return [w.worker_id for w in brought_up if w is not None]

    def _worker_ids(self, slots: list[WorkerSlot]) -> dict[WorkerSlot, str]:
        """Each planned slot's worker id; slots left without one are in ``slots_without_id``."""
        if self.worker_tokens_dir is None:
            return {slot: slot.worker_id for slot in slots}
        import ray

        claims = self._claims.load()
        needing = set(unclaimed([s.key for s in slots], claims))
        available: list[str] = []
        why = ""
        if needing:
            try:
                available = list_slot_worker_ids(self.worker_tokens_dir, next(s for s in slots if s.key in needing))
            except Exception as exc:  # the claimed slots are still supervised; listed again next pass
                why = f"{self.worker_tokens_dir} could not be listed: {str(exc)[-300:]}"
        why = why or f"every id in {self.worker_tokens_dir} ({len(available)}) is taken"
        live = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == self.namespace}
        assignment = assign_worker_ids([s.key for s in slots], claims, available, live)
        by_key = {s.key: s for s in slots}
        for worker_id in assignment.released:
            log.info("worker id released: its slot is gone", extra={"worker_id": worker_id})
            self._claims.drop(worker_id)
        for slot_key, worker_id in assignment.worker_ids.items():
            if worker_id in assignment.new_claims:  # recorded before the worker starts
                self._claims.put(worker_id, slot_key)
        self._report_without_id(tuple(by_key[k] for k in assignment.without_id), why)
        return {by_key[k]: worker_id for k, worker_id in assignment.worker_ids.items()}

    def _report_without_id(self, without_id: tuple[WorkerSlot, ...], why: str) -> None:
        """Logs when the slots without an id, or the reason, change (not every pass); ``status``
        has them."""
        if without_id and (without_id, why) != (self.slots_without_id, self._without_id_reason):
            log.error(
                "no worker id for %d slot(s), so no worker starts there: %s. Add a token per worker id "
                "(the chart: a key of auth.workerTokensSecret, or more maxReplicas x gpusPerWorker for "
                "the generated Secret)", len(without_id), why,
                extra={"slots": [f"{s.node_address}/{s.index}" for s in without_id]})
        elif not without_id and self.slots_without_id:
            log.info("every planned slot has a worker id again")
        self.slots_without_id = without_id
        self._without_id_reason = why

    def _slot_config(self, slot: WorkerSlot, worker_id: str) -> WorkerConfig:
        config = load_slot_config(self.config_file, self.base_config, slot)
        if self.worker_tokens_dir is None:
            return config
        return dataclasses.replace(config, auth_token_file=self.worker_tokens_dir / worker_id)

    def _bring_up(self, slot: WorkerSlot, worker_id: str) -> PoolWorker | None:
        """Adopt the slot's named actor (a previous pool's, or one Ray restarted) or start it."""
        import ray

        from kvtier.worker.actor import run_phases

        try:
            try:
                actor = ray.get_actor(worker_id, namespace=self.namespace)
            except ValueError:  # no such actor: start one
                actor, address = start_slot_worker(
                    self._slot_config(slot, worker_id), slot, worker_id=worker_id, name=worker_id, detached=True,
                    namespace=self.namespace, max_restarts=self.max_restarts,
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
        return PoolWorker(worker_id, slot, actor, address)

    def _is_healthy(self, worker: PoolWorker) -> bool:
        import ray

        from kvtier.worker.actor import call_actor

        try:
            call_actor(worker.actor, "check_health", timeout_s=30.0)
            return True
        except FailedPrecondition:  # Ray restarted the process: it needs its phases again
            return False
        except (ray.exceptions.RayError, TimeoutError) as exc:
            log.warning("worker unreachable", extra={"worker_id": worker.worker_id, "error": str(exc)[:300]})
            return False

    def run(self, stop: threading.Event, *, interval_s: float = 10.0) -> None:
        while not stop.is_set():
            started = time.monotonic()
            try:
                self.reconcile()
            except Exception as exc:  # a bug or a Ray hiccup: keep supervising
                log.error("worker pool pass failed", exc_info=exc)
            stop.wait(max(0.0, interval_s - (time.monotonic() - started)))
