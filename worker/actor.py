"""The worker process as a Ray actor (one per GPU), with explicit start-up phases.

    actor = ray.remote(**actor_options(config))(WorkerActor).remote(config, worker_id="w0")
    init_device → load_model → allocate_pools → serve          (run_phases does all four)

The constructor only stores the configuration, so a failure names the phase it happened in.
``serve()`` starts the gRPC server and the controller link on an asyncio loop on a background
thread of the actor (``WorkerRuntime``); the actor's own methods stay synchronous.

Restarts: with ``max_restarts`` Ray re-creates a killed process and runs only the
constructor, so a restarted actor's constructor runs every phase itself: the worker comes
back serving, registered with the controller under its id, with a new boot id and address
(a phase that fails there fails the restart, naming the phase). Every phase is idempotent
(a repeat returns the first result), so ``run_phases`` simply resends a call that met a
restart in progress.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from opentelemetry.sdk.trace import TracerProvider

from kvtier.domain.errors import ConfigError, FailedPrecondition, Unavailable
from kvtier.domain.hashing import NamespaceIdentity
from kvtier.domain.kv_dtype import KvCacheDtype
from kvtier.domain.records import WorkerStats
from kvtier.domain.tiers import Tier
from kvtier.engine.engine import Engine, default_namespace
from kvtier.engine.model import LlamaModel, load_model
from kvtier.engine.model.loader import TINY_LLAMA_CONFIG, has_chat_template, write_random_checkpoint
from kvtier.rpc.auth import TokenTableFile, read_token_file
from kvtier.rpc.server_options import advertised_host
from kvtier.rpc.tls import ClientTls, secure_or_insecure_channel, server_credentials
from kvtier.runtime import tracing
from kvtier.runtime.config import WorkerConfig, load_config, settings_of
from kvtier.runtime.log import get_logger, setup_logging
from kvtier.runtime.shutdown import run_steps_sync
from kvtier.runtime.telemetry import Telemetry
from kvtier.tiers.manager import TierConfig
from kvtier.tiers.nvme.format import slots_for_bytes
from kvtier.worker.link import WorkerLink
from kvtier.worker.peer_actor import PeerExportMixin, peer_options
from kvtier.worker.servicer import WorkerServer, default_worker_id, serve_worker
from kvtier.worker.sizing import cache_format, model_dtype, pool_geometries, size_hbm_pool

log = get_logger("kvtier.worker.actor")

T = TypeVar("T")

DEFAULT_HEARTBEAT_INTERVAL_S = 1.0  # WorkerConfig has no setting for it
TINY_MODEL_DIR = "models/tiny"
_PHASES = ("init_device", "load_model", "allocate_pools", "serve")


# --------------------------------------------------------------------------- flags


@dataclass(frozen=True, slots=True)
class WorkerArgs:
    """The worker's configuration plus the two settings WorkerConfig does not hold yet."""

    config: WorkerConfig
    worker_id: str | None = None
    heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S


# vLLM's flag names where vLLM has one; kvtier's own names otherwise.
_FLAG_FIELDS: dict[str, str] = {
    "--model": "model",
    "--host": "host",
    "--port": "port",
    "--controller": "controller_address",
    "--device": "device",
    "--block-size": "page_size",
    "--kv-cache-dtype": "kv_cache_dtype",
    "--lower-tier-dtype": "lower_tier_dtype",
    "--gpu-memory-utilization": "gpu_memory_utilization",
    "--max-model-len": "max_model_len",
    "--eviction-policy": "eviction_policy",
    "--session-hold-fraction": "session_hold_fraction",
    "--wait-scale": "wait_scale",
    "--tenant-quotas": "tenant_quotas",
    "--namespace-ttls": "namespace_ttls",
    "--hbm-bytes": "hbm_bytes",
    "--dram-bytes": "dram_bytes",
    "--nvme-bytes": "nvme_bytes",
    "--nvme-dir": "nvme_dir",
    "--emulated-dram-link-bytes-per-s": "emulated_dram_link_bytes_per_s",
    "--emulated-nvme-link-bytes-per-s": "emulated_nvme_link_bytes_per_s",
    "--state-dir": "state_dir",
    "--auth-token-file": "auth_token_file",
    "--auth-tokens-file": "auth_tokens_file",
    "--tls-cert-file": "tls_cert_file",
    "--tls-key-file": "tls_key_file",
    "--tls-client-ca-file": "tls_client_ca_file",
    "--tls-ca-file": "tls_ca_file",
    "--tls-server-name": "tls_server_name",
    "--metrics-port": "metrics_port",
    "--otlp-endpoint": "otlp_endpoint",
    "--log-level": "log_level",
}


