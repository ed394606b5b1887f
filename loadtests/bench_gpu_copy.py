"""HBM <-> pinned DRAM through the transfer engine on a GPU, against a bare torch copy.

    python -m loadtests.bench_gpu_copy [--json] [--mib N] [--page-mib N] [--repeats N]

Needs CUDA (exits 2 without). Baseline in the same run: ``dst.copy_(src, non_blocking=True)``
between the same HBM tensor and the same pinned host tensor, on a side stream, one call for
all bytes. kvtier's path: ``TransferEngine`` runs of pages on its copy-lane stream, each page
checksummed in HBM (before it leaves, after it lands), completion by CUDA event. Also reports
how much a matmul loop on the default stream slows while a demotion is in flight.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from kvtier.cache.page_pool import PagePool, PoolGeometry
from kvtier.domain.tiers import Tier
from kvtier.tiers.dram import make_dram_pool
from kvtier.tiers.transfer import TransferReason
from kvtier.tiers.transfer_engine import TransferEngine


def _geometry(page_mib: int) -> PoolGeometry:
    # Llama-3.1-8B-like page: 32 layers x 2 x 16 tokens x 8 kv heads x 128 dims x bf16 = 2 MiB.
    tokens = 16 * page_mib // 2 if page_mib >= 2 else 16
    return PoolGeometry(32, 8, 128, tokens, torch.bfloat16)


def _timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def run(mib: int, page_mib: int, repeats: int) -> dict:
    geometry = _geometry(page_mib)
    num_pages = max(1, (mib << 20) // geometry.page_bytes)
    hbm = PagePool(num_pages, geometry, device="cuda")
    dram = make_dram_pool(num_pages, geometry, pin_memory=True)
    for pool in (hbm, dram):
        while pool.allocate() is not None:
            pass
    hbm.tensor.copy_(torch.randn(hbm.tensor.shape, device="cuda").to(hbm.tensor.dtype))
    engine = TransferEngine(hbm, dram)
    pairs = [(i, i) for i in range(num_pages)]
    nbytes = num_pages * geometry.page_bytes
    side = torch.cuda.Stream()

    def base_down() -> None:
        with torch.cuda.stream(side):
            dram.tensor.copy_(hbm.tensor, non_blocking=True)
        side.synchronize()

    def base_up() -> None:
        with torch.cuda.stream(side):
            hbm.tensor.copy_(dram.tensor, non_blocking=True)
        side.synchronize()

    def kv(src: Tier, dst: Tier) -> None:
        engine.submit(src, dst, pairs, TransferReason.EVICTION if dst is Tier.DRAM else TransferReason.PROMOTION_ON_HIT)
        assert engine.wait_idle(60)
        done = engine.poll_completed()
        assert all(d.is_ok for d in done), [d.status for d in done]

    original = hbm.tensor.clone()
    rows = {"down_base": [], "down_kvtier": [], "up_base": [], "up_kvtier": []}
    for _ in range(repeats):
        rows["down_base"].append(nbytes / _timed(base_down) / 1e9)
        rows["down_kvtier"].append(nbytes / _timed(lambda: kv(Tier.HBM, Tier.DRAM)) / 1e9)
        hbm.tensor.zero_()
        rows["up_base"].append(nbytes / _timed(base_up) / 1e9)
        hbm.tensor.zero_()
        rows["up_kvtier"].append(nbytes / _timed(lambda: kv(Tier.DRAM, Tier.HBM)) / 1e9)
    identical = bool(torch.equal(hbm.tensor, original))

    # Compute while a demotion runs: a bf16 matmul loop on the default stream.
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

    def matmuls() -> None:
        for _ in range(50):
            a @ a

    idle_s = statistics.median(_timed(matmuls) for _ in range(3))
    engine.submit(Tier.HBM, Tier.DRAM, pairs, TransferReason.EVICTION)
    busy_s = _timed(matmuls)
    assert engine.wait_idle(60)
    engine.poll_completed()
    engine.close()
    med = {k: statistics.median(v) for k, v in rows.items()}
    return {
        "page_bytes": geometry.page_bytes,
        "bytes": nbytes,
        "gb_per_s": med,
        "hbm_to_dram_vs_copy": med["down_kvtier"] / med["down_base"],
        "dram_to_hbm_vs_copy": med["up_kvtier"] / med["up_base"],
        "round_trip_identical": identical,
        "matmul_slowdown_during_demotion": busy_s / idle_s,
        "device": torch.cuda.get_device_name(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtests.bench_gpu_copy", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--mib", type=int, default=2048, help="bytes per measurement, in MiB")
    parser.add_argument("--page-mib", type=int, default=2, help="page size in MiB (2: Llama-3.1-8B at 16 tokens)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu_copy: no CUDA device", file=sys.stderr)
        raise SystemExit(2)
    result = run(args.mib, args.page_mib, args.repeats)
    if args.json:
        print(json.dumps(result))
        return
    g = result["gb_per_s"]
    print(f"{result['device']}: {result['bytes'] >> 20} MiB in {result['page_bytes'] >> 20} MiB pages")
    print(f"HBM->DRAM kvtier {g['down_kvtier']:.1f} GB/s vs copy_ {g['down_base']:.1f} -> "
          f"{result['hbm_to_dram_vs_copy']:.2f}x")
    print(f"DRAM->HBM kvtier {g['up_kvtier']:.1f} GB/s vs copy_ {g['up_base']:.1f} -> "
          f"{result['dram_to_hbm_vs_copy']:.2f}x")
    print(f"round trip byte-identical: {result['round_trip_identical']}; "
          f"matmul loop during a demotion: {result['matmul_slowdown_during_demotion']:.2f}x")


if __name__ == "__main__":
    main()
