"""Field readers shared by every converter: strings, counts, token ids, keys, digests, durations,
tiers, enums, prefixes and list limits, each raising with the offending field's path."""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable, Sequence, Sized
from typing import Any

from kvtier.domain.errors import InvalidArgument, ResourceExhausted
from kvtier.domain.hashing import KEY_BYTES, NamespaceDigest, PageKey
from kvtier.domain.records import PageKeyPrefix, Prefix, TokenPrefix
from kvtier.domain.tiers import Tier
from kvtier.rpc._gen import common_pb2
from kvtier.rpc.convert.limits import (
    MAX_DURATION_MS,
    MAX_ID_CHARS,
    MAX_LIST_ITEMS,
    MAX_LIST_LIMIT,
    MAX_PREFIX_PAGE_KEYS,
    MAX_PROMPT_TOKENS,
)


def join_path(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def invalid(path: str, message: str) -> InvalidArgument:
    return InvalidArgument(f"{path} {message}", field=path)


def read_string(value: str, path: str, *, required: bool = False, max_chars: int = MAX_ID_CHARS) -> str:
    if required and not value:
        raise invalid(path, "must be set")
    if len(value) > max_chars:
        raise invalid(path, f"must be at most {max_chars} characters, got {len(value)}")
    return value


def read_optional_string(value: str, path: str, *, max_chars: int = MAX_ID_CHARS) -> str | None:
    """Empty string on the wire ↔ None in the domain."""
    return read_string(value, path, max_chars=max_chars) or None


def check_count(values: Sized, path: str, limit: int, *, volume: bool = False) -> None:
    if len(values) > limit:
        error = ResourceExhausted if volume else InvalidArgument
        raise error(f"{path} has {len(values)} items; at most {limit} are allowed", field=path)


def read_token_ids(values: Sequence[int], path: str, *, limit: int, volume: bool = False) -> tuple[int, ...]:
    check_count(values, path, limit, volume=volume)
    tokens = tuple(values)
    if tokens and min(tokens) < 0:
        index = next(i for i, t in enumerate(tokens) if t < 0)
        raise invalid(f"{path}[{index}]", f"must be a token id >= 0, got {tokens[index]}")
    return tokens


def read_key(value: bytes, path: str) -> PageKey:
    if len(value) != KEY_BYTES:
        raise invalid(path, f"must be a {KEY_BYTES}-byte page key, got {len(value)} bytes")
    return PageKey(value)


def read_keys(values: Sequence[bytes], path: str, *, limit: int) -> tuple[PageKey, ...]:
    check_count(values, path, limit, volume=True)
    return tuple(read_key(v, f"{path}[{i}]") for i, v in enumerate(values))


def read_digest(value: bytes, path: str) -> NamespaceDigest:
    if len(value) != KEY_BYTES:
        raise invalid(path, f"must be a {KEY_BYTES}-byte namespace digest, got {len(value)} bytes")
    return NamespaceDigest(value)


def read_finite(value: float, path: str, *, minimum: float | None = None) -> float:
    if not math.isfinite(value):
        raise invalid(path, f"must be a finite number, got {value}")
    if minimum is not None and value < minimum:
        raise invalid(path, f"must be >= {minimum}, got {value}")
    return value


def optional_field(msg: Any, name: str) -> Any:
    """Value of a proto3 ``optional`` scalar, or None when unset."""
    return getattr(msg, name) if msg.HasField(name) else None


def read_optional_duration(msg: Any, name: str, path: str, *, unit_ms: int = 1) -> int | None:
    """A proto3 ``optional`` duration (in ``unit_ms`` milliseconds), at most ``MAX_DURATION_MS``."""
    value = optional_field(msg, name)
    limit = MAX_DURATION_MS // unit_ms
    if value is not None and value > limit:
        raise invalid(join_path(path, name), f"must be at most {limit} (a year), got {value}")
    return value


def read_optional_spread(msg: Any, name: str, path: str) -> float | None:
    """A proto3 ``optional`` sigma of a log-normal spread: finite and > 0 when set."""
    value = optional_field(msg, name)
    if value is not None and not (math.isfinite(value) and value > 0.0):
        raise invalid(join_path(path, name), f"must be a finite number > 0, got {value}")
    return value


def required_message(msg: Any, name: str, path: str) -> Any:
    if not msg.HasField(name):
        raise invalid(join_path(path, name), "must be set")
    return getattr(msg, name)


def read_tier(value: int, path: str) -> Tier:
    return Tier.from_value(value, field=path)


def read_optional_tier(msg: Any, name: str, path: str) -> Tier | None:
    return read_tier(getattr(msg, name), join_path(path, name)) if msg.HasField(name) else None


# The wire tier of each domain tier, by name (``Tier.HBM`` ⇄ ``TIER_HBM``). Built at import,
# so a renamed member fails loudly.
_WIRE_TIERS: dict[Tier, common_pb2.Tier] = {tier: common_pb2.Tier.Value(f"TIER_{tier.name}") for tier in Tier}


def wire_tier(tier: Tier) -> common_pb2.Tier:
    return _WIRE_TIERS[tier]


def wire_optional_tier(tier: Tier | None) -> common_pb2.Tier | None:
    """``None`` leaves an optional tier field unset."""
    return None if tier is None else _WIRE_TIERS[tier]


def tier_or_unset(tier: Tier | None) -> common_pb2.Tier:
    return common_pb2.TIER_UNSPECIFIED if tier is None else _WIRE_TIERS[tier]


class EnumMap:
    """Domain enum ⇄ wire enum by member name (``FinishReason.TOOL_CALL`` ⇄
    ``FINISH_REASON_TOOL_CALL``). Built at import, so a renamed member fails loudly."""

    def __init__(self, domain: type[enum.Enum], wire: Any, prefix: str) -> None:
        self.to_wire = {member: wire.Value(prefix + member.name) for member in domain}
        self.from_wire = {number: member for member, number in self.to_wire.items()}
        self.valid = ", ".join(member.name for member in domain)

    def parse(self, number: int, path: str) -> Any:
        if number == 0:
            raise invalid(path, f"must be set to one of {self.valid}")
        try:
            return self.from_wire[number]
        except KeyError:
            raise invalid(path, f"has unknown value {number}; valid values are {self.valid}") from None

    def parse_optional(self, number: int, path: str) -> Any:
        return None if number == 0 else self.parse(number, path)




def _rebased(err: InvalidArgument, old_root: str, new_root: str) -> InvalidArgument:
    """Re-root a field path raised by a domain ``validate()`` (``max_tokens`` or
    ``namespace.page_size``) onto the path of the message being converted."""
    old_field = err.field or old_root
    if old_root and (old_field == old_root or old_field.startswith(old_root + ".")):
        new_field = new_root + old_field[len(old_root) :]
    else:
        new_field = join_path(new_root, old_field)
    if new_field == old_field:
        return err
    message = err.message
    message = (
        new_field + message[len(old_field) :] if message.startswith(old_field) else f"{new_field}: {message}"
    )
    return type(err)(message, field=new_field)


def validate_as(check: Callable[[], None], old_root: str, new_root: str) -> None:
    try:
        check()
    except InvalidArgument as err:
        raise _rebased(err, old_root, new_root) from None


def read_list(items: Sequence[Any], path: str, parse: Callable[[Any, str], Any]) -> tuple[Any, ...]:
    check_count(items, path, MAX_LIST_ITEMS)
    return tuple(parse(item, f"{path}[{i}]") for i, item in enumerate(items))


def check_unique_tiers(records: Iterable[Any], path: str) -> None:
    seen: set[Tier] = set()
    for i, record in enumerate(records):
        if record.tier in seen:
            raise invalid(f"{path}[{i}].tier", f"repeats tier {record.tier.label}; one entry per tier")
        seen.add(record.tier)


# The fields of every message with `oneof prefix { TokenIds token_ids; PageKeys page_keys; }`.
def prefix_fields(prefix: Prefix | None) -> dict[str, Any]:
    if prefix is None:
        return {}
    if isinstance(prefix, TokenPrefix):
        return {"token_ids": common_pb2.TokenIds(ids=prefix.token_ids)}
    return {"page_keys": common_pb2.PageKeys(keys=prefix.page_keys)}


def read_prefix(msg: Any, path: str, *, required: bool = True) -> Prefix | None:
    which = msg.WhichOneof("prefix")
    if which == "token_ids":
        ids = read_token_ids(
            msg.token_ids.ids, join_path(path, "token_ids.ids"), limit=MAX_PROMPT_TOKENS, volume=True
        )
        return TokenPrefix(token_ids=ids)
    if which == "page_keys":
        return PageKeyPrefix(
            page_keys=read_keys(msg.page_keys.keys, join_path(path, "page_keys.keys"), limit=MAX_PREFIX_PAGE_KEYS)
        )
    if required:
        raise invalid(join_path(path, "prefix"), "must set token_ids or page_keys")
    return None




def read_list_limit(msg: Any, path: str, default: int) -> int:
    if not msg.HasField("limit"):
        return default
    if not 1 <= msg.limit <= MAX_LIST_LIMIT:
        raise invalid(join_path(path, "limit"), f"must be in [1, {MAX_LIST_LIMIT}], got {msg.limit}")
    return msg.limit