def emulated_links(config: WorkerConfig) -> dict[tuple[Tier, Tier], float]:
    """The config's emulated links as the transfer engine takes them: both directions of
    HBM <-> DRAM (PCIe) and of HBM <-> NVMe (kvtier.tiers.transfer's doc)."""
    lower = {"dram": Tier.DRAM, "nvme": Tier.NVME}
    links: dict[tuple[Tier, Tier], float] = {}
    for name, rate in config.emulated_link_bytes_per_s.items():
        links[(Tier.HBM, lower[name])] = links[(lower[name], Tier.HBM)] = rate
    return links


def worker_args(argv: Sequence[str] | None = None, *, env: Mapping[str, str] | None = None) -> WorkerArgs:
    """Parse worker flags (vLLM names: ``--block-size`` is the page size) into ``WorkerArgs``.

    Values are validated by ``load_config``, so errors name the ``WorkerConfig`` field.
    """
    helps = {
        s.name: f"{s.help} ({s.accepted or 'default ' + str(s.default)}; env {s.env_var})"
        for s in settings_of(WorkerConfig)
    }
    parser = argparse.ArgumentParser(prog="python -m kvtier.worker", description="Run one kvtier worker.")
    parser.add_argument("--config", help="configuration file (.toml or .yaml)")
    for flag, name in _FLAG_FIELDS.items():
        parser.add_argument(flag, dest=name, help=helps[name])
    parser.add_argument("--controller-address", dest="controller_address", help=argparse.SUPPRESS)
    for flag, name in (("--log-json", "log_json"), ("--allow-unauthenticated", "allow_unauthenticated")):
        parser.add_argument(flag, dest=name, action="store_const", const="true", help=helps[name])
    parser.add_argument("--worker-id", help="worker id, stable across restarts of the same slot")
    parser.add_argument(
        "--heartbeat-interval-s",
        type=float,
        default=DEFAULT_HEARTBEAT_INTERVAL_S,
        help="seconds between heartbeats to the controller",
    )
    ns = vars(parser.parse_args(argv))
    switches = ["log_json", "allow_unauthenticated"]
    overrides = {name: ns.pop(name) for name in [*_FLAG_FIELDS.values(), *switches] if name in ns}
    try:
        config = load_config(WorkerConfig, file=ns.pop("config"), env=env, overrides=overrides)
    except ConfigError as err:  # name the flag as the user typed it (--block-size, not --page-size)
        own_flag = "--" + (err.field or "").replace("_", "-")
        typed = next((flag for flag, name in _FLAG_FIELDS.items() if name == err.field), own_flag)
        raise ConfigError(
            err.message.replace(f"from {own_flag})", f"from {typed})"), field=err.field
        ) from None
    interval = ns.pop("heartbeat_interval_s")
    if not 0 < interval <= 60:
        raise ConfigError(
            f"heartbeat_interval_s must be in (0, 60], got {interval}", field="heartbeat_interval_s"
        )
    return WorkerArgs(config=config, worker_id=ns.pop("worker_id"), heartbeat_interval_s=interval)


# --------------------------------------------------------------------------- helpers


