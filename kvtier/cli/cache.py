"""Operator commands on cached pages: ``lookup`` (who holds a prefix), ``invalidate``, ``pin``,
``unpin`` and ``evict``."""


from __future__ import annotations

import dataclasses
from typing import Annotated, Any

import typer
from rich.table import Table

from kvtier.cli.common import (
    ControllerOption,
    JsonOption,
    Remote,
    TimeoutOption,
    TokenOption,
    _console,
    app,
    fail,
    print_json,
)
from kvtier.cli.flags import (
    AdapterOption,
    KvDtypeOption,
    ModelOption,
    NamespaceFlags,
    PageSizeOption,
    RopeConfigOption,
    TenantOption,
    TokenizerDigestOption,
    TokensFileOption,
    TokensOption,
    WeightsDigestOption,
    format_at,
    tier_flag,
    tokens_from_flags,
)
from kvtier.client import AsyncClient
from kvtier.domain.errors import InvalidArgument
from kvtier.domain.hashing import NamespaceIdentity
from kvtier.domain.records import InvalidationScope, TokenPrefix
from kvtier.rpc.convert.limits import MAX_PIN_REPLICAS


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
    replicas: Annotated[int, typer.Option(
        help="Keep this many workers holding the prefix: a copy is made from a survivor when "
        "one is lost or drained; 0: no copies.")] = 0,
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
      kvtier pin --tokens-file system_prompt.json --tier hbm --replicas 2
    """
    pinned_tier = tier_flag(tier, "--tier")
    if not 0 <= replicas <= MAX_PIN_REPLICAS:
        fail(f"--replicas must be 0..{MAX_PIN_REPLICAS}, got {replicas}")
    ns_flags = NamespaceFlags(model, tenant, adapter, weights_digest, tokenizer_digest, rope_config, kv_dtype, page_size)
    ns_flags.check()
    prefix = tokens_from_flags(tokens, tokens_file, required=True)
    assert prefix is not None

    async def pin(client: AsyncClient) -> Any:
        namespace = ns_flags.resolve(await client.list_workers())
        return await client.pin(namespace, TokenPrefix(prefix), pinned_tier, ttl_s=ttl_s, replicas=replicas)

    result = Remote.of(controller, token, timeout_s).run(pin)
    if as_json:
        print_json(result)
        return
    expiry = "never expires" if result.expires_at_ms is None else f"expires {format_at(result.expires_at_ms)}"
    copies = f"; kept on {replicas} worker(s)" if replicas else ""
    _console().print(
        f"pin {result.pin_id}: {result.num_pinned_pages:,} page(s) kept in {pinned_tier.label} or faster; {expiry}"
        f"{copies}"
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
    target_tier = tier_flag(demote_to, "--demote-to") if demote_to is not None else None
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
