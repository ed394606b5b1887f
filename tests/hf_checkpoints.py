"""Tiny random-weight Hugging Face checkpoints, built locally (never downloaded).

``initializer_range=0.3`` makes greedy continuations diverse; with the default init a
random model repeats one token and an oracle comparison proves little.
"""

from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.3,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)


def hf_config(arch: str, **overrides):
    import transformers

    kwargs = dict(COMMON)
    kwargs.update(overrides)
    cls = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[arch]
    if arch == "mistral":
        kwargs.setdefault("sliding_window", None)
    return cls(**kwargs)


def build_checkpoint(path: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    import transformers

    torch.manual_seed(seed)
    config = hf_config(arch, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    model.save_pretrained(path)
    return path


def load_hf(path: Path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model


@torch.inference_mode()
def hf_logits(model, token_ids: list[int]) -> torch.Tensor:
    """Logits ``[len, vocab]`` at every position of one sequence."""
    return model(input_ids=torch.tensor([token_ids])).logits[0].float()
