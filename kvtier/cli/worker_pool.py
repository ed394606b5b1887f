"""``kvtier worker-pool``: a Ray driver that keeps one worker per GPU of a Ray cluster running.

    kvtier worker-pool --ray-address auto --config /etc/kvtier/config.toml [--workers-per-node N]
                       [--worker-tokens-dir /etc/kvtier/worker-tokens]

The Helm chart runs it beside the Ray head (``deploy/helm/kvtier/templates/raycluster.yaml``).
Workers are detached, named Ray actors pinned to their node (``kvtier/local/worker_pool.py``):
a restarted pool adopts them, a node that joins gets its workers on the next pass, a worker
whose process Ray restarted is driven through its start-up phases again. Each worker's
configuration is read on its own node (the mounted file and that container's ``KVTIER_*``
variables, e.g. ``KVTIER_DRAM_BYTES``). With ``--worker-tokens-dir`` (auth on) each worker's id is
one of that directory's file names, given out by the pool (``kvtier/local/worker_ids.py``), and
its token is ``<dir>/<id>``, read on its own node. SIGTERM stops the pool and leaves the
workers running.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Annotated

import typer

from kvtier.cli.common import app


@app.command("worker-pool")
def worker_pool_command(
    ray_address: Annotated[str, typer.Option(envvar="KVTIER_RAY_ADDRESS", help="The Ray cluster to join.")] = "auto",
    config: Annotated[
        Path | None, typer.Option(help="Worker configuration file (.toml or .yaml), read on each worker's node.")
    ] = None,
    workers_per_node: Annotated[int | None, typer.Option(
        help="Workers per node without GPUs (default 1); GPU nodes get one per GPU.", min=1)] = None,
    worker_tokens_dir: Annotated[Path | None, typer.Option(
        envvar="KVTIER_WORKER_TOKENS_DIR",
        help="Directory on the worker nodes with one token file per worker id (the file name is the id): "
             "each worker takes a free id from it and <dir>/<id> as its auth_token_file. Read on the "
             "worker nodes; the pool needs no token.")] = None,
    interval_s: Annotated[float, typer.Option(help="Seconds between supervision passes.", min=0.1)] = 10.0,
) -> None:
    """Start and supervise the workers of a Ray cluster against a controller.

    [bold]Example[/bold]

      kvtier worker-pool --ray-address auto --config /etc/kvtier/config.toml
    """
    import ray

    from kvtier.local.worker_pool import RAY_NAMESPACE, WorkerPool
    from kvtier.runtime.config import WorkerConfig, load_config
    from kvtier.runtime.log import setup_logging

    base = load_config(WorkerConfig, file=config)  # checked here too: errors name the field
    setup_logging(base.log_level, base.log_json)
    ray.init(address=ray_address, namespace=RAY_NAMESPACE, include_dashboard=False, log_to_driver=False)
    pool = WorkerPool(base, config_file=config, workers_per_node=workers_per_node, worker_tokens_dir=worker_tokens_dir)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    typer.echo(f"worker pool on Ray cluster {ray_address}; supervising every {interval_s:g} s")
    try:
        pool.run(stop, interval_s=interval_s)
    finally:
        ray.shutdown()
