"""Trace replay of the eviction and tier policies: share of block references served from cache.

    python -m loadtests.replay [--trace FILE] [--policy lru|kvtier|value|experts]
        [--hbm-blocks N --dram-blocks N --nvme-blocks N] [--json]
    python -m loadtests.replay [--trace FILE] --sweep [--plot PATH] [--json]

``--trace`` defaults to ``../shared/traces/mooncake_synthetic_trace.jsonl`` next to the
repository.

The trace is Mooncake's (FAST'25): one request per line, ``hash_ids`` naming its 512-token
blocks prefix-chained. One block is one page (page size 1 whose token is the block id,
keys chained with ``kvtier.domain.hashing.next_key``), so the replay runs the real
``RadixIndex``, eviction policies and ``TierManager`` (``simulate=True``: pools count
pages, nothing is copied). Per request, in arrival order:

    match its keys ─ hits counted by the tier that serves them (HBM, DRAM, NVMe)
    promote the lower-tier hits to HBM (the tier manager's promotion path)
    insert the missing blocks into HBM; a full HBM evicts through the policy, and a
    victim is demoted to DRAM, then NVMe, then dropped (a tier of 0 blocks is absent)
    release the request's references

A request holds all its pages while it is served (its KV must sit in HBM for decode), so
a request longer than the whole HBM tier caches only the blocks that fit; the rest is
recomputed and not cached.

Baselines from the same run: HBM-only LRU at the same total capacity, and an infinite
cache (every block seen before is a hit: 64.0 % for this trace per its README). The
sweep adds Belady's offline policy (evict the page whose next use is furthest, leaves
first), which knows the future: how much any online policy could still gain.

Besides the hit rate, ``compute_saved`` is the share of prefill FLOP-seconds the served
blocks avoid (``CostModel``: a deep block costs more to recompute than a shallow one),
which is what the value policy weighs, and ``restore_saved_s`` is that time less the
transfers that brought lower-tier hits back.

Belady under these rules (one tier, a request holds its blocks, leaves first) equals a
brute-force optimum on small traces (``tests/test_belady.py``). ``loadtests.replay_report``
runs every trace (this one and ``loadtests.workloads``') against LRU, Belady and the
infinite cache.
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.cache.eviction import CostModel, make_engine_policy, reorder
from kvtier.cache.page_pool import PagePool, PoolGeometry
from kvtier.cache.radix import RadixIndex, RadixNode
from kvtier.domain.hashing import PageKey, next_key, root_key
from kvtier.domain.tiers import Tier
from kvtier.tiers.manager import TierConfig, TierManager

TRACE_FILE = Path("shared") / "traces" / "mooncake_synthetic_trace.jsonl"
# The shared traces sit beside the repository, or beside the folder of its worktrees.
DEFAULT_TRACE = next(
    (p / TRACE_FILE for p in Path(__file__).resolve().parents[1:4] if (p / TRACE_FILE).is_file()),
    Path(__file__).resolve().parents[2] / TRACE_FILE,
)
BLOCK_TOKENS = 512
TRACE_NAMESPACE = b"mooncake-replay!"
SWEEP_CAPACITIES = (1_000, 2_000, 5_000, 10_000, 20_000, 50_000)
SWEEP_SPLIT = (0.2, 0.3, 0.5)  # HBM / DRAM / NVMe share of the total in tiered runs
# Policy names on the command line: "kvtier" is the value policy over the tiers.
CLI_POLICIES = {"lru": "lru", "kvtier": "value", "value": "value", "experts": "experts"}
BELADY = "belady"
_TOKENS = (0,)  # a simulated page's tokens: matches compare keys only


def replay_cost_model() -> CostModel:
    """Llama-3.1-8B (bf16) with one 512-token block per page: 128 KiB of KV per token."""
    return CostModel(page_size=BLOCK_TOKENS, page_bytes=BLOCK_TOKENS * 128 * 1024)


@dataclass(slots=True)
class TraceRequest:
    timestamp_ms: int
    keys: list[PageKey]


def load_trace(path: str | Path) -> list[TraceRequest]:
    """Requests of a Mooncake-format JSONL file in arrival order (see ``trace_from_records``)."""
    records = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except ValueError as exc:
                raise ValueError(f"{path}:{line_no}: not a Mooncake trace record ({exc})") from None
    return trace_from_records(records, where=str(path))


def trace_from_records(records: Sequence[dict], *, where: str = "trace") -> list[TraceRequest]:
    """Requests in arrival order, each block id turned into the key of its whole prefix."""
    memo: dict[tuple[PageKey, int], PageKey] = {}
    root = root_key(TRACE_NAMESPACE)  # type: ignore[arg-type]
    requests: list[TraceRequest] = []
    for line_no, record in enumerate(records, 1):
        try:
            ids, timestamp = record["hash_ids"], int(record["timestamp"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{where}:{line_no}: not a Mooncake trace record ({exc})") from None
        keys, parent = [], root
        for block in ids:
            key = memo.get((parent, block))
            if key is None:
                key = memo[(parent, block)] = next_key(parent, (block,))
            keys.append(key)
            parent = key
        requests.append(TraceRequest(timestamp, keys))
    requests.sort(key=lambda r: r.timestamp_ms)  # stable: same-millisecond requests keep file order
    return requests


def infinite_hit_rate(trace: Sequence[TraceRequest]) -> float:
    """Share of block references to a block seen before (prefix-chained: a prefix)."""
    seen: set[PageKey] = set()
    hits = total = 0
    for request in trace:
        for key in request.keys:
            hits += key in seen
            seen.add(key)
        total += len(request.keys)
    return hits / total if total else 0.0


@dataclass(slots=True)
class ReplayResult:
    label: str
    policy: str
    hbm_blocks: int
    dram_blocks: int
    nvme_blocks: int
    num_refs: int = 0
    hits_by_tier: dict[Tier, int] = field(default_factory=lambda: dict.fromkeys(Tier, 0))
    compute_total_s: float = 0.0  # prefill seconds of every request without a cache
    compute_saved_s: float = 0.0  # of which the served blocks avoided
    transfer_s: float = 0.0  # seconds spent bringing lower-tier hits back to HBM
    pages_dropped: int = 0
    pages_moved: dict[str, int] = field(default_factory=dict)
    elapsed_s: float = 0.0

    @property
    def total_blocks(self) -> int:
        return self.hbm_blocks + self.dram_blocks + self.nvme_blocks

    @property
    def hit_rate(self) -> float:
        return sum(self.hits_by_tier.values()) / self.num_refs if self.num_refs else 0.0

    @property
    def compute_saved(self) -> float:
        return self.compute_saved_s / self.compute_total_s if self.compute_total_s else 0.0

    @property
    def restore_saved_s(self) -> float:
        """Prefill seconds the served blocks avoided, less the transfers that served them."""
        return self.compute_saved_s - self.transfer_s

    @property
    def hit_rate_by_tier(self) -> dict[str, float]:
        return {t.label: (n / self.num_refs if self.num_refs else 0.0) for t, n in self.hits_by_tier.items()}

    def as_dict(self) -> dict[str, object]:
        return {
            "label": self.label,
            "policy": self.policy,
            "blocks": {"hbm": self.hbm_blocks, "dram": self.dram_blocks, "nvme": self.nvme_blocks},
            "hit_rate": self.hit_rate,
            "hit_rate_by_tier": self.hit_rate_by_tier,
            "compute_saved": self.compute_saved,
            "restore_saved_s": self.restore_saved_s,
            "pages_moved": self.pages_moved,
            "pages_dropped": self.pages_dropped,
            "elapsed_s": round(self.elapsed_s, 3),
        }


class BeladyPolicy:
    """Offline reference: evict the page whose next use lies furthest ahead (never used
    again first). It reads the future from the trace, so no server can run it."""

    name = BELADY

    def __init__(self, trace: Sequence[TraceRequest]) -> None:
        self.now = 0  # index of the request being served
        self._uses: dict[PageKey, list[int]] = defaultdict(list)
        for i, request in enumerate(trace):
            for key in request.keys:
                self._uses[key].append(i)

    def priority(self, node: RadixNode) -> float:
        # Fixed while queued: the next use changes only at a use, which re-queues the page.
        uses = self._uses[node.key]
        j = bisect.bisect_right(uses, self.now)
        return -float(uses[j]) if j < len(uses) else -float("inf")

    def on_access(self, node: RadixNode) -> None:
        pass

    def on_evict(self, node: RadixNode, priority: float) -> None:
        pass


class Replay:
    """One engine's cache, simulated: the real index, policy and tier manager, no bytes.

    By default it builds them as an engine does (``make_engine_policy``, ``TierManager`` in
    simulation mode); ``cache`` replays through an engine's own index and tier manager instead
    (their pool's pages must hold one token each).
    """

    def __init__(
        self,
        policy: str,
        *,
        hbm_blocks: int,
        dram_blocks: int = 0,
        nvme_blocks: int = 0,
        label: str = "",
        trace: Sequence[TraceRequest] = (),
        cache: tuple[RadixIndex, TierManager | None] | None = None,
        cost: CostModel | None = None,
    ) -> None:
        if hbm_blocks < 1 or dram_blocks < 0 or nvme_blocks < 0:
            raise ValueError(
                f"capacities need hbm >= 1 and dram, nvme >= 0 blocks, got {hbm_blocks}/{dram_blocks}/{nvme_blocks}"
            )
        self.now_s = 0.0  # trace time, the index's clock
        self.cost = cost or replay_cost_model()
        self.belady = BeladyPolicy(trace) if policy == BELADY else None
        self.result = ReplayResult(label or policy, policy, hbm_blocks, dram_blocks, nvme_blocks)
        if cache is not None:
            self.index, self.tiers = cache
            self.pool = self.index.pool
            return
        tiers = [Tier.HBM] + [t for t, n in ((Tier.DRAM, dram_blocks), (Tier.NVME, nvme_blocks)) if n > 0]
        total = hbm_blocks + dram_blocks + nvme_blocks
        eviction = self.belady or make_engine_policy(policy, cost=self.cost, tiers=tiers, capacity_pages=total)
        self.pool = PagePool(hbm_blocks, PoolGeometry(1, 1, 1, 1))
        self.index = RadixIndex(self.pool, eviction, clock=lambda: self.now_s)
        config = TierConfig(
            dram_pages=dram_blocks, nvme_slots=nvme_blocks, simulate=True, demotion_budget_bytes_per_s=None
        )
        self.tiers = TierManager(self.index, config)

    def close(self) -> None:
        if self.tiers is not None:
            self.tiers.close()

    def serve(self, request: TraceRequest) -> None:
        index, pool, hits = self.index, self.pool, self.result.hits_by_tier
        keys = request.keys
        self.now_s = request.timestamp_ms / 1000.0
        self.result.num_refs += len(keys)
        nodes = index.match(keys).nodes
        num_hbm = next((i for i, n in enumerate(nodes) if n.tier is not Tier.HBM), len(nodes))
        held = [n.page for n in nodes[:num_hbm]]
        for page in held:
            pool.acquire(page)
        hits[Tier.HBM] += num_hbm
        lower = nodes[num_hbm:]
        if lower and self.tiers is not None:
            sources = [n.tier for n in lower]
            promoted = self.tiers.promote(lower)  # each with one reference for us
            for tier in sources[: len(promoted)]:
                hits[tier] += 1
                self.result.transfer_s += self.cost.transfer_s(tier, Tier.HBM)
            held.extend(n.page for n in promoted)
        served = len(held)
        self.result.compute_saved_s += self.cost.prefix_recompute_s(served)
        self.result.compute_total_s += self.cost.prefix_recompute_s(len(keys))
        for i in range(served, len(keys)):
            if keys[i] in index:  # a lower-tier hit that found no HBM page: recomputed in place
                break
            page = pool.allocate()
            if page is None and self.tiers.free_hbm_page():
                page = pool.allocate()
            if page is None:  # the request outgrew HBM: the rest is recomputed, not cached
                break
            held.append(page)
            index.insert(keys[i], keys[i - 1] if i else None, page, _TOKENS)
        for page in held:
            pool.release(page)
        reorder(index)

    def run(self, trace: Sequence[TraceRequest], *, check_every: int = 0) -> ReplayResult:
        start = time.perf_counter()
        for i, request in enumerate(trace):
            if self.belady is not None:
                self.belady.now = i
            self.serve(request)
            if check_every and i % check_every == 0:
                (self.tiers or self.index).check_integrity()
        if self.tiers is not None:
            counters = self.tiers.counters
            self.result.pages_dropped = counters.pages_dropped
            self.result.pages_moved = {f"{s.label}->{d.label}": n for (s, d), n in counters.pages_moved.items()}
        self.result.elapsed_s = time.perf_counter() - start
        return self.result


def replay(
    trace: Sequence[TraceRequest],
    policy: str,
    *,
    hbm_blocks: int,
    dram_blocks: int = 0,
    nvme_blocks: int = 0,
    label: str = "",
    check_every: int = 0,
    cost: CostModel | None = None,
) -> ReplayResult:
    sim = Replay(
        policy,
        hbm_blocks=hbm_blocks,
        dram_blocks=dram_blocks,
        nvme_blocks=nvme_blocks,
        label=label,
        trace=trace,
        cost=cost,
    )
    try:
        return sim.run(trace, check_every=check_every)
    finally:
        sim.close()


def split(total: int, shares: Sequence[float] = SWEEP_SPLIT) -> tuple[int, int, int]:
    hbm = max(1, round(total * shares[0]))
    dram = round(total * shares[1])
    return hbm, dram, total - hbm - dram


def compare(
    trace: Sequence[TraceRequest], policy: str, hbm_blocks: int, dram_blocks: int, nvme_blocks: int
) -> dict[str, object]:
    """One tiered run against HBM-only LRU at the same total and the infinite cache."""
    tiered = replay(trace, policy, hbm_blocks=hbm_blocks, dram_blocks=dram_blocks, nvme_blocks=nvme_blocks)
    lru = replay(trace, "lru", hbm_blocks=tiered.total_blocks, label="lru-hbm-only")
    return {
        "trace_requests": len(trace),
        "block_refs": tiered.num_refs,
        "hit_rate": tiered.hit_rate,
        "hit_rate_by_tier": tiered.hit_rate_by_tier,
        "lru_hit_rate": lru.hit_rate,
        "infinite_hit_rate": infinite_hit_rate(trace),
        "compute_saved": tiered.compute_saved,
        "lru_compute_saved": lru.compute_saved,
        "runs": [tiered.as_dict(), lru.as_dict()],
    }


SWEEP_RUNS = ("kvtier", "lru-tiered", "value", "lru", BELADY)  # tiered: value, LRU; then HBM only


def sweep(trace: Sequence[TraceRequest], capacities: Sequence[int] = SWEEP_CAPACITIES) -> dict[str, object]:
    rows = []
    for total in capacities:
        hbm, dram, nvme = split(total)
        runs = {
            "kvtier": replay(trace, "value", hbm_blocks=hbm, dram_blocks=dram, nvme_blocks=nvme),
            "lru-tiered": replay(trace, "lru", hbm_blocks=hbm, dram_blocks=dram, nvme_blocks=nvme),
            "value": replay(trace, "value", hbm_blocks=total),
            "lru": replay(trace, "lru", hbm_blocks=total),
            BELADY: replay(trace, BELADY, hbm_blocks=total),
        }
        rows.append(
            {
                "total_blocks": total,
                "split": {"hbm": hbm, "dram": dram, "nvme": nvme},
                **{f"{name}_hit_rate": r.hit_rate for name, r in runs.items()},
                **{f"{name}_compute_saved": r.compute_saved for name, r in runs.items()},
                "kvtier_hit_rate_by_tier": runs["kvtier"].hit_rate_by_tier,
                "elapsed_s": round(sum(r.elapsed_s for r in runs.values()), 2),
            }
        )
    return {"infinite_hit_rate": infinite_hit_rate(trace), "rows": rows}


_COLUMNS = {
    "kvtier": "kvtier tiered",
    "lru-tiered": "lru tiered",
    "value": "value 1-tier",
    "lru": "lru 1-tier",
    BELADY: "belady 1-tier",
}


def print_sweep(result: dict[str, object]) -> None:
    infinite = result["infinite_hit_rate"]
    split_pct = "/".join(f"{round(100 * x)}" for x in SWEEP_SPLIT)
    print(f"infinite cache: {100 * infinite:.1f} % of block references; tiered = hbm/dram/nvme {split_pct} %")
    for metric, title in (("hit_rate", "block references served from cache"), ("compute_saved", "prefill avoided")):
        print(f"\n{title} (%)")
        header = "".join(f"{name:>15}" for name in _COLUMNS.values())
        extra = f"{'kvtier by tier':>20}{'kvtier-lru':>12}" + (f"{'kvtier-inf':>12}" if metric == "hit_rate" else "")
        print(f"{'blocks':>7}{header}{extra}")
        for row in result["rows"]:
            cells = "".join(f"{100 * row[f'{name}_{metric}']:>15.1f}" for name in _COLUMNS)
            line = f"{row['total_blocks']:>7}{cells}"
            if metric == "hit_rate":
                by = row["kvtier_hit_rate_by_tier"]
                line += f"{'/'.join(f'{100 * by[t]:.1f}' for t in ('hbm', 'dram', 'nvme')):>20}"
            else:
                line += f"{'':>20}"
            line += f"{100 * (row[f'kvtier_{metric}'] - row[f'lru_{metric}']):>+10.1f}pp"
            if metric == "hit_rate":
                line += f"{100 * (row['kvtier_hit_rate'] - infinite):>+10.1f}pp"
            print(line)


def plot_sweep(result: dict[str, object], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    x = [r["total_blocks"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = {"kvtier": "o-", "lru-tiered": "s:", "value": "^--", "lru": "v-.", BELADY: "x:"}
    labels = {
        "kvtier": "kvtier (value, HBM/DRAM/NVMe 20/30/50 %)",
        "lru-tiered": "LRU, same tiers",
        "value": "value, HBM only",
        "lru": "LRU, HBM only",
        BELADY: "Belady (offline), HBM only",
    }
    for name in SWEEP_RUNS:
        ax.plot(x, [100 * r[f"{name}_hit_rate"] for r in rows], styles[name], label=labels[name])
    ax.axhline(100 * result["infinite_hit_rate"], color="grey", linestyle="--", label="infinite cache")
    ax.set_xscale("log")
    ax.set_xlabel("total cache capacity (512-token blocks)")
    ax.set_ylabel("block references served from cache (%)")
    ax.set_title("Mooncake trace replay")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.replay", description=__doc__.split("\n")[0])
    parser.add_argument("--trace", default=str(DEFAULT_TRACE), help="Mooncake-format JSONL trace")
    parser.add_argument("--policy", default="kvtier", choices=sorted(CLI_POLICIES), help="eviction policy")
    parser.add_argument("--hbm-blocks", type=int, default=2_000)
    parser.add_argument("--dram-blocks", type=int, default=3_000)
    parser.add_argument("--nvme-blocks", type=int, default=5_000)
    parser.add_argument("--sweep", action="store_true", help=f"capacities {', '.join(map(str, SWEEP_CAPACITIES))}")
    parser.add_argument("--plot", help="with --sweep: write a PNG plot here")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if not Path(args.trace).is_file():
        print(f"no trace at {args.trace}; pass --trace with a Mooncake-format JSONL file", file=sys.stderr)
        return 2
    trace = load_trace(args.trace)
    if args.sweep:
        result = sweep(trace)
        if args.plot:
            plot_sweep(result, args.plot)
        if args.json:
            print(json.dumps(result, indent=2))
        else:
            print_sweep(result)
            if args.plot:
                print(f"plot: {args.plot}")
        return 0
    try:
        result = compare(trace, CLI_POLICIES[args.policy], args.hbm_blocks, args.dram_blocks, args.nvme_blocks)
    except ValueError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    by = result["hit_rate_by_tier"]
    total = args.hbm_blocks + args.dram_blocks + args.nvme_blocks
    print(f"{len(trace)} requests, {result['block_refs']} block references")
    print(
        f"{args.policy} over hbm/dram/nvme {args.hbm_blocks}/{args.dram_blocks}/{args.nvme_blocks} blocks: "
        f"{100 * result['hit_rate']:.1f} % served from cache "
        f"(hbm {100 * by['hbm']:.1f} %, dram {100 * by['dram']:.1f} %, nvme {100 * by['nvme']:.1f} %)"
    )
    print(f"LRU, HBM only, {total} blocks: {100 * result['lru_hit_rate']:.1f} %")
    print(f"infinite cache: {100 * result['infinite_hit_rate']:.1f} % (trace README: 64.0 %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
