"""Engine benchmark: paged vs dense decode attention, prefix-hit prefill, tokens/s.

    python -m loadtests.bench_engine [--json] [--quick] [--kv-dtype fp8] [--busy] [--threads N]
                                     [--prefill-in-kernel]

Geometry: 8 layers, hidden 1024, 8 query / 8 KV heads of 128, fp32, on this CPU.
Every number is measured against a baseline in the same run:
  (1) one paged decode attention step (8 sequences x 2,048 context, pages scattered)
      over dense ``scaled_dot_product_attention`` on contiguous K/V  (target <= 1.5x);
  (2) prefill of a prompt whose first half is a cached prefix over the same prefill
      from scratch, the median of 7 pairs with its range            (target <= 0.55x); in
      FLOPs a 1,024-token hit costs 0.52 of a full prefill (projections 105 of 211
      GFLOP; causal attention 12.9 of 17.2 GFLOP, the cached half's keys are still read);
  (3) generated tokens per second at batch 1, 8 and 32.
Loops are bounded in count; nothing leaves the process.

``--kv-dtype fp8`` measures the FP8 cache against bf16 in the same run instead:
  (1) one decode attention step over FP8 pages / over a bf16 pool with the same values, same
      backend, interleaved                                           (target <= 1.1 on a CPU);
  (2) pages of the bench model that fit in the same HBM bytes, fp8 / bf16 (target >= 1.9);
  (3) bytes moved per page demoted HBM -> DRAM by the engine's tiers, fp8 / bf16, and for a
      bf16 cache that demotes as FP8 (``lower_tier_dtype = fp8``)   (target 0.5 plus the scales);
  (4) one engine decode step at batch 8 with an fp8 cache / with an fp32 cache (the model runs
      in fp32 either way), the two engines stepping in turn.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvtier.domain.tiers import Tier
from kvtier.engine import Engine, SamplingParams
from kvtier.engine.attention.cpu_fused import CpuFusedBackend
from kvtier.engine.model.loader import write_random_checkpoint
from kvtier.tiers.manager import TierConfig
from loadtests.bench_attention import measure_decode, measure_fp8_decode
from loadtests.busy import add_busy_flag, busy_core

BENCH_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 8192,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def _prompt(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, BENCH_CONFIG["vocab_size"], (length,), generator=g).tolist()


def _timed_prefill(engine: Engine, prompt: list[int]) -> tuple[float, int]:
    rid = engine.add_request(prompt, SamplingParams(max_tokens=1))
    start = time.perf_counter()
    engine.step()
    elapsed = time.perf_counter() - start
    return elapsed, engine.pop_result(rid).num_cached_tokens


def measure_prefix_prefill(engine: Engine, prompt_len: int, repeats: int) -> dict:
    """Full prefill vs prefill with the first half cached, same prompt length."""
    full_s, hit_s = [], []
    half = prompt_len // 2
    for r in range(repeats):
        prompt = _prompt(prompt_len, seed=1000 + r)
        t_full, cached = _timed_prefill(engine, prompt)
        assert cached == 0
        full_s.append(t_full)
        # Same first half, new second half: exactly `half` tokens come from the cache.
        other = prompt[:half] + _prompt(prompt_len - half, seed=2000 + r)
        t_hit, cached = _timed_prefill(engine, other)
        assert cached == half, f"expected {half} cached tokens, got {cached}"
        hit_s.append(t_hit)
    ratios = [h / f for h, f in zip(hit_s, full_s, strict=True)]
    return {
        "prompt_tokens": prompt_len,
        "cached_tokens": half,
        "full_prefill_ms": statistics.median(full_s) * 1e3,
        "prefix_hit_prefill_ms": statistics.median(hit_s) * 1e3,
        "prefix_hit_prefill_ratio": statistics.median(ratios),
        "prefix_hit_prefill_ratio_range": [min(ratios), max(ratios)],
    }


def measure_throughput(engine: Engine, batch: int, prompt_len: int, max_tokens: int) -> dict:
    """End-to-end generated tokens/s, and decode-only tokens/s once the batch is prefilled."""
    prompts = [_prompt(prompt_len, seed=5000 + batch * 100 + i) for i in range(batch)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    rids = [engine.add_request(p, params) for p in prompts]
    while engine.scheduler.waiting:  # prefill steps
        engine.step()
    decode_start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    end = time.perf_counter()
    generated = sum(len(engine.pop_result(r).token_ids) for r in rids)
    return {
        "batch": batch,
        "generated_tokens": generated,
        "seconds": end - start,
        "tokens_per_s": generated / (end - start),
        "decode_tokens_per_s": (generated - batch) / (end - decode_start),
    }


def run(quick: bool = False, prefill_in_kernel: bool = False) -> dict:
    torch.manual_seed(0)
    decode = measure_decode(
        num_seqs=8, context_len=2048, num_heads=8, num_kv_heads=8, head_dim=128, page_size=16,
        iterations=10 if quick else 30,
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = write_random_checkpoint(Path(tmp) / "bench-model", BENCH_CONFIG, seed=0)
        # 4,096 pages of 16 tokens: every prompt and its cached prefixes stay resident.
        engine = Engine.from_pretrained(path, page_size=16, num_pages=4096)
        if prefill_in_kernel and isinstance(engine.backend, CpuFusedBackend):
            engine.backend.sdpa_min_query_len = 1 << 30  # every prefill row through the C++ kernel
        engine.generate([_prompt(64, seed=1)], SamplingParams(max_tokens=2))  # warm-up
        prefill = measure_prefix_prefill(engine, prompt_len=512 if quick else 1024, repeats=2 if quick else 7)
        throughput = [
            measure_throughput(engine, b, prompt_len=64, max_tokens=8 if quick else 32)
            for b in (1, 8, 32)
        ]
        backend = engine.backend.name
    return {
        "attention_backend": backend,
        "threads": torch.get_num_threads(),
        "paged_over_dense_decode": decode["paged_over_dense_decode"],
        "prefix_hit_prefill_ratio": prefill["prefix_hit_prefill_ratio"],
        "tokens_per_s": {str(t["batch"]): round(t["tokens_per_s"], 1) for t in throughput},
        "decode_tokens_per_s": {str(t["batch"]): round(t["decode_tokens_per_s"], 1) for t in throughput},
        "decode": decode,
        "prefill": prefill,
        "throughput": throughput,
    }


def _demoted_bytes_per_page(path: Path, kv_cache_dtype: str) -> dict:
    """Generate one 256-token prompt, demote its pages HBM -> DRAM, count what moved."""
    dtype = torch.bfloat16 if kv_cache_dtype.startswith("bf16") else torch.float32
    engine = Engine.from_pretrained(
        path, page_size=16, num_pages=64, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
        tier_config=TierConfig(dram_pages=64),
    )
    engine.generate([_prompt(256, seed=7)], SamplingParams(max_tokens=1))
    engine.tiers.demote_all(Tier.DRAM)
    stats = engine.tiers.transfers.stats()
    pair = (Tier.HBM, Tier.DRAM)
    out = {
        "kv_dtype": engine.namespace.kv_dtype,
        "hbm_page_bytes": engine.geometry.page_bytes,
        "pages": stats.pages_moved[pair],
        "bytes_per_page": stats.bytes_moved[pair] / stats.pages_moved[pair],
    }
    engine.close()
    return out


def run_fp8(quick: bool = False) -> dict:
    """The FP8 cache against bf16, every number from this run (module doc, ``--kv-dtype fp8``)."""
    torch.manual_seed(0)
    decode = measure_fp8_decode(
        num_seqs=8, context_len=2048, num_heads=8, num_kv_heads=8, head_dim=128, page_size=16,
        iterations=10 if quick else 30,
    )
    hbm_bytes = 256 << 20
    with tempfile.TemporaryDirectory() as tmp:
        path = write_random_checkpoint(Path(tmp) / "bench-model", BENCH_CONFIG, seed=0)
        pages = {}
        for name, dtype, kv in (("bf16", torch.bfloat16, None), ("fp8", torch.float32, "fp8")):
            engine = Engine.from_pretrained(
                path, page_size=16, hbm_bytes=hbm_bytes, dtype=dtype, kv_cache_dtype=kv
            )
            pages[name] = {"num_pages": engine.pool.num_pages, "page_bytes": engine.geometry.page_bytes}
            del engine
        moved = {kv: _demoted_bytes_per_page(path, kv) for kv in ("bf16", "fp8", "bf16/fp8")}
        engines = {
            name: Engine.from_pretrained(path, page_size=16, num_pages=1024, kv_cache_dtype=kv)
            for name, kv in (("fp32", None), ("fp8", "fp8"))
        }
        decode_steps = interleaved_decode(engines, batch=8, prompt_len=64, steps=8 if quick else 32)
        backend = engines["fp8"].backend.name
        del engines
    bf16_bytes = moved["bf16"]["bytes_per_page"]
    return {
        "attention_backend": backend,
        "threads": torch.get_num_threads(),
        "fp8_over_bf16_decode": decode["fp8_over_bf16_decode"],
        "pages_in_same_hbm_bytes": pages["fp8"]["num_pages"] / pages["bf16"]["num_pages"],
        "demoted_bytes_per_page_fp8_over_bf16": moved["fp8"]["bytes_per_page"] / bf16_bytes,
        "demoted_bytes_per_page_lower_fp8_over_bf16": moved["bf16/fp8"]["bytes_per_page"] / bf16_bytes,
        "decode_step_fp8_over_fp32": decode_steps["fp8_over_fp32"],
        "decode": decode,
        "hbm_bytes": hbm_bytes,
        "pages": pages,
        "demotion": moved,
        "decode_steps": decode_steps,
    }


def interleaved_decode(engines: dict[str, Engine], *, batch: int, prompt_len: int, steps: int) -> dict:
    """Decode step times of engines serving the same batch, one step each in turn (the order
    alternating), so a loaded machine slows both alike; the median of per-step ratios."""
    params = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    prompts = [_prompt(prompt_len, seed=5000 + i) for i in range(batch)]
    for engine in engines.values():
        for p in prompts:
            engine.add_request(p, params)
        while engine.scheduler.waiting:  # prefill
            engine.step()
    names = list(engines)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(steps):
        for name in names if i % 2 == 0 else reversed(names):
            start = time.perf_counter()
            engines[name].step()
            times[name].append(time.perf_counter() - start)
    ratios = [f / b for f, b in zip(times["fp8"], times["fp32"], strict=True)]
    return {
        "batch": batch,
        "steps": steps,
        **{f"{name}_step_ms": statistics.median(t) * 1e3 for name, t in times.items()},
        "fp8_over_fp32": statistics.median(ratios),
        "fp8_over_fp32_min": min(ratios),
        "fp8_over_fp32_max": max(ratios),
    }


def print_fp8(r: dict) -> None:
    d = r["decode"]
    print(f"attention backend: {r['attention_backend']}, torch threads: {r['threads']}")
    print(
        f"(1) decode attention 8x2048: bf16 {d['bf16_ms']:.2f} ms, fp8 {d['fp8_ms']:.2f} ms -> fp8/bf16 "
        f"{d['fp8_over_bf16_decode']:.2f} [{d['fp8_over_bf16_min']:.2f}, {d['fp8_over_bf16_max']:.2f}] "
        "(target <= 1.1)"
    )
    p = r["pages"]
    print(
        f"(2) pages in {r['hbm_bytes'] >> 20} MiB: bf16 {p['bf16']['num_pages']} of "
        f"{p['bf16']['page_bytes']:,} B, "
        f"fp8 {p['fp8']['num_pages']} of {p['fp8']['page_bytes']:,} B -> "
        f"{r['pages_in_same_hbm_bytes']:.3f}x (target >= 1.9)"
    )
    for m in r["demotion"].values():
        print(f"(3) demoted HBM -> DRAM, {m['kv_dtype']}: {m['bytes_per_page']:,.0f} B per page")
    print(
        f"    fp8/bf16 {r['demoted_bytes_per_page_fp8_over_bf16']:.4f}x, bf16 demoting as fp8 "
        f"{r['demoted_bytes_per_page_lower_fp8_over_bf16']:.4f}x (target 0.5 plus the scales)"
    )
    t = r["decode_steps"]
    print(
        f"(4) engine decode step at batch {t['batch']}: fp32 cache {t['fp32_step_ms']:.1f} ms, fp8 cache "
        f"{t['fp8_step_ms']:.1f} ms -> {t['fp8_over_fp32']:.2f} [{t['fp8_over_fp32_min']:.2f}, "
        f"{t['fp8_over_fp32_max']:.2f}]"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtests.bench_engine", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="fewer iterations and shorter prompts")
    parser.add_argument("--kv-dtype", choices=("fp8",), help="fp8: the FP8 cache against bf16 (module doc)")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument(
        "--prefill-in-kernel", action="store_true",
        help="cpu-fused: run prefills through the C++ kernel too, not SDPA (the comparison for (2))",
    )
    add_busy_flag(parser)
    args = parser.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    with busy_core(args.busy):
        result = (
            run_fp8(quick=args.quick) if args.kv_dtype == "fp8"
            else run(quick=args.quick, prefill_in_kernel=args.prefill_in_kernel)
        )
    result["busy"] = args.busy
    if args.kv_dtype == "fp8":
        if args.json:
            print(json.dumps(result, indent=2))
        else:
            print_fp8(result)
        return
    if args.json:
        print(json.dumps(result, indent=2))
        return
    d, p = result["decode"], result["prefill"]
    print(f"attention backend: {result['attention_backend']}, torch threads: {result['threads']}")
    print(
        f"(1) decode attention 8x2048: paged {d['paged_ms']:.2f} ms vs dense ({d['dense_baseline']}) "
        f"{d[d['dense_baseline'] + '_ms']:.2f} ms -> {d['paged_over_dense_decode']:.2f}x (target <= 1.5x)"
    )
    print(
        f"(2) prefill {p['prompt_tokens']} tokens: full {p['full_prefill_ms']:.0f} ms, "
        f"{p['cached_tokens']} cached {p['prefix_hit_prefill_ms']:.0f} ms -> "
        f"{p['prefix_hit_prefill_ratio']:.2f}x (target <= 0.55x)"
    )
    for t in result["throughput"]:
        print(
            f"(3) batch {t['batch']:>2}: {t['tokens_per_s']:.1f} generated tokens/s end to end, "
            f"{t['decode_tokens_per_s']:.1f} in decode"
        )


if __name__ == "__main__":
    main()
