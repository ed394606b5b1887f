"""What `kvtier up` does once its options are checked, and what `kvtier down` reports.

`kvtier up` starts the stack, prints where everything is, then supervises it
(``kvtier.local.supervisor``) until SIGINT or SIGTERM (`kvtier down`): a worker Ray restarted
is reported with its new address, and what cannot come back is reported as such.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal

from rich.console import Console
from rich.markup import escape

from kvtier.local import stack as local
from kvtier.local.supervisor import Finding, StackSupervisor


async def run_until_stopped(options: local.StackOptions, console: Console, *,
                            gateway_port: int | None = None, tool_parser: str | None = None) -> None:
    """``gateway_port``: serve the OpenAI-compatible gateway there (0: a free port) for the
    stack's model, ``options.model``; None: no gateway. ``tool_parser``: the gateway's
    tool-call format (None: chosen from the chat template)."""
    from kvtier.local.frontend import start_gateway

    stack = await local.start_local_stack(options)
    try:
        served = (await start_gateway(stack, options.model, port=gateway_port, tool_parser=tool_parser)
                  if gateway_port is not None and options.model is not None else None)
    except BaseException:
        await stack.stop()
        raise
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    endpoints = stack.endpoints()
    console.print(f"controller  {endpoints['controller']}")
    redis_password = endpoints["redis_password_file"]
    console.print(f"redis       {endpoints['redis']}" + (f"   (password in {redis_password})" if redis_password else ""))
    for worker_id, address in endpoints["workers"].items():
        console.print(f"{worker_id:<11} {address}")
    auth_dir = stack.options.state_dir / local.AUTH_DIR
    console.print(f"admin token {auth_dir / local.ADMIN_TOKEN_FILE}   (kvtier commands use it)")
    console.print(f"frontend    {auth_dir / local.FRONTEND_TOKEN_FILE}   (tenant {local.DEFAULT_TENANT!r}: "
                  "send `authorization: Bearer <token>`; `kvtier models --token <token>` lists what to send)")
    console.print(f"model       {endpoints['model_id']}   (Ctrl-C or `kvtier down` stops everything)")
    if served is not None:
        console.print(f"gateway     {served.base_url}   (OpenAI API; model {served.model.name!r})")
        console.print(f"api key     {stack.frontend_token}   (tenant {local.DEFAULT_TENANT!r})")
    supervision = asyncio.create_task(StackSupervisor(stack).run(lambda finding: _print(console, finding)))
    try:
        await stop.wait()
    finally:
        supervision.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await supervision
        console.print("stopping ...")
        if served is not None:
            await served.stop()
        await stack.stop()


def _print(console: Console, finding: Finding) -> None:
    label = "recovered" if finding.is_recovered else "[bold red]cannot recover[/bold red]"
    console.print(f"{label}: {escape(finding.message)}")


def print_stop_report(console: Console, report: local.StopReport) -> None:
    if report.was_running:
        console.print(f"stopped the stack (process {report.pid})")
    else:
        console.print(f"the stack's process {report.pid} had died without stopping its stack")
    if report.stopped:
        names = ", ".join(f"{p.pid} {escape(p.name)}" for p in report.stopped)
        console.print(f"stopped {len(report.stopped)} process(es) it left running: {names}")
