"""What counting the clean HBM pages costs an engine step: kept (``CleanPages``) vs a walk.

    python -m loadtests.bench_clean_pages [--json] [--pages N,M,...] [--steps N]

A real ``TierManager`` over an HBM pool of N pages (chains of 16 pages, a tiny geometry: the
count does not read page bytes) with a DRAM tier: every page is demoted and promoted back, so
every one is clean (idle, with its copy below as a shadow) — the worst case for a walk. Then each
"step" does what a step does to the count: a request holds one chain's pages and lets them go
(each page's holders change twice), and the step asks for ``num_reclaimable``.

Baseline, in the same run: the walk from the leaves over every page (``CleanPages.walk``, the
oracle; a per-step count that walks the shadows does the same work). The ratio is
walk time over kept-count time per step, the median of ``--steps`` steps (bounded).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from kvtier.cache.page_pool import PagePool, PoolGeometry
from kvtier.cache.radix import RadixIndex
from kvtier.domain.hashing import next_key, root_key
from kvtier.domain.tiers import Tier
from kvtier.tiers.manager import TierConfig, TierManager

GEOMETRY = PoolGeometry(num_layers=1, kv_heads=1, head_dim=8, page_size=16, dtype=torch.float32)
CHAIN = 16
DIGEST = b"bench-clean-page"


def build(num_pages: int) -> tuple[TierManager, list[list]]:
    pool = PagePool(num_pages, GEOMETRY)
    index = RadixIndex(pool)
    tiers = TierManager(index, TierConfig(dram_pages=num_pages, demotion_budget_bytes_per_s=None))
    chains: list[list] = []
    held = []
    for c in range(num_pages // CHAIN):
        parent = None
        chain = []
        for d in range(CHAIN):
            page = pool.allocate()
            tokens = [c, d] + [0] * (GEOMETRY.page_size - 2)
            key = next_key(parent or root_key(DIGEST), tokens)
            chain.append(index.insert(key, parent, page, tokens, DIGEST))
            held.append(page)
            parent = key
        chains.append(chain)
    for page in held:
        pool.release(page)
    tiers.demote_all(Tier.DRAM)
    for chain in chains:
        for node in tiers.promote(chain):  # held for the caller, as for a request: let go
            pool.release(node.page)
    return tiers, chains


def measure(num_pages: int, steps: int, seed: int = 0) -> dict:
    tiers, chains = build(num_pages)
    clean = tiers.clean
    assert clean is not None
    pool = tiers.hbm
    if tiers.num_reclaimable() != num_pages:
        raise RuntimeError(f"expected every page clean, got {tiers.num_reclaimable()} of {num_pages}")
    rng = random.Random(seed)
    kept_s, walk_s = [], []
    deadline = time.monotonic() + 60.0
    for _ in range(steps):
        chain = rng.choice(chains)
        for node in chain:  # a request hits the chain ...
            pool.acquire(node.page)
        t = time.perf_counter()
        held = tiers.num_reclaimable()
        kept_s.append(time.perf_counter() - t)
        for node in chain:  # ... and lets it go
            pool.release(node.page)
        t = time.perf_counter()
        walked = len(clean.walk())
        walk_s.append(time.perf_counter() - t)
        if held != num_pages - CHAIN or walked != num_pages:
            raise RuntimeError(f"counts disagree: {held} while held, {walked} walked of {num_pages}")
        if time.monotonic() > deadline:
            break
    tiers.close()
    kept, walk = statistics.median(kept_s), statistics.median(walk_s)
    return {"pages": num_pages, "steps": len(kept_s), "kept_us": round(kept * 1e6, 1),
            "walk_us": round(walk * 1e6, 1), "walk_over_kept": round(walk / kept, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--pages", default="1024,16384,65536", help="HBM sizes in pages, comma-separated")
    parser.add_argument("--steps", type=int, default=50, help="steps per size (at most 60 s each)")
    args = parser.parse_args(argv)
    sizes = [int(p) for p in args.pages.split(",") if p]
    if any(p < CHAIN or p % CHAIN for p in sizes) or args.steps < 1:
        parser.error(f"--pages must be multiples of {CHAIN}, --steps >= 1")
    results = [measure(p, args.steps) for p in sizes]
    if args.json:
        print(json.dumps({"results": results}, indent=2))
    else:
        print(f"{'pages':>7} {'steps':>5} {'kept µs':>9} {'walk µs':>10} {'walk/kept':>9}")
        for r in results:
            print(f"{r['pages']:>7} {r['steps']:>5} {r['kept_us']:>9} {r['walk_us']:>10} {r['walk_over_kept']:>9}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
