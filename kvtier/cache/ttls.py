"""Per-namespace TTLs of cached pages (DESIGN §8; docs/decisions/0009-quotas-and-ttls.md).

Configuration (``WorkerConfig.namespace_ttls``): rules, each a selector (``tenant``,
``model_id``, both or neither) and ``ttl_s``; a namespace takes the most specific rule that
matches it (tenant and model > tenant > model > neither), and ``ttl_s: 0`` means no TTL::

    namespace_ttls = [{ttl_s: 3600}, {tenant: acme, ttl_s: 60}, {tenant: acme, model_id: m, ttl_s: 0}]

A page expires ``ttl_s`` seconds of the index's clock after its last use: a prefix hit,
its insertion, or a sequence that held it letting go (``RadixNode.last_used_s``).
``TtlSweeper.expire`` drops expired pages from every tier, leaves first, at most a bounded
number per call; the engine runs it before each step and the worker's idle loop wakes for
the next deadline. Each drop is an ordinary index removal, so the worker sends a DROP page
event and the controller's directory forgets the page like any other.

Deadlines sit in one heap and are checked lazily: a popped page that was used since is
pushed back at its new deadline; one that is in use, pinned or being copied is looked at
again later; a parent that expired before its children waits for them (dropping the last
expired child drops the expired parent at once).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.domain.errors import ConfigError
from kvtier.domain.hashing import NamespaceDigest, NamespaceIdentity

if TYPE_CHECKING:
    from kvtier.cache.radix import RadixIndex, RadixNode

FIELD = "namespace_ttls"
# A page whose TTL passed but that cannot go yet (held, pinned, moving) is looked at again
# after at most this long.
RETRY_S = 1.0
_KEYS = ("tenant", "model_id", "ttl_s")


@dataclass(frozen=True, slots=True)
class TtlRule:
    ttl_s: float  # 0: no TTL
    tenant: str | None = None  # None: any tenant
    model_id: str | None = None  # None: any model

    @property
    def specificity(self) -> int:
        return (2 if self.tenant is not None else 0) + (1 if self.model_id is not None else 0)

    def matches(self, identity: NamespaceIdentity) -> bool:
        return (self.tenant is None or self.tenant == identity.tenant) and (
            self.model_id is None or self.model_id == identity.model_id
        )


@dataclass(frozen=True, slots=True)
class TtlTable:
    """The configured TTL rules (immutable: it is a ``WorkerConfig`` field)."""

    rules: tuple[TtlRule, ...] = ()

    def __bool__(self) -> bool:
        return any(rule.ttl_s > 0 for rule in self.rules)

    @classmethod
    def from_setting(cls, value: Any, field: str = FIELD) -> TtlTable:
        """Parse a list of ``{tenant?, model_id?, ttl_s}``; errors name the offending rule."""
        if value is None:
            return cls()
        if isinstance(value, Mapping) or not isinstance(value, Sequence) or isinstance(value, str):
            raise ConfigError(
                f"{field} must be a list of rules such as [{{tenant: acme, ttl_s: 60}}, {{ttl_s: 3600}}]; "
                f"got {type(value).__name__}",
                field=field,
            )
        rules: list[TtlRule] = []
        seen: dict[tuple[str | None, str | None], int] = {}
        for i, raw in enumerate(value):
            where = f"{field}[{i}]"
            if not isinstance(raw, Mapping):
                raise ConfigError(f"{where} must be a mapping with ttl_s and optional tenant, model_id",
                                  field=where)
            unknown = [k for k in raw if k not in _KEYS]
            if unknown:
                raise ConfigError(f"{where} has unknown key {unknown[0]!r}; known keys: {', '.join(_KEYS)}",
                                  field=where)
            ttl = raw.get("ttl_s")
            if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not math.isfinite(ttl) or ttl < 0:
                raise ConfigError(f"{where}.ttl_s must be a number of seconds >= 0 (0: no TTL), got {ttl!r}",
                                  field=f"{where}.ttl_s")
            selector: list[str | None] = []
            for key in ("tenant", "model_id"):
                part = raw.get(key)
                if part is not None and not isinstance(part, str):
                    raise ConfigError(f"{where}.{key} must be a string, got {part!r}", field=f"{where}.{key}")
                selector.append(part)
            tenant, model_id = selector
            if (tenant, model_id) in seen:
                raise ConfigError(f"{where} repeats the selector of {field}[{seen[(tenant, model_id)]}]",
                                  field=where)
            seen[(tenant, model_id)] = i
            rules.append(TtlRule(float(ttl), tenant, model_id))
        return cls(tuple(rules))

    def ttl_s(self, identity: NamespaceIdentity) -> float:
        """The namespace's TTL in seconds (0: none)."""
        best: TtlRule | None = None
        for rule in self.rules:
            if rule.matches(identity) and (best is None or rule.specificity > best.specificity):
                best = rule
        return 0.0 if best is None else best.ttl_s


