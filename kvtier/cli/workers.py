"""``kvtier models``, ``kvtier workers`` and ``kvtier tiers``: what the registered workers serve,
their state, and their tiers' occupancy summed."""


from __future__ import annotations

from typing import Any

from rich.table import Table

from kvtier.cli.common import (
    ControllerOption,
    JsonOption,
    Remote,
    TimeoutOption,
    TokenOption,
    _console,
    _format_bytes,
    app,
    print_json,
)
from kvtier.cli.flags import format_ago, format_pages
from kvtier.domain.records import WorkerInfo, WorkerState
from kvtier.domain.tiers import Tier


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
            *(format_pages(w.tiers, tier) for tier in Tier),
            str(w.queue_depth),
            str(w.num_running_seqs),
            format_ago(w.last_heartbeat_at_ms),
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
