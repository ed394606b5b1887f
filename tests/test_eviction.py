"""Value-based eviction: hand-computed victim orders, the cost model, TTL pins, and a
property test that no policy ever evicts a parent before its child or a pinned page."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.cache.eviction import POLICY_NAMES, CostModel, ExpertPolicy, ValuePolicy, make_policy, reorder
from kvtier.cache.page_pool import PagePool, PoolGeometry
from kvtier.cache.radix import LRUPolicy, RadixIndex, RadixNode
from kvtier.domain.errors import InvalidArgument
from kvtier.domain.geometry import geometry_from_config
from kvtier.domain.hashing import NamespaceIdentity, namespace_digest
from kvtier.domain.tiers import Tier
from kvtier.policy.eviction import Expert
from kvtier.tiers.manager import TierConfig, TierManager

from factories import keys_for

EXAMPLES = Path(__file__).resolve().parents[1] / "kvtier" / "examples"


def unit_cost() -> CostModel:
    """recompute_s(d) = 1 × (2·1 + 4·1·1·(d − ½)·1) / 1 = 4d seconds; DRAM → HBM 2 s."""
    return CostModel(
        num_params=1, num_layers=1, hidden_size=1, page_size=1, page_bytes=1, flops_per_s=1,
        bandwidth_bytes_per_s={(Tier.DRAM, Tier.HBM): 0.5, (Tier.NVME, Tier.HBM): 0.25},
    )


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def value_index(num_pages: int, **kwargs) -> RadixIndex:
    pool = PagePool(num_pages, PoolGeometry(1, 1, 1, 1, torch.float32))
    return RadixIndex(pool, ValuePolicy(unit_cost(), **kwargs))


def digest(tenant: str):
    return namespace_digest(NamespaceIdentity(model_id="m", tenant=tenant))


def put(index: RadixIndex, tokens: list[int], tenant: str = "t"):
    """Cache one page per token (page size 1) as a finished sequence would; returns the keys."""
    keys = keys_for(tokens, 1, tenant)
    pages = []
    for i, key in enumerate(keys):
        if key in index:
            continue
        page = index.pool.allocate()
        assert page is not None
        index.insert(key, keys[i - 1] if i else None, page, [tokens[i]], digest(tenant))
        pages.append(page)
    for page in pages:
        index.pool.release(page)
    return keys


def hit(index: RadixIndex, keys, times: int = 1) -> None:
    for _ in range(times):
        pages = index.match(keys).pages
        for page in pages:  # a request holds what it matched, then finishes
            index.pool.acquire(page)
        for page in pages:
            index.pool.release(page)


def evicted_order(index: RadixIndex, n: int) -> list:
    order = []
    index.on_remove.append(lambda node: order.append(node.key))
    assert index.evict(n) == n
    index.check_integrity()
    return order


# ---- victim order, hand computed ---------------------------------------------------------
def test_a_frequently_hit_page_outlives_a_once_hit_newer_one():
    index = value_index(4)
    (old,) = put(index, [1])
    hit(index, [old], times=3)  # hits 3: priority 0 + (3 + 1) × 4·1 = 16
    (new,) = put(index, [2])
    hit(index, [new])  # hits 1: priority 0 + 2 × 4 = 8
    policy = index.policy
    assert policy.priority(index.get(old)) == 16.0 and policy.priority(index.get(new)) == 8.0
    assert evicted_order(index, 1) == [new]
    assert policy.clock == 8.0  # raised to the victim's priority

    # LRU on the same history evicts the older page.
    lru = RadixIndex(PagePool(4, PoolGeometry(1, 1, 1, 1)), LRUPolicy())
    (old,) = put(lru, [1])
    hit(lru, [old], times=3)
    put(lru, [2])
    assert evicted_order(lru, 1) == [old]


def test_the_clock_ages_pages_that_stop_being_hit():
    index = value_index(2)
    (a,) = put(index, [1])
    hit(index, [a], times=2)  # 0 + 3 × 4 = 12
    order = []
    index.on_remove.append(lambda node: order.append(node.key))
    newcomers = put(index, [10])  # priority 0 + 4
    for token in (11, 12, 13):
        index.evict(1)  # the clock rises to each victim's priority: 4, 8, 12
        newcomers += put(index, [token])  # and each newcomer starts from it: 8, 12, 16
    index.evict(1)
    # a (12) ties with the third newcomer and, queued first, goes first: the clock caught up.
    assert order == [newcomers[0], newcomers[1], a, newcomers[2]]
    assert index.policy.clock == 12.0
    index.check_integrity()


def test_a_deep_page_costs_more_to_recompute_than_a_shallow_one():
    index = value_index(8)
    deep = put(index, [1, 2, 3])  # leaf at depth 3: recompute 12 s
    (shallow,) = put(index, [9])  # depth 1: recompute 4 s, and newer
    policy = index.policy
    assert policy.restore_s(index.get(deep[2])) == 12.0
    assert policy.restore_s(index.get(shallow)) == 4.0
    # Leaves first: the chain's root cannot go before its children.
    assert evicted_order(index, 4) == [shallow, deep[2], deep[1], deep[0]]


def test_tenant_weight_keeps_the_heavier_tenant():
    a, b = digest("a"), digest("b")
    index = value_index(4, tenant_weights={a: 3.0})
    (gold,) = put(index, [1], tenant="a")  # 0 + 1 × 4 × 3 = 12
    (plain,) = put(index, [1], tenant="b")  # same tokens, another namespace: 4
    assert index.policy.weight(a) == 3.0 and index.policy.weight(b) == 1.0
    assert evicted_order(index, 1) == [plain]
    assert gold in index


def test_a_page_with_a_tier_below_costs_its_transfer_not_its_recompute():
    def node(tier: Tier) -> RadixNode:
        return RadixNode(key=b"k" * 16, parent=None, page=0, tokens=(1,), depth=3, tier=tier)

    two = ValuePolicy(unit_cost(), tiers=(Tier.HBM, Tier.DRAM))
    assert two.restore_s(node(Tier.HBM)) == 2.0  # demoted to DRAM: 1 byte at 0.5 B/s back
    assert two.restore_s(node(Tier.DRAM)) == 12.0  # last tier: dropped, recomputed at depth 3
    three = ValuePolicy(unit_cost(), tiers=(Tier.HBM, Tier.DRAM, Tier.NVME))
    assert three.restore_s(node(Tier.DRAM)) == 4.0  # demoted to NVMe: 0.25 B/s back
    assert three.restore_s(node(Tier.NVME)) == 12.0


def test_expert_policy_reorders_the_queue_when_the_lead_changes():
    pool = PagePool(4, PoolGeometry(1, 1, 1, 1, torch.float32))
    policy = ExpertPolicy(unit_cost(), capacity_pages=4, experts=(Expert.LRU, Expert.FREQUENCY))
    index = RadixIndex(pool, policy)
    (a,) = put(index, [1])
    hit(index, [a], times=3)
    (b,) = put(index, [2])  # newer than a's last hit, used once
    assert not reorder(index)  # LRU leads from the start: nothing to do
    policy.learner.leader = 1  # as if frequency's miniature had won the paired test
    assert reorder(index) and not reorder(index)  # once per change
    assert evicted_order(index, 1) == [b]  # a's four uses outweigh b's recency

    lru = RadixIndex(PagePool(4, PoolGeometry(1, 1, 1, 1)), ExpertPolicy(unit_cost(), capacity_pages=4))
    (a,) = put(lru, [1])
    hit(lru, [a], times=3)
    put(lru, [2])
    assert evicted_order(lru, 1) == [a]  # under LRU the same history loses a


# ---- cost model and registry ---------------------------------------------------------
def test_cost_model_from_llama_3_1_8b_config():
    geometry = geometry_from_config(json.loads((EXAMPLES / "llama-3.1-8b.json").read_text()))
    cost = CostModel.for_model(geometry, page_size=16)
    assert cost.page_bytes == 2 << 20  # 32 layers × 2 × 8 kv heads × 128 × 2 bytes × 16 tokens
    assert cost.num_params == pytest.approx(CostModel().num_params, rel=0.01)
    assert cost.recompute_s(100) > cost.recompute_s(1)
    expected = sum(cost.recompute_s(d) for d in range(1, 51))
    assert cost.prefix_recompute_s(50) == pytest.approx(expected, rel=1e-12)
    assert cost.transfer_s(Tier.DRAM, Tier.HBM) == pytest.approx((2 << 20) / 25e9)


def test_cost_model_errors_name_the_field():
    with pytest.raises(InvalidArgument, match="flops_per_s"):
        CostModel(flops_per_s=0)
    with pytest.raises(InvalidArgument, match="dram -> hbm"):
        CostModel(bandwidth_bytes_per_s={(Tier.DRAM, Tier.HBM): -1.0})
    with pytest.raises(InvalidArgument, match="no bandwidth for nvme -> hbm"):
        CostModel(bandwidth_bytes_per_s={}).transfer_s(Tier.NVME, Tier.HBM)
    with pytest.raises(InvalidArgument, match="weight must be > 0"):
        ValuePolicy(tenant_weights={digest("a"): 0.0})


def test_make_policy_by_name():
    assert POLICY_NAMES == ("lru", "value", "experts")
    assert isinstance(make_policy("lru"), LRUPolicy)
    policy = make_policy("Value", tiers=[Tier.HBM, Tier.NVME], default_weight=2.0)
    assert isinstance(policy, ValuePolicy) and policy.default_weight == 2.0
    assert isinstance(make_policy("experts", capacity_pages=10), ExpertPolicy)
    with pytest.raises(InvalidArgument, match="choose one of lru, value, experts"):
        make_policy("lfu")
    with pytest.raises(InvalidArgument, match="'lru'"):
        make_policy("lru", tiers=[Tier.HBM])


# ---- TTL pins --------------------------------------------------------------------------
def test_a_ttl_pin_holds_until_its_deadline_on_the_index_clock():
    clock = Clock()
    index = RadixIndex(PagePool(4, PoolGeometry(1, 1, 1, 1)), clock=clock)
    keys = put(index, [1, 2])
    index.pin(keys[1], ttl_s=5.0)
    assert index.evict(2) == 0  # the leaf is pinned, so its parent stays too
    clock.now += 4.0
    assert index.expire_pins() == 0
    assert index.evict(2) == 0
    clock.now += 1.0
    assert index.expire_pins() == 1
    assert index.get(keys[1]).pins == 0 and not index.pool.is_pinned(index.get(keys[1]).page)
    assert index.evict(2) == 2
    assert index.expire_pins(now=1e9) == 0
    index.check_integrity()


def test_ttl_pins_expire_in_deadline_order_and_skip_pages_that_left():
    clock = Clock()
    index = RadixIndex(PagePool(6, PoolGeometry(1, 1, 1, 1)), clock=clock)
    (a,) = put(index, [1])
    (b,) = put(index, [2])
    index.pin(a, ttl_s=10.0)
    index.pin(b, ttl_s=2.0)
    index.pin(b)  # an ordinary pin on the same page outlives the timed one
    assert index.expire_pins(now=clock.now + 2.0) == 1
    assert index.get(b).pins == 1 and index.get(a).pins == 1
    index.pin(b, ttl_s=5.0)
    index.unpin(b)
    index.unpin(b)  # (as if the page's pins were all released elsewhere)
    index.remove(b)
    index.pin(put(index, [2])[0], ttl_s=1.0)  # same key, a new page: its own pin
    # Due: the new page (101), the page that left (105, skipped), a (110).
    assert index.expire_pins(now=clock.now + 100.0) == 2
    assert index.get(a).pins == 0 and index.get(b).pins == 0
    with pytest.raises(ValueError, match="ttl_s"):
        index.pin(a, ttl_s=-1.0)
    with pytest.raises(KeyError):
        index.pin(keys_for([7], 1)[0])
    index.check_integrity()


def test_a_pin_follows_its_page_when_promotion_brings_it_into_hbm():
    clock = Clock()
    index = RadixIndex(PagePool(4, PoolGeometry(1, 1, 1, 1)), ValuePolicy(unit_cost()), clock=clock)
    tiers = TierManager(index, TierConfig(dram_pages=4, simulate=True))
    keys = put(index, [1, 2])
    assert tiers.demote_all(Tier.DRAM) == 2
    index.pin(keys[0], ttl_s=3.0)
    nodes = index.match(keys).nodes
    promoted = tiers.promote(nodes)
    assert [n.tier for n in promoted] == [Tier.HBM, Tier.HBM]
    for node in promoted:
        index.pool.release(node.page)
    root = index.get(keys[0])
    assert index.pool.is_pinned(root.page)
    clock.now += 3.0
    assert index.expire_pins() == 1
    assert not index.pool.is_pinned(root.page)
    tiers.check_integrity()
    tiers.close()


# ---- property: leaves first, pinned and held pages stay ------------------------------
OPS = st.one_of(
    st.tuples(st.just("serve"), st.lists(st.integers(0, 2), min_size=1, max_size=5), st.booleans()),
    st.tuples(st.just("finish")),
    st.tuples(st.just("pin"), st.integers(0, 50), st.sampled_from([None, 1.0, 3.0])),
    st.tuples(st.just("unpin")),
    st.tuples(st.just("tick"), st.sampled_from([0.5, 2.0])),
    st.tuples(st.just("evict"), st.integers(1, 4)),
)


class Driver:
    """Requests against an index (and, with lower tiers, a simulated tier manager)."""

    def __init__(self, policy: str, dram: int, nvme: int) -> None:
        self.clock = Clock()
        tiers = [Tier.HBM] + [t for t, n in ((Tier.DRAM, dram), (Tier.NVME, nvme)) if n]
        params = {
            "lru": {},
            "value": {"cost": unit_cost(), "tiers": tiers},
            "experts": {"cost": unit_cost(), "tiers": tiers, "capacity_pages": 6 + dram + nvme},
        }[policy]
        self.index = RadixIndex(PagePool(6, PoolGeometry(1, 1, 1, 1)), make_policy(policy, **params), clock=self.clock)
        config = TierConfig(dram_pages=dram, nvme_slots=nvme, simulate=True)
        self.tiers = TierManager(self.index, config) if dram or nvme else None
        self.held: list[list[int]] = []  # pages of requests still running
        self.pins: list = []  # keys with an ordinary pin
        self.pinned: dict = {}  # key -> node, every page we ever pinned
        self.index.on_remove.append(self._removed)
        self.index.on_move.append(self._moved)

    def free_page(self) -> bool:
        """One HBM page freed the way the engine's scheduler frees it: through the tiers when
        there are any (a spill), else the index's next victim dropped."""
        return self.tiers.free_hbm_page() if self.tiers is not None else self.index.evict(1) == 1

    def _removed(self, node) -> None:
        assert not node.children, "a parent left before its child"
        assert node.pins == 0, "a pinned page was evicted"
        parent = node.parent
        assert parent is None or self.index.get(parent.key) is parent

    def _moved(self, node, old: Tier) -> None:
        assert node.tier < old or node.pins == 0, "a pinned page was demoted"

    def serve(self, tokens: list[int], finish: bool) -> None:
        index, pool = self.index, self.index.pool
        keys = keys_for(tokens, 1)
        nodes = index.match(keys).nodes
        num_hbm = next((i for i, n in enumerate(nodes) if n.tier is not Tier.HBM), len(nodes))
        pages = [n.page for n in nodes[:num_hbm]]
        for page in pages:
            pool.acquire(page)
        if num_hbm < len(nodes) and self.tiers is not None:
            pages += [n.page for n in self.tiers.promote(nodes[num_hbm:])]
        for i in range(len(pages), len(keys)):
            if keys[i] in index:
                break
            page = pool.allocate()
            if page is None and self.free_page():
                page = pool.allocate()
            if page is None:
                break
            pages.append(page)
            index.insert(keys[i], keys[i - 1] if i else None, page, [tokens[i]])
        self.held.append(pages)
        if finish:
            self.finish()

    def finish(self) -> None:
        if self.held:
            for page in self.held.pop(0):
                self.index.pool.release(page)

    def pin(self, which: int, ttl_s: float | None) -> None:
        nodes = sorted(self.index.nodes(), key=lambda n: n.key)
        if not nodes:
            return
        node = nodes[which % len(nodes)]
        self.index.pin(node.key, ttl_s)
        self.pinned[node.key] = node
        if ttl_s is None:
            self.pins.append(node.key)

    def unpin(self) -> None:
        if self.pins:
            self.index.unpin(self.pins.pop())

    def check(self) -> None:
        (self.tiers or self.index).check_integrity()
        for key, node in self.pinned.items():
            if node.pins:
                assert self.index.get(key) is node, "a pinned page left the index"
        for pages in self.held:
            for page in pages:
                assert self.index.pool.ref_count(page) > 0

    def close(self) -> None:
        if self.tiers is not None:
            self.tiers.close()


@pytest.mark.parametrize("policy", ["value", "lru", "experts"])
@pytest.mark.parametrize("dram,nvme", [(0, 0), (3, 3)])
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(OPS, max_size=40))
def test_no_policy_evicts_a_parent_first_or_a_pinned_or_held_page(policy, dram, nvme, ops):
    driver = Driver(policy, dram, nvme)
    try:
        for op in ops:
            name, *args = op
            if name == "tick":
                driver.clock.now += args[0]
                driver.index.expire_pins()
            elif name == "evict":
                for _ in range(args[0]):
                    driver.free_page()
            else:
                getattr(driver, name)(*args)
            driver.check()
        while driver.held:
            driver.finish()
        driver.check()
    finally:
        driver.close()