class TtlSweeper:
    """Drops the cached pages of one engine whose namespace TTL passed. Engine thread only."""

    def __init__(
        self,
        index: RadixIndex,
        table: TtlTable,
        *,
        identity_of: Callable[[NamespaceDigest], NamespaceIdentity | None],
    ) -> None:
        self.index = index
        self.table = table
        self.num_expired = 0
        self._identity_of = identity_of
        self._ttl: dict[NamespaceDigest, float] = {}
        self._unknown: set[NamespaceDigest | None] = set()  # seen on pages before their identity
        self._heap: list[tuple[float, int, RadixNode]] = []  # (deadline, push order, node)
        self._order = itertools.count()
        for node in index.nodes():
            self._on_insert(node)
        index.on_insert.append(self._on_insert)

    def ttl_of(self, digest: NamespaceDigest | None) -> float:
        if digest is None:
            return 0.0
        ttl = self._ttl.get(digest)
        if ttl is None:
            identity = self._identity_of(digest)
            if identity is None:
                self._unknown.add(digest)
                return 0.0
            ttl = self._ttl[digest] = self.table.ttl_s(identity)
        return ttl

    def forget(self, digest: NamespaceDigest) -> None:
        """Drop the TTL kept for ``digest``, a namespace the engine forgot (its pages gone)."""
        self._ttl.pop(digest, None)
        self._unknown.discard(digest)

    def learn(self, digest: NamespaceDigest) -> None:
        """The engine learnt ``digest``'s identity: pages indexed before that get their deadline."""
        if digest not in self._unknown:
            return
        self._unknown.discard(digest)
        if self.ttl_of(digest) > 0:
            for node in self.index.nodes():
                if node.namespace == digest:
                    self._push(node, node.last_used_s + self._ttl[digest])

    def next_deadline(self) -> float | None:
        """The earliest deadline queued (on the index's clock), or None."""
        return self._heap[0][0] if self._heap else None

    def _on_insert(self, node: RadixNode) -> None:
        ttl = self.ttl_of(node.namespace)
        if ttl > 0:
            self._push(node, node.last_used_s + ttl)

    def _push(self, node: RadixNode, deadline: float) -> None:
        heapq.heappush(self._heap, (deadline, next(self._order), node))

    def expire(self, now: float | None = None, max_pages: int = 64) -> int:
        """Drop up to ``max_pages`` pages whose TTL passed at ``now`` (default: the index's
        clock); returns how many went."""
        now = self.index.clock() if now is None else now
        index = self.index
        dropped = 0
        while self._heap and self._heap[0][0] <= now and dropped < max_pages:
            _, _, node = heapq.heappop(self._heap)
            if index.get(node.key) is not node:
                continue  # gone already; a page cached again under this key has its own entry
            ttl = self.ttl_of(node.namespace)
            deadline = node.last_used_s + ttl
            if deadline > now:
                self._push(node, deadline)  # used since it was queued
            elif node.children:
                # Children expire no earlier than ~now (they were used after their parent);
                # the last one to go takes the parent along (see below).
                latest = max(c.last_used_s + self.ttl_of(c.namespace) for c in node.children.values())
                self._push(node, max(latest, now + min(ttl, RETRY_S) / 8))
            elif not index.is_evictable(node):
                self._push(node, now + min(ttl, RETRY_S))  # held, pinned or moving: later
            else:
                dropped += self._drop_up(node, now)
        return dropped

    def _drop_up(self, node: RadixNode | None, now: float) -> int:
        """Drop an expired leaf, then each parent that is now an expired, evictable leaf."""
        dropped = 0
        while node is not None:
            parent = node.parent
            self.index.remove(node.key)
            dropped += 1
            self.num_expired += 1
            node = parent
            if node is None or node.children or not self.index.is_evictable(node):
                break
            ttl = self.ttl_of(node.namespace)
            if ttl <= 0 or node.last_used_s + ttl > now:
                break
        return dropped
