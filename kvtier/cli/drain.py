"""``kvtier drain`` (stop routing to a worker and wait for its requests and held pages to go)
and ``kvtier snapshot`` (ask workers for an inventory snapshot)."""


from __future__ import annotations

import asyncio
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvtier.cli.common import (
    EXIT_FAILED,
    CommandFailed,
    ControllerOption,
    JsonOption,
    Remote,
    TimeoutOption,
    TokenOption,
    _console,
    app,
    print_json,
    stderr_console,
)
from kvtier.cli.flags import find_worker
from kvtier.client import AsyncClient
from kvtier.domain.records import WorkerInfo, WorkerState


def _requests(worker: WorkerInfo) -> int:
    return worker.num_running_seqs + worker.queue_depth


def _held_pages(worker: WorkerInfo) -> int:
    """Pages with content the drain will drop: cached or in use, pins excepted (they stay)."""
    return sum(occ.unpinned_pages for occ in worker.tiers)


async def drain_worker(
    client: AsyncClient,
    remote: Remote,
    worker_id: str,
    *,
    resume: bool,
    wait_s: float | None,
    progress: Progress,
    poll_s: float = 0.2,
) -> WorkerInfo:
    """Drain (or resume) ``worker_id``. With ``wait_s``, wait until the worker is empty: a
    heartbeat sent after the drain shows nothing running or queued and no page held but
    pinned ones. (The controller lets running requests finish, moves pinned prefixes and the
    most valuable pages to peers, then drops the worker's cached pages in every tier; see
    kvtier.controller.worker_admin.)"""
    worker = await client.drain(worker_id, resume=resume)
    if resume or wait_s is None:
        return worker
    # The drain answer carries the last heartbeat before it; only a later one can show the
    # worker empty (an idle heartbeat from before the drain proves nothing).
    baseline_ms = worker.last_heartbeat_at_ms
    total = max(_held_pages(worker), 1)
    progress.start()  # only now: a drain that fails or does not wait draws nothing
    task = progress.add_task(f"draining {worker_id}", total=total)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while True:
        requests, pages = _requests(worker), _held_pages(worker)
        total = max(total, pages)
        progress.update(
            task, total=total, completed=total - pages, description=f"{worker_id}: {requests} running/queued"
        )
        if worker.last_heartbeat_at_ms > baseline_ms and requests == 0 and pages == 0:
            return worker
        if worker.state is WorkerState.EXPIRED:
            raise CommandFailed(f"worker {worker_id} expired (lease lost) while draining", EXIT_FAILED)
        if loop.time() >= deadline:
            raise CommandFailed(
                f"worker {worker_id} still has {requests} request(s) running or queued and {pages:,} page(s) "
                f"after {wait_s:g} s; it stays draining (wait longer with --wait-s, or "
                f"`kvtier drain {worker_id} --resume`)",
                EXIT_FAILED,
            )
        await asyncio.sleep(poll_s)
        worker = find_worker(await client.list_workers(), worker_id, remote)


@app.command("drain")
def drain_command(
    worker_id: Annotated[str, typer.Argument(metavar="WORKER", help="Worker id, as `kvtier workers` lists it.")],
    resume: Annotated[bool, typer.Option(help="Put a draining worker back into service instead.")] = False,
    wait: Annotated[
        bool,
        typer.Option(help="Wait, with a progress bar, until it runs nothing and its pages are dropped (pins stay)."),
    ] = False,
    wait_s: Annotated[float, typer.Option(min=0.1, help="With --wait: give up (exit 1) after this many seconds.")] = 600.0,
    controller: ControllerOption = None,
    token: TokenOption = None,
    timeout_s: TimeoutOption = 10.0,
    as_json: JsonOption = False,
) -> None:
    """Take a worker out of service: no new requests; running ones finish, then its pinned prefixes
    and most valuable pages move to peers with room (up to the controller's drain_migrate_bytes)
    and the rest is dropped (pins that found no peer stay). --resume puts it back.

    [bold]Examples[/bold]

      kvtier drain worker-0 --wait
      kvtier drain worker-0 --resume
    """
    remote = Remote.of(controller, token, timeout_s)
    progress = Progress(
        TextColumn("{task.description}"), BarColumn(bar_width=24), MofNCompleteColumn(), TextColumn("pages dropped"),
        TimeElapsedColumn(), console=stderr_console(), disable=as_json or not wait or resume,
    )
    try:
        worker = remote.run(
            lambda client: drain_worker(
                client, remote, worker_id, resume=resume, wait_s=wait_s if wait else None, progress=progress
            )
        )
    finally:
        if progress.live.is_started:  # stopping an unstarted one still prints a newline
            progress.stop()
    if as_json:
        print_json(worker)
        return
    if resume:
        _console().print(f"{worker.worker_id} is {worker.state.value}: admitting requests again")
    elif wait:
        _console().print(f"{worker.worker_id} is {worker.state.value} and empty: nothing running, no pages cached")
    else:
        _console().print(
            f"{worker.worker_id} is {worker.state.value}: no new requests; {_requests(worker)} running or queued "
            f"and {_held_pages(worker):,} page(s) at its last heartbeat (--wait waits until it is empty)"
        )


@app.command("snapshot")
def snapshot_command(
    worker: Annotated[
        list[str] | None, typer.Option(show_default=False, help="Worker to snapshot; repeatable; default: every live one.")
    ] = None,
    wait: Annotated[bool, typer.Option(help="Answer once every snapshot is reconciled with the directory.")] = False,
    controller: ControllerOption = None,
    token: TokenOption = None,
    timeout_s: TimeoutOption = 60.0,
    as_json: JsonOption = False,
) -> None:
    """Ask workers for a full inventory and reconcile the directory with it.

    [bold]Examples[/bold]

      kvtier snapshot --wait
      kvtier snapshot --worker worker-0 --json
    """
    snapshots = Remote.of(controller, token, timeout_s).run(lambda client: client.snapshot(worker or (), wait=wait))
    if as_json:
        print_json({"snapshots": snapshots})
        return
    table = Table(title="inventory snapshots")
    for name in ("worker", "snapshot", "complete", "pages"):
        table.add_column(name, justify="right" if name == "pages" else "left")
    for s in snapshots:
        table.add_row(s.worker_id, s.snapshot_id, "yes" if s.is_complete else "in progress", f"{s.num_pages:,}")
    _console().print(table)
