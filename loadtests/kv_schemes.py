"""Which 8-bit scheme for K and V would meet the quality targets (decision 0015, table 4).

    python -m loadtests.kv_schemes --model DIR [--window 256] [--json] [--scheme NAME ...]

Each scheme is a float pool whose pages, after every write, hold their rows quantized and
dequantized by that scheme ("fake quantization"), measured with ``loadtests.kv_quality``'s
text comparison against the exact pool. The row ``e4m3`` is the FP8 cache as built (its
numbers equal ``kv_quality --quick``'s text row, which reads real FP8 pages); the others are
candidates that have no page format or kernels. Scales are per (page, kv head) unless named.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable

import torch

from kvtier.engine.attention import get_backend
from kvtier.engine.attention.base import AttentionBackend, AttentionMetadata
from loadtests import kv_quality as kq

E4M3_MAX = 448.0
Quantizer = Callable[[torch.Tensor], torch.Tensor]  # [pages, page_size, kv_heads, head_dim] -> same


def e4m3(x: torch.Tensor, dims: tuple[int, ...] = (1, 3)) -> torch.Tensor:
    """e4m3 with one power-of-two scale per slice over ``dims`` (the cache's quantizer)."""
    amax = x.abs().amax(dim=dims, keepdim=True)
    scale = torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2(amax / E4M3_MAX))), torch.ones_like(amax))
    return (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * scale


def int8(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """Symmetric int8 with one scale (amax / 127) per slice over ``dims``."""
    amax = x.abs().amax(dim=dims, keepdim=True)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return torch.round(x / scale).clamp(-127, 127) * scale


def around_offset(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """e4m3 of ``x`` minus its per-(page, head, channel) midrange, which is added back."""
    mid = (x.amax(dim=1, keepdim=True) + x.amin(dim=1, keepdim=True)) / 2
    return e4m3(x - mid, dims) + mid


def _exact(x: torch.Tensor) -> torch.Tensor:
    return x


SCHEMES: dict[str, tuple[str, Quantizer, Quantizer]] = {
    # name: (what it is, K quantizer, V quantizer)
    "e4m3": ("e4m3 K and V (the cache as built)", e4m3, e4m3),
    "e4m3-sinks": ("e4m3, the first 4 positions' K exact", e4m3, e4m3),
    "e4m3-hadamard": ("e4m3 of K times a Hadamard matrix (q too)", e4m3, e4m3),
    "e4m3-offset": ("e4m3 K around a per-(page, head, channel) offset", lambda x: around_offset(x, (1, 3)), e4m3),
    "e4m3-offset-channel": ("same, per-(page, head, channel) scales", lambda x: around_offset(x, (1,)), e4m3),
    "exact-k": ("exact K, e4m3 V", _exact, e4m3),
    "int8-k-exact-v": ("int8 K per (page, head, channel), exact V", lambda x: int8(x, (1,)), _exact),
    "int8-k": ("int8 K per (page, head, channel), e4m3 V", lambda x: int8(x, (1,)), e4m3),
    "int8-k-int8-v": ("int8 K per (page, head, channel), int8 V per (token, head)",
                      lambda x: int8(x, (1,)), lambda x: int8(x, (3,))),
}


def hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


class FakeQuantBackend:
    """A float pool whose touched pages are requantized by a scheme after every write."""

    def __init__(self, inner: AttentionBackend, quantize_k: Quantizer, quantize_v: Quantizer,
                 rotation: torch.Tensor | None = None, exact_k_rows: int = 0) -> None:
        self.inner, self.quantize_k, self.quantize_v, self.rotation = inner, quantize_k, quantize_v, rotation
        self.exact_k_rows = exact_k_rows  # of page 0 (the sequence's first positions)
        self.name = f"{inner.name}+fake-quant"

    def write_kv(self, kv_layer, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata) -> None:
        if self.rotation is not None:
            k = k.float() @ self.rotation
        self.inner.write_kv(kv_layer, k, v, md)
        pages = (md.slot_mapping // kv_layer.shape[2]).unique()
        block = kv_layer[pages].float()  # [n, 2, page_size, kv_heads, head_dim]
        quantized = torch.stack([self.quantize_k(block[:, 0]), self.quantize_v(block[:, 1])], dim=1)
        if self.exact_k_rows and int(pages[0]) == 0:
            quantized[0, 0, : self.exact_k_rows] = block[0, 0, : self.exact_k_rows]
        kv_layer[pages] = quantized.to(kv_layer.dtype)

    def forward(self, q: torch.Tensor, kv_layer, md: AttentionMetadata, scale: float) -> torch.Tensor:
        if self.rotation is not None:
            q = (q.float() @ self.rotation).to(q.dtype)  # q·k is unchanged by an orthonormal rotation
        return self.inner.forward(q, kv_layer, md, scale)


def measure(model_dir: str, names: list[str], window: int) -> list[dict[str, object]]:
    model, tokenizer = kq.load(model_dir)
    backend = get_backend("auto", "cpu", page_size=kq.PAGE_SIZE)
    head_dim = model.kv_geometry[2]
    full = kq.PagedSequence(model, window, None, backend)
    rows = []
    for name in names:
        what, quantize_k, quantize_v = SCHEMES[name]
        rotation = hadamard(head_dim) if name == "e4m3-hadamard" else None
        exact_rows = 4 if name == "e4m3-sinks" else 0
        fake = kq.PagedSequence(
            model, window, None, FakeQuantBackend(backend, quantize_k, quantize_v, rotation, exact_rows)
        )
        start = time.perf_counter()
        text = kq.measure_text(model, tokenizer, full, fake, window, 1).report()
        rows.append({
            "scheme": name, "what": what, "ppl_increase": text["ppl_increase"],
            "top1_agreement": text["top1_agreement"], "mean_kl": text["mean_kl"],
            "elapsed_s": round(time.perf_counter() - start, 1),
        })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="checkpoint directory (config.json + safetensors + tokenizer)")
    parser.add_argument("--window", type=int, default=256, help="tokens of text, one window")
    parser.add_argument("--scheme", action="append", choices=list(SCHEMES), help="schemes to measure (default: all)")
    parser.add_argument("--json", action="store_true", help="print one JSON list")
    args = parser.parse_args(argv)
    rows = measure(args.model, args.scheme or list(SCHEMES), args.window)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        print(
            f"{r['scheme']:<22} perplexity {100 * r['ppl_increase']:+.2f} %  top-1 {100 * r['top1_agreement']:.1f} %  "
            f"KL {r['mean_kl']:.1e}  ({r['what']})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
