"""Quality of an FP8 KV cache against the full-precision cache, on one real model.

    python -m loadtests.kv_quality --model DIR [--json] [--quick] [--format e4m3|e5m2]
    python -m loadtests.kv_quality --model DIR --granularity [--json]

Both sides run kvtier's own model (``LlamaModel``) and attention backend over paged K/V; they
differ only in the pages: fp32 tensors, or FP8 pages (``Fp8Pages``: codes + scales in the
page) that attention decodes as it reads. Every K/V row the model writes goes through the
FP8 quantizer, in prefill and in decode, so what is measured is the cache's effect.

  (1) perplexity over windows of up to 2,048 tokens of English text that ships with Python
      itself (``pydoc_data.topics``: the language reference's help topics), the relative
      change reported per position bucket (target: +<= 1 %);
  (2) top-1 next-token agreement (target >= 99 %) and mean KL(full || fp8) of the
      next-token distributions, at every position of those windows;
  (3) multi-turn chats through the model's chat template: each turn's greedy continuation
      with both caches, over the same (full-precision) history, and the first token where
      they part (``null``: identical for the whole continuation).

``--granularity`` instead measures the relative RMS error of the model's own K and V (512
tokens of that text) under each scale granularity and format, the evidence for decision 0015.

``--scale-error F`` multiplies every scale the FP8 side reads by F: a broken quantizer, which
the thresholds must catch (the test suite runs ``--quick`` both ways). Runs on CPU, fp32
weights; the FP8 cache path goes through the attention backend and quantizer directly,
not through the engine's page pools.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from kvtier.engine.attention import get_backend
from kvtier.engine.attention.base import AttentionBackend, AttentionMetadata, KvLayer
from kvtier.engine.attention.fp8 import FORMATS, Fp8KvLayer, Fp8Pages, encode, pow2_scales
from kvtier.engine.model.llama import LlamaModel
from kvtier.engine.model.loader import load_model

PAGE_SIZE = 16
BUCKETS = (0, 128, 512, 1024, 2048)  # position buckets [lo, hi)
TARGET_PPL_INCREASE = 0.01
TARGET_TOP1 = 0.99
CHATS: tuple[tuple[str, ...], ...] = (
    (
        "What is a KV cache in a transformer model?",
        "Why does it grow with the length of the conversation?",
        "Give one way to make it smaller.",
    ),
    (
        "Write a short Python function that reverses a string.",
        "Now make it ignore spaces.",
        "Explain how your function works in two sentences.",
    ),
    (
        "I am planning a trip to the mountains in autumn. What should I pack?",
        "What if it rains every day?",
        "Summarize your advice in one line.",
    ),
)


class ScaleErrorBackend:
    """Wraps a backend so attention reads every FP8 scale multiplied by ``factor`` (fault injection)."""

    def __init__(self, inner: AttentionBackend, factor: float) -> None:
        self.inner = inner
        self.factor = factor
        self.name = f"{inner.name}+scale-error-{factor:g}"

    def write_kv(self, kv_layer: KvLayer, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata) -> None:
        self.inner.write_kv(kv_layer, k, v, md)

    def forward(self, q: torch.Tensor, kv_layer: KvLayer, md: AttentionMetadata, scale: float) -> torch.Tensor:
        if isinstance(kv_layer, Fp8KvLayer):
            kv_layer = Fp8KvLayer(kv_layer.codes, kv_layer.scales * self.factor)
        return self.inner.forward(q, kv_layer, md, scale)


class PagedSequence:
    """One sequence over its own pages (float pool or FP8 pages), fed token runs in order."""

    def __init__(
        self, model: LlamaModel, max_tokens: int, kv_format: str | None, backend: AttentionBackend
    ) -> None:
        num_layers, kv_heads, head_dim = model.kv_geometry
        num_pages = -(-max_tokens // PAGE_SIZE)
        self.model = model
        self.backend = backend
        self.max_tokens = max_tokens
        if kv_format is None:
            self.pool = torch.zeros(num_pages, num_layers, 2, PAGE_SIZE, kv_heads, head_dim, dtype=model.dtype)
        else:
            self.pool = Fp8Pages.allocate(
                num_pages, num_layers=num_layers, page_size=PAGE_SIZE, kv_heads=kv_heads, head_dim=head_dim,
                fmt=kv_format,
            )  # fmt: skip
        self.num_tokens = 0

    def reset(self) -> None:
        self.num_tokens = 0  # pages are rewritten from offset 0, which discards what they held

    @torch.inference_mode()
    def feed(self, tokens: Sequence[int]) -> torch.Tensor:
        """Hidden states ``[len(tokens), hidden]`` of the new tokens after attending over the cache."""
        ctx = self.num_tokens + len(tokens)
        if ctx > self.max_tokens:
            raise ValueError(f"sequence of {ctx} tokens exceeds the {self.max_tokens} this cache holds")
        table = list(range(-(-ctx // PAGE_SIZE)))
        md = AttentionMetadata.build([len(tokens)], [ctx], [table], PAGE_SIZE)
        ids = torch.tensor(list(tokens), dtype=torch.long)
        positions = torch.arange(self.num_tokens, ctx)
        hidden = self.model(ids, positions, self.pool, md, self.backend)
        self.num_tokens = ctx
        return hidden


@dataclass(slots=True)
class BucketStats:
    lo: int
    hi: int
    num_tokens: int = 0
    nll_full: float = 0.0
    nll_fp8: float = 0.0

    @property
    def ppl_full(self) -> float:
        return math.exp(self.nll_full / self.num_tokens) if self.num_tokens else float("nan")

    @property
    def ppl_fp8(self) -> float:
        return math.exp(self.nll_fp8 / self.num_tokens) if self.num_tokens else float("nan")


@dataclass(slots=True)
class TextStats:
    num_windows: int = 0
    num_tokens: int = 0
    nll_full: float = 0.0
    nll_fp8: float = 0.0
    num_top1_agree: int = 0
    kl_sum: float = 0.0
    buckets: list[BucketStats] = field(default_factory=list)

    def report(self) -> dict[str, object]:
        ppl_full = math.exp(self.nll_full / self.num_tokens)
        ppl_fp8 = math.exp(self.nll_fp8 / self.num_tokens)
        return {
            "num_windows": self.num_windows,
            "num_tokens": self.num_tokens,
            "ppl_full": round(ppl_full, 4),
            "ppl_fp8": round(ppl_fp8, 4),
            "ppl_increase": round(ppl_fp8 / ppl_full - 1, 6),
            "top1_agreement": round(self.num_top1_agree / self.num_tokens, 6),
            "mean_kl": self.kl_sum / self.num_tokens,
            "by_position": [
                {
                    "positions": f"{b.lo}-{b.hi - 1}",
                    "num_tokens": b.num_tokens,
                    "ppl_full": round(b.ppl_full, 4),
                    "ppl_fp8": round(b.ppl_fp8, 4),
                    "ppl_increase": round(b.ppl_fp8 / b.ppl_full - 1, 6),
                }
                for b in self.buckets
                if b.num_tokens
            ],
        }


def reference_text() -> str:
    """English prose shipped with Python: the language reference's help topics, in key order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def _compare_rows(model: LlamaModel, full: torch.Tensor, fp8: torch.Tensor, targets: torch.Tensor, stats, pos0):
    """Accumulate NLL, top-1 agreement and KL for rows predicting ``targets`` (chunks bound memory)."""
    for start in range(0, targets.numel(), 256):
        end = min(start + 256, targets.numel())
        log_full = F.log_softmax(model.compute_logits(full[start:end]), dim=-1)
        log_fp8 = F.log_softmax(model.compute_logits(fp8[start:end]), dim=-1)
        tgt = targets[start:end]
        nll_full = -log_full.gather(1, tgt[:, None])[:, 0]
        nll_fp8 = -log_fp8.gather(1, tgt[:, None])[:, 0]
        stats.nll_full += nll_full.sum().item()
        stats.nll_fp8 += nll_fp8.sum().item()
        stats.num_top1_agree += (log_full.argmax(-1) == log_fp8.argmax(-1)).sum().item()
        stats.kl_sum += (log_full.exp() * (log_full - log_fp8)).sum(-1).clamp_min(0).sum().item()
        stats.num_tokens += end - start
        positions = torch.arange(pos0 + start, pos0 + end)
        for bucket in stats.buckets:
            inside = (positions >= bucket.lo) & (positions < bucket.hi)
            bucket.num_tokens += int(inside.sum())
            bucket.nll_full += nll_full[inside].sum().item()
            bucket.nll_fp8 += nll_fp8[inside].sum().item()


