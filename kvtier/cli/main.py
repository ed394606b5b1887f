"""The ``kvtier`` command line (DESIGN §6 "Client and CLI"): the local commands and ``main``.

This module holds the local commands (plan, up, down, demo, and the process entry points)
and ``status``; the operator commands live by group in ``kvtier.cli.workers`` (models,
workers, tiers), ``kvtier.cli.sessions``, ``kvtier.cli.cache`` (lookup, invalidate, pin, unpin,
evict) and ``kvtier.cli.drain`` (drain, snapshot), with their shared flags in
``kvtier.cli.flags``; ``bench`` is in ``kvtier.cli.bench``,
the ``policy`` group in ``kvtier.cli.policy`` and ``token`` in ``kvtier.cli.token``. All of
them register on ``kvtier.cli.common.app``.

Exit codes, the same for every command:

    0  done
    1  the controller refused or failed the operation (NOT_FOUND, FAILED_PRECONDITION, ...)
    2  bad input (a flag, a file, or INVALID_ARGUMENT from the controller), or the
       controller could not be reached

Commands raise domain errors; ``main`` turns each into one ``error: ...`` line on stderr,
never a traceback. ``remote_error`` is the one place a controller's status code becomes a
message and an exit code. ``--json`` prints one JSON document on stdout and nothing else
(progress and notes go to stderr).
"""

from __future__ import annotations

import asyncio
import importlib.resources
import json
import math
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

# The command modules register their commands on app when imported, and `kvtier --help` lists
# commands in registration order: the operator views first, then the cache and worker operations.
# isort: off
import kvtier.cli.workers  # noqa: F401
import kvtier.cli.sessions  # noqa: F401
import kvtier.cli.cache  # noqa: F401
import kvtier.cli.drain  # noqa: F401
import kvtier.cli.bench  # noqa: F401
import kvtier.cli.gateway  # noqa: F401
import kvtier.cli.policy  # noqa: F401
import kvtier.cli.token  # noqa: F401
import kvtier.cli.worker_pool  # noqa: F401
# isort: on
from kvtier.cli.common import (
    _REPO_ROOT,
    _TIER_LABELS,
    DEMO_TRACE,
    DEMO_TRACE_COLUMN,
    GIB,
    CommandFailed,
    ControllerOption,
    JsonOption,
    Remote,
    TimeoutOption,
    TokenOption,
    _console,
    _format_bytes,
    _gib_to_bytes,
    _json_number,
    _worker_option,
    app,
    fail,
    print_json,
)
from kvtier.domain.errors import ConfigError, InvalidArgument, KvtierError
from kvtier.domain.geometry import load_geometry, parse_dtype
from kvtier.policy.capacity import (
    CapacityPlan,
    PageSizeStudy,
    page_size_study,
    parse_plan_dtype,
    plan,
    read_lengths_csv,
    validate_headroom,
    validate_page_size,
)
from kvtier.runtime.config import WorkerConfig, load_config

_PLAN_KV_DTYPE_HELP = "KV element type: bf16, fp16, fp32, fp8 or fp4; HBM/lower (bf16/fp8) for lower_tier_dtype."
_PLAN_BUDGET_HELP = "Study: share of requests whose allocated slots fit this many tokens."
_PLAN_CSV_HELP = "CSV of request lengths for a page-size study (needs --column)."


