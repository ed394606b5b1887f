"""The served model's text side: tokenizer, chat template, EOS ids, streaming detokenization
and stop strings.

``ChatText.load(dir)`` reads a Hugging Face checkpoint directory (``tokenizer.json``,
``tokenizer_config.json`` or ``chat_template.jinja``, ``generation_config.json``). The
gateway never tokenizes with anything but the checkpoint's own tokenizer, so the token ids
it sends are the ones the worker's model was trained on.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.domain.errors import ConfigError


@dataclass(slots=True)
class ChatText:
    """A checkpoint's tokenizer with its chat template and end-of-sequence ids."""

    tokenizer: Any  # transformers.PreTrainedTokenizerBase
    eos_token_ids: tuple[int, ...]

    @classmethod
    def load(cls, checkpoint: Path) -> ChatText:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"cannot load a tokenizer from {checkpoint}: {exc}; pass a checkpoint directory with "
                "tokenizer.json and tokenizer_config.json",
                field="model",
            ) from exc
        if not tokenizer.chat_template:
            raise ConfigError(f"the tokenizer in {checkpoint} has no chat template", field="model")
        return cls(tokenizer, eos_ids(checkpoint, tokenizer))

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @property
    def supports_tools(self) -> bool:
        """Whether the chat template renders a ``tools`` argument itself."""
        return "tools" in (self.tokenizer.chat_template or "")

    def render(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None) -> str:
        """The prompt text for ``messages`` with the assistant's turn opened."""
        kwargs: dict[str, Any] = {"tools": list(tools)} if tools else {}
        return self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=True, **kwargs
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of rendered prompt text; the template already placed the special tokens."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def detokenizer(self) -> Detokenizer:
        return Detokenizer(self.tokenizer)


def eos_ids(checkpoint: Path, tokenizer: Any) -> tuple[int, ...]:
    """EOS ids from ``generation_config.json`` (an id or a list), else ``config.json``; the
    tokenizer's EOS is added when neither names it."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        try:
            value = json.loads((checkpoint / name).read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, int):
            ids.append(value)
        elif isinstance(value, list):
            ids.extend(v for v in value if isinstance(v, int))
        if ids:
            break
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return tuple(ids)


@dataclass(slots=True)
class Detokenizer:
    """Turns a growing list of token ids into text deltas, never splitting a UTF-8 character.

    A byte-level BPE token may carry part of a multi-byte character; decoding it alone
    yields U+FFFD. The text of tokens ``[read_offset:]`` is released only once it no longer
    ends in U+FFFD, and each decode starts at the previous delta (``prefix_offset``) so that
    tokenizers which drop a leading space on a sequence's first token still decode it::

        ids:  ... | prefix_offset ... read_offset | new ids ...
                    decoded for context only        released as text once complete
    """

    tokenizer: Any
    token_ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0

    def add(self, new_ids: Sequence[int]) -> str:
        """The text the new ids complete (may be empty while a character is split)."""
        self.token_ids.extend(new_ids)
        decode = self.tokenizer.decode
        prefix = decode(self.token_ids[self.prefix_offset:self.read_offset], skip_special_tokens=False)
        full = decode(self.token_ids[self.prefix_offset:], skip_special_tokens=False)
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return full[len(prefix):]

    def flush(self) -> str:
        """What is left at the end of the stream, incomplete characters included."""
        prefix = self.tokenizer.decode(self.token_ids[self.prefix_offset:self.read_offset], skip_special_tokens=False)
        full = self.tokenizer.decode(self.token_ids[self.prefix_offset:], skip_special_tokens=False)
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return full[len(prefix):]


@dataclass(slots=True)
class StopMatch:
    """One step of ``StopMatcher.feed``: text safe to emit, and whether a stop string ended it."""

    text: str
    is_stopped: bool


@dataclass(slots=True)
class StopMatcher:
    """Finds stop strings in streamed text, across token boundaries.

    It holds back the last ``longest stop - 1`` characters, which could be the start of a stop
    string that the next delta completes; the matched stop string itself is never emitted
    (OpenAI's behaviour).
    """

    stops: tuple[str, ...]
    pending: str = ""

    @property
    def _hold(self) -> int:
        return max((len(s) for s in self.stops), default=1) - 1

    def feed(self, delta: str) -> StopMatch:
        self.pending += delta
        hits = [(i, s) for s in self.stops if (i := self.pending.find(s)) >= 0]
        if hits:
            cut = min(i for i, _ in hits)
            text, self.pending = self.pending[:cut], ""
            return StopMatch(text, True)
        keep = self._hold
        if keep <= 0 or len(self.pending) <= keep:
            text, self.pending = (self.pending, "") if keep <= 0 else ("", self.pending)
            return StopMatch(text, False)
        text, self.pending = self.pending[:-keep], self.pending[-keep:]
        return StopMatch(text, False)

    def flush(self) -> str:
        text, self.pending = self.pending, ""
        return text