def measure_text(
    model: LlamaModel, tokenizer, full: PagedSequence, fp8: PagedSequence, window: int, num_windows: int
) -> TextStats:
    ids = tokenizer(reference_text(), add_special_tokens=False)["input_ids"]
    stats = TextStats(buckets=[BucketStats(lo, hi) for lo, hi in zip(BUCKETS, BUCKETS[1:], strict=False)])
    for w in range(num_windows):
        chunk = ids[w * window : (w + 1) * window + 1]
        if len(chunk) < 2:
            break
        full.reset()
        fp8.reset()
        h_full = full.feed(chunk[:-1])
        h_fp8 = fp8.feed(chunk[:-1])
        _compare_rows(model, h_full, h_fp8, torch.tensor(chunk[1:]), stats, 0)
        stats.num_windows += 1
    return stats


def _greedy(seq: PagedSequence, prompt: list[int], max_new_tokens: int, eos: set[int]) -> list[int]:
    seq.reset()
    hidden = seq.feed(prompt)
    out: list[int] = []
    for _ in range(max_new_tokens):
        token = int(seq.model.compute_logits(hidden[-1:]).argmax(-1))
        out.append(token)
        if token in eos:
            break
        hidden = seq.feed([token])
    return out


def measure_chats(
    tokenizer, full: PagedSequence, fp8: PagedSequence, max_new_tokens: int, chats=CHATS
) -> list[dict[str, object]]:
    eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    results = []
    for c, turns in enumerate(chats):
        messages: list[dict[str, str]] = []
        for t, user in enumerate(turns):
            messages.append({"role": "user", "content": user})
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if not isinstance(prompt, list):  # transformers 5 returns a BatchEncoding
                prompt = prompt["input_ids"]
            ours = _greedy(full, prompt, max_new_tokens, eos)
            theirs = _greedy(fp8, prompt, max_new_tokens, eos)
            first = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), None)
            if first is None and len(ours) != len(theirs):
                first = min(len(ours), len(theirs))
            results.append(
                {"chat": c, "turn": t, "prompt_tokens": len(prompt), "num_tokens": len(ours), "first_divergence": first}
            )
            messages.append({"role": "assistant", "content": tokenizer.decode(ours, skip_special_tokens=True)})
    return results