@app.command("plan")
def plan_command(
    model_config: Annotated[
        Path,
        typer.Option(
            "--model-config",
            help="A model's config.json, or a checkpoint directory (config.json + *.safetensors: "
            "weight bytes are then summed exactly from the safetensors headers).",
        ),
    ],
    kv_dtype: Annotated[str, typer.Option(help=_PLAN_KV_DTYPE_HELP)] = "bf16",
    page_size: Annotated[int, typer.Option(help="Tokens per page, a power of two in [1, 1024].")] = 16,
    hbm_gib: Annotated[
        float, typer.Option(help="Device memory of one GPU, GiB (weights come out of it).")
    ] = 80.0,
    dram_gib: Annotated[float, typer.Option(help="Host memory given to the DRAM tier, GiB.")] = 0.0,
    nvme_gib: Annotated[float, typer.Option(help="Disk given to the NVMe tier, GiB.")] = 0.0,
    context: Annotated[
        list[int] | None,
        typer.Option(
            help="Context length of one session, in tokens; repeat for several (default: 4096 and 32768)."
        ),
    ] = None,
    headroom: Annotated[
        float, typer.Option(help="Share of HBM left after weights kept free for activations, in [0, 1).")
    ] = 0.15,
    weights_dtype: Annotated[
        str | None,
        typer.Option(
            help="Serve the weights in this dtype (estimate from the config) instead of the checkpoint's."
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")] = False,
    lengths_csv: Annotated[Path | None, typer.Option(help=_PLAN_CSV_HELP)] = None,
    column: Annotated[str | None, typer.Option(help="Column of --lengths-csv holding token counts.")] = None,
    budget_tokens: Annotated[int | None, typer.Option(help=_PLAN_BUDGET_HELP)] = None,
) -> None:
    """Capacity plan: KV bytes per token and page, pages, tokens and sessions per tier.

    [bold]Examples[/bold]

      kvtier plan --model-config ./Llama-3.1-8B/config.json --hbm-gib 80 --dram-gib 256 --context 32768

      kvtier plan --model-config ./ckpt --kv-dtype fp8 --page-size 32 --json

      kvtier plan --model-config config.json --lengths-csv trace.csv --column ContextTokens --budget-tokens 8192
    """
    parse_plan_dtype(kv_dtype, field="--kv-dtype")  # its errors name the flag
    validate_page_size(page_size, name="--page-size")
    validate_headroom(headroom, name="--headroom")
    budgets = (
        _gib_to_bytes(hbm_gib, "--hbm-gib", positive=True),
        _gib_to_bytes(dram_gib, "--dram-gib"),
        _gib_to_bytes(nvme_gib, "--nvme-gib"),
    )
    contexts = context or [4096, 32768]
    for length in contexts:
        if length < 1:
            raise InvalidArgument(f"--context must be >= 1, got {length}", field="--context")
    if budget_tokens is not None and budget_tokens < 1:
        raise InvalidArgument(f"--budget-tokens must be >= 1, got {budget_tokens}", field="--budget-tokens")
    if (lengths_csv is None) != (column is None):
        raise InvalidArgument(
            "--lengths-csv and --column go together; give both or neither", field="--column"
        )

    geometry = load_geometry(model_config)
    if weights_dtype is not None:
        geometry = geometry.with_weights_dtype(parse_dtype(weights_dtype, field="--weights-dtype")[0])
    result = plan(geometry, kv_dtype, page_size, *budgets, context_lengths=contexts, headroom=headroom)
    study = None
    if lengths_csv is not None and column is not None:
        study = page_size_study(read_lengths_csv(lengths_csv, column), budget_tokens=budget_tokens)

    if as_json:
        typer.echo(json.dumps(plan_json(result, study), indent=2))
        return
    console = _console()
    print_plan(console, result)
    if study is not None:
        print_study(console, study, f"{lengths_csv} column {column}")


@app.command("demo")
def demo_command(
    quick: Annotated[
        bool, typer.Option(help="A smaller workload (CI runs this, through the same code).")
    ] = False,
    out: Annotated[Path, typer.Option(help="Where the report (demo.json, demo.txt, demo.png) goes.")] = Path("out"),
    state_dir: Annotated[
        Path | None,
        typer.Option(help="Where the embedded Valkey and NVMe files live; default: a temporary directory."),
    ] = None,
    model: Annotated[
        Path | None,
        typer.Option(help="Checkpoint directory with a tokenizer and chat template; default: the bundled "
                          "SmolLM2-135M-Instruct, converted once into ~/.cache/kvtier/models."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as one JSON object.")] = False,
    planner: Annotated[
        bool, typer.Option(help="Run the capacity-planner demo instead (no services).")
    ] = False,
) -> None:
    """Real agents through the OpenAI-compatible gateway: tiered, then HBM only; report, shut down.

    Two tenants run OpenAI-SDK agent sessions with tools (calculator, docs search, a simulated
    web fetch) on SmolLM2-135M-Instruct. HBM holds fewer sessions than run, so paused sessions'
    pages go down to DRAM and NVMe and come back by prefetch. The report prints one
    conversation, TTFT of first and resumed turns, cached tokens by tier and prefetch outcomes,
    against the same workload with tiering off.

    [bold]Examples[/bold]

      kvtier demo
      kvtier demo --quick --json
      kvtier demo --planner
    """
    if planner:
        run_planner_demo(_console(), quick=quick)
        return
    from kvtier.cli.demo import run_agent_demo

    console = _console() if not as_json else Console(stderr=True)
    run_agent_demo(console, quick=quick, out_dir=out, state_dir=state_dir, model=model, as_json=as_json)


@app.command("up")
def up_command(
    workers: Annotated[int, typer.Option(help="Worker actors to start without --ray-address.", min=1)] = 1,
    workers_per_node: Annotated[int | None, typer.Option(
        help="With --ray-address: workers per node without GPUs (default 1); GPU nodes get one per GPU.",
        min=1)] = None,
    model: Annotated[
        Path | None,
        typer.Option(help="Checkpoint directory; default: the bundled SmolLM2-135M-Instruct, converted once "
                          "into STATE_DIR/models."),
    ] = None,
    redis_url: Annotated[
        str | None,
        typer.Option(envvar="KVTIER_REDIS_URL", help="Use this Redis instead of an embedded Valkey."),
    ] = None,
    ray_address: Annotated[str | None, typer.Option(envvar="KVTIER_RAY_ADDRESS", help=(
        "Join this Ray cluster instead of a local one; workers spread over its nodes, pinned by node."))] = None,
    state_dir: Annotated[Path, typer.Option(envvar="KVTIER_STATE_DIR", help="Valkey data, model, NVMe files.")] = (
        Path(".kvtier")),
    port: Annotated[
        int, typer.Option(help="Controller gRPC port; 0 picks a free one.", min=0, max=65535)
    ] = 50051,
    hbm_gib: Annotated[
        float | None,
        typer.Option(help="HBM tier per worker, GiB; default 0.0625 (64 MiB), a CPU-sized cache."),
    ] = None,
    dram_gib: Annotated[float, typer.Option(help="DRAM tier per worker, GiB.")] = 0.25,
    nvme_gib: Annotated[
        float, typer.Option(help="NVMe tier per worker, GiB (files under STATE_DIR/nvme).")
    ] = 0.0,
    eviction_policy: Annotated[str | None, _worker_option("eviction_policy")] = None,
    session_hold_fraction: Annotated[float | None, _worker_option("session_hold_fraction")] = None,
    kv_cache_dtype: Annotated[str | None, _worker_option("kv_cache_dtype")] = None,
    lower_tier_dtype: Annotated[str | None, _worker_option("lower_tier_dtype")] = None,
    gateway_port: Annotated[
        int, typer.Option(help="Port of the OpenAI-compatible gateway on 127.0.0.1; 0 picks a free one.",
                          min=0, max=65535)
    ] = 8000,
    gateway: Annotated[bool, typer.Option(help="Serve the OpenAI-compatible gateway.")] = True,
    tool_parser: Annotated[
        str | None, typer.Option(help="The gateway's tool-call format: hermes or llama3 (default: chosen from the "
                                      "model's chat template).")
    ] = None,
) -> None:
    """Start a local kvtier: Valkey, Ray, the controller, workers and the OpenAI-compatible gateway;
    Ctrl-C (or `kvtier down`) stops it.

    [bold]Examples[/bold]

      kvtier up
      kvtier up --workers 2 --model ./Llama-3.2-1B --nvme-gib 4
      kvtier up --hbm-gib 60 --dram-gib 200 --session-hold-fraction 1.0
      kvtier up --model ./Llama-3.2-1B --kv-cache-dtype fp8
      kvtier up --redis-url redis://10.0.0.5:6379/0 --ray-address auto --workers-per-node 2
    """
    from kvtier.cli.up import run_until_stopped
    from kvtier.gateway.tool_parsers import parser_format
    from kvtier.local import stack as local

    console = _console()
    if tool_parser is not None:
        try:
            parser_format(tool_parser)
        except ConfigError as exc:
            fail(f"--tool-parser: {exc.message}")
    # The worker settings' own checks, before anything starts; their errors name the flag.
    worker = load_config(
        WorkerConfig,
        env={},
        overrides={"eviction_policy": eviction_policy, "session_hold_fraction": session_hold_fraction,
                   "kv_cache_dtype": kv_cache_dtype, "lower_tier_dtype": lower_tier_dtype},
    )
    options = local.StackOptions(
        state_dir=state_dir,
        num_workers=workers,
        model=model,
        redis_url=redis_url,
        ray_address=ray_address,
        workers_per_node=workers_per_node,
        controller_port=port,
        **({} if hbm_gib is None else {"hbm_bytes": _gib_to_bytes(hbm_gib, "--hbm-gib", positive=True)}),
        dram_bytes=_gib_to_bytes(dram_gib, "--dram-gib"),
        nvme_bytes=_gib_to_bytes(nvme_gib, "--nvme-gib"),
        eviction_policy=worker.eviction_policy,
        kv_cache_dtype=worker.kv_cache_dtype,
        lower_tier_dtype=worker.lower_tier_dtype,
        session_hold_fraction=worker.session_hold_fraction,
        auth=True,  # an admin token in STATE_DIR/auth/admin.token; kvtier commands pick it up
    )

    if options.model is None:  # every flag is checked by now: convert (once) only for a stack that starts
        from kvtier.local import real_model
        from kvtier.runtime.private_files import ensure_private_dir

        # Refused before any work when other users can open it; created 0700 when missing.
        options.model = real_model.ensure_checkpoint(ensure_private_dir(state_dir) / "models" / real_model.MODEL_NAME,
                                                     seed_from=real_model.default_cache_dir())
    asyncio.run(run_until_stopped(options, console, gateway_port=gateway_port if gateway else None,
                                  tool_parser=tool_parser))


@app.command("down")
def down_command(
    state_dir: Annotated[
        Path, typer.Option(envvar="KVTIER_STATE_DIR", help="The state directory of `kvtier up`.")
    ] = Path(".kvtier"),
) -> None:
    """Stop the stack that `kvtier up` started from STATE_DIR, and what it left running if it was killed.

    [bold]Example[/bold]

      kvtier down
    """
    from kvtier.cli.up import print_stop_report
    from kvtier.local.stack import stop_recorded_stack

    print_stop_report(_console(), stop_recorded_stack(state_dir))


_PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


@app.command("controller", context_settings=_PASS_THROUGH, add_help_option=False)
def controller_command(ctx: typer.Context) -> None:
    """Run the controller process (what the Helm chart starts): `kvtier controller --config FILE`."""
    from kvtier.controller.__main__ import main as controller_main

    controller_main(list(ctx.args))


@app.command("worker", context_settings=_PASS_THROUGH, add_help_option=False)
def worker_command(ctx: typer.Context) -> None:
    """Run one worker without Ray, with vLLM-style flags: `kvtier worker --block-size 16 ...`."""
    from kvtier.worker.__main__ import main as worker_main

    worker_main(list(ctx.args))


@app.command("status")
def status_command(
    controller: ControllerOption = None,
    token: TokenOption = None,
    timeout_s: TimeoutOption = 5.0,
    as_json: JsonOption = False,
) -> None:
    """The controller's view: leader, workers, sessions, directory health.

    [bold]Examples[/bold]

      kvtier status
      kvtier status --controller 10.0.0.5:50051 --json
    """
    status = Remote.of(controller, token, timeout_s).run(lambda client: client.status())
    if as_json:
        print_json(status)
        return
    table = Table(
        title=f"kvtier controller {status.controller_id} ({'leader' if status.is_leader else 'standby'})"
    )
    table.add_column("field")
    table.add_column("value", justify="right")
    table.add_row("leader", status.leader_address or "-")
    table.add_row("version / uptime", f"{status.version} / {status.uptime_s} s")
    table.add_row("workers (live / known)", f"{status.num_live_workers} / {status.num_workers}")
    table.add_row(
        "sessions (active / paused / resuming)",
        f"{status.num_active_sessions} / {status.num_paused_sessions} / {status.num_resuming_sessions}",
    )
    table.add_row("policy version", str(status.policy_version))
    table.add_row("directory reachable", "yes" if status.is_directory_reachable else "NO")
    for occ in status.tiers:
        table.add_row(
            f"{_TIER_LABELS[occ.tier.label]} pages free / total", f"{occ.free_pages:,} / {occ.total_pages:,}"
        )
    _console().print(table)


def run_planner_demo(console: Console, *, quick: bool = False) -> None:
    """The planner on the bundled Llama-3.1-8B config and the Azure code trace, when present."""
    console.rule("kvtier capacity planner: Llama-3.1-8B, bf16 KV, 16-token pages")
    example = importlib.resources.files("kvtier") / "examples" / "llama-3.1-8b.json"
    with importlib.resources.as_file(example) as path:
        geometry = load_geometry(path)
    contexts = (8192, 32768) if quick else (8192, 32768, 131072)
    print_plan(console, plan(geometry, "bf16", 16, 80 * GIB, 256 * GIB, 2000 * GIB, contexts))

    candidates = dict.fromkeys([(Path.cwd() / DEMO_TRACE).resolve(), (_REPO_ROOT / DEMO_TRACE).resolve()])
    trace = next((p for p in candidates if p.is_file()), None)
    if trace is None:
        console.print(
            f"trace {DEMO_TRACE} not found (relative to the repository root); skipping the page-size study"
        )
        return
    lengths = read_lengths_csv(trace, DEMO_TRACE_COLUMN)
    print_study(
        console, page_size_study(lengths, budget_tokens=4096), f"{trace.name} column {DEMO_TRACE_COLUMN}"
    )


def plan_json(result: CapacityPlan, study: PageSizeStudy | None = None) -> dict[str, Any]:
    g = result.geometry
    tiers = result.tiers
    out: dict[str, Any] = {
        "model": {
            "architecture": g.architecture,
            "model_type": g.model_type,
            "attention": g.attention_kind,
            "num_layers": g.num_layers,
            "num_attention_heads": g.num_attention_heads,
            "num_kv_heads": g.num_kv_heads,
            "head_dim": g.head_dim,
            "hidden_size": g.hidden_size,
            "vocab_size": g.vocab_size,
            "num_experts": g.num_experts,
            "param_count": g.param_count,
            "weights_dtype": g.weights_dtype,
            "max_position_embeddings": g.max_position_embeddings,
        },
        "kv_dtype": result.kv_dtype,
        "page_size": result.page_size,
        "headroom": result.headroom,
        "bytes_per_token": _json_number(result.bytes_per_token),
        "bytes_per_page": result.bytes_per_page,
        "lower_bytes_per_page": result.lower_bytes_per_page,
        "weights_bytes": g.weights_bytes,
        "weights_source": g.weights_source,
        "latent": g.is_latent,
        "note": result.latent_note,
        "budget_bytes": {t.tier: t.budget_bytes for t in tiers},
        "kv_budget_bytes": {t.tier: t.kv_bytes for t in tiers},
        "pages": {t.tier: t.num_pages for t in tiers},
        "tokens": {t.tier: t.num_tokens for t in tiers},
        "sessions": {t.tier: {str(n): s for n, s in t.sessions.items()} for t in tiers},
        "notes": list(result.notes),
    }
    if study is not None:
        out["page_size_study"] = {
            "num_requests": study.num_requests,
            "num_tokens": study.num_tokens,
            "max_length": study.max_length,
            "budget_tokens": study.budget_tokens,
            "rows": [
                {
                    "page_size": r.page_size,
                    "fragmentation_pct": r.fragmentation_pct,
                    "page_table_entries": r.num_page_table_entries,
                    "mean_entries_per_request": r.mean_entries_per_request,
                    "fit_budget_pct": r.fit_budget_pct,
                }
                for r in study.rows
            ],
        }
    return out


def print_plan(console: Console, result: CapacityPlan) -> None:
    g = result.geometry
    heads = f"{g.num_attention_heads} query / {g.num_kv_heads} KV heads, head_dim {g.head_dim}"
    if g.is_latent:
        heads = f"{g.num_attention_heads} query heads, one {g.latent_dim}-element latent per layer"
    console.print(
        f"[bold]{escape(g.architecture)}[/bold] ({escape(g.model_type)}): {g.num_layers} layers, "
        f"{g.attention_kind} {heads}"
    )
    console.print(
        f"weights: {g.param_count / 1e9:,.2f} B params x {g.weights_dtype} = {_format_bytes(g.weights_bytes)} "
        f"({g.weights_source})"
    )
    console.print(
        f"KV: {_format_bytes(result.bytes_per_token)} per token ({result.kv_dtype}), "
        f"page of {result.page_size} tokens = {_format_bytes(result.bytes_per_page)}"
    )

    per_session = Table(title="one session")
    for name in ("context tokens", "pages", "KV bytes"):
        per_session.add_column(name, justify="right")
    for n in result.context_lengths:
        pages = math.ceil(n / result.page_size)
        per_session.add_row(f"{n:,}", f"{pages:,}", _format_bytes(pages * result.bytes_per_page))
    console.print(per_session)

    tiers = Table(title=f"per tier (HBM headroom {result.headroom:.0%} after weights)")
    for name in ("tier", "budget", "reserved", "KV bytes", "pages", "tokens"):
        tiers.add_column(name, justify="left" if name == "tier" else "right")
    for n in result.context_lengths:
        tiers.add_column(f"sessions @ {n:,}", justify="right")
    for t in result.tiers:
        tiers.add_row(
            _TIER_LABELS[t.tier],
            _format_bytes(t.budget_bytes),
            _format_bytes(t.reserved_bytes),
            _format_bytes(t.kv_bytes),
            f"{t.num_pages:,}",
            f"{t.num_tokens:,}",
            *(f"{t.sessions[n]:,}" for n in result.context_lengths),
        )
    console.print(tiers)
    for note in result.notes:
        console.print(f"note: {escape(note)}")


def print_study(console: Console, study: PageSizeStudy, source: str) -> None:
    mean = study.num_tokens / study.num_requests
    table = Table(
        title=f"page-size study: {study.num_requests:,} requests from {escape(source)}, "
        f"mean {mean:,.0f} tokens, max {study.max_length:,}"
    )
    columns = ["page size", "fragmentation", "page-table entries", "entries / request"]
    if study.budget_tokens is not None:
        columns.append(f"fit {study.budget_tokens:,} tokens")
    for name in columns:
        table.add_column(name, justify="right")
    for r in study.rows:
        cells = [str(r.page_size), f"{r.fragmentation_pct:.2f} %", f"{r.num_page_table_entries:,}"]
        cells.append(f"{r.mean_entries_per_request:,.1f}")
        if r.fit_budget_pct is not None:
            cells.append(f"{r.fit_budget_pct:.1f} %")
        table.add_row(*cells)
    console.print(table)


def main(argv: list[str] | None = None) -> None:
    try:
        app(args=argv, prog_name="kvtier")
    except CommandFailed as exc:
        fail(str(exc), exc.exit_code)
    except KvtierError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"{exc.strerror or exc}: {exc.filename}" if exc.filename else str(exc))


if __name__ == "__main__":
    main()
