"""Operator commands over Admin gRPC: models (Router.ListModels), workers, tiers, sessions,
lookup, invalidate, drain, pin, unpin, evict, snapshot (DESIGN §6 "Client and CLI"); ``kvtier.cli.bench`` and
``kvtier.cli.policy`` hold ``bench`` and ``policy``.

Each command resolves where the controller is (``Remote``), makes its calls through
``kvtier.client``, and prints a table, or with ``--json`` one JSON document. Commands that
name a namespace take its identity fields as flags; the model fields default to the model
the registered workers serve, so ``--tenant acme`` alone names acme's namespace of the one
served model. Token ids given with ``--tokens`` are sent, never printed or logged.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvtier.cli.common import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    CommandFailed,
    ControllerOption,
    JsonOption,
    Remote,
    TimeoutOption,
    TokenOption,
    _console,
    _format_bytes,
    app,
    print_json,
    stderr_console,
)
from kvtier.client import AsyncClient
from kvtier.domain.errors import InvalidArgument
from kvtier.domain.hashing import KV_DTYPES, NamespaceIdentity
from kvtier.domain.records import (
    InvalidationScope,
    ModelIdentity,
    SessionInfo,
    SessionState,
    TierOccupancy,
    TokenPrefix,
    WorkerInfo,
    WorkerState,
)
from kvtier.domain.tiers import Tier

# ---- shared flags ----------------------------------------------------------------------------

ModelOption = Annotated[
    str | None,
    typer.Option(
        "--model",
        show_default=False,
        help="model_id of the namespace. Default: the model the registered workers serve (when it is one).",
    ),
]
TenantOption = Annotated[str | None, typer.Option("--tenant", show_default=False, help="Tenant of the namespace.")]
AdapterOption = Annotated[str, typer.Option("--adapter", help="Adapter of the namespace; empty for none.")]
WeightsDigestOption = Annotated[
    str | None, typer.Option("--weights-digest", show_default=False, help="Default: the serving worker's.")
]
TokenizerDigestOption = Annotated[
    str | None, typer.Option("--tokenizer-digest", show_default=False, help="Default: the serving worker's.")
]
RopeConfigOption = Annotated[
    str | None, typer.Option("--rope-config", show_default=False, help="Default: the serving worker's.")
]
KvDtypeOption = Annotated[
    str | None, typer.Option("--kv-dtype", show_default=False, help="KV dtype. Default: the serving worker's.")
]
PageSizeOption = Annotated[
    int | None, typer.Option("--page-size", min=1, show_default=False, help="Default: the serving worker's.")
]
TokensOption = Annotated[
    str | None,
    typer.Option("--tokens", show_default=False, help="Prefix token ids, comma-separated: 1,2,3."),
]
TokensFileOption = Annotated[
    Path | None,
    typer.Option(
        "--tokens-file", show_default=False, help="File of prefix token ids: a JSON list, or whitespace/comma separated."
    ),
]


@dataclasses.dataclass(frozen=True, slots=True)
class NamespaceFlags:
    """The namespace identity flags as given; ``None`` means "the serving worker's value"."""

    model: str | None = None
    tenant: str | None = None
    adapter: str = ""
    weights_digest: str | None = None
    tokenizer_digest: str | None = None
    rope_config: str | None = None
    kv_dtype: str | None = None
    page_size: int | None = None

    def check(self) -> None:
        if self.kv_dtype is not None and self.kv_dtype not in KV_DTYPES:
            raise InvalidArgument(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}", field="--kv-dtype")

    def resolve(self, workers: tuple[WorkerInfo, ...]) -> NamespaceIdentity:
        """Model fields from the registered workers serving ``--model`` (or the one served model),
        overridden by the flags given. Raises ``CommandFailed`` (exit 2) when the model is ambiguous."""
        serving = [w for w in workers if w.state is not WorkerState.EXPIRED]
        if self.model is not None:
            serving = [w for w in serving if w.model.model_id == self.model]
        models = {(w.model, w.page_size) for w in serving}
        if len(models) == 1:
            (model, page_size), = models
        elif self.model is not None:
            model, page_size = ModelIdentity(model_id=self.model), 16
        elif not models:
            raise CommandFailed(
                "no worker is registered, so the namespace's model is unknown; pass --model and the namespace "
                "fields (--weights-digest, --tokenizer-digest, --kv-dtype, --page-size ...)",
                EXIT_BAD_INPUT,
            )
        else:
            served = ", ".join(sorted({m.model_id for m, _ in models}))
            raise CommandFailed(f"the workers serve several models ({served}); pass --model", EXIT_BAD_INPUT)
        return NamespaceIdentity(
            model_id=model.model_id,
            weights_digest=_given(self.weights_digest, model.weights_digest),
            tokenizer_digest=_given(self.tokenizer_digest, model.tokenizer_digest),
            adapter=self.adapter,
            rope_config=_given(self.rope_config, model.rope_config),
            kv_dtype=_given(self.kv_dtype, model.kv_dtype),
            page_size=_given(self.page_size, page_size),
            tenant=self.tenant or "",
        )


def _given(flag: Any, default: Any) -> Any:
    return default if flag is None else flag


def parse_tokens(text: str, flag: str) -> tuple[int, ...]:
    """Token ids from ``1,2,3`` / whitespace / a JSON list. Errors never echo the ids."""
    body = text.strip()
    if body.startswith("["):
        body = body[1:].rstrip().removesuffix("]")
    items = [item for item in body.replace(",", " ").split() if item]
    if not items:
        raise InvalidArgument(f"{flag} holds no token ids", field=flag)
    ids = []
    for i, item in enumerate(items):
        if not item.isdigit():
            raise InvalidArgument(f"{flag}: item {i} is not a token id (a whole number >= 0)", field=flag)
        ids.append(int(item))
    return tuple(ids)


def tokens_from_flags(tokens: str | None, tokens_file: Path | None, *, required: bool) -> tuple[int, ...] | None:
    if tokens is not None and tokens_file is not None:
        raise InvalidArgument("give --tokens or --tokens-file, not both", field="--tokens")
    if tokens is not None:
        return parse_tokens(tokens, "--tokens")
    if tokens_file is not None:
        return parse_tokens(tokens_file.read_text(encoding="utf-8"), f"--tokens-file {tokens_file}")
    if required:
        raise InvalidArgument("the prefix is required: pass --tokens 1,2,3 or --tokens-file FILE", field="--tokens")
    return None


def _tier_flag(name: str, flag: str) -> Tier:
    return Tier.parse(name, field=flag)


def _find_worker(workers: tuple[WorkerInfo, ...], worker_id: str, remote: Remote) -> WorkerInfo:
    for w in workers:
        if w.worker_id == worker_id:
            return w
    known = ", ".join(w.worker_id for w in workers) or "none"
    raise CommandFailed(f"worker {worker_id!r} is not registered at {remote.address} (registered: {known})", EXIT_FAILED)


def _pages(occupancies: tuple[TierOccupancy, ...], tier: Tier) -> str:
    for occ in occupancies:
        if occ.tier is tier:
            return f"{occ.cached_pages + occ.in_use_pages:,} / {occ.total_pages:,}"
    return "-"


def _ago(ms: int) -> str:
    return f"{max(0.0, time.time() - ms / 1000):.1f} s ago" if ms else "never"


def _at(ms: int | None) -> str:
    if ms is None:
        return "-"
    delta_s = ms / 1000 - time.time()
    return f"in {delta_s:.1f} s" if delta_s >= 0 else f"{-delta_s:.1f} s ago"


# ---- models, workers and tiers ----------------------------------------------------------------


@app.command("models")
def models_command(
    controller: ControllerOption = None,
    token: TokenOption = None,
    timeout_s: TimeoutOption = 10.0,
    as_json: JsonOption = False,
) -> None:
    """Served models: the exact namespace fields a frontend sends, vocabulary, context, EOS ids,
    chat template, KV dtype and live workers (Router.ListModels; a frontend token is enough).

    [bold]Examples[/bold]

      kvtier models
      kvtier models --json | jq '.models[0].namespace'
    """
    models = Remote.of(controller, token, timeout_s).run(lambda client: client.list_models())
    if as_json:
        print_json({"models": models})
        return
    table = Table(title=f"{len(models)} served model(s); send the namespace fields exactly as `--json` shows")
    for name in ("model", "page", "kv dtype", "weights", "rope", "vocab", "context", "eos", "chat", "workers"):
        table.add_column(name, justify="right" if name in ("page", "vocab", "context", "workers") else "left")
    for m in models:
        ns, facts = m.namespace, m.facts
        table.add_row(
            ns.model_id, str(ns.page_size), ns.kv_dtype, ns.weights_digest[:8] or "-", ns.rope_config or "-",
            f"{facts.vocab_size:,}" if facts else "?", f"{facts.max_context_tokens:,}" if facts else "?",
            ",".join(map(str, facts.eos_token_ids)) if facts else "?",
            ("yes" if facts.has_chat_template else "no") if facts else "?", str(m.num_workers),
        )
    _console().print(table)


@app.command("workers")
def workers_command(
    controller: ControllerOption = None,
    token: TokenOption = None,
    timeout_s: TimeoutOption = 10.0,
    as_json: JsonOption = False,
) -> None:
    """Registered workers: state, address, model, pages used per tier, load, last heartbeat.

    [bold]Examples[/bold]

      kvtier workers
      kvtier workers --json | jq '.workers[] | select(.state == "draining") | .worker_id'
    """
    workers = Remote.of(controller, token, timeout_s).run(lambda client: client.list_workers())
    if as_json:
        print_json({"workers": workers})
        return
    table = Table(title=f"{len(workers)} worker(s); pages used (cached + in use) / total per tier")
    for name in ("worker", "state", "address", "model", "page", "HBM", "DRAM", "NVMe", "queued", "running", "heartbeat"):
        table.add_column(name, justify="right" if name in ("page", "HBM", "DRAM", "NVMe", "queued", "running") else "left")
    for w in workers:
        table.add_row(
            w.worker_id,
            w.state.value.upper() if w.state is not WorkerState.LIVE else w.state.value,
            w.address,
            w.model.model_id,
            str(w.page_size),
            *(_pages(w.tiers, tier) for tier in Tier),
            str(w.queue_depth),
            str(w.num_running_seqs),
            _ago(w.last_heartbeat_at_ms),
        )
    _console().print(table)


def _sum_tiers(workers: tuple[WorkerInfo, ...]) -> dict[Tier, dict[str, Any]]:
    """Occupancy and capacity per tier, summed over live and draining workers (expired ones hold
    nothing). ``capacity_bytes`` is None for a tier no worker reported a capacity for."""
    totals: dict[Tier, dict[str, Any]] = {
        tier: {**dict.fromkeys(_OCCUPANCY_FIELDS, 0), "capacity_bytes": None} for tier in Tier
    }
    for w in workers:
        if w.state is WorkerState.EXPIRED:
            continue
        for occ in w.tiers:
            for name in _OCCUPANCY_FIELDS:
                totals[occ.tier][name] += getattr(occ, name)
        for cap in w.capacities:
            totals[cap.tier]["capacity_bytes"] = (totals[cap.tier]["capacity_bytes"] or 0) + cap.capacity_bytes
    return totals


_OCCUPANCY_FIELDS = ("total_pages", "free_pages", "cached_pages", "in_use_pages", "pinned_pages", "reclaimable_pages")


def _tier_row(tier: Tier, counts: dict[str, Any]) -> dict[str, Any]:
    used = counts["cached_pages"] + counts["in_use_pages"]
    return {
        "tier": tier.label,
        **counts,
        "used_fraction": used / counts["total_pages"] if counts["total_pages"] else 0.0,
    }


@app.command("tiers")
def tiers_command(
    controller: ControllerOption = None,
    token: TokenOption = None,
    timeout_s: TimeoutOption = 10.0,
    as_json: JsonOption = False,
) -> None:
    """Tier occupancy: pages free, cached (and of those reclaimable: free to take at no copy), in use
    and pinned, summed over workers and per worker.

    [bold]Examples[/bold]

      kvtier tiers
      kvtier tiers --json | jq '.tiers[] | {tier, used_fraction}'
    """
    workers = Remote.of(controller, token, timeout_s).run(lambda client: client.list_workers())
    summed = [_tier_row(tier, counts) for tier, counts in _sum_tiers(workers).items()]
    per_worker = {
        w.worker_id: [_tier_row(tier, counts) for tier, counts in _sum_tiers((w,)).items()]
        for w in workers
        if w.state is not WorkerState.EXPIRED
    }
    if as_json:
        print_json({"tiers": summed, "workers": per_worker})
        return
    columns = ("tier", "capacity", "total", "free", "cached", "reclaimable", "in use", "pinned", "used")
    console = _console()
    for title, rows in [("all workers", summed), *((f"worker {wid}", rows) for wid, rows in per_worker.items())]:
        table = Table(title=f"tiers: {title}")
        for name in columns:
            table.add_column(name, justify="left" if name == "tier" else "right")
        for r in rows:
            table.add_row(
                r["tier"],
                _format_bytes(r["capacity_bytes"]) if r["capacity_bytes"] is not None else "-",
                f"{r['total_pages']:,}",
                f"{r['free_pages']:,}",
                f"{r['cached_pages']:,}",
                f"{r['reclaimable_pages']:,}",
                f"{r['in_use_pages']:,}",
                f"{r['pinned_pages']:,}",
                f"{r['used_fraction']:.1%}",
            )
        console.print(table)


# ---- sessions and lookup ---------------------------------------------------------------------


def _session_state(name: str | None) -> SessionState | None:
    if name is None:
        return None
    try:
        return SessionState(name.strip().lower())
    except ValueError:
        valid = ", ".join(s.value for s in SessionState)
        raise InvalidArgument(f"--state must be one of {valid}, got {name!r}", field="--state") from None


@app.command("sessions")
def sessions_command(
    state: Annotated[
        str | None, typer.Option(show_default=False, help="Only sessions in this state: active, paused, resuming, ended.")
    ] = None,
    limit: Annotated[int, typer.Option(min=1, help="Most sessions to list (fetched page by page).")] = 1000,
    controller: ControllerOption = None,
    token: TokenOption = None,
    timeout_s: TimeoutOption = 10.0,
    as_json: JsonOption = False,
) -> None:
    """Sessions the controller tracks: state, worker, tool call, predicted return and prefetch.

    [bold]Examples[/bold]

      kvtier sessions
      kvtier sessions --state paused --json
    """
    wanted = _session_state(state)

    async def fetch(client: AsyncClient) -> tuple[list[SessionInfo], bool]:
        sessions: list[SessionInfo] = []
        async for session in client.iter_sessions(wanted, page_size=min(limit, 1000)):
            if len(sessions) == limit:
                return sessions, True
            sessions.append(session)
        return sessions, False

    sessions, truncated = Remote.of(controller, token, timeout_s).run(fetch)
    if as_json:
        print_json({"sessions": sessions, "truncated": truncated})
        return
    table = Table(title=f"{len(sessions)} session(s)" + (f" (first {limit})" if truncated else ""))
    for name in ("session", "state", "worker", "tool", "paused", "returns", "prefetch", "parked in", "cached tokens"):
        table.add_column(name, justify="right" if name == "cached tokens" else "left")
    for s in sessions:
        table.add_row(
            s.session_id,
            s.state.value,
            s.worker_id or "-",
            s.tool_name or "-",
            _at(s.paused_at_ms),
            _at(s.predicted_return_at_ms) + (f" ({s.prediction_source.value})" if s.prediction_source else ""),
            _at(s.prefetch_at_ms),
            s.parked_tier.label if s.parked_tier else "-",
            f"{s.num_cached_tokens:,}",
        )
    _console().print(table)


@app.command("lookup")
def lookup_command(
    tokens: TokensOption = None,
    tokens_file: TokensFileOption = None,
    model: ModelOption = None,
    tenant: TenantOption = None,
    adapter: AdapterOption = "",
    weights_digest: WeightsDigestOption = None,
    tokenizer_digest: TokenizerDigestOption = None,
    rope_config: RopeConfigOption = None,
    kv_dtype: KvDtypeOption = None,
    page_size: PageSizeOption = None,
    controller: ControllerOption = None,
    token: TokenOption = None,
    timeout_s: TimeoutOption = 10.0,
    as_json: JsonOption = False,
) -> None:
    """Which workers hold a prefix, and in which tiers (the directory's view).

    [bold]Examples[/bold]

      kvtier lookup --tenant acme --tokens 1,2,3,4
      kvtier lookup --model llama-3.1-8b --tokens-file prompt.json --json
    """
    ns_flags = NamespaceFlags(model, tenant, adapter, weights_digest, tokenizer_digest, rope_config, kv_dtype, page_size)
    ns_flags.check()
    prefix = tokens_from_flags(tokens, tokens_file, required=True)
    assert prefix is not None

    async def look(client: AsyncClient) -> tuple[NamespaceIdentity, Any]:
        namespace = ns_flags.resolve(await client.list_workers())
        return namespace, await client.lookup(namespace, TokenPrefix(prefix))

    namespace, result = Remote.of(controller, token, timeout_s).run(look)
    if as_json:
        print_json({"namespace": namespace, **_fields(result)})
        return
    page = namespace.page_size
    table = Table(
        title=f"namespace {result.namespace_digest.hex()[:8]} (model {namespace.model_id}, tenant "
        f"{namespace.tenant or '-'}): {len(prefix)} tokens, {result.num_query_pages} full page(s)"
    )
    for name in ("worker", "HBM tokens", "DRAM tokens", "NVMe tokens", "matched", "of full pages"):
        table.add_column(name, justify="left" if name == "worker" else "right")
    for m in result.matches:
        t = m.matched_tokens
        table.add_row(
            m.worker_id, f"{t.hbm_tokens:,}", f"{t.dram_tokens:,}", f"{t.nvme_tokens:,}", f"{t.total_tokens:,}",
            f"{t.total_tokens / (result.num_query_pages * page):.0%}" if result.num_query_pages else "-",
        )
    console = _console()
    console.print(table)
    if not result.matches:
        console.print("no worker holds any page of this prefix")


def _fields(record: Any) -> dict[str, Any]:
    """A record's fields as a dict (for merging into a JSON object)."""
    return {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}


# ---- invalidate, pin, unpin, evict -----------------------------------------------------------


@app.command("invalidate")
def invalidate_command(
    tenant: Annotated[str | None, typer.Option(show_default=False, help="Every namespace of this tenant.")] = None,
    model: Annotated[str | None, typer.Option(show_default=False, help="Every namespace of this model_id.")] = None,
    namespace: Annotated[
        bool,
        typer.Option(
            "--namespace",
            help="Exactly one namespace, named by --model/--tenant/--adapter/--weights-digest/... "
            "(model fields default to the serving worker's).",
        ),
    ] = False,
    all_namespaces: Annotated[bool, typer.Option("--all", help="Every namespace (say so explicitly).")] = False,
    adapter: AdapterOption = "",
    weights_digest: WeightsDigestOption = None,
    tokenizer_digest: TokenizerDigestOption = None,
    rope_config: RopeConfigOption = None,
    kv_dtype: KvDtypeOption = None,
    page_size: PageSizeOption = None,
    reason: Annotated[str, typer.Option(help="Why, for the audit log.")] = "",
    controller: ControllerOption = None,
    token: TokenOption = None,
    timeout_s: TimeoutOption = 10.0,
    as_json: JsonOption = False,
) -> None:
    """Make cached pages unreachable at once (bumps the policy epoch); they are reclaimed in the background.

    Exactly one scope: --tenant, --model, --namespace (with its fields) or --all.

    [bold]Examples[/bold]

      kvtier invalidate --tenant acme --reason "tenant data deleted"
      kvtier invalidate --model llama-3.1-8b --reason "new weights"
      kvtier invalidate --namespace --tenant acme --adapter sql-lora
      kvtier invalidate --all --reason "tokenizer fix"
    """
    ns_flags = NamespaceFlags(model, tenant, adapter, weights_digest, tokenizer_digest, rope_config, kv_dtype, page_size)
    ns_flags.check()
    scopes = [flag for flag, on in (("--namespace", namespace), ("--all", all_namespaces)) if on]
    if not namespace:  # with --namespace, --tenant and --model name the namespace instead
        scopes += [flag for flag, value in (("--tenant", tenant), ("--model", model)) if value is not None]
    if len(scopes) != 1:
        raise InvalidArgument(
            "give exactly one scope: --tenant T, --model M, --namespace (with --model/--tenant/... naming it) "
            f"or --all; got {' and '.join(scopes) or 'none'}",
            field="scope",
        )
    for flag, value in (("--tenant", tenant), ("--model", model)):
        if value == "" and not namespace:
            raise InvalidArgument(f"{flag} must not be empty", field=flag)

    async def invalidate(client: AsyncClient) -> tuple[InvalidationScope, Any]:
        if namespace:
            scope = InvalidationScope(namespace=ns_flags.resolve(await client.list_workers()))
        elif all_namespaces:
            scope = InvalidationScope(all_namespaces=True)
        elif tenant is not None:
            scope = InvalidationScope(tenant=tenant)
        else:
            scope = InvalidationScope(model_id=model)
        return scope, await client.invalidate(scope, reason)

    scope, result = Remote.of(controller, token, timeout_s).run(invalidate)
    if as_json:
        print_json({"scope": scope, **_fields(result)})
        return
    what = (
        "every namespace" if scope.all_namespaces
        else f"tenant {scope.tenant}" if scope.tenant is not None
        else f"model {scope.model_id}" if scope.model_id is not None
        else "the namespace"
    )
    _console().print(
        f"invalidated {what}: policy epoch {result.policy_epoch}, {result.num_workers_notified} worker(s) notified"
    )


@app.command("pin")
def pin_command(
    tier: Annotated[str, typer.Option(help="Slowest tier the pinned pages may sink to: hbm, dram or nvme.")],
    tokens: TokensOption = None,
    tokens_file: TokensFileOption = None,
    ttl_s: Annotated[int | None, typer.Option(min=1, show_default=False, help="Seconds until the pin expires; default: never.")] = None,
    model: ModelOption = None,
    tenant: TenantOption = None,
    adapter: AdapterOption = "",
    weights_digest: WeightsDigestOption = None,
    tokenizer_digest: TokenizerDigestOption = None,
    rope_config: RopeConfigOption = None,
    kv_dtype: KvDtypeOption = None,
    page_size: PageSizeOption = None,
    controller: ControllerOption = None,
    token: TokenOption = None,
    timeout_s: TimeoutOption = 10.0,
    as_json: JsonOption = False,
) -> None:
    """Keep a prefix's pages resident (in --tier or faster) until unpinned or the TTL ends.

    [bold]Examples[/bold]

      kvtier pin --tenant acme --tokens-file system_prompt.json --tier hbm
      kvtier pin --tokens 1,2,3,4 --tier dram --ttl-s 3600 --json
    """
    pinned_tier = _tier_flag(tier, "--tier")
    ns_flags = NamespaceFlags(model, tenant, adapter, weights_digest, tokenizer_digest, rope_config, kv_dtype, page_size)
    ns_flags.check()
    prefix = tokens_from_flags(tokens, tokens_file, required=True)
    assert prefix is not None

    async def pin(client: AsyncClient) -> Any:
        namespace = ns_flags.resolve(await client.list_workers())
        return await client.pin(namespace, TokenPrefix(prefix), pinned_tier, ttl_s=ttl_s)

    result = Remote.of(controller, token, timeout_s).run(pin)
    if as_json:
        print_json(result)
        return
    expiry = "never expires" if result.expires_at_ms is None else f"expires {_at(result.expires_at_ms)}"
    _console().print(
        f"pin {result.pin_id}: {result.num_pinned_pages:,} page(s) kept in {pinned_tier.label} or faster; {expiry}"
    )


@app.command("unpin")
def unpin_command(
    pin_id: Annotated[str, typer.Argument(help="The id `kvtier pin` printed.")],
    controller: ControllerOption = None,
    token: TokenOption = None,
    timeout_s: TimeoutOption = 10.0,
    as_json: JsonOption = False,
) -> None:
    """Release a pin; its pages become evictable again.

    [bold]Example[/bold]

      kvtier unpin pin-3f9c2a
    """
    result = Remote.of(controller, token, timeout_s).run(lambda client: client.unpin(pin_id))
    if as_json:
        print_json({"pin_id": pin_id, **_fields(result)})
        return
    _console().print(f"unpinned {pin_id}: {result.num_unpinned_pages:,} page(s) released")


@app.command("evict")
def evict_command(
    tokens: TokensOption = None,
    tokens_file: TokensFileOption = None,
    whole_namespace: Annotated[
        bool, typer.Option("--whole-namespace", help="Evict every page of the namespace (instead of --tokens).")
    ] = False,
    worker: Annotated[str | None, typer.Option(show_default=False, help="Only on this worker; default: every worker.")] = None,
    demote_to: Annotated[
        str | None, typer.Option(show_default=False, help="Demote to this tier (dram, nvme) instead of dropping.")
    ] = None,
    model: ModelOption = None,
    tenant: TenantOption = None,
    adapter: AdapterOption = "",
    weights_digest: WeightsDigestOption = None,
    tokenizer_digest: TokenizerDigestOption = None,
    rope_config: RopeConfigOption = None,
    kv_dtype: KvDtypeOption = None,
    page_size: PageSizeOption = None,
    controller: ControllerOption = None,
    token: TokenOption = None,
    timeout_s: TimeoutOption = 10.0,
    as_json: JsonOption = False,
) -> None:
    """Drop (or demote) a prefix's pages and everything cached after it, or a whole namespace's.

    [bold]Examples[/bold]

      kvtier evict --tenant acme --tokens 1,2,3,4
      kvtier evict --tenant acme --whole-namespace --worker worker-0 --demote-to dram
    """
    target_tier = _tier_flag(demote_to, "--demote-to") if demote_to is not None else None
    ns_flags = NamespaceFlags(model, tenant, adapter, weights_digest, tokenizer_digest, rope_config, kv_dtype, page_size)
    ns_flags.check()
    prefix = tokens_from_flags(tokens, tokens_file, required=False)
    if (prefix is None) == (not whole_namespace):
        raise InvalidArgument(
            "give the prefix (--tokens / --tokens-file) or --whole-namespace, exactly one", field="--whole-namespace"
        )

    async def evict(client: AsyncClient) -> Any:
        namespace = ns_flags.resolve(await client.list_workers())
        return await client.evict(
            namespace, TokenPrefix(prefix) if prefix else None, worker_id=worker, demote_to=target_tier
        )

    result = Remote.of(controller, token, timeout_s).run(evict)
    if as_json:
        print_json(result)
        return
    verb = f"demoted to {target_tier.label}" if target_tier else "dropped"
    _console().print(f"{result.num_pages:,} page(s) {verb} on {result.num_workers} worker(s)")


# ---- drain and snapshot ----------------------------------------------------------------------


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
    pinned ones. (The controller lets running requests finish, then drops the worker's
    cached pages in every tier; see kvtier.controller.worker_admin.)"""
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
        worker = _find_worker(await client.list_workers(), worker_id, remote)


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
    """Take a worker out of service: no new requests; running ones finish, then its cached pages
    are dropped (pinned ones stay). --resume puts it back.

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

