"""A whole kvtier on one machine: Valkey, Ray, the controller and workers (``kvtier up``).

Everything has an embedded default and every default is a flag away from a real
deployment: ``redis_url`` for an existing Redis, ``ray_address`` for a Ray cluster,
``model`` for a checkpoint. The controller runs in this process; workers are Ray actors.
Stopping the stack stops exactly what it started (an external Redis or Ray is left alone).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import os
import signal
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.domain.errors import FailedPrecondition, NotFound, Unavailable
from kvtier.domain.hashing import NamespaceIdentity
from kvtier.local.leftovers import Leftover, find_leftovers, is_running, stop_leftovers
from kvtier.runtime.config import ControllerConfig, WorkerConfig
from kvtier.runtime.log import get_logger

log = get_logger("kvtier.local.stack")

STATE_FILE = "stack.json"
AUTH_DIR = "auth"
ADMIN_TOKEN_FILE = "admin.token"
WORKER_TOKEN_FILE = "{worker_id}.token"  # one per worker, bound to its id
FRONTEND_TOKEN_FILE = "frontend.token"
DEFAULT_TENANT = "default"  # the tenant the local frontend token acts for
TOKEN_TABLE_FILE = "tokens.yaml"


@dataclass(slots=True)
class StackOptions:
    state_dir: Path = Path(".kvtier")
    num_workers: int = 1
    model: Path | None = None
    redis_url: str | None = None
    ray_address: str | None = None
    controller_port: int = 0
    page_size: int = 16
    hbm_bytes: int | None = 64 << 20
    dram_bytes: int = 256 << 20
    nvme_bytes: int = 0
    eviction_policy: str = "experts"  # WorkerConfig.eviction_policy of every worker
    kv_cache_dtype: str = "auto"  # WorkerConfig.kv_cache_dtype of every worker
    lower_tier_dtype: str = "same"  # WorkerConfig.lower_tier_dtype of every worker
    # WorkerConfig.session_hold_fraction of every worker; None: its default.
    session_hold_fraction: float | None = None
    # Link emulation, benchmarks without a GPU only (WorkerConfig.emulated_*_link_bytes_per_s,
    # decision 0011): every worker's HBM <-> DRAM / HBM <-> NVMe links at these bytes/s.
    # None (the default): no emulation.
    emulated_dram_link_bytes_per_s: float | None = None
    emulated_nvme_link_bytes_per_s: float | None = None
    wait_scale: float = 1.0  # WorkerConfig.wait_scale of every worker
    max_restarts: int = 2
    # With ray_address: workers spread over the cluster's nodes, each pinned to its node, one
    # per GPU and workers_per_node (default 1) on a node without GPUs (kvtier/local/worker_pool.py);
    # num_workers is then unused, and the controller and workers listen on every interface
    # (so ``auth`` must be on, as ``kvtier up`` has it).
    workers_per_node: int | None = None
    # Bearer-token auth for the stack (DESIGN §8): an admin token, a frontend token and one token
    # per worker (bound to its id) under state_dir/auth (0600). `kvtier up` and `kvtier demo` turn it on; off by default for
    # library use (tests, benchmarks), where clients dial without a token.
    auth: bool = False
    lease_ttl_s: float = 3.0  # a worker silent this long leaves the directory
    # Passed to serve_controller as-is (None: its defaults): OrchestratorParams, PredictorParams.
    orchestrator_params: Any = None
    predictor_params: Any = None

    @property
    def heartbeat_interval_s(self) -> float:
        return min(1.0, self.lease_ttl_s / 3)


@dataclass(slots=True)
class WorkerHandle:
    worker_id: str
    address: str
    actor: Any = field(repr=False)


@dataclass(slots=True)
class LocalStack:
    options: StackOptions
    controller: Any  # kvtier.controller.server.ControllerServer
    workers: list[WorkerHandle]
    namespace: NamespaceIdentity
    started_ray: bool
    vocab_size: int
    admin_token: str | None = None  # set when options.auth: acts for any tenant (the demo's client uses it)
    frontend_token: str | None = None  # set when options.auth: acts for DEFAULT_TENANT only
    ray_session_dir: str | None = None  # set when the stack started Ray: `kvtier down` cleans it up
    problems: dict[str, str] = field(default_factory=dict)  # what the supervisor could not recover, by subject

    @property
    def controller_address(self) -> str:
        return self.controller.address

    def endpoints(self) -> dict[str, Any]:
        """What the stack's record (``stack.json``) holds: addresses, paths and pids, no secret."""
        embedded = self.controller.embedded_redis
        return {
            "controller": self.controller_address,
            "redis": self.controller.redis_url,  # without credentials
            "redis_password_file": str(embedded.password_file) if embedded is not None else None,
            "valkey_pid": embedded.pid if embedded is not None else None,
            "workers": {w.worker_id: w.address for w in self.workers},
            "model_id": self.namespace.model_id,
            "pid": os.getpid(),
            "ray_session_dir": self.ray_session_dir,
            "problems": dict(self.problems),
        }

    def write_record(self) -> None:
        """(Re)write ``state_dir/stack.json``: 0600 like every file of the state directory."""
        from kvtier.runtime.private_files import write_secret_file

        write_secret_file(self.options.state_dir / STATE_FILE, json.dumps(self.endpoints(), indent=2))

    async def stop(self) -> None:
        import ray

        for w in self.workers:
            try:
                ray.kill(w.actor, no_restart=True)
            except Exception as exc:  # already gone: nothing to stop
                log.debug("worker %s already stopped: %s", w.worker_id, type(exc).__name__)
        try:
            await asyncio.wait_for(self.controller.stop(), timeout=30)
        except TimeoutError:
            log.error("the controller did not stop within 30 s; leaving it to process exit")
        if self.started_ray and ray.is_initialized():
            ray.shutdown()
        (self.options.state_dir / STATE_FILE).unlink(missing_ok=True)


