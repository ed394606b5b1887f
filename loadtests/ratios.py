"""Every published ratio with its target, from one command: each benchmark run as its own
process (``--json``), its headline ratios read back and checked.

    python -m loadtests.ratios                 # every benchmark once, quiet
    python -m loadtests.ratios --busy          # each with one core burnt (``loadtests.busy``)
    python -m loadtests.ratios --only tiers,directory --json

The tier benchmark's kvtier / LMCache rows (one per path and page size, each ≥ 1.0) appear
where ``bench_tiers`` found LMCache (``make lmcache-venv``); otherwise its skip line does.
The agent workload runs its default (calibrated, seeds pooled) with the two policies its ratio
compares, reactive and kvtier (~12 min on a 2-core machine); the gateway benchmark serves the
bundled real model (~8 min). Each benchmark alternates its two
sides within its own run and reports the median of its
per-round ratios (with the range where it keeps one); this module only collects them, so a
run of it is one sample of each ratio. The issue's protocol is two quiet runs and two busy
ones; ``docs/benchmarks.md`` gives them with the date and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Ratio:
    name: str
    read: Callable[[dict[str, Any]], float | None]
    bound: float
    at_most: bool  # True: the ratio must be <= bound; False: >= bound
    optional: bool = False  # a peer's ratio: left out of the report when that peer did not run

    def met(self, value: float | None) -> bool | None:
        if value is None:
            return None
        return value <= self.bound if self.at_most else value >= self.bound


@dataclass(frozen=True, slots=True)
class Bench:
    name: str
    argv: tuple[str, ...]
    ratios: tuple[Ratio, ...]


def _geometry(name: str, key: str) -> Callable[[dict[str, Any]], float | None]:
    return lambda r: r.get("geometries", {}).get(name, {}).get(key)


def _vs_lmcache(name: str, path: str) -> Callable[[dict[str, Any]], float | None]:
    return lambda r: r.get("lmcache", {}).get("geometries", {}).get(name, {}).get(path, {}).get("median")


_LMCACHE_PATHS = {"mem_write": "memory write", "mem_read": "memory read", "disk_write": "disk write",
                  "disk_read": "disk read"}
_PAGES = {"tiny": "32 KiB", "llama-3.1-8b": "2 MiB"}


def _pooled(key: str) -> Callable[[dict[str, Any]], float | None]:
    return lambda r: r.get("pooled", {}).get(key)


BENCHES = (
    Bench("engine", ("loadtests.bench_engine", "--json"), (
        Ratio("paged / dense decode", lambda r: r.get("paged_over_dense_decode"), 1.5, True),
        Ratio("prefill at 50 % prefix hit / full", lambda r: r.get("prefix_hit_prefill_ratio"), 0.55, True),
    )),
    Bench("tiers", ("loadtests.bench_tiers", "--json"), (
        Ratio("NVMe read / dd, 32 KiB", _geometry("tiny", "nvme_read_vs_direct"), 0.8, False),
        Ratio("NVMe read / dd, 2 MiB", _geometry("llama-3.1-8b", "nvme_read_vs_direct"), 0.95, False),
        Ratio("DRAM demote / memcpy, 32 KiB", _geometry("tiny", "dram_demote_vs_memcpy"), 0.8, False),
        Ratio("DRAM demote / memcpy, 2 MiB", _geometry("llama-3.1-8b", "dram_demote_vs_memcpy"), 0.8, False),
        # kvtier over LMCache (loadtests/lmcache_peer.py), where bench_tiers found LMCache.
        *(
            Ratio(f"kvtier / LMCache, {label}, {pages}", _vs_lmcache(name, path), 1.0, False, optional=True)
            for name, pages in _PAGES.items()
            for path, label in _LMCACHE_PATHS.items()
        ),
    )),
    Bench("directory", ("loadtests.bench_directory", "--json"), (
        Ratio("directory lookup p50 / PING p50", lambda r: r.get("lookup_p50_over_ping"), 1.5, True),
        Ratio("directory ingest, events/s", lambda r: r.get("ingest_events_per_s"), 50_000, False),
    )),
    Bench("serving", ("loadtests.bench_serving", "--json"), (
        Ratio("Route p50 / health p50", lambda r: r.get("route_p50_over_health_p50"), 1.5, True),
    )),
    Bench("gateway", ("loadtests.bench_gateway", "--json"), (
        Ratio("gateway / gRPC tokens/s, 32 streams",
              lambda r: r.get("streams", {}).get("32", {}).get("gateway_over_grpc_tokens_per_s", {}).get("median"),
              0.9, False),
        Ratio("agent resumed-turn TTFT p50, tiered / HBM only",
              lambda r: r.get("agents", {}).get("resume_ttft_tiered_over_hbm_only", {}).get("p50"), 0.5, True),
    )),
    Bench("agent", ("loadtests.agent_workload", "--json", "--policies", "reactive,kvtier"), (
        Ratio("agent resume TTFT p50, kvtier / reactive (pooled seeds)", _pooled("kvtier_over_reactive"), 0.5, True),
    )),
)


def supports_busy(module: str) -> bool:
    out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, check=False)
    return "--busy" in out.stdout


def last_json(text: str) -> dict[str, Any]:
    """The JSON object a benchmark printed last, starting on a line of its own (some print
    progress lines before it)."""
    decoder = json.JSONDecoder()
    found: dict[str, Any] | None = None
    for match in re.finditer(r"^\{", text, flags=re.MULTILINE):
        try:
            value, _ = decoder.raw_decode(text, match.start())
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):
            found = value
    if found is None:
        raise ValueError("no JSON object in the benchmark's output")
    return found


def run_bench(bench: Bench, busy: bool) -> dict[str, Any]:
    module, *args = bench.argv
    argv = [sys.executable, "-m", module, *args]
    if busy:
        if not supports_busy(module):
            return {"bench": bench.name, "error": f"{module} has no --busy flag"}
        argv.append("--busy")
    started = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    elapsed = time.monotonic() - started
    if proc.returncode != 0:
        return {"bench": bench.name, "error": f"exit {proc.returncode}: {proc.stderr[-2000:]}", "elapsed_s": elapsed}
    result = last_json(proc.stdout)
    peer = result.get("lmcache") or {}
    notes = [peer["skipped"]] if "skipped" in peer else []
    rows = []
    for ratio in bench.ratios:
        value = ratio.read(result)
        if value is None and ratio.optional:
            continue
        rows.append({"ratio": ratio.name, "value": value, "target": ("<= " if ratio.at_most else ">= ") + f"{ratio.bound:g}",
                     "met": ratio.met(value)})
    return {"bench": bench.name, "rows": rows, "elapsed_s": elapsed, "load_avg_1m": os.getloadavg()[0],
            "notes": notes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--busy", action="store_true", help="pass --busy to every benchmark")
    parser.add_argument("--only", default="", help=f"comma-separated subset of {', '.join(b.name for b in BENCHES)}")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    chosen = {name for name in args.only.split(",") if name}
    unknown = chosen - {b.name for b in BENCHES}
    if unknown:
        parser.error(f"--only: unknown benchmarks {sorted(unknown)}")
    results = []
    for bench in BENCHES:
        if chosen and bench.name not in chosen:
            continue
        print(f"running {bench.name}{' (busy)' if args.busy else ''} ...", file=sys.stderr, flush=True)
        results.append(run_bench(bench, args.busy))
    if args.json:
        print(json.dumps({"busy": args.busy, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                          "results": results}, indent=2))
        return 0
    for r in results:
        if "error" in r:
            print(f"{r['bench']}: {r['error']}")
            continue
        print(f"{r['bench']} ({r['elapsed_s']:.0f} s, load {r['load_avg_1m']:.1f})")
        for note in r.get("notes", []):
            print(f"  {note}")
        for row in r["rows"]:
            value = "n/a" if row["value"] is None else f"{row['value']:.3g}"
            verdict = {True: "met", False: "MISSED", None: "not measured"}[row["met"]]
            print(f"  {row['ratio']}: {value} (target {row['target']}) {verdict}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
