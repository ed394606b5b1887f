"""What a paused session's next turn costs on a GPU, by where its history waited.

    python -m loadtests.bench_resume_gpu [--json] [--contexts 2048,8192,16384] [--new-tokens 128]
                                         [--layers 4] [--repeats 3] [--tiny]

The agent workload (``loadtests.agent_workload``) runs on CPU, where a DRAM -> "HBM" promotion is a
memcpy as fast as attention reads, so it emulates a GPU's link (decision 0011). This benchmark
measures the premise of that emulation on a real GPU, through kvtier's own engine and tier
manager (no Ray, no gRPC): time to first token of a resumed turn (``--new-tokens`` new tokens
after a ``context``-token history, one output token) when the history is

    in HBM        what kvtier's prefetch gives (and the infinite-HBM reference)   = baseline
    in DRAM       pinned host memory, promoted on arrival over PCIe, checksummed: what a reactive
                  tier (LMCache / HiCache-like) pays on the token path
    gone          recomputed: a full prefill of history + new tokens (no cache)

and prints ``reactive / in-HBM`` and ``recompute / in-HBM`` per context length. Model: a random
Llama-shaped checkpoint with Llama-3.1-8B's layer (hidden 4096, 32 heads, 8 KV heads x 128,
MLP 14336, bf16: 128 KiB of KV per token over 32 layers) and ``--layers`` of them (default 4):
both the prefill of the new tokens and the bytes to promote scale with the layer count, so their
ratio is the full model's, up to the embedding and LM head. Needs CUDA (exits 2 without) unless
``--tiny`` (a small model on CPU, to check the script). Bounded: a few generations per context.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvtier.domain.tiers import Tier
from kvtier.engine import Engine, SamplingParams
from kvtier.engine.model.loader import write_random_checkpoint
from kvtier.tiers.manager import TierConfig

PAGE_SIZE = 16
LLAMA_8B_LAYER = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000,
    "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "max_position_embeddings": 32768, "tie_word_embeddings": False, "hidden_act": "silu",
}
TINY = {**LLAMA_8B_LAYER, "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}
ONE_TOKEN = SamplingParams(max_tokens=1, ignore_eos=True)


def _tokens(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _ttft_s(engine: Engine, prompt: list[int], device: str) -> tuple[float, int, int]:
    """Seconds to the first (only) token, cached and promoted tokens of that request."""
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    (result,) = engine.generate([prompt], ONE_TOKEN)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, result.num_cached_tokens, result.num_promoted_tokens


def measure(engine: Engine, context: int, new_tokens: int, repeats: int, device: str, vocab: int) -> dict:
    rows: dict[str, list[float]] = {"hbm": [], "dram": [], "recompute": []}
    history_len = context // PAGE_SIZE * PAGE_SIZE  # whole pages: every history token is cacheable
    for r in range(repeats + 1):  # round 0 warms up (Triton compiles, allocator) and is dropped
        seed = 10 * (context * (repeats + 1) + r)  # no two prompts of the run share a first page
        history = _tokens(history_len, seed + 1, vocab)
        engine.generate([history], ONE_TOKEN)  # the session's history, cached in HBM
        hbm_s, cached, promoted = _ttft_s(engine, history + _tokens(new_tokens, seed + 2, vocab), device)
        assert cached == history_len and promoted == 0, (cached, promoted)
        engine.tiers.demote_all(Tier.DRAM)  # paused: the whole history waits in pinned DRAM
        dram_s, cached, promoted = _ttft_s(engine, history + _tokens(new_tokens, seed + 3, vocab), device)
        assert cached == promoted == history_len, (cached, promoted)
        fresh = _tokens(history_len + new_tokens, seed + 4, vocab)  # nothing cached: a full prefill
        recompute_s, cached, _ = _ttft_s(engine, fresh, device)
        assert cached == 0, cached
        engine.tiers.demote_all(Tier.DRAM)  # this round's pages out of the way of the next
        if r:
            rows["hbm"].append(hbm_s)
            rows["dram"].append(dram_s)
            rows["recompute"].append(recompute_s)
    med = {k: statistics.median(v) * 1000.0 for k, v in rows.items()}
    kv_bytes = history_len * engine.geometry.page_bytes // PAGE_SIZE
    return {
        "context_tokens": history_len, "new_tokens": new_tokens, "history_bytes": kv_bytes,
        "ttft_ms": {k: round(v, 2) for k, v in med.items()},
        "reactive_over_hbm": round(med["dram"] / med["hbm"], 2),
        "recompute_over_hbm": round(med["recompute"] / med["hbm"], 2),
        "promote_gb_per_s": round(kv_bytes / max(1e-9, (med["dram"] - med["hbm"]) / 1000.0) / 1e9, 1),
    }


def run(contexts: list[int], new_tokens: int, layers: int, repeats: int, tiny: bool) -> dict:
    device = "cpu" if tiny else "cuda"
    dtype = torch.float32 if tiny else torch.bfloat16
    config = {**(TINY if tiny else LLAMA_8B_LAYER), "num_hidden_layers": layers}
    with tempfile.TemporaryDirectory(prefix="kvtier-resume-") as tmp:
        ckpt = write_random_checkpoint(Path(tmp) / "model", config, seed=0, dtype=dtype)
        max_pages = (max(contexts) + new_tokens) // PAGE_SIZE + 2
        # HBM for the history, the new turn and a fresh prompt of the same size; DRAM for two rounds.
        engine = Engine.from_pretrained(
            ckpt, page_size=PAGE_SIZE, num_pages=3 * max_pages, dtype=dtype, device=device,
            tier_config=TierConfig(dram_pages=4 * max_pages),
        )
        try:
            results = [measure(engine, c, new_tokens, repeats, device, config["vocab_size"]) for c in contexts]
        finally:
            engine.close()
    return {
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "attention_backend": engine.backend.name, "layers": layers, "kv_bytes_per_token": engine.geometry.page_bytes // PAGE_SIZE,
        "results": results,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--contexts", default="2048,8192,16384", help="history lengths in tokens, comma-separated")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="a small model on CPU (checks the script, not a GPU)")
    args = parser.parse_args(argv)
    if not args.tiny and not torch.cuda.is_available():
        print("bench_resume_gpu needs a CUDA device (or --tiny)", file=sys.stderr)
        return 2
    contexts = [int(c) for c in args.contexts.split(",") if c]
    if not contexts or min(contexts) < PAGE_SIZE or args.new_tokens < 1 or args.layers < 1 or args.repeats < 1:
        parser.error(f"contexts must be >= {PAGE_SIZE} tokens; new-tokens, layers and repeats >= 1")
    result = run(contexts, args.new_tokens, args.layers, args.repeats, args.tiny)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{result['device']}, {result['layers']} layers, attention {result['attention_backend']}, "
              f"{result['kv_bytes_per_token']} B of KV per token")
        print(" context   history MiB   in HBM   in DRAM (promoted)   recomputed   reactive/HBM   recompute/HBM   GB/s")
        for r in result["results"]:
            t = r["ttft_ms"]
            print(f"{r['context_tokens']:8d} {r['history_bytes'] / 2**20:13.1f} {t['hbm']:8.2f} {t['dram']:20.2f} "
                  f"{t['recompute']:12.2f} {r['reactive_over_hbm']:14.2f} {r['recompute_over_hbm']:15.2f} "
                  f"{r['promote_gb_per_s']:6.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