def ensure_tiny_model(state_dir: Path) -> Path:
    """The built-in random-weight model under ``state_dir``, written once (fixed seed), to a
    private directory renamed into place: concurrent workers never see a half-written one."""
    target = state_dir.expanduser() / TINY_MODEL_DIR
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".tiny-", dir=target.parent))
    write_random_checkpoint(scratch, TINY_LLAMA_CONFIG, seed=0)
    try:
        os.rename(scratch, target)
        log.info("built-in model written", extra={"path": str(target)})
    except OSError:  # another worker got there first
        for file in scratch.iterdir():
            file.unlink()
        scratch.rmdir()
    return target


def model_namespace(path: Path, model: LlamaModel, *, page_size: int, kv_dtype: str) -> NamespaceIdentity:
    """The worker's namespace identity: exactly what ``Engine.from_pretrained`` derives."""
    return default_namespace(path, model, page_size=page_size, kv_dtype=kv_dtype)


def module_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


class WorkerRuntime:
    """An asyncio loop on a daemon thread; synchronous code submits coroutines to it."""

    def __init__(self, name: str = "kvtier-worker-io") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


# --------------------------------------------------------------------------- the actor


class WorkerActor(PeerExportMixin):
    """One worker: device, model, page pools, gRPC server and controller link."""

    def __init__(
        self,
        config: WorkerConfig,
        *,
        worker_id: str | None = None,
        heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S,
        connect_controller: bool = True,
        attention_backend: str = "auto",
    ) -> None:
        self.config = config
        self.worker_id = worker_id or default_worker_id()
        self._heartbeat_interval_s = heartbeat_interval_s
        self._connect_controller = connect_controller
        self._attention_backend = attention_backend
        self._device: torch.device | None = None
        self._dtype: torch.dtype | None = None
        self._kv_format: KvCacheDtype | None = None
        self._model: LlamaModel | None = None
        self._model_path: Path | None = None
        self._engine: Engine | None = None
        self._runtime: WorkerRuntime | None = None
        self._server: WorkerServer | None = None
        self._telemetry: Telemetry | None = None
        self._tracing: TracerProvider | None = None  # installed by this actor (otlp_endpoint)
        self._link: WorkerLink | None = None
        self._results: dict[str, Any] = {}  # phase -> its result; a repeated phase returns it
        setup_logging(config.log_level, config.log_json)
        if _was_restarted_by_ray():  # nothing else drives a restarted actor's phases
            log.warning("worker restarted by Ray; running its phases again", extra={"worker_id": self.worker_id})
            for phase in _PHASES:
                try:
                    getattr(self, phase)()
                except Exception as exc:
                    raise FailedPrecondition(f"restarted worker {self.worker_id} failed in {phase}: {exc}") from exc

    # ---- phases -------------------------------------------------------------------------
    def init_device(self) -> str:
        if "init_device" in self._results:
            return self._results["init_device"]
        has_cuda = torch.cuda.is_available()
        wanted = self.config.device
        if wanted == "cuda" and not has_cuda:
            raise ConfigError(
                "device is cuda but this worker sees no CUDA device; use --device cpu or give the actor a GPU",
                field="device",
            )
        use_cuda = wanted == "cuda" or (wanted == "auto" and has_cuda)
        kv_format = cache_format(self.config.kv_cache_dtype, self.config.lower_tier_dtype, use_cuda=use_cuda)
        if use_cuda:
            torch.cuda.set_device(0)
        self._device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
        self._kv_format = kv_format
        self._dtype = model_dtype(kv_format, use_cuda=use_cuda)
        log.info(
            "device ready",
            extra={"device": str(self._device), "kv_dtype": kv_format.name, "worker_id": self.worker_id},
        )
        self._results["init_device"] = str(self._device)
        return str(self._device)

    def load_model(self) -> dict[str, Any]:
        if "load_model" in self._results:
            return self._results["load_model"]
        if self._device is None or self._dtype is None:
            raise FailedPrecondition("call init_device() before load_model()")
        path = (
            Path(self.config.model).expanduser()
            if self.config.model
            else ensure_tiny_model(self.config.state_dir)
        )
        self._model = load_model(path, dtype=self._dtype, device=self._device)
        self._model_path = path
        info = {"model_id": path.name, "path": str(path), "weights_bytes": module_bytes(self._model)}
        log.info("model loaded", extra=info)
        self._results["load_model"] = info
        return info

    def allocate_pools(self) -> dict[str, Any]:
        if "allocate_pools" in self._results:
            return self._results["allocate_pools"]
        if self._model is None or self._model_path is None or self._kv_format is None:
            raise FailedPrecondition("call load_model() before allocate_pools()")
        assert self._device is not None and self._dtype is not None
        page_size = self.config.page_size
        kv_format = self._kv_format
        geometry, lower_geometry = pool_geometries(self._model.kv_geometry, page_size, self._dtype, kv_format)
        budget = size_hbm_pool(
            gpu_memory_utilization=self.config.gpu_memory_utilization,
            weights_bytes=module_bytes(self._model),
            configured_bytes=self.config.hbm_bytes,
            use_gpu=self._device.type == "cuda",
        )
        num_pages = geometry.pages_for_bytes(budget.kv_bytes)
        if num_pages < 1:
            raise ConfigError(
                f"the HBM budget of {budget.kv_bytes} bytes ({budget.source}) holds no page of "
                f"{geometry.page_bytes} bytes; raise --hbm-bytes or --gpu-memory-utilization",
                field="hbm_bytes",
            )
        namespace = model_namespace(
            self._model_path, self._model, page_size=page_size, kv_dtype=kv_format.name
        )
        tier_config = TierConfig(
            dram_pages=self.config.dram_bytes // lower_geometry.page_bytes,
            nvme_slots=slots_for_bytes(self.config.nvme_bytes, lower_geometry),
            nvme_dir=self.config.nvme_dir or Path(self.config.state_dir).expanduser() / "nvme" / self.worker_id,
            link_bytes_per_s=emulated_links(self.config) or None,
        )
        self._engine = Engine(
            self._model,
            num_pages=num_pages,
            page_size=page_size,
            namespace=namespace,
            attention_backend=self._attention_backend,
            max_model_len=self.config.max_model_len,
            tier_config=tier_config if tier_config.dram_pages or tier_config.nvme_slots else None,
            eviction_policy=self.config.eviction_policy,
            tenant_quotas=self.config.tenant_quotas,
            namespace_ttls=self.config.namespace_ttls,
            kv_cache_dtype=kv_format.name,
        )
        info = {
            "num_pages": num_pages,
            "kv_dtype": kv_format.name,
            "page_bytes": geometry.page_bytes,
            "lower_page_bytes": lower_geometry.page_bytes,
            "hbm_bytes": num_pages * geometry.page_bytes,
            "source": budget.source,
            "max_model_len": self._engine.max_model_len,
            "dram_pages": tier_config.dram_pages,
            "nvme_slots": tier_config.nvme_slots,
            "emulated_link_bytes_per_s": self.config.emulated_link_bytes_per_s,
            "eviction_policy": self._engine.index.policy.name,
        }
        log.info("page pools allocated", extra=info)
        self._results["allocate_pools"] = info
        return info

    def serve(self) -> str:
        """Start the gRPC server (and the controller link); returns the address to dial."""
        if self._engine is None:
            raise FailedPrecondition("call allocate_pools() before serve()")
        if self._server is not None:
            return self._server.address
        self._runtime = self._runtime or WorkerRuntime()
        if self.config.otlp_endpoint and not tracing.is_enabled():
            # ConfigError naming otlp_endpoint and the kvtier[otlp] extra when the exporter is missing.
            self._tracing = tracing.setup_process("kvtier-worker", otlp_endpoint=self.config.otlp_endpoint)
        if self.config.metrics_port is not None and self._telemetry is None:
            self._telemetry = Telemetry("kvtier-worker", port=self.config.metrics_port, host=self.config.host)
        config = self.config
        # Every auth and TLS file is read before anything listens, so a bad one fails the phase cleanly.
        tokens = TokenTableFile(config.auth_tokens_file) if config.auth_tokens_file is not None else None
        credentials = server_credentials(config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file)
        link_token = read_token_file(config.auth_token_file) if config.auth_token_file is not None else None
        link_tls = ClientTls.from_files(
            config.tls_ca_file,
            # The worker's certificate doubles as its client certificate (mTLS) on TLS links.
            config.tls_cert_file if config.tls_ca_file is not None else None,
            config.tls_key_file if config.tls_ca_file is not None else None,
            config.tls_server_name,
        )
        self._server = self._runtime.run(
            serve_worker(
                self._engine,
                host=config.host,
                port=config.port,
                worker_id=self.worker_id,
                advertise_host=self._advertise_host(),
                telemetry=self._telemetry,
                tokens=tokens,
                identity_token=link_token,
                credentials=credentials,
                allow_unauthenticated=config.allow_unauthenticated,
                hold_fraction=config.session_hold_fraction,
                wait_scale=config.wait_scale,
                peers=peer_options(config, link_token),
            )
        )
        if self._connect_controller:
            self._link = WorkerLink(
                self._server.loop,
                controller_address=self.config.controller_address,
                worker_id=self._server.worker_id,
                address=self._server.address,
                boot_id=self._server.boot_id,
                heartbeat_interval_s=self._heartbeat_interval_s,
                token=link_token,
                tls=link_tls,
                has_chat_template=self._model_path is not None and has_chat_template(self._model_path),
                tickets=self._server.tickets, peers=self._server.servicer.peers,
            )
            self._runtime.run(_start(self._link))
        return self._server.address

    # ---- queries -----------------------------------------------------------------------
    def address(self) -> str:
        if self._server is None:
            raise FailedPrecondition("the worker is not serving; run its phases (run_phases)")
        return self._server.address

    def namespace(self) -> NamespaceIdentity:
        """The namespace identity requests for this worker's model must carry (tenant unset)."""
        if self._engine is None:
            raise FailedPrecondition(f"the worker has no model yet (last phase: {self.phase()})")
        return self._engine.namespace

    def phase(self) -> str:
        """The last phase completed: "constructed", "init_device", ..., "serve"."""
        done = [self._device, self._model, self._engine, self._server]
        completed = [name for name, result in zip(_PHASES, done, strict=True) if result is not None]
        return completed[-1] if completed else "constructed"

    def check_health(self) -> None:
        """Raise unless the engine thread runs and the gRPC server answers its health check."""
        if self._server is None or self._runtime is None:
            raise FailedPrecondition(f"the worker is not serving (last phase: {self.phase()})")
        if not self._server.loop.is_alive:
            raise Unavailable("the worker's engine thread has stopped")
        self._runtime.run(_probe(self._server.address, self._self_tls()), timeout_s=10.0)

    def stats(self) -> WorkerStats:
        if self._server is None or self._runtime is None:
            raise FailedPrecondition(f"the worker is not serving (last phase: {self.phase()})")
        return self._runtime.run(self._server.servicer.stats(), timeout_s=10.0)

    def is_link_connected(self) -> bool:
        return self._link is not None and self._link.is_connected

    def shutdown(self, grace_s: float = 2.0) -> None:
        """Stop the link, the server (engine thread included) and the runtime; each step runs
        even when one before it fails (``run_steps_sync``)."""
        if self._runtime is None:
            return
        runtime, link, server, telemetry = self._runtime, self._link, self._server, self._telemetry
        self._runtime = self._link = self._server = self._telemetry = None
        steps: list[tuple[str, Callable[[], object]]] = []
        if link is not None:
            steps.append(("controller link", lambda: runtime.run(link.stop())))
        if server is not None:
            steps.append(("worker server", lambda: runtime.run(server.stop(grace_s))))
        steps.append(("runtime", runtime.close))
        if telemetry is not None:
            steps.append(("telemetry", telemetry.close))
        if self._tracing is not None:
            self._tracing = None
            steps.append(("tracing", tracing.shutdown))  # flushes the spans still queued for export
        run_steps_sync(steps, log=log, what="worker shutdown")

    def _self_tls(self) -> ClientTls | None:
        """How the worker dials its own TLS server for health checks: trusting the deployment CA
        (``tls_ca_file``, else the client CA, else its certificate as a self-signed root) and
        presenting its certificate when the server requires one."""
        c = self.config
        if c.tls_cert_file is None:
            return None
        return ClientTls(
            ca_file=c.tls_ca_file or c.tls_client_ca_file or c.tls_cert_file,
            cert_file=c.tls_cert_file if c.tls_client_ca_file is not None else None,
            key_file=c.tls_key_file if c.tls_client_ca_file is not None else None,
        )

    def _advertise_host(self) -> str:
        host = self.config.host
        if host not in ("0.0.0.0", "::", ""):
            return host
        with contextlib.suppress(Exception):
            import ray

            if ray.is_initialized():
                return ray.util.get_node_ip_address()
        return advertised_host(host)


