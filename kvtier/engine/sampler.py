"""Token selection: greedy, temperature, top-k, top-p, with a per-sequence generator.

Each sequence owns its ``torch.Generator``; nothing here touches global RNG state, so
batch composition and preemption cannot change what a seeded request samples.
"""

from __future__ import annotations

import os

import torch

from kvtier.domain.params import SamplingParams


def make_generator(params: SamplingParams) -> torch.Generator | None:
    if params.temperature == 0.0:
        return None
    gen = torch.Generator(device="cpu")
    seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
    gen.manual_seed(seed)
    return gen


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick one token from a ``[vocab]`` row of fp32 logits."""
    if params.temperature == 0.0:
        return int(torch.argmax(logits).item())
    scaled = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # Keep the smallest set whose mass reaches top_p (the first token always stays).
        drop = cumulative - sorted_probs >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator).item())
