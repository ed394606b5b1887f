"""Engine benchmark: paged vs dense decode attention, prefix-hit prefill, tokens/s.

    python -m loadtests.bench_engine [--json] [--quick]

Geometry: 8 layers, hidden 1024, 8 query / 8 KV heads of 128, fp32, on this CPU.
Every number is measured against a baseline in the same run:
  (1) one paged decode attention step (8 sequences x 2,048 context, pages scattered)
      over dense ``scaled_dot_product_attention`` on contiguous K/V  (target <= 1.5x);
  (2) prefill of a prompt whose first half is a cached prefix over the same prefill
      from scratch                                                   (target <= 0.55x);
  (3) generated tokens per second at batch 1, 8 and 32.
Loops are bounded in count; nothing leaves the process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvtier.engine import Engine, SamplingParams
from kvtier.engine.model.loader import write_random_checkpoint
from loadtests.bench_attention import measure_decode

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
    return {
        "prompt_tokens": prompt_len,
        "cached_tokens": half,
        "full_prefill_ms": statistics.median(full_s) * 1e3,
        "prefix_hit_prefill_ms": statistics.median(hit_s) * 1e3,
        "prefix_hit_prefill_ratio": statistics.median(h / f for h, f in zip(hit_s, full_s, strict=True)),
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


def run(quick: bool = False) -> dict:
    torch.manual_seed(0)
    decode = measure_decode(
        num_seqs=8, context_len=2048, num_heads=8, num_kv_heads=8, head_dim=128, page_size=16,
        iterations=10 if quick else 30,
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = write_random_checkpoint(Path(tmp) / "bench-model", BENCH_CONFIG, seed=0)
        # 4,096 pages of 16 tokens: every prompt and its cached prefixes stay resident.
        engine = Engine.from_pretrained(path, page_size=16, num_pages=4096)
        engine.generate([_prompt(64, seed=1)], SamplingParams(max_tokens=2))  # warm-up
        prefill = measure_prefix_prefill(engine, prompt_len=512 if quick else 1024, repeats=2 if quick else 3)
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtests.bench_engine", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="fewer iterations and shorter prompts")
    args = parser.parse_args(argv)
    result = run(quick=args.quick)
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