async def start_local_stack(options: StackOptions) -> LocalStack:
    """Start (or join) Redis and Ray, then the controller, then ``num_workers`` workers."""
    import ray

    from kvtier.controller.server import serve_controller
    from kvtier.local.worker_pool import WorkerSlot, plan_slots, ray_nodes, slot_config, start_slot_worker
    from kvtier.runtime.private_files import ensure_private_dir
    from kvtier.worker.actor import call_actor

    # It holds tokens, the Valkey password and data: refused when other users can open it.
    state_dir = ensure_private_dir(options.state_dir.expanduser().resolve())
    options.state_dir = state_dir
    # Ray first, before this process has gRPC's threads (the controller's server): Ray starts
    # its GCS and raylet by fork + exec with Python in between, and a child forked while other
    # threads hold locks can hang before its exec; the raylet then never comes up.
    started_ray = False
    if not ray.is_initialized():
        try:
            if options.ray_address:
                ray.init(address=options.ray_address, include_dashboard=False, log_to_driver=False)
            else:
                # "local" starts a fresh instance rather than joining a stale session.
                ray.init(
                    address="local",
                    num_cpus=max(2, options.num_workers),
                    object_store_memory=200 << 20,
                    include_dashboard=False,
                    log_to_driver=False,
                )
                started_ray = True
        except Exception as exc:  # Ray reports start-up failures as bare Exceptions
            ray.shutdown()
            where = options.ray_address or "a local instance"
            raise Unavailable(f"Ray did not start ({where}): {exc}; retry, or pass --ray-address") from exc
    try:
        slots = (plan_slots(ray_nodes(), workers_per_node=options.workers_per_node) if options.ray_address
                 else [WorkerSlot(None, "", i, uses_gpu=False) for i in range(options.num_workers)])
        if not slots:
            raise FailedPrecondition(f"the Ray cluster at {options.ray_address} has no node with a CPU for a "
                                     "worker; add one (`ray start --address ...`)")
        # One token per worker id, in the table before the controller loads it.
        auth = ensure_local_tokens(state_dir, [slot.worker_id for slot in slots]) if options.auth else None
        # Joining a cluster: workers on other nodes dial the controller, clients the workers.
        host = "0.0.0.0" if options.ray_address else "127.0.0.1"
        controller = await serve_controller(
            ControllerConfig(
                host=host,
                port=options.controller_port,
                state_dir=state_dir,
                redis_url=options.redis_url,
                lease_ttl_s=options.lease_ttl_s,
                heartbeat_interval_s=options.heartbeat_interval_s,
                auth_token_file=auth.table_file if auth else None,
            ),
            redis_url=options.redis_url,
            advertise_host=ray.util.get_node_ip_address() if options.ray_address else None,
            orchestrator_params=options.orchestrator_params,
            predictor_params=options.predictor_params,
        )
    except BaseException:
        if started_ray:
            ray.shutdown()
        raise
    try:
        workers: list[WorkerHandle] = []
        loop = asyncio.get_running_loop()
        for slot in slots:
            config = WorkerConfig(
                host=host,
                controller_address=controller.address,
                model=options.model,
                device="auto",
                page_size=options.page_size,
                hbm_bytes=options.hbm_bytes,
                dram_bytes=options.dram_bytes,
                nvme_bytes=options.nvme_bytes,
                eviction_policy=options.eviction_policy,
                kv_cache_dtype=options.kv_cache_dtype,
                lower_tier_dtype=options.lower_tier_dtype,
                emulated_dram_link_bytes_per_s=options.emulated_dram_link_bytes_per_s,
                emulated_nvme_link_bytes_per_s=options.emulated_nvme_link_bytes_per_s,
                wait_scale=options.wait_scale,
                state_dir=state_dir,
                auth_token_file=auth.worker_token_files[slot.worker_id] if auth else None,
                auth_tokens_file=auth.table_file if auth else None,
            )
            if options.session_hold_fraction is not None:
                config = dataclasses.replace(config, session_hold_fraction=options.session_hold_fraction)
            if slot.node_id is not None:
                config = slot_config(config, slot)
            config.check()  # built directly, not by load_config: the field checks run here
            actor, address = await loop.run_in_executor(
                None,
                functools.partial(
                    # Named by worker id (how a peer fetch finds the holder) where this stack
                    # owns the Ray namespace: the instance it started, or the cluster it joined.
                    start_slot_worker, config, slot, max_restarts=options.max_restarts,
                    name=slot.worker_id if started_ray or options.ray_address else None,
                    heartbeat_interval_s=options.heartbeat_interval_s,
                ),
            )
            workers.append(WorkerHandle(slot.worker_id, address, actor))
        namespace = await loop.run_in_executor(None, lambda: call_actor(workers[0].actor, "namespace"))
        admin_token = auth.admin_token if auth else None
        await _wait_until_routable(controller.address, namespace, len(workers), token=admin_token)
    except BaseException:
        await controller.stop()
        if started_ray:
            ray.shutdown()
        raise
    stack = LocalStack(
        options, controller, workers, namespace, started_ray, _vocab_size(options.model), admin_token=admin_token,
        frontend_token=auth.frontend_token if auth else None,
        ray_session_dir=_ray_session_dir() if started_ray else None,
    )
    stack.write_record()
    return stack


