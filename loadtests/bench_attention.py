"""Decode attention: paged backends against dense SDPA over contiguous K/V.

    python -m loadtests.bench_attention [--json] [--iterations N] [--busy]
    python -m loadtests.bench_attention --device cuda --backend triton [--dtype bfloat16]
    python -m loadtests.bench_attention --kv-dtype fp8 [--json] [--device cuda --backend triton]

The dense baseline is ``scaled_dot_product_attention`` on ``q [B, H, 1, D]`` and contiguous
``k/v [B, kv_heads, ctx, D]`` holding the same values as the pool. Two forms are timed,
GQA through ``enable_gqa=True`` and K/V pre-expanded to ``H`` heads (expansion not timed);
the faster one is the baseline, so the ratio never flatters the paged path. Pages of the
paged pool are a random sample of a pool ``pool_slack`` times larger than needed, with
``num_layers`` layers, as a busy pool leaves them. Each iteration runs every variant
back to back, so noise from other processes on a shared machine lands on all of them;
``paged_over_dense_decode`` is the median of the per-iteration ratios.

``--device cuda`` builds the same pool, K/V and queries on the GPU (``--dtype`` defaults
to bfloat16 there, float32 on CPU) and adds two larger geometries, since 8 sequences leave
an H200 mostly idle. One CUDA sample is the mean of ``CUDA_CALLS_PER_SAMPLE`` back-to-back
calls between two synchronisations: per-call host overhead (Python, kernel launches) is
counted, as a serving loop without CUDA graphs pays it, but it overlaps the GPU work of
the previous call instead of adding a synchronisation per call.

``--kv-dtype fp8`` times decode over FP8 pages (e4m3 codes + scales, decoded in the kernel)
against the same backend over a bf16 pool holding the same values, the two interleaved in
every iteration; it prints the median ratio fp8/bf16 with its range, the bytes of one page
of each kind and how many more FP8 pages fit in the same bytes (for the benchmark's pool
and for two real model geometries).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvtier.domain.page_layout import PageLayout
from kvtier.engine.attention.base import AttentionBackend, AttentionMetadata, ReferenceBackend
from kvtier.engine.attention.fp8 import quantize_pages
from kvtier.engine.attention.registry import get_backend
from loadtests.busy import add_busy_flag, busy_core

GEOMETRIES = (
    # (num_seqs, context_len, num_heads, num_kv_heads)
    (8, 2048, 8, 8),
    (8, 2048, 16, 8),
    (8, 512, 8, 8),
    (8, 512, 16, 8),
)
CUDA_GEOMETRIES = (
    (64, 4096, 32, 8),
    (256, 1024, 32, 8),
)
CUDA_CALLS_PER_SAMPLE = 10


def _time_ms(fn: Callable[[], object], device: torch.device) -> float:
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(CUDA_CALLS_PER_SAMPLE):
        fn()
    torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3 / CUDA_CALLS_PER_SAMPLE


def measure_decode(
    num_seqs: int = 8,
    context_len: int = 2048,
    num_heads: int = 8,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    page_size: int = 16,
    *,
    num_layers: int = 2,
    pool_slack: float = 2.0,
    iterations: int = 20,
    warmup: int = 3,
    backend: AttentionBackend | None = None,
    include_reference: bool = True,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> dict:
    """Time one decode step (``num_seqs`` rows, each over ``context_len`` keys) three ways.

    ``backend`` defaults to ``get_backend("auto")``. Returns medians in milliseconds, the
    ratio ``paged_over_dense_decode`` (median of per-iteration paged/dense-best), the
    thread count used by every variant, and ``max_abs_diff`` between paged and dense
    outputs as a sanity check.
    """
    device = torch.device(device)
    backend = backend or get_backend("auto", device, page_size=page_size)
    gen = torch.Generator(device).manual_seed(seed)
    rng = random.Random(seed)
    pages_per_seq = -(-context_len // page_size)
    num_used = num_seqs * pages_per_seq
    num_pages = max(num_used, int(num_used * pool_slack))
    pool = torch.zeros(
        num_pages, num_layers, 2, page_size, num_kv_heads, head_dim, dtype=dtype, device=device
    )
    kv_layer = pool[:, num_layers - 1]
    page_ids = rng.sample(range(num_pages), num_used)
    tables = [page_ids[i * pages_per_seq : (i + 1) * pages_per_seq] for i in range(num_seqs)]
    used = torch.tensor(page_ids, device=device)
    kv_layer[used] = torch.randn(
        num_used, 2, page_size, num_kv_heads, head_dim, generator=gen, device=device
    ).to(dtype)

    md = AttentionMetadata.build([1] * num_seqs, [context_len] * num_seqs, tables, page_size, device=device)
    q = torch.randn(num_seqs, num_heads, head_dim, generator=gen, device=device).to(dtype)
    scale = head_dim**-0.5

    # Dense K/V with the same values, [B, kv_heads, ctx, D] contiguous.
    table_t = torch.tensor(tables, device=device)
    k = kv_layer[table_t, 0].reshape(num_seqs, -1, num_kv_heads, head_dim)[:, :context_len]
    v = kv_layer[table_t, 1].reshape(num_seqs, -1, num_kv_heads, head_dim)[:, :context_len]
    k = k.transpose(1, 2).contiguous()
    v = v.transpose(1, 2).contiguous()
    group = num_heads // num_kv_heads
    k_expanded = k.repeat_interleave(group, dim=1) if group > 1 else k
    v_expanded = v.repeat_interleave(group, dim=1) if group > 1 else v
    q_dense = q[:, :, None, :]

    variants: dict[str, Callable[[], torch.Tensor]] = {
        "dense_gqa": lambda: F.scaled_dot_product_attention(q_dense, k, v, scale=scale, enable_gqa=True),
        "dense_expanded": lambda: F.scaled_dot_product_attention(
            q_dense, k_expanded, v_expanded, scale=scale
        ),
        "paged": lambda: backend.forward(q, kv_layer, md, scale),
    }
    if include_reference:
        reference = ReferenceBackend()
        variants["paged_reference"] = lambda: reference.forward(q, kv_layer, md, scale)

    dense_out = variants["dense_gqa"]()[:, :, 0]
    max_abs_diff = (variants["paged"]().float() - dense_out.float()).abs().max().item()

    for _ in range(warmup):
        for fn in variants.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(iterations):
        for name, fn in variants.items():
            times[name].append(_time_ms(fn, device))
    dense_best = min(("dense_gqa", "dense_expanded"), key=lambda name: statistics.median(times[name]))
    ratios = [p / d for p, d in zip(times["paged"], times[dense_best], strict=True)]

    result = {
        "num_seqs": num_seqs,
        "context_len": context_len,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "page_size": page_size,
        "device": device.type,
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "iterations": iterations,
        "backend": backend.name,
        "dense_baseline": dense_best,
        "max_abs_diff": max_abs_diff,
        "paged_over_dense_decode": statistics.median(ratios),
    }
    for name, samples in times.items():
        result[f"{name}_ms"] = statistics.median(samples)
    if include_reference:
        result["reference_over_dense_decode"] = result["paged_reference_ms"] / result[f"{dense_best}_ms"]
    return result


# (name, layers, kv heads, head_dim) of real models, for the page-bytes comparison.
MODEL_PAGE_GEOMETRIES = (("SmolLM2-135M", 30, 3, 64), ("Llama-3.1-8B", 32, 8, 128))


def page_bytes_row(name: str, num_layers: int, kv_heads: int, head_dim: int, page_size: int) -> dict:
    bf16 = PageLayout("bf16", num_layers, 2, page_size, kv_heads, head_dim)
    fp8 = PageLayout("fp8", num_layers, 2, page_size, kv_heads, head_dim)
    return {
        "geometry": name,
        "page_size": page_size,
        "bf16_page_bytes": bf16.page_bytes,
        "fp8_page_bytes": fp8.page_bytes,
        "fp8_scale_bytes": fp8.scale_bytes,
        "fp8_over_bf16_bytes": fp8.page_bytes / bf16.page_bytes,
        "pages_in_same_bytes": bf16.page_bytes / fp8.page_bytes,
    }


def measure_fp8_decode(
    num_seqs: int = 8,
    context_len: int = 2048,
    num_heads: int = 8,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    page_size: int = 16,
    *,
    num_layers: int = 2,
    pool_slack: float = 2.0,
    iterations: int = 20,
    warmup: int = 3,
    backend: AttentionBackend | None = None,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> dict:
    """One decode step over FP8 pages and over a bf16 pool with the same values, interleaved.

    Returns the median of the per-iteration ratios fp8/bf16 with their min and max, the
    median times, and ``max_abs_diff`` between the two outputs (the quantization's effect).
    """
    device = torch.device(device)
    backend = backend or get_backend("auto", device, page_size=page_size)
    gen = torch.Generator(device).manual_seed(seed)
    rng = random.Random(seed)
    pages_per_seq = -(-context_len // page_size)
    num_used = num_seqs * pages_per_seq
    num_pages = max(num_used, int(num_used * pool_slack))
    values = torch.zeros(num_pages, num_layers, 2, page_size, num_kv_heads, head_dim, device=device)
    page_ids = rng.sample(range(num_pages), num_used)
    values[torch.tensor(page_ids, device=device)] = torch.randn(
        num_used, num_layers, 2, page_size, num_kv_heads, head_dim, generator=gen, device=device
    )
    bf16_pool = values.to(torch.bfloat16)
    fp8_pages = quantize_pages(values)
    del values
    layer = num_layers - 1
    tables = [page_ids[i * pages_per_seq : (i + 1) * pages_per_seq] for i in range(num_seqs)]
    md = AttentionMetadata.build([1] * num_seqs, [context_len] * num_seqs, tables, page_size, device=device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q = torch.randn(num_seqs, num_heads, head_dim, generator=gen, device=device).to(dtype)
    scale = head_dim**-0.5
    variants: dict[str, Callable[[], torch.Tensor]] = {
        "bf16": lambda: backend.forward(q, bf16_pool[:, layer], md, scale),
        "fp8": lambda: backend.forward(q, fp8_pages[:, layer], md, scale),
    }
    max_abs_diff = (variants["fp8"]().float() - variants["bf16"]().float()).abs().max().item()
    for _ in range(warmup):
        for fn in variants.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(iterations):
        order = list(variants) if i % 2 == 0 else list(reversed(variants))  # neither side always goes first
        for name in order:
            times[name].append(_time_ms(variants[name], device))
    ratios = [f / b for f, b in zip(times["fp8"], times["bf16"], strict=True)]
    return {
        "num_seqs": num_seqs,
        "context_len": context_len,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "page_size": page_size,
        "device": device.type,
        "threads": torch.get_num_threads(),
        "iterations": iterations,
        "backend": backend.name,
        "bf16_ms": statistics.median(times["bf16"]),
        "fp8_ms": statistics.median(times["fp8"]),
        "fp8_over_bf16_decode": statistics.median(ratios),
        "fp8_over_bf16_min": min(ratios),
        "fp8_over_bf16_max": max(ratios),
        "max_abs_diff": max_abs_diff,
        "page_bytes": page_bytes_row("bench pool", num_layers, num_kv_heads, head_dim, page_size),
    }


def fp8_main(args: argparse.Namespace, device: torch.device) -> None:
    backend = get_backend(args.backend, device, page_size=16)
    geometries = GEOMETRIES + (CUDA_GEOMETRIES if device.type == "cuda" else ())
    results = [
        measure_fp8_decode(seqs, ctx, heads, kv_heads, iterations=args.iterations, backend=backend, device=device)
        for seqs, ctx, heads, kv_heads in geometries
    ]
    pages = [page_bytes_row(*g, page_size=16) for g in MODEL_PAGE_GEOMETRIES]
    if args.json:
        print(json.dumps({"decode": results, "model_pages": pages}, indent=2))
        return
    print(f"backend={backend.name} device={device.type} threads={torch.get_num_threads()} page_size=16")
    print(f"{'seqs x ctx':>11} {'H/kv':>6} {'bf16 ms':>8} {'fp8 ms':>8} {'fp8/bf16 median [min, max]':>28}")
    for r in results:
        span = f"{r['fp8_over_bf16_decode']:.2f} [{r['fp8_over_bf16_min']:.2f}, {r['fp8_over_bf16_max']:.2f}]"
        print(
            f"{r['num_seqs']:>4} x {r['context_len']:<4} {r['num_heads']:>3}/{r['num_kv_heads']:<2} "
            f"{r['bf16_ms']:>8.2f} {r['fp8_ms']:>8.2f} {span:>28}"
        )
    for row in [results[0]["page_bytes"], *pages]:
        print(
            f"{row['geometry']}: page {row['bf16_page_bytes']:,} B bf16 vs {row['fp8_page_bytes']:,} B fp8 "
            f"({row['fp8_scale_bytes']} B scales) = {row['fp8_over_bf16_bytes']:.4f}x bytes, "
            f"{row['pages_in_same_bytes']:.3f}x pages in the same bytes"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON list instead of a table")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--backend", default="auto", help="attention backend name (default: auto)")
    parser.add_argument(
        "--no-reference", action="store_true", help="skip the (slow) gather-then-SDPA reference"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads for every variant")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument(
        "--kv-dtype", choices=("fp8",), help="fp8: FP8 pages against a bf16 pool with the same backend"
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "float16", "bfloat16"),
        help="pool and query dtype (default: float32 on cpu, bfloat16 on cuda)",
    )
    add_busy_flag(parser)
    args = parser.parse_args(argv)
    with busy_core(args.busy):
        _run(args)


def _run(args: argparse.Namespace) -> None:
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.kv_dtype == "fp8":
        fp8_main(args, device)
        return
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    geometries = GEOMETRIES + (CUDA_GEOMETRIES if device.type == "cuda" else ())

    backend = get_backend(args.backend, device, page_size=16)
    results = [
        measure_decode(
            seqs,
            ctx,
            heads,
            kv_heads,
            iterations=args.iterations,
            backend=backend,
            include_reference=not args.no_reference,
            device=device,
            dtype=dtype,
        )
        for seqs, ctx, heads, kv_heads in geometries
    ]
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(
        f"backend={backend.name} device={device.type} threads={torch.get_num_threads()} "
        f"{str(dtype).removeprefix('torch.')} page_size=16 (median ms)"
    )
    header = (
        f"{'seqs x ctx':>11} {'H/kv':>6} {'dense':>16} {'paged':>8} {'reference':>10} {'paged/dense':>12}"
        f" {'max|diff|':>10}"
    )
    print(header)
    for r in results:
        dense = f"{r[r['dense_baseline'] + '_ms']:.2f} ({r['dense_baseline'][6:]})"
        ref = f"{r['paged_reference_ms']:.2f}" if "paged_reference_ms" in r else "-"
        print(
            f"{r['num_seqs']:>4} x {r['context_len']:<4} {r['num_heads']:>3}/{r['num_kv_heads']:<2} {dense:>16} "
            f"{r['paged_ms']:>8.2f} {ref:>10} {r['paged_over_dense_decode']:>12.2f} {r['max_abs_diff']:>10.2e}"
        )


if __name__ == "__main__":
    main()
