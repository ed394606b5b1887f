"""The directory's Lua scripts and the bytes they read: script sources, keys, packed events.

Key layout: the module docstring of ``controller/directory.py``; the scripts sit in
``controller/lua/``, each prepended with the shared files ``SCRIPTS`` names.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from pathlib import Path

from kvtier.domain.errors import InvalidArgument
from kvtier.domain.hashing import KEY_BYTES, PackedKeys, PageKey
from kvtier.domain.records import PageEvent, PageEventKind
from kvtier.domain.tiers import Tier

_LUA_DIR = Path(__file__).with_name("lua")
_EVENT = struct.Struct("<BBBBi16s16s")  # kind, tier, from_tier, flags, depth, key, parent
_FLAG_PARENT, _FLAG_BAD_KEY = 1, 2
_NO_KEY = bytes(KEY_BYTES)
RECORD_BYTES = 13
"""Bytes per holder record in a page value (worker id u24, tier mask u8, child counts 3 x u24)."""
KIND_CODES = {PageEventKind.INSERT: 1, PageEventKind.MOVE: 2, PageEventKind.DROP: 3}
"""Event kinds as the scripts number them (``directory_mirror`` uses the same numbers); any other
kind packs as 0, which the script rejects as ``bad_kind``."""


def script_source(name: str, preludes: Sequence[str]) -> str:
    body = (_LUA_DIR / f"{name}.lua").read_text()
    shared = "\n".join((_LUA_DIR / f"{p}.lua").read_text() for p in preludes)
    if body.startswith("#!"):  # flags must stay on the first line
        shebang, _, rest = body.partition("\n")
        return f"{shebang}\n{shared}\n{rest}"
    return f"{shared}\n{body}"


# Script name -> the shared files it is prepended with (read-only scripts get the short one).
SCRIPTS = {
    **dict.fromkeys(("lookup", "stats"), ("namespace_keys",)),
    **dict.fromkeys(("apply_events", "drop_worker", "invalidate", "reclaim", "fence"),
                    ("namespace_keys", "namespace_write")),
    **dict.fromkeys(("register", "heartbeat", "retire", "sweep", "forget", "workers"), ("registry_common",)),
}


def check_namespace(namespace: bytes) -> None:
    if len(namespace) != KEY_BYTES:
        raise InvalidArgument(f"namespace digest must be {KEY_BYTES} bytes, got {len(namespace)}",
                              field="namespace")


def meta_key(namespace: bytes) -> str:
    return f"kvt:{{{namespace.hex()}}}:m"


def ns_key(namespace: bytes, suffix: str) -> str:
    return f"kvt:{{{namespace.hex()}}}:{suffix}"


def pack_keys(keys: Sequence[PageKey]) -> bytes:
    # A list skips the isinstance check (an ABC's, not cheap on the lookup's hot path).
    if type(keys) is not list and isinstance(keys, PackedKeys):
        return keys.packed
    packed = b"".join(keys)
    if len(packed) != KEY_BYTES * len(keys):
        bad = next(i for i, k in enumerate(keys) if len(k) != KEY_BYTES)
        raise InvalidArgument(f"page key {bad} is {len(keys[bad])} bytes, expected {KEY_BYTES}",
                              field="page_keys")
    return packed


EventCodes = tuple[int, bytes, int, int]
"""``(kind, page key, tier, from_tier)`` of one event as ``DirectoryMirror.apply`` reads it."""

_TIER_CODES: dict[object, int] = {None: 0, **{t: int(t) for t in Tier}}


def pack_events(events: Iterable[PageEvent]) -> tuple[bytes, list[EventCodes]]:
    """Events as the ``apply_events`` script reads them (``_EVENT``), and each one's codes for
    the mirror. Out-of-range fields are packed so that the script rejects the event with its
    reason instead of failing the batch."""
    out: list[bytes] = []
    codes: list[EventCodes] = []
    pack, tier_codes = _EVENT.pack, _TIER_CODES
    for e in events:
        kind = KIND_CODES.get(e.kind, 0)
        key: bytes = e.page_key
        parent: bytes | None = e.parent_key
        depth = e.depth or 0
        tier, from_tier = tier_codes.get(e.tier), tier_codes.get(e.from_tier)
        # A miss is a number no tier has (None has code 0): packed as itself, or 255 past a
        # byte, for the script to reject.
        if tier is None:
            tier = int(e.tier) if e.tier is not None and 0 <= int(e.tier) < 256 else 255
        if from_tier is None:
            from_tier = int(e.from_tier) if e.from_tier is not None and 0 <= int(e.from_tier) < 256 else 255
        codes.append((kind, key, tier, from_tier))
        flags = _FLAG_PARENT if parent is not None else 0
        if parent is None:
            parent = _NO_KEY
        if len(key) != KEY_BYTES or len(parent) != KEY_BYTES:
            flags, key, parent = flags | _FLAG_BAD_KEY, _NO_KEY, _NO_KEY
        if not -(2**31) <= depth < 2**31:
            depth = -1
        out.append(pack(kind, tier, from_tier, flags, depth, key, parent))
    return b"".join(out), codes
