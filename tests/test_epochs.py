"""kvtier.cache.epochs: which scopes match a namespace, and epochs that only ever rise."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.cache.epochs import EpochEntry, EpochTable, scope_key
from kvtier.domain.errors import InvalidArgument
from kvtier.domain.hashing import NamespaceIdentity, namespace_digest
from kvtier.domain.records import InvalidationScope

BASE = NamespaceIdentity(model_id="m", tenant="acme", page_size=16)
OTHER_TENANT = dataclasses.replace(BASE, tenant="globex")
OTHER_MODEL = dataclasses.replace(BASE, model_id="m2")
OTHER_ADAPTER = dataclasses.replace(BASE, adapter="lora-1")  # same tenant and model, another namespace
EVERYONE = (BASE, OTHER_TENANT, OTHER_MODEL, OTHER_ADAPTER)


def epochs_of(table: EpochTable) -> list[int]:
    return [table.effective_epoch(ns) for ns in EVERYONE]


def test_an_empty_table_leaves_every_namespace_at_epoch_zero() -> None:
    table = EpochTable()
    assert epochs_of(table) == [0, 0, 0, 0]
    assert table.apply(BASE) is BASE  # nothing to change: the same identity, the same digest
    assert len(table) == 0 and table.max_epoch == 0


@pytest.mark.parametrize(
    ("scope", "expected"),
    [
        (InvalidationScope(tenant="acme"), [5, 0, 5, 5]),
        (InvalidationScope(model_id="m"), [5, 5, 0, 5]),
        (InvalidationScope(namespace=BASE), [5, 0, 0, 0]),
        (InvalidationScope(namespace=OTHER_ADAPTER), [0, 0, 0, 5]),
        (InvalidationScope(all_namespaces=True), [5, 5, 5, 5]),
    ],
)
def test_a_scope_moves_exactly_the_namespaces_it_matches(scope: InvalidationScope, expected: list[int]) -> None:
    table = EpochTable()
    assert table.install(scope, 5)
    assert epochs_of(table) == expected
    for ns, epoch in zip(EVERYONE, expected, strict=True):
        assert scope.matches(ns) == (epoch == 5)  # the worker's test (records) agrees with the table's
        assert table.apply(ns).policy_epoch == epoch


def test_the_effective_epoch_is_the_highest_matching_scope() -> None:
    table = EpochTable()
    table.install(InvalidationScope(tenant="acme"), 3)
    table.install(InvalidationScope(model_id="m"), 7)
    table.install(InvalidationScope(namespace=OTHER_ADAPTER), 9)
    assert epochs_of(table) == [7, 7, 3, 9]
    table.install(InvalidationScope(all_namespaces=True), 8)
    assert epochs_of(table) == [8, 8, 8, 9]
    assert table.max_epoch == 9 and len(table) == 4
    assert [e.epoch for e in table.entries()] == [3, 7, 8, 9]  # replay order: oldest first


def test_an_exact_namespace_scope_ignores_the_epoch_it_was_given_with() -> None:
    # A worker's identities carry their epoch; the scope names the namespace, not one epoch of it.
    table = EpochTable()
    table.install(InvalidationScope(namespace=dataclasses.replace(BASE, policy_epoch=4)), 6)
    assert table.effective_epoch(BASE) == 6
    assert table.effective_epoch(dataclasses.replace(BASE, policy_epoch=2)) == 6
    assert table.epoch_of(InvalidationScope(namespace=BASE)) == 6
    assert scope_key(InvalidationScope(namespace=BASE)) == scope_key(
        InvalidationScope(namespace=dataclasses.replace(BASE, policy_epoch=6)))


def test_epochs_never_go_down() -> None:
    table = EpochTable()
    assert table.install(InvalidationScope(tenant="acme"), 4)
    assert not table.install(InvalidationScope(tenant="acme"), 4)  # a re-send changes nothing
    assert not table.install(InvalidationScope(tenant="acme"), 2)  # nor does an older entry
    assert table.effective_epoch(BASE) == 4


def test_a_new_epoch_gives_a_new_digest_and_marks_the_old_identity_stale() -> None:
    table = EpochTable()
    before = table.apply(BASE)
    table.install(InvalidationScope(tenant="acme"), 1)
    after = table.apply(BASE)
    assert namespace_digest(before) != namespace_digest(after)
    assert table.is_stale(before) and not table.is_stale(after)
    assert not table.is_stale(table.apply(OTHER_TENANT))


def test_bad_entries_are_refused() -> None:
    table = EpochTable()
    with pytest.raises(InvalidArgument) as excinfo:
        table.install(InvalidationScope(), 1)  # "everything" only when asked for
    assert excinfo.value.field == "scope"
    with pytest.raises(ValueError, match="epoch"):
        table.install(InvalidationScope(tenant="acme"), 0)


def test_a_table_rebuilt_from_its_entries_is_the_same_table() -> None:
    table = EpochTable()
    table.install(InvalidationScope(tenant="acme"), 2)
    table.install(InvalidationScope(namespace=OTHER_MODEL), 3)
    copy = EpochTable(reversed(table.entries()))
    assert epochs_of(copy) == epochs_of(table)
    assert copy.entries() == table.entries()


SCOPES = st.sampled_from([
    InvalidationScope(tenant="acme"),
    InvalidationScope(tenant="globex"),
    InvalidationScope(model_id="m"),
    InvalidationScope(model_id="m2"),
    InvalidationScope(namespace=BASE),
    InvalidationScope(namespace=OTHER_ADAPTER),
    InvalidationScope(all_namespaces=True),
])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(SCOPES, st.integers(1, 50)), max_size=12))
def test_installs_in_any_order_only_raise_epochs(installs: list[tuple[InvalidationScope, int]]) -> None:
    table = EpochTable()
    for i, (scope, epoch) in enumerate(installs):
        before = epochs_of(table)
        table.install(scope, epoch)
        after = epochs_of(table)
        assert all(a >= b for a, b in zip(after, before, strict=True))
        assert table.effective_epoch(BASE) == max([e for s, e in installs[: i + 1] if s.matches(BASE)], default=0)
    # The order entries arrive in does not matter (a worker may hear them in any order).
    assert epochs_of(EpochTable(EpochEntry(s, e) for s, e in reversed(installs))) == epochs_of(table)


@settings(max_examples=60, deadline=None)
@given(st.lists(SCOPES, min_size=1, max_size=10))
def test_epochs_from_one_counter_strictly_raise_every_matching_namespace(scopes: list[InvalidationScope]) -> None:
    # The controller issues epoch n + 1 after n, whatever the scope (controller/cache_store.py).
    table = EpochTable()
    for epoch, scope in enumerate(scopes, start=1):
        before = epochs_of(table)
        table.install(scope, epoch)
        for ns, old, new in zip(EVERYONE, before, epochs_of(table), strict=True):
            assert new > old if scope.matches(ns) else new == old
