"""Turns a scheduled batch into tensors, runs the model, returns next-token logits."""

from __future__ import annotations

import torch

from kvtier.cache.page_pool import PagePool
from kvtier.engine.attention.base import AttentionBackend, AttentionMetadata
from kvtier.engine.attention.fp8 import Fp8Pages
from kvtier.engine.model import LlamaModel
from kvtier.engine.sequence import Sequence


class ModelRunner:
    def __init__(self, model: LlamaModel, pool: PagePool, backend: AttentionBackend) -> None:
        self.model = model
        self.pool = pool
        self.backend = backend
        self.device = pool.tensor.device
        # What the model reads and writes: the float pool itself, or codes and scales over an
        # FP8 pool's bytes (views, no copy).
        self.kv: torch.Tensor | Fp8Pages = Fp8Pages.over_pool(pool) if pool.geometry.is_fp8 else pool.tensor

    @torch.inference_mode()
    def run(self, seqs: list[Sequence]) -> torch.Tensor:
        """Compute K/V for every uncomputed token of ``seqs``; logits ``[B, vocab]`` of each last token.

        The caller has given every sequence pages for all its tokens.
        """
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        for seq in seqs:
            start = seq.num_computed
            input_ids.extend(seq.tokens[start:])
            positions.extend(range(start, seq.num_tokens))
            query_lens.append(seq.num_tokens - start)
        md = AttentionMetadata.build(
            query_lens,
            [s.num_tokens for s in seqs],
            [s.pages for s in seqs],
            self.pool.page_size,
            device=self.device,
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        hidden = self.model(ids, pos, self.kv, md, self.backend)
        last_rows = md.query_start[1:].long() - 1
        return self.model.compute_logits(hidden[last_rows])