def _ray_session_dir() -> str | None:
    """The session directory of the Ray instance this process started: every process of that
    instance holds files under it, which is how `kvtier down` finds them after a crash."""
    import ray

    node: Any = getattr(ray._private.worker, "_global_node", None)
    try:
        return str(Path(node.get_session_dir_path()).resolve())
    except Exception:  # no node, or a Ray without the method: `kvtier down` then has no session to clean
        return None


async def _wait_until_routable(
    address: str, namespace: NamespaceIdentity, num_workers: int, *, token: str | None = None
) -> None:
    """Workers register over their WorkerLink asynchronously; wait until Route sees them all."""
    import time

    from kvtier.client import AsyncClient

    deadline = time.monotonic() + 60
    async with AsyncClient(address, token=token, max_retries=0) as client:
        while True:
            try:  # UNAVAILABLE until the first worker is live
                num_routable = len((await client.route(namespace, [0])).workers)
            except Unavailable:
                num_routable = 0
            if num_routable >= num_workers:
                return
            if time.monotonic() > deadline:
                raise FailedPrecondition(
                    f"only {num_routable} of {num_workers} workers registered with the controller "
                    "within 60 s; see the worker logs"
                )
            await asyncio.sleep(0.1)


@dataclass(frozen=True, slots=True)
class LocalTokens:
    """The local stack's credentials, all under ``state_dir/auth`` (directory 0700, files 0600)."""

    admin_token: str
    admin_token_file: Path
    worker_token_files: dict[str, Path]  # worker id -> its own token (role worker, bound to that id)
    table_file: Path  # the controller's and workers' token table (hashes only)
    frontend_token: str
    frontend_token_file: Path  # a frontend's credential for DEFAULT_TENANT


