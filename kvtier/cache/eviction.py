"""Eviction by value (DESIGN §5 decision 7): evict the pages whose loss costs least per byte.

    value(page) ≈ P(reuse soon) × restore_s(page) × tenant_weight / page_bytes

``ValuePolicy`` is GreedyDual-Size-Frequency over that value, with one aging clock:

    priority(page) = clock at its last access
                     + (hits + 1) × restore_s(page) × weight(tenant) / page_bytes
    clock          = the highest priority evicted so far (from any tier)

``hits`` (matches that reached the page, counted by the index) stands for P(reuse soon).
The clock lets recency in: a page touched later starts from a higher clock, so an old
page keeps its place only as long as its hits outweigh what the clock gained since.
The clock is read at the *access*, not when the page becomes evictable: a parent that
becomes a leaf when its last child leaves is as old as its last hit, not fresh (reading
it late kept dead prefixes for a whole cache turnover and lost ~1.5 points of hit rate
on the Mooncake trace). One clock for every tier keeps "clock at access" one timescale
wherever the page moves; only the restore cost differs by tier.

``restore_s`` is what getting the page back would cost after it leaves its tier:

    a tier below exists    transfer back to HBM:  page_bytes / bandwidth(below → HBM)
    last tier              recompute the page:    page_size × (2 × params
                                                    + 4 × layers × hidden × context) / flop/s
    context of page d (1-based) ≈ (d − ½) × page_size tokens: a deep page attends to more

Within a tier with a tier below, every page costs the same to restore, so the order is
by hits and age; depth only counts where a victim is dropped for good.

``ExpertPolicy`` (decision 0014) is the learned alternative: by default recency, a reuse-time
expert and frequency in cache turnovers (``DEFAULT_EXPERTS``; frequency by mean gaps and this
value are selectable experts), with ``kvtier.policy.eviction``'s learner choosing which one
orders the index; ``reorder`` queues the candidates again when the lead changes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from kvtier.cache.radix import EvictionPolicy, LRUPolicy, RadixIndex, RadixNode
from kvtier.domain.errors import InvalidArgument
from kvtier.domain.geometry import ModelGeometry
from kvtier.domain.hashing import NamespaceDigest
from kvtier.domain.tiers import Tier
from kvtier.policy.eviction import DEFAULT_EXPERTS, Expert, ExpertLearner, Usage


def _default_bandwidth() -> dict[tuple[Tier, Tier], float]:
    # Sustained rates of one H100-class host (PCIe 5 x16, one Gen4 NVMe drive); pass
    # measured numbers (loadtests/bench_tiers.py) where they are known.
    return {
        (Tier.DRAM, Tier.HBM): 25e9,
        (Tier.HBM, Tier.DRAM): 25e9,
        (Tier.NVME, Tier.HBM): 6e9,
        (Tier.NVME, Tier.DRAM): 6e9,
        (Tier.HBM, Tier.NVME): 4e9,
        (Tier.DRAM, Tier.NVME): 4e9,
    }


# Achieved prefill throughput of one H100-class GPU, not the datasheet peak.
FLOPS_PER_S = 400e12


@dataclass(slots=True)
class CostModel:
    """Seconds to get one page back: by recomputing it, or by copying it between tiers.

    Defaults describe Llama-3.1-8B in bf16 with 16-token pages on one H100-class GPU.
    """

    num_params: float = 8.03e9
    num_layers: int = 32
    hidden_size: int = 4096
    page_size: int = 16  # tokens per page
    page_bytes: int = 2 << 20
    flops_per_s: float = FLOPS_PER_S
    bandwidth_bytes_per_s: dict[tuple[Tier, Tier], float] = field(default_factory=_default_bandwidth)

    def __post_init__(self) -> None:
        for name in ("num_params", "num_layers", "hidden_size", "page_size", "page_bytes", "flops_per_s"):
            if not getattr(self, name) > 0:
                raise InvalidArgument(f"cost model {name} must be > 0, got {getattr(self, name)}", field=name)
        for pair, rate in self.bandwidth_bytes_per_s.items():
            if not rate > 0:
                raise InvalidArgument(
                    f"bandwidth {pair[0].label} -> {pair[1].label} must be > 0 bytes/s, got {rate}",
                    field="bandwidth_bytes_per_s",
                )

    @classmethod
    def for_model(
        cls, geometry: ModelGeometry, *, page_size: int, kv_dtype: str = "bf16",
        flops_per_s: float = FLOPS_PER_S,
        bandwidth_bytes_per_s: Mapping[tuple[Tier, Tier], float] | None = None,
    ) -> CostModel:
        """The cost model of a model read from its config (``kvtier.domain.geometry``)."""
        page_bytes = geometry.page_bytes(kv_dtype, page_size)  # FP8 pages include their scales
        return cls(
            num_params=float(geometry.param_count),
            num_layers=geometry.num_layers,
            hidden_size=geometry.num_attention_heads * geometry.head_dim,
            page_size=page_size,
            page_bytes=page_bytes,
            flops_per_s=flops_per_s,
            bandwidth_bytes_per_s=(
                _default_bandwidth() if bandwidth_bytes_per_s is None else dict(bandwidth_bytes_per_s)
            ),
        )

    def recompute_s(self, depth: int) -> float:
        """Prefill seconds for page ``depth`` (1 = first page) with its prefix cached."""
        context = (depth - 0.5) * self.page_size
        flops_per_token = 2.0 * self.num_params + 4.0 * self.num_layers * self.hidden_size * context
        return self.page_size * flops_per_token / self.flops_per_s

    def prefix_recompute_s(self, num_pages: int) -> float:
        """Prefill seconds for the first ``num_pages`` pages: the sum of ``recompute_s``
        over depths 1..n, in closed form (the depths' (d − ½) sum to n²/2)."""
        dense = 2.0 * self.num_params * num_pages
        attention = 4.0 * self.num_layers * self.hidden_size * self.page_size * num_pages * num_pages / 2.0
        return self.page_size * (dense + attention) / self.flops_per_s

    def transfer_s(self, src: Tier, dst: Tier) -> float:
        rate = self.bandwidth_bytes_per_s.get((src, dst))
        if rate is None:
            raise InvalidArgument(
                f"the cost model has no bandwidth for {src.label} -> {dst.label}; add it to bandwidth_bytes_per_s",
                field="bandwidth_bytes_per_s",
            )
        return self.page_bytes / rate


class ValuePolicy:
    """GreedyDual-Size-Frequency by restore cost and tenant weight (see the module doc).

    ``tiers`` are the tiers the index places pages in (``TierManager.tiers``): a victim of
    a tier with another one below is demoted there, a victim of the last is dropped.
    ``tenant_weights`` maps a namespace digest to its weight (default ``default_weight``).
    """

    name = "value"

    def __init__(
        self,
        cost: CostModel | None = None,
        *,
        tiers: Sequence[Tier] = (Tier.HBM,),
        tenant_weights: Mapping[NamespaceDigest, float] | None = None,
        default_weight: float = 1.0,
    ) -> None:
        self.cost = cost or CostModel()
        present = sorted(set(tiers) | {Tier.HBM})
        weights = dict(tenant_weights or {})
        for digest, weight in [(None, default_weight), *weights.items()]:
            if not weight > 0:
                who = "default_weight" if digest is None else f"tenant {digest.hex()[:8]}"
                raise InvalidArgument(f"{who} weight must be > 0, got {weight}", field="tenant_weights")
        self.tenant_weights = weights
        self.default_weight = default_weight
        self.clock = 0.0
        # Restore seconds per byte for a page of each tier: the transfer back from the
        # tier below when there is one; recompute (by depth) in the last tier.
        self._transfer_per_byte: dict[Tier, float | None] = {}
        for i, tier in enumerate(present):
            below = present[i + 1] if i + 1 < len(present) else None
            self._transfer_per_byte[tier] = (
                None if below is None else self.cost.transfer_s(below, Tier.HBM) / self.cost.page_bytes
            )
        self._recompute_per_byte: list[float] = [0.0]  # by depth, grown on demand

    def restore_s(self, node: RadixNode) -> float:
        """Seconds to have ``node``'s page back in HBM after it leaves its tier."""
        return self._restore_per_byte(node) * self.cost.page_bytes

    def _restore_per_byte(self, node: RadixNode) -> float:
        per_byte = self._transfer_per_byte.get(node.tier)
        if per_byte is not None:
            return per_byte
        table = self._recompute_per_byte
        while len(table) <= node.depth:
            table.append(self.cost.recompute_s(len(table)) / self.cost.page_bytes)
        return table[node.depth]

    def weight(self, namespace: NamespaceDigest | None) -> float:
        if namespace is None:
            return self.default_weight
        return self.tenant_weights.get(namespace, self.default_weight)

    def priority(self, node: RadixNode) -> float:
        value = (node.hits + 1) * self._restore_per_byte(node) * self.weight(node.namespace)
        return node.access_clock + value

    def on_access(self, node: RadixNode) -> None:
        node.access_clock = self.clock

    def on_evict(self, node: RadixNode, priority: float) -> None:
        if priority > self.clock:
            self.clock = priority


class ExpertPolicy:
    """Eviction by experts and an online learner (``kvtier.policy.eviction``, decision 0014).

    The index's access tick (``RadixNode.last_access``) is the learner's clock. A page's
    restore cost (``ValuePolicy.restore_s``: the transfer back when a tier below will take it,
    else its recompute at its depth) enters the value expert (when ``experts`` includes it) as a
    ratio to the moving mean, so demoting and dropping are weighed by what each would cost to undo.
    ``capacity_pages`` is the cache's size over all tiers (the learner's miniatures are that
    size scaled by their sample).
    """

    name = "experts"

    def __init__(
        self,
        cost: CostModel | None = None,
        *,
        tiers: Sequence[Tier] = (Tier.HBM,),
        capacity_pages: int = 4096,
        experts: Sequence[Expert] = DEFAULT_EXPERTS,
    ) -> None:
        self._restore = ValuePolicy(cost, tiers=tiers)
        self.cost = self._restore.cost
        self.learner = ExpertLearner(capacity_pages, experts=experts)
        self._mean_restore_s = 0.0
        self._ordered_by = self.learner.leading

    def take_reorder(self) -> bool:
        """True once after another expert took the lead: the pages queued under the last
        leader's scores must be queued again (``reorder``)."""
        if self.learner.leading is self._ordered_by:
            return False
        self._ordered_by = self.learner.leading
        return True

    def _cost_ratio(self, restore_s: float) -> float:
        return restore_s / self._mean_restore_s if self._mean_restore_s > 0 else 1.0

    def priority(self, node: RadixNode) -> float:
        usage = self.learner.history.get(node.key) or Usage(last=node.last_access)
        return self.learner.priority(usage, cost_ratio=self._cost_ratio(self._restore.restore_s(node)))

    def on_access(self, node: RadixNode) -> None:
        parent = node.parent.key if node.parent is not None else None
        restore_s = self._restore.restore_s(node)
        if self._mean_restore_s > 0:
            self._mean_restore_s += 0.01 * (restore_s - self._mean_restore_s)  # a moving mean
        else:
            self._mean_restore_s = restore_s
        self.learner.observe(node.key, parent, node.last_access, cost_ratio=self._cost_ratio(restore_s))

    def on_evict(self, node: RadixNode, priority: float) -> None:
        pass


def reorder(index: RadixIndex) -> bool:
    """Queue every candidate again when the index's policy asks for it (an expert policy whose
    leader changed); the engine and the replay call this between requests. Returns whether it did."""
    policy = index.policy
    if isinstance(policy, ExpertPolicy) and policy.take_reorder():
        index.reprioritize()
        return True
    return False


_POLICIES: dict[str, Callable[..., EvictionPolicy]] = {
    "lru": LRUPolicy,
    "value": ValuePolicy,
    "experts": ExpertPolicy,
}
POLICY_NAMES: tuple[str, ...] = tuple(_POLICIES)
DEFAULT_POLICY = "experts"

# What each policy takes from the engine that runs it (``make_engine_policy``).
_ENGINE_PARAMS: dict[str, Callable[[CostModel, Sequence[Tier], int], dict[str, object]]] = {
    "lru": lambda cost, tiers, capacity: {},
    "value": lambda cost, tiers, capacity: {"cost": cost, "tiers": tuple(tiers)},
    "experts": lambda cost, tiers, capacity: {"cost": cost, "tiers": tuple(tiers), "capacity_pages": capacity},
}


def _factory(name: str) -> tuple[str, Callable[..., EvictionPolicy]]:
    key = name.strip().lower()
    factory = _POLICIES.get(key)
    if factory is None:
        raise InvalidArgument(
            f"unknown eviction policy {name!r}; choose one of {', '.join(POLICY_NAMES)}", field="eviction_policy"
        )
    return key, factory


def make_policy(name: str, **params: object) -> EvictionPolicy:
    """An eviction policy by name (``lru`` takes no parameters; ``value`` takes
    ``ValuePolicy``'s: ``cost``, ``tiers``, ``tenant_weights``, ``default_weight``)."""
    _, factory = _factory(name)
    try:
        return factory(**params)
    except TypeError as exc:
        raise InvalidArgument(f"eviction policy {name!r}: {exc}", field="eviction_policy") from None


def make_engine_policy(
    name: str, *, cost: CostModel, tiers: Sequence[Tier], capacity_pages: int = 4096
) -> EvictionPolicy:
    """The named policy configured for an engine (``WorkerConfig.eviction_policy``): each policy
    takes the engine facts it uses — ``value`` its cost model and tiers, ``experts`` those and the
    pages of all tiers together (``capacity_pages``), ``lru`` nothing."""
    key, factory = _factory(name)
    return factory(**_ENGINE_PARAMS[key](cost, tiers, capacity_pages))
