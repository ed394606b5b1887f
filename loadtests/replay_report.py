"""What a policy is worth on every trace: LRU, Belady, the infinite cache and the policy.

    python -m loadtests.replay_report [--traces mooncake,chat,agent,rag,fewshot]
        [--capacities 1000,10000,50000] [--policy experts] [--seed N] [--json]

Per trace and total capacity (512-token blocks), all runs through ``loadtests.replay``:

    lru, belady, policy    one tier (HBM) of the whole capacity; Belady is the offline optimum
                           under the same prefix rule (``BeladyPolicy``)
    gap closed             (policy − LRU) / (Belady − LRU), when Belady is > 0.1 point above LRU
    restore saved          tiered HBM/DRAM/NVMe 20/30/50 %: prefill seconds the cache avoided less
                           the transfers that brought lower-tier hits back (``CostModel``), per
                           request, for the policy and for LRU over the same tiers

Traces: ``mooncake`` is the shared Mooncake synthetic trace; the others come from
``loadtests.workloads`` with ``--seed``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from loadtests import workloads
from loadtests.replay import (
    BELADY,
    DEFAULT_TRACE,
    TraceRequest,
    infinite_hit_rate,
    load_trace,
    replay,
    split,
    trace_from_records,
)

TRACES = ("mooncake", *workloads.GENERATORS)
CAPACITIES = (1_000, 10_000, 50_000)
MIN_GAP = 0.001  # below a tenth of a point there is no gap to close


def load(name: str, seed: int = 0) -> list[TraceRequest]:
    if name == "mooncake":
        if not DEFAULT_TRACE.is_file():
            raise FileNotFoundError(f"no Mooncake trace at {DEFAULT_TRACE}")
        return load_trace(DEFAULT_TRACE)
    return trace_from_records(workloads.generate(name, seed), where=name)


def gap_closed(policy: float, lru: float, belady: float) -> float | None:
    """Share of the LRU → Belady gap the policy closes (None when there is no gap)."""
    gap = belady - lru
    return (policy - lru) / gap if gap > MIN_GAP else None


def evaluate(trace: Sequence[TraceRequest], total: int, policy: str) -> dict[str, object]:
    hbm, dram, nvme = split(total)
    lru = replay(trace, "lru", hbm_blocks=total)
    belady = replay(trace, BELADY, hbm_blocks=total)
    ours = replay(trace, policy, hbm_blocks=total)
    ours_tiered = replay(trace, policy, hbm_blocks=hbm, dram_blocks=dram, nvme_blocks=nvme)
    lru_tiered = replay(trace, "lru", hbm_blocks=hbm, dram_blocks=dram, nvme_blocks=nvme)
    num_requests = max(1, len(trace))
    return {
        "total_blocks": total,
        "lru": lru.hit_rate,
        "belady": belady.hit_rate,
        "policy": ours.hit_rate,
        "gap_closed": gap_closed(ours.hit_rate, lru.hit_rate, belady.hit_rate),
        "policy_tiered": ours_tiered.hit_rate,
        "lru_tiered": lru_tiered.hit_rate,
        "restore_saved_ms_per_request": 1000 * ours_tiered.restore_saved_s / num_requests,
        "lru_restore_saved_ms_per_request": 1000 * lru_tiered.restore_saved_s / num_requests,
    }


def report(
    traces: Sequence[str] = TRACES, capacities: Sequence[int] = CAPACITIES, policy: str = "experts", seed: int = 0
) -> dict[str, object]:
    out: dict[str, object] = {"policy": policy, "seed": seed, "traces": {}}
    for name in traces:
        trace = load(name, seed)
        rows = [evaluate(trace, total, policy) for total in capacities]
        out["traces"][name] = {"infinite": infinite_hit_rate(trace), "requests": len(trace), "rows": rows}
    return out


def _pct(x: float | None, digits: int = 2) -> str:
    return "—" if x is None else f"{100 * x:.{digits}f}"


def print_report(result: dict[str, object]) -> None:
    print(
        "| trace | blocks | LRU | Belady | infinite | policy | policy − LRU | gap closed "
        "| restore saved, ms/request (policy / LRU, tiered) |"
    )  # hit rates in % of block references
    print("|---|---|---|---|---|---|---|---|---|")
    for name, data in result["traces"].items():
        for row in data["rows"]:
            print(
                f"| {name} | {row['total_blocks']:,} | {_pct(row['lru'])} | {_pct(row['belady'])} "
                f"| {_pct(data['infinite'])} | {_pct(row['policy'])} | {100 * (row['policy'] - row['lru']):+.2f} "
                f"| {_pct(row['gap_closed'], 1)} % | {row['restore_saved_ms_per_request']:.1f} / "
                f"{row['lru_restore_saved_ms_per_request']:.1f} |"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.replay_report", description=__doc__.split("\n")[0])
    parser.add_argument("--traces", default=",".join(TRACES))
    parser.add_argument("--capacities", default=",".join(map(str, CAPACITIES)))
    parser.add_argument("--policy", default="experts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        result = report(
            [t for t in args.traces.split(",") if t],
            [int(c) for c in args.capacities.split(",") if c],
            args.policy,
            args.seed,
        )
    except (FileNotFoundError, ValueError) as exc:
        print(str(exc), file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_report(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