def ensure_local_tokens(state_dir: Path, workers: Sequence[str] = ("worker-0",)) -> LocalTokens:
    """An admin token, a frontend token (tenant ``DEFAULT_TENANT``) and one token per worker id
    in ``workers`` (``worker-<id>.token``, bound to that id) for a local stack, kept across
    restarts of the same ``state_dir`` (a client holding one keeps working), and the token
    table that admits exactly these."""
    from kvtier.rpc.auth import Role, TokenEntry, dump_token_table, hash_token, new_token, write_secret_file

    auth_dir = state_dir / AUTH_DIR
    auth_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(auth_dir, 0o700)

    def kept_or_new(name: str) -> str:
        path = auth_dir / name
        try:
            token = path.read_text(encoding="utf-8").strip()
        except OSError:
            token = ""
        token = token or new_token()
        write_secret_file(path, token + "\n")  # (re)asserts 0600 on a kept file too
        return token

    admin, frontend = kept_or_new(ADMIN_TOKEN_FILE), kept_or_new(FRONTEND_TOKEN_FILE)
    entries = [TokenEntry("local-admin", Role.ADMIN, frozenset(), hash_token(admin)),
               TokenEntry("local-frontend", Role.FRONTEND, frozenset({DEFAULT_TENANT}), hash_token(frontend))]
    worker_files = {}
    for worker_id in workers:
        name = WORKER_TOKEN_FILE.format(worker_id=worker_id)
        entries.append(TokenEntry(f"local-{worker_id}", Role.WORKER, frozenset(), hash_token(kept_or_new(name)),
                                  worker_id=worker_id))
        worker_files[worker_id] = auth_dir / name
    table = auth_dir / TOKEN_TABLE_FILE
    dump_token_table(entries, table)  # 0600
    return LocalTokens(admin, auth_dir / ADMIN_TOKEN_FILE, worker_files, table, frontend,
                       auth_dir / FRONTEND_TOKEN_FILE)


def local_admin_token(state_dir: Path, controller: str) -> str | None:
    """The admin token of the stack `kvtier up` runs from ``state_dir``, when ``controller`` is
    that stack's address (a local token is never sent to another controller); else None."""
    state_dir = state_dir.expanduser()
    try:
        recorded = json.loads((state_dir / STATE_FILE).read_text())["controller"]
        token = (state_dir / AUTH_DIR / ADMIN_TOKEN_FILE).read_text(encoding="utf-8").strip()
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return token if recorded == controller and token else None


def _vocab_size(model: Path | None) -> int:
    from kvtier.engine.model.config import ModelConfig
    from kvtier.engine.model.loader import TINY_LLAMA_CONFIG

    return TINY_LLAMA_CONFIG["vocab_size"] if model is None else ModelConfig.from_file(model).vocab_size


def read_state(state_dir: Path) -> dict[str, Any]:
    path = state_dir.expanduser() / STATE_FILE
    if not path.exists():
        raise NotFound(f"no running stack recorded in {path}; start one with `kvtier up`", field="state_dir")
    return json.loads(path.read_text())


@dataclass(frozen=True, slots=True)
class StopReport:
    pid: int  # the `kvtier up` process
    was_running: bool  # False: it had died without stopping its stack
    stopped: list[Leftover]  # processes it left behind, stopped here


def stop_recorded_stack(state_dir: Path, timeout_s: float = 30.0) -> StopReport:
    """Stop the stack `kvtier up` runs from ``state_dir``: signal that process and wait for it,
    then stop whatever the stack still has running (all of it when `kvtier up` was killed)."""
    import time

    state = read_state(state_dir)
    pid = int(state["pid"])
    was_running = is_running(pid)
    if was_running:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while is_running(pid):
            if time.monotonic() > deadline:
                raise FailedPrecondition(f"the stack's process {pid} did not stop within {timeout_s:.0f} s")
            time.sleep(0.2)
    leftovers = find_leftovers(state)
    remaining = stop_leftovers(leftovers)
    if remaining:
        names = ", ".join(f"{p.pid} ({p.name})" for p in remaining)
        raise FailedPrecondition(f"processes of the stack did not stop: {names}; stop them by pid")
    (state_dir.expanduser() / STATE_FILE).unlink(missing_ok=True)
    return StopReport(pid, was_running, leftovers)
