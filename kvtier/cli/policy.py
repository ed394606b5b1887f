"""``kvtier policy``: show, set, history and rollback of the tiering policy (Admin.*Policy).

A policy is written either as a file (YAML or JSON, the shape ``policy show --json``
prints, with or without its version fields) or as flags applied on top of the policy in
force (or on top of ``--file``)::

    --watermark hbm=0.9:0.8        demote HBM above 90 % until back at 80 % (high:low)
    --watermark nvme=none          never demote NVMe proactively
    --budget dram=256MiB           move at most 256 MiB/s into DRAM; dram=none: unlimited
    --weight nvme=0.3              router weight of a token cached on NVMe

Flags are checked here, before anything is sent, and an error names the flag; the whole
policy is then checked as the controller will check it (``Policy.validate``).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
import yaml
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
from kvtier.domain.errors import InvalidArgument
from kvtier.domain.records import Policy, VersionedPolicy, Watermarks
from kvtier.domain.tiers import TIER_LABELS, Tier

V = TypeVar("V")

policy_app = typer.Typer(
    name="policy",
    help="The tiering policy: watermarks, router tier weights, transfer budgets; versioned.",
    no_args_is_help=True,
    rich_markup_mode="rich",
)
app.add_typer(policy_app, name="policy")

_POLICY_KEYS = ("watermarks", "tier_weights", "budget_bytes_per_s", "eviction_policy")
_VERSION_KEYS = ("version", "set_by", "set_at_ms", "reason")
_NONE = frozenset({"none", "off", "unset"})
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*(?:/s)?\s*$")
# Units as kvtier.runtime.config accepts them in sizes: binary (KiB, Mi) and decimal (KB, G).
_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30, "gib": 2**30, "ti": 2**40, "tib": 2**40,
}  # fmt: skip


# ---- parsing ---------------------------------------------------------------------------------


def _tier_entry(text: str, flag: str) -> tuple[Tier, str]:
    """``"hbm=0.9:0.8"`` -> (Tier.HBM, "0.9:0.8")."""
    name, sep, value = text.partition("=")
    if not sep or not value.strip():
        raise InvalidArgument(f"{flag} takes TIER=VALUE (tiers: {', '.join(TIER_LABELS)}), got {text!r}", field=flag)
    return Tier.parse(name, field=flag), value.strip()


def _fraction(text: str, flag: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise InvalidArgument(f"{flag}: {what} must be a number in [0, 1], got {text!r}", field=flag) from None
    if not 0.0 <= value <= 1.0:
        raise InvalidArgument(f"{flag}: {what} must be a fraction in [0, 1], got {value:g}", field=flag)
    return value


def parse_watermark(text: str, flag: str = "--watermark") -> tuple[Tier, Watermarks | None]:
    """``hbm=0.9:0.8`` (high:low) or ``hbm=none`` (no proactive demotion)."""
    tier, value = _tier_entry(text, flag)
    if value.lower() in _NONE:
        return tier, None
    high_text, sep, low_text = value.partition(":")
    if not sep:
        raise InvalidArgument(f"{flag} takes TIER=HIGH:LOW such as hbm=0.9:0.8, got {text!r}", field=flag)
    high = _fraction(high_text, flag, f"{tier.label} high")
    low = _fraction(low_text, flag, f"{tier.label} low")
    if low > high:
        raise InvalidArgument(
            f"{flag}: {tier.label} low ({low:g}) must be <= high ({high:g}); the form is TIER=HIGH:LOW", field=flag
        )
    return tier, Watermarks(high=high, low=low)


def parse_size(text: str, flag: str) -> int:
    """Bytes from ``268435456``, ``256MiB``, ``2GB`` (an optional ``/s`` is allowed)."""
    match = _SIZE.match(text)
    unit = _SIZE_UNITS.get(match.group(2).lower()) if match else None
    if match is None or unit is None:
        raise InvalidArgument(
            f"{flag}: expected a size in bytes per second such as 268435456, 256MiB or 2GB, got {text!r}", field=flag
        )
    value = float(match.group(1)) * unit
    if value != int(value):
        raise InvalidArgument(f"{flag}: {text!r} is not a whole number of bytes", field=flag)
    return int(value)


def parse_budget(text: str, flag: str = "--budget") -> tuple[Tier, int | None]:
    """``dram=256MiB`` (bytes per second moved into the tier) or ``dram=none`` (unlimited)."""
    tier, value = _tier_entry(text, flag)
    return tier, None if value.lower() in _NONE else parse_size(value, flag)


def parse_weight(text: str, flag: str = "--weight") -> tuple[Tier, float | None]:
    """``nvme=0.3`` (router weight of a cached token, >= 0) or ``nvme=none`` (weighs 0)."""
    tier, value = _tier_entry(text, flag)
    if value.lower() in _NONE:
        return tier, None
    try:
        weight = float(value)
    except ValueError:
        weight = math.nan
    if not (math.isfinite(weight) and weight >= 0):
        raise InvalidArgument(f"{flag}: {tier.label} weight must be a finite number >= 0, got {value!r}", field=flag)
    return tier, weight


def _updated(mapping: Mapping[Tier, V], entries: Sequence[tuple[Tier, V | None]]) -> dict[Tier, V]:
    result = dict(mapping)
    for tier, value in entries:
        if value is None:
            result.pop(tier, None)
        else:
            result[tier] = value
    return result


def apply_flags(
    base: Policy,
    *,
    watermarks: Sequence[str] = (),
    budgets: Sequence[str] = (),
    weights: Sequence[str] = (),
    eviction_policy: str | None = None,
) -> Policy:
    """``base`` with the flags applied (later flags for the same tier win), validated."""
    policy = Policy(
        watermarks=_updated(base.watermarks, [parse_watermark(w) for w in watermarks]),
        tier_weights=_updated(base.tier_weights, [parse_weight(w) for w in weights]),
        budget_bytes_per_s=_updated(base.budget_bytes_per_s, [parse_budget(b) for b in budgets]),
        eviction_policy=base.eviction_policy if eviction_policy is None else eviction_policy,
    )
    policy.validate("policy")
    return policy


def _tier_map(data: Any, where: str, read: Callable[[Any, str], V]) -> dict[Tier, V]:
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise InvalidArgument(f"{where} must map tier names ({', '.join(TIER_LABELS)}) to values", field=where)
    return {
        Tier.parse(str(label), field=f"{where}.{label}"): read(value, f"{where}.{label}")
        for label, value in data.items()
    }


def _read_watermarks(value: Any, where: str) -> Watermarks:
    if not isinstance(value, Mapping) or set(value) != {"high", "low"}:
        raise InvalidArgument(f"{where} must be a mapping with exactly 'high' and 'low'", field=where)
    return Watermarks(high=_number(value["high"], f"{where}.high"), low=_number(value["low"], f"{where}.low"))


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgument(f"{where} must be a number, got {value!r}", field=where)
    return float(value)


def _budget(value: Any, where: str) -> int:
    if isinstance(value, str):
        return parse_size(value, where)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{where} must be whole bytes per second or a size such as 256MiB", field=where)
    return value


def policy_from_mapping(data: Any, source: str) -> Policy:
    """A policy from a parsed file; accepts ``policy show --json`` output (version fields ignored).
    Errors name the field (``policy.watermarks.hbm.low``) and start with ``source``."""
    try:
        return _policy_from_mapping(data, source)
    except InvalidArgument as exc:
        message = str(exc) if str(exc).startswith(source) else f"{source}: {exc}"
        raise InvalidArgument(message, field=exc.field) from None


def _policy_from_mapping(data: Any, source: str) -> Policy:
    if isinstance(data, Mapping) and "policy" in data and set(data) <= {"policy", *_VERSION_KEYS}:
        data = data["policy"]
    if not isinstance(data, Mapping):
        raise InvalidArgument(f"{source} must hold a mapping with keys {', '.join(_POLICY_KEYS)}", field=source)
    for key in data:
        if key not in _POLICY_KEYS:
            raise InvalidArgument(
                f"{source}: unknown key {key!r}; a policy has {', '.join(_POLICY_KEYS)}", field=f"{source}:{key}"
            )
    eviction = data.get("eviction_policy", "experts")
    if not isinstance(eviction, str):
        raise InvalidArgument(f"{source}: eviction_policy must be a string", field="policy.eviction_policy")
    policy = Policy(
        watermarks=_tier_map(data.get("watermarks"), "policy.watermarks", _read_watermarks),
        tier_weights=_tier_map(data.get("tier_weights"), "policy.tier_weights", _number),
        budget_bytes_per_s=_tier_map(data.get("budget_bytes_per_s"), "policy.budget_bytes_per_s", _budget),
        eviction_policy=eviction,
    )
    policy.validate("policy")
    return policy


def policy_from_file(path: Path) -> Policy:
    """YAML (``.yaml``/``.yml``) or JSON (anything else) holding a policy."""
    text = path.read_text(encoding="utf-8")  # OSError: main prints it as one line
    is_yaml = path.suffix.lower() in (".yaml", ".yml")
    try:
        data = yaml.safe_load(text) if is_yaml else json.loads(text)
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        kind = "YAML" if is_yaml else "JSON"
        raise InvalidArgument(f"--file {path} is not valid {kind}: {exc}", field="--file") from None
    return policy_from_mapping(data, f"--file {path}")


# ---- output ----------------------------------------------------------------------------------


def _when(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC") if ms else "-"


def print_policy(versioned: VersionedPolicy) -> None:
    p = versioned.policy
    table = Table(
        title=f"policy v{versioned.version}: set by {versioned.set_by or '-'} at {_when(versioned.set_at_ms)}"
        + (f" ({versioned.reason})" if versioned.reason else "")
    )
    for name in ("tier", "demote above", "down to", "router weight", "budget in"):
        table.add_column(name, justify="left" if name == "tier" else "right")
    for tier in Tier:
        marks = p.watermarks.get(tier)
        budget = p.budget_bytes_per_s.get(tier)
        table.add_row(
            tier.label,
            f"{marks.high:.0%}" if marks else "never",
            f"{marks.low:.0%}" if marks else "-",
            f"{p.tier_weights.get(tier, 0.0):g}",
            f"{_format_bytes(budget)}/s" if budget is not None else "unlimited",
        )
    console = _console()
    console.print(table)
    console.print(f"eviction policy: {p.eviction_policy}")


# ---- commands --------------------------------------------------------------------------------


@policy_app.command("show")
def show_command(
    version: Annotated[int | None, typer.Option(min=1, help="Show this version instead of the one in force.")] = None,
    controller: ControllerOption = None,
    token: TokenOption = None,
    timeout_s: TimeoutOption = 10.0,
    as_json: JsonOption = False,
) -> None:
    """The policy in force (or an earlier version).

    [bold]Examples[/bold]

      kvtier policy show
      kvtier policy show --version 3 --json > policy.json
    """
    versioned = Remote.of(controller, token, timeout_s).run(lambda client: client.get_policy(version))
    if as_json:
        print_json(versioned)
    else:
        print_policy(versioned)


@policy_app.command("set")
def set_command(
    file: Annotated[
        Path | None,
        typer.Option(help="YAML or JSON policy (the shape `policy show --json` prints); replaces the whole policy."),
    ] = None,
    watermark: Annotated[
        list[str] | None, typer.Option(help="TIER=HIGH:LOW fractions, or TIER=none; repeatable.")
    ] = None,
    budget: Annotated[
        list[str] | None, typer.Option(help="TIER=BYTES per second moved into the tier (256MiB), or TIER=none.")
    ] = None,
    weight: Annotated[list[str] | None, typer.Option(help="TIER=WEIGHT router weight of a cached token (>= 0).")] = None,
    eviction_policy: Annotated[str | None, typer.Option(help="Eviction policy name, e.g. value.")] = None,
    expected_version: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Fail unless this is the version in force. Default: the version the flags were applied to "
            "(none with --file alone).",
        ),
    ] = None,
    reason: Annotated[str, typer.Option(help="Why, for the audit log (policy history).")] = "",
    controller: ControllerOption = None,
    token: TokenOption = None,
    timeout_s: TimeoutOption = 10.0,
    as_json: JsonOption = False,
) -> None:
    """Install a new policy version: a file, or flags applied to the policy in force.

    [bold]Examples[/bold]

      kvtier policy set --watermark hbm=0.9:0.8 --reason "more headroom"
      kvtier policy set --budget dram=256MiB --weight nvme=0.3
      kvtier policy set --file policy.yaml --expected-version 4
    """
    flags: dict[str, Any] = dict(
        watermarks=watermark or (), budgets=budget or (), weights=weight or (), eviction_policy=eviction_policy
    )
    if file is None and not any(value is not None and value != () for value in flags.values()):
        raise InvalidArgument(
            "nothing to set: give --file, or at least one of --watermark, --budget, --weight, --eviction-policy",
            field="--file",
        )
    from_file = policy_from_file(file) if file is not None else None
    apply_flags(from_file or Policy(), **flags)  # bad flags fail here, before anything is sent

    async def install(client: Any) -> VersionedPolicy:
        expected = expected_version
        if from_file is not None:
            base = from_file
        else:
            current = await client.get_policy()
            base = current.policy
            expected = current.version if expected is None else expected
        return await client.set_policy(apply_flags(base, **flags), expected_version=expected, reason=reason)

    versioned = Remote.of(controller, token, timeout_s).run(install)
    if as_json:
        print_json(versioned)
    else:
        print_policy(versioned)


@policy_app.command("history")
def history_command(
    limit: Annotated[int, typer.Option(min=1, max=1000, help="Most versions to list, newest first.")] = 20,
    controller: ControllerOption = None,
    token: TokenOption = None,
    timeout_s: TimeoutOption = 10.0,
    as_json: JsonOption = False,
) -> None:
    """Installed policy versions, newest first: who, when, why, what.

    [bold]Examples[/bold]

      kvtier policy history
      kvtier policy history --limit 5 --json
    """
    versions = Remote.of(controller, token, timeout_s).run(lambda client: client.policy_history(limit))
    if as_json:
        print_json({"policies": versions})
        return
    table = Table(title="policy history (newest first)")
    for name in ("version", "set at", "set by", "reason", "watermarks high/low", "weights", "budgets"):
        table.add_column(name)
    for v in versions:
        p = v.policy
        table.add_row(
            str(v.version),
            _when(v.set_at_ms),
            v.set_by or "-",
            v.reason or "-",
            " ".join(f"{t.label}={m.high:g}:{m.low:g}" for t, m in sorted(p.watermarks.items())) or "-",
            " ".join(f"{t.label}={w:g}" for t, w in sorted(p.tier_weights.items())) or "-",
            " ".join(f"{t.label}={_format_bytes(b)}/s" for t, b in sorted(p.budget_bytes_per_s.items())) or "-",
        )
    _console().print(table)


@policy_app.command("rollback")
def rollback_command(
    version: Annotated[int, typer.Argument(min=1, help="The version whose policy becomes the newest version.")],
    reason: Annotated[str, typer.Option(help="Why, for the audit log.")] = "",
    controller: ControllerOption = None,
    token: TokenOption = None,
    timeout_s: TimeoutOption = 10.0,
    as_json: JsonOption = False,
) -> None:
    """Install a copy of an earlier version as the newest version (history is never rewritten).

    [bold]Example[/bold]

      kvtier policy rollback 3 --reason "v4 thrashed DRAM"
    """
    versioned = Remote.of(controller, token, timeout_s).run(lambda client: client.rollback_policy(version, reason))
    if as_json:
        print_json(versioned)
    else:
        print_policy(versioned)

