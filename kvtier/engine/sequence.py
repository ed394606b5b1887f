"""One request's state: its tokens, its pages, and what it needs to resume exactly.

Invariants (checked by the scheduler's integrity check):
- ``num_computed`` leading positions have K/V written in ``pages``;
  ``len(pages) == ceil(num_computed_or_scheduled / page_size)``.
- Pages ``[0, num_registered)`` have been offered to the radix index.
- ``generator`` carries the sampler's RNG state across preemption, so a resumed
  sequence draws the same random numbers as an uninterrupted one (DESIGN §5.9).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from kvtier.cache.page_pool import PageId
from kvtier.domain.hashing import NamespaceDigest, PageKey, next_key, root_key
from kvtier.domain.params import FinishReason, SamplingParams
from kvtier.domain.tiers import Tier


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    prompt_len: int
    tokens: list[int]  # prompt followed by generated tokens
    params: SamplingParams
    namespace: NamespaceDigest
    page_size: int
    arrival: int
    priority: int = 0
    generator: torch.Generator | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    pages: list[PageId] = field(default_factory=list)
    num_computed: int = 0
    num_registered: int = 0
    reserved_pages: int = 0
    # Accounting reported back to the caller.
    num_cached_tokens: int = -1  # prefix hit at first admission; -1 until admitted
    num_computed_tokens: int = 0  # K/V computed by the model, recomputation included
    num_promoted_tokens: int = 0  # cached tokens copied up from DRAM/NVMe before prefill
    promoted_tokens_by_tier: dict[Tier, int] = field(default_factory=dict)
    promotion_wait_s: float = 0.0  # eviction-induced first-token latency
    num_preemptions: int = 0
    has_waited: bool = False  # admission found no room at least once
    logits_trace: list[torch.Tensor] | None = None
    _keys: list[PageKey] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def full_page_keys(self) -> list[PageKey]:
        """Chained keys of every full page of ``tokens`` (extended incrementally)."""
        ps = self.page_size
        num_full = len(self.tokens) // ps
        while len(self._keys) < num_full:
            i = len(self._keys)
            parent = self._keys[-1] if self._keys else root_key(self.namespace)
            self._keys.append(next_key(parent, self.tokens[i * ps : (i + 1) * ps]))
        return self._keys[:num_full]

    def page_tokens(self, index: int) -> list[int]:
        return self.tokens[index * self.page_size : (index + 1) * self.page_size]

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)
