"""The policy-epoch table: which epoch each namespace's digest is derived with (DESIGN §5.3).

Invalidation never touches a page. It raises the epoch of a *scope* (one namespace
identity, a tenant, a model, or everything); a namespace's effective epoch is the highest
epoch of every scope that matches it, and the epoch is one of the inputs of its digest::

    effective_epoch(ns) = max(all, tenant[ns.tenant], model[ns.model_id], namespace[ns], 0)
    digest(ns)          = namespace_digest(ns with policy_epoch = effective_epoch(ns))

So once a scope's epoch rises, every key chained from the old digest is unreachable at
once, and its pages are reclaimed in the background. The controller issues epochs from one
counter, so a new epoch is above every epoch any scope had: the effective epoch of every
matching namespace strictly increases, and a namespace never returns to a digest it used
before. ``install`` keeps the highest epoch per scope, so the table only ever moves up
(entries arriving twice or out of order change nothing). The controller persists it in
Redis (``controller/cache_store.py``) and sends it to every worker on (re)connect; both
sides hold one of these.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import NamedTuple

from kvtier.domain.hashing import NamespaceIdentity, namespace_digest
from kvtier.domain.records import InvalidationScope


class EpochEntry(NamedTuple):
    scope: InvalidationScope
    epoch: int


def base_identity(identity: NamespaceIdentity) -> NamespaceIdentity:
    """The identity without its epoch: what an exact-namespace scope is keyed by."""
    return identity if identity.policy_epoch == 0 else dataclasses.replace(identity, policy_epoch=0)


def scope_key(scope: InvalidationScope) -> str:
    """A stable text name of a scope (the Redis field it is stored under)."""
    if scope.all_namespaces:
        return "all"
    if scope.tenant is not None:
        return f"tenant:{scope.tenant}"
    if scope.model_id is not None:
        return f"model:{scope.model_id}"
    assert scope.namespace is not None, "a validated scope sets exactly one member"
    return f"namespace:{namespace_digest(base_identity(scope.namespace)).hex()}"


class EpochTable:
    """Highest epoch per scope; the effective epoch of a namespace in O(1).

    Not thread-safe: one event loop owns it (the controller's, or a worker's asyncio side).
    """

    def __init__(self, entries: Iterable[EpochEntry] = ()) -> None:
        self._all = 0
        self._tenants: dict[str, int] = {}
        self._models: dict[str, int] = {}
        self._namespaces: dict[NamespaceIdentity, int] = {}
        self._scopes: dict[str, EpochEntry] = {}
        for entry in entries:
            self.install(entry.scope, entry.epoch)

    def __len__(self) -> int:
        return len(self._scopes)

    @property
    def max_epoch(self) -> int:
        """The highest epoch of any scope (0 for an empty table)."""
        return max((e.epoch for e in self._scopes.values()), default=0)

    def entries(self) -> list[EpochEntry]:
        """Every scope with its epoch, oldest epoch first (the order to replay them in)."""
        return sorted(self._scopes.values(), key=lambda e: e.epoch)

    def epoch_of(self, scope: InvalidationScope) -> int:
        entry = self._scopes.get(scope_key(scope))
        return entry.epoch if entry is not None else 0

    def install(self, scope: InvalidationScope, epoch: int) -> bool:
        """Raise ``scope`` to ``epoch``; False (nothing changes) when it is there already or higher."""
        scope.validate()
        if epoch < 1:
            raise ValueError(f"a policy epoch is >= 1, got {epoch}")
        key = scope_key(scope)
        current = self._scopes.get(key)
        if current is not None and current.epoch >= epoch:
            return False
        if scope.namespace is not None:
            scope = dataclasses.replace(scope, namespace=base_identity(scope.namespace))
        self._scopes[key] = EpochEntry(scope, epoch)
        if scope.all_namespaces:
            self._all = epoch
        elif scope.tenant is not None:
            self._tenants[scope.tenant] = epoch
        elif scope.model_id is not None:
            self._models[scope.model_id] = epoch
        else:
            assert scope.namespace is not None
            self._namespaces[scope.namespace] = epoch
        return True

    def effective_epoch(self, identity: NamespaceIdentity) -> int:
        """Highest epoch of every scope matching ``identity`` (its own epoch is ignored)."""
        epoch = max(self._all, self._tenants.get(identity.tenant, 0), self._models.get(identity.model_id, 0))
        if self._namespaces:
            epoch = max(epoch, self._namespaces.get(base_identity(identity), 0))
        return epoch

    def apply(self, identity: NamespaceIdentity) -> NamespaceIdentity:
        """``identity`` with its effective epoch: the one to derive its digest from."""
        epoch = self.effective_epoch(identity)
        return identity if epoch == identity.policy_epoch else dataclasses.replace(identity, policy_epoch=epoch)

    def is_stale(self, identity: NamespaceIdentity) -> bool:
        """A digest derived from ``identity`` is no longer reachable (a matching scope moved past it)."""
        return self.effective_epoch(identity) > identity.policy_epoch
