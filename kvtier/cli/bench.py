"""``kvtier bench``: the serving benchmark (loadtests/bench_serving.py) from the CLI, against
a running controller or a fresh local stack, bounded (see the command's help)."""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from kvtier.cli.common import (
    EXIT_BAD_INPUT,
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
from kvtier.cli.flags import ModelOption, NamespaceFlags
from kvtier.client import AsyncClient
from kvtier.domain.errors import InvalidArgument

MAX_BENCH_SESSIONS = 64


def _bench_module() -> Any:
    """loadtests.bench_serving, which ships with a source checkout (not with the wheel)."""
    try:
        from loadtests import bench_serving
    except ImportError:
        root = Path(__file__).resolve().parents[2]
        if not (root / "loadtests" / "bench_serving.py").is_file():
            raise CommandFailed(
                "kvtier bench runs loadtests/bench_serving.py, which comes with the source checkout, not the "
                "installed package; run it from a clone of the repository",
                EXIT_BAD_INPUT,
            ) from None
        sys.path.insert(0, str(root))
        from loadtests import bench_serving
    return bench_serving


def _levels(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        levels = ()
    if not levels or any(not 1 <= n <= MAX_BENCH_SESSIONS for n in levels):
        raise InvalidArgument(
            f"--sessions takes comma-separated counts in [1, {MAX_BENCH_SESSIONS}], such as 1,8,32; got {text!r}",
            field="--sessions",
        )
    return levels


@app.command("bench")
def bench_command(
    local: Annotated[
        bool, typer.Option(help="Start a fresh local stack (Valkey, Ray, controller, one CPU worker) and stop it after.")
    ] = False,
    full: Annotated[bool, typer.Option(help="The longer run: 400 Route calls, 4 rounds of 32 tokens per level.")] = False,
    sessions: Annotated[str, typer.Option(help="Concurrency levels: sessions in flight at once.")] = "1,8,32",
    tenant: Annotated[str, typer.Option(help="Tenant the benchmark's requests use (its cache stays apart).")] = "kvtier-bench",
    vocab_size: Annotated[
        int, typer.Option(min=2, help="Token ids are drawn below this; 512 is valid for every model.")
    ] = 512,
    model: ModelOption = None,
    controller: ControllerOption = None,
    token: TokenOption = None,
    timeout_s: TimeoutOption = 60.0,
    as_json: JsonOption = False,
) -> None:
    """Serving benchmark (loadtests/bench_serving.py): Route latency against a gRPC health check,
    then TTFT, time per output token and tokens/s at each concurrency level.

    Bounded: the default (quick) run makes 100 Route + health pairs, then 2 rounds per level of
    one request per session (160 prompt tokens, 16 generated). Without --local it runs against
    the controller (flags, KVTIER_CONTROLLER, or `kvtier up`'s record).

    [bold]Examples[/bold]

      kvtier bench --local --json
      kvtier bench --controller 10.0.0.5:50051 --sessions 1,8 --model llama-3.1-8b
    """
    levels = _levels(sessions)
    bench = _bench_module()
    notes = stderr_console()

    async def against(client: AsyncClient) -> dict[str, Any]:
        namespace = NamespaceFlags(model=model, tenant=tenant).resolve(await client.list_workers())
        notes.print(f"benchmarking {client.controller} (model {namespace.model_id}, sessions {levels}) ...")
        return await bench.measure(
            client.controller, namespace, vocab_size, quick=not full, levels=levels, client=client
        )

    if local:
        from kvtier.local.stack import StackOptions, start_local_stack

        async def fresh() -> dict[str, Any]:
            with tempfile.TemporaryDirectory(prefix="kvtier-bench-") as tmp:
                notes.print(f"starting a local stack in {tmp} ...")
                stack = await start_local_stack(StackOptions(state_dir=Path(tmp), num_workers=1))
                try:
                    remote = Remote(stack.controller_address, token, timeout_s)
                    async with remote.client() as client:
                        return await against(client)
                finally:
                    await stack.stop()

        result = asyncio.run(fresh())
    else:
        result = Remote.of(controller, token, timeout_s).run(against)
    if as_json:
        print_json(result)
        return
    r = result["route"]
    table = Table(
        title=f"Route p50 {r['route_p50_ms']:.3f} ms vs health check p50 {r['health_p50_ms']:.3f} ms: "
        f"{r['route_p50_over_health_p50']:.2f}x"
    )
    for name in ("sessions", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "tokens/s"):
        table.add_column(name, justify="right")
    for n, ttft in result["ttft_ms"].items():
        tpot = result["tpot_ms"][n]
        table.add_row(
            n, f"{ttft['p50']:.1f} ms", f"{ttft['p99']:.1f} ms", f"{tpot['p50']:.1f} ms", f"{tpot['p99']:.1f} ms",
            f"{result['tokens_per_s'][n]:.1f}",
        )
    _console().print(table)