def _was_restarted_by_ray() -> bool:
    """Whether this process is a Ray actor that Ray re-created after its process died."""
    ray = sys.modules.get("ray")  # never imported here: a worker outside Ray has no restarts
    context = ray.get_runtime_context() if ray is not None and ray.is_initialized() else None
    return context is not None and context.get_actor_id() is not None and bool(context.was_current_actor_reconstructed)


async def _start(link: WorkerLink) -> None:
    link.start()


async def _probe(address: str, tls: ClientTls | None = None) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with secure_or_insecure_channel(address, tls) as channel:
        response = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5.0
        )
    if response.status != health_pb2.HealthCheckResponse.SERVING:
        raise Unavailable(
            f"the worker's health service reports {health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)}"
        )


# --------------------------------------------------------------------------- Ray glue


def actor_options(config: WorkerConfig, *, max_restarts: int = 0, name: str | None = None) -> dict[str, Any]:
    """``ray.remote`` options: one GPU when the worker runs on CUDA (``device=auto`` asks the
    cluster whether it has any), else one CPU; tasks are never retried (Generate is not
    idempotent, and the phases are driven by the owner)."""
    import ray

    if config.device == "cuda":
        num_gpus = 1
    elif config.device == "cpu":
        num_gpus = 0
    else:
        num_gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
    options: dict[str, Any] = {
        "num_cpus": 1,
        "num_gpus": num_gpus,
        "max_restarts": max_restarts,
        "max_task_retries": 0,
    }
    if name is not None:
        options["name"] = name
    return options