def granularity_study(model_dir: str | Path, num_tokens: int = 512) -> list[dict[str, object]]:
    """Relative RMS error of the model's K and V under each scale granularity, per format."""
    model, tokenizer = load(model_dir)
    ids = tokenizer(reference_text(), add_special_tokens=False)["input_ids"][:num_tokens]
    seq = PagedSequence(model, len(ids), None, get_backend("auto", "cpu", page_size=PAGE_SIZE))
    seq.feed(ids)
    pool = seq.pool[: -(-len(ids) // PAGE_SIZE)]  # [pages, L, 2, P, H, D]
    n, layers, _, page, heads, dim = pool.shape
    by_page = pool.permute(1, 2, 4, 0, 3, 5)  # [L, 2, H, pages, P, D]
    by_token = by_page.reshape(layers, 2, heads, n * page, dim)

    def rel_error(approx: torch.Tensor, plane: int) -> float:
        exact = by_page[:, plane]
        return round(((approx - exact).norm() / exact.norm()).item(), 4)

    def fake(x: torch.Tensor, dims: tuple[int, ...], fmt, exact: bool = False) -> torch.Tensor:
        amax = x.abs().amax(dim=dims, keepdim=True)
        scale = (amax / fmt.max_value).clamp_min(1e-30) if exact else pow2_scales(amax, fmt)
        return encode(x, scale, fmt).float() * scale

    rows = []
    for name, fmt in FORMATS.items():
        variants = {
            "per layer, plane, head (pow2)": fake(by_token, (3, 4), fmt),
            "per page, head (pow2)": fake(by_page, (4, 5), fmt),
            "per page, head (exact amax)": fake(by_page, (4, 5), fmt, exact=True),
            "per token, head (pow2)": fake(by_token, (4,), fmt),
        }
        for variant, approx in variants.items():
            approx = approx.reshape(by_page.shape)
            rows.append({"format": name, "granularity": variant, "k_error": rel_error(approx[:, 0], 0),
                         "v_error": rel_error(approx[:, 1], 1)})  # fmt: skip
    bf16 = by_page.to(torch.bfloat16).float()
    rows.append({"format": "bf16", "granularity": "-", "k_error": rel_error(bf16[:, 0], 0),
                 "v_error": rel_error(bf16[:, 1], 1)})  # fmt: skip
    return rows


def load(model_dir: str | Path) -> tuple[LlamaModel, object]:
    """kvtier's fp32 model and the checkpoint's tokenizer."""
    from transformers import AutoTokenizer

    return load_model(model_dir, torch.float32), AutoTokenizer.from_pretrained(str(model_dir))


def run(
    model_dir: str | Path,
    *,
    loaded: tuple[LlamaModel, object] | None = None,
    kv_format: str = "e4m3",
    window: int = 2048,
    num_windows: int = 4,
    max_new_tokens: int = 48,
    chats: Sequence[Sequence[str]] = CHATS,
    scale_error: float = 1.0,
    backend_name: str = "auto",
) -> dict[str, object]:
    """The comparison; ``loaded`` (from ``load``) skips reading the checkpoint again."""
    if not 2 <= window <= 2048:
        raise ValueError(f"window must be in [2, 2048], got {window}")
    model, tokenizer = loaded or load(model_dir)
    backend = get_backend(backend_name, "cpu", page_size=PAGE_SIZE)
    fp8_backend = backend if scale_error == 1.0 else ScaleErrorBackend(backend, scale_error)
    max_tokens = max(window, 2048)
    full = PagedSequence(model, max_tokens, None, backend)
    fp8 = PagedSequence(model, max_tokens, kv_format, fp8_backend)
    start = time.perf_counter()
    text = measure_text(model, tokenizer, full, fp8, window, num_windows).report()
    turns = measure_chats(tokenizer, full, fp8, max_new_tokens, chats) if chats else []
    diverged = [t["first_divergence"] for t in turns if t["first_divergence"] is not None]
    return {
        "model": Path(model_dir).name,
        "kv_format": kv_format,
        "backend": backend.name,
        "scale_error": scale_error,
        "text_source": "pydoc_data.topics (Python language reference help topics)",
        "window": window,
        "text": text,
        "chats": {
            "num_turns": len(turns),
            "num_identical": len(turns) - len(diverged),
            "first_divergence_min": min(diverged) if diverged else None,
            "turns": turns,
        },
        "targets": {"ppl_increase_max": TARGET_PPL_INCREASE, "top1_agreement_min": TARGET_TOP1},
        "meets_targets": text["ppl_increase"] <= TARGET_PPL_INCREASE and text["top1_agreement"] >= TARGET_TOP1,
        "elapsed_s": round(time.perf_counter() - start, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="checkpoint directory (config.json + safetensors + tokenizer)")
    parser.add_argument("--format", default="e4m3", choices=["e4m3", "e5m2"], help="FP8 format of the pages")
    parser.add_argument("--window", type=int, default=2048, help="tokens per perplexity window (<= 2048)")
    parser.add_argument("--num-windows", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48, help="greedy tokens per chat turn")
    parser.add_argument("--scale-error", type=float, default=1.0, help="multiply scales read by this (fault injection)")
    parser.add_argument("--backend", default="auto", help="attention backend (auto, cpu-fused, torch-reference)")
    parser.add_argument("--quick", action="store_true", help="one 256-token window and one chat turn")
    parser.add_argument("--granularity", action="store_true", help="K/V error by scale granularity, then exit")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.granularity:
        rows = granularity_study(args.model)
        if args.json:
            print(json.dumps(rows, indent=2))
        for row in [] if args.json else rows:
            print(f"{row['format']:>5} {row['granularity']:<32} K {row['k_error']:.4f}  V {row['v_error']:.4f}")
        return 0
    kwargs = dict(kv_format=args.format, scale_error=args.scale_error, backend_name=args.backend)
    if args.quick:
        result = run(args.model, window=256, num_windows=1, max_new_tokens=24, chats=[CHATS[0][:1]], **kwargs)
    else:
        result = run(
            args.model, window=args.window, num_windows=args.num_windows, max_new_tokens=args.max_new_tokens,
            **kwargs,
        )  # fmt: skip
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        text = result["text"]
        print(
            f"{result['model']} {result['kv_format']} over {text['num_tokens']} tokens: perplexity "
            f"{text['ppl_full']} -> {text['ppl_fp8']} ({100 * text['ppl_increase']:+.3f} %), top-1 agreement "
            f"{100 * text['top1_agreement']:.2f} %, mean KL {text['mean_kl']:.2e}; chat turns identical "
            f"{result['chats']['num_identical']}/{result['chats']['num_turns']}"
        )
        for bucket in text["by_position"]:
            print(f"  positions {bucket['positions']}: {100 * bucket['ppl_increase']:+.3f} %")
    return 0 if result["meets_targets"] else 1


if __name__ == "__main__":
    sys.exit(main())
