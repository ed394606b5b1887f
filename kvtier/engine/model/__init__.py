"""Llama-family decoders over a paged KV pool, loaded from Hugging Face checkpoints.

``config`` parses ``config.json``; ``llama`` is the decoder; ``loader`` reads and writes
checkpoint directories.
"""

from kvtier.engine.model.config import SUPPORTED_ARCHITECTURES, ModelConfig
from kvtier.engine.model.llama import LlamaModel
from kvtier.engine.model.loader import TINY_LLAMA_CONFIG, load_model, write_random_checkpoint

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "TINY_LLAMA_CONFIG",
    "LlamaModel",
    "ModelConfig",
    "load_model",
    "write_random_checkpoint",
]
