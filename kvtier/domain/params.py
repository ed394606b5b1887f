"""Per-request generation parameters and finish reasons (shared by engine, wire and client)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvtier.domain.errors import InvalidArgument

MAX_STOP_SEQUENCES = 16
MAX_STOP_SEQUENCE_TOKENS = 64


class FinishReason(enum.Enum):
    LENGTH = "length"  # max_tokens reached (or the model context)
    STOP = "stop"  # a stop token id or stop sequence was generated
    TOOL_CALL = "tool_call"  # the configured tool-call stop sequence was generated
    ABORTED = "aborted"  # cancelled by the caller


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature == 0`` is greedy. With ``seed`` set, sampling is deterministic and a
    preempted/resumed sequence produces the same tokens as an uninterrupted one.
    Stop sequences are token-id sequences; the matched sequence stays in the output.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0  # 0 = disabled
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop_sequences: list[list[int]] = field(default_factory=list)
    tool_call_sequence: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def validate(self) -> None:
        if self.max_tokens < 1:
            raise InvalidArgument(f"max_tokens must be >= 1, got {self.max_tokens}", field="max_tokens")
        if not (self.temperature >= 0.0):
            raise InvalidArgument(f"temperature must be >= 0, got {self.temperature}", field="temperature")
        if self.top_k < 0:
            raise InvalidArgument(f"top_k must be >= 0, got {self.top_k}", field="top_k")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidArgument(f"top_p must be in (0, 1], got {self.top_p}", field="top_p")
        if len(self.stop_sequences) > MAX_STOP_SEQUENCES:
            raise InvalidArgument(
                f"at most {MAX_STOP_SEQUENCES} stop_sequences are allowed, got {len(self.stop_sequences)}",
                field="stop_sequences",
            )
        named = [(f"stop_sequences[{i}]", seq) for i, seq in enumerate(self.stop_sequences)]
        for name, seq in [*named, ("tool_call_sequence", self.tool_call_sequence)]:
            if len(seq) > MAX_STOP_SEQUENCE_TOKENS:
                raise InvalidArgument(
                    f"{name} may have at most {MAX_STOP_SEQUENCE_TOKENS} tokens, got {len(seq)}", field=name
                )
        for i, seq in enumerate(self.stop_sequences):
            if not seq:
                raise InvalidArgument(f"stop_sequences[{i}] must not be empty", field=f"stop_sequences[{i}]")