def call_actor(actor: Any, method: str, *, timeout_s: float = 600.0) -> Any:
    """``ray.get(actor.method.remote())``, waiting out a restart in progress.

    Only for the actor's idempotent methods (the phases, queries): a call that met the
    restart may or may not have run, so it is simply sent again.
    """
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get(getattr(actor, method).remote(), timeout=max(deadline - time.monotonic(), 0.1))
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.2)


def run_phases(actor: Any, *, timeout_s: float = 600.0) -> str:
    """Drive a new or restarted actor through every phase (each is idempotent); returns its address."""
    deadline = time.monotonic() + timeout_s
    for phase in _PHASES:
        result = call_actor(actor, phase, timeout_s=max(deadline - time.monotonic(), 0.1))
    return result


def start_worker_actor(
    config: WorkerConfig,
    *,
    worker_id: str,
    name: str | None = None,
    max_restarts: int = 0,
    connect_controller: bool = True,
    heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S,
    timeout_s: float = 600.0,
) -> tuple[Any, str]:
    """Create a ``WorkerActor`` in the connected Ray cluster and run its phases."""
    import ray

    actor_cls = ray.remote(**actor_options(config, max_restarts=max_restarts, name=name))(WorkerActor)
    actor = actor_cls.remote(
        config,
        worker_id=worker_id,
        heartbeat_interval_s=heartbeat_interval_s,
        connect_controller=connect_controller,
    )
    return actor, run_phases(actor, timeout_s=timeout_s)
