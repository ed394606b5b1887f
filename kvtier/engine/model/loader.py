"""Hugging Face checkpoint directories in and out: load one into ``LlamaModel``, write a random one.

A checkpoint directory holds ``config.json`` and either ``model.safetensors`` or
``model.safetensors.index.json`` plus the shards it names. Loading is check-then-build:
every tensor the model expects is looked up in the safetensors headers (no data read) and
its shape compared before a byte is loaded, so a wrong checkpoint fails with the tensor's
name instead of half-way through. The expected names and shapes come from ``LlamaModel``
itself, built on the meta device, so there is one source of truth for the layout.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from kvtier.domain.errors import CheckpointError, InvalidArgument
from kvtier.engine.model.config import ARCHITECTURES, ModelConfig
from kvtier.engine.model.llama import LlamaModel

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Showing more than this many missing names makes the message useless.
_MAX_NAMES_IN_ERROR = 5

LOAD_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

# The built-in model `kvtier up` serves when no checkpoint is given (~0.7 M parameters).
TINY_LLAMA_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """Accept a torch dtype or its name; only the dtypes the engine runs in."""
    resolved = LOAD_DTYPES.get(dtype.removeprefix("torch.")) if isinstance(dtype, str) else dtype
    if resolved not in LOAD_DTYPES.values():
        raise InvalidArgument(
            f"dtype {dtype} is not supported; use one of {', '.join(LOAD_DTYPES)}", field="dtype"
        )
    assert resolved is not None
    return resolved


def expected_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name a checkpoint for ``config`` must hold, with its shape, in module order."""
    return _shapes_of(_meta_model(config))


def load_model(
    path: str | Path, dtype: torch.dtype | str = torch.float32, device: torch.device | str = "cpu"
) -> LlamaModel:
    """Build a ``LlamaModel`` from the checkpoint directory ``path``, in ``dtype`` on ``device``.

    Raises ``CheckpointError`` naming the field, file or tensor when the checkpoint does not
    describe a supported model; nothing is loaded in that case.
    """
    directory = Path(path)
    dtype = resolve_dtype(dtype)
    config = ModelConfig.from_file(directory)
    model = _meta_model(config)
    expected = _shapes_of(model)
    tensor_files, found = _read_headers(directory)
    _verify(expected, found, directory)

    state: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(tensor_files[name], []).append(name)
    for file, names in by_file.items():
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in names:
                    state[name] = f.get_tensor(name).to(device=device, dtype=dtype)
        except (OSError, SafetensorError) as exc:
            raise CheckpointError(f"cannot read {file}: {exc}") from exc
    # assign=True swaps the meta parameters for the loaded tensors: no second copy, no init.
    model.load_state_dict(state, strict=True, assign=True)
    model.requires_grad_(False)
    return model.eval()


def write_random_checkpoint(
    path: str | Path,
    config: Mapping[str, Any],
    seed: int,
    dtype: torch.dtype | str = torch.float32,
    init_std: float = 0.02,
) -> Path:
    """Write ``config.json`` + ``model.safetensors`` with seeded random weights; no transformers needed.

    ``config`` is a Hugging Face ``config.json`` as a dict (e.g. ``TINY_LLAMA_CONFIG``). Matrices,
    embeddings and biases are N(0, init_std²); norm weights are 1 + N(0, init_std²), so a mix-up
    of two norms changes the output. The same (config, seed, dtype) always gives the same bytes.
    Tensor names and layout are Hugging Face's, so transformers loads the result too.
    """
    directory = Path(path)
    dtype = resolve_dtype(dtype)
    if not init_std > 0:
        raise InvalidArgument(f"init_std={init_std} must be positive", field="init_std")
    raw = copy.deepcopy(dict(config))
    model_config = ModelConfig.from_dict(raw)
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in expected_tensor_shapes(model_config).items():
        noise = torch.randn(shape, generator=generator) * init_std
        weight = 1.0 + noise if name.endswith("norm.weight") else noise
        tensors[name] = weight.to(dtype).contiguous()

    dtype_name = next(n for n, d in LOAD_DTYPES.items() if d == dtype)
    raw.setdefault("model_type", ARCHITECTURES[model_config.architecture].model_type)
    # transformers 5 reads "dtype"; "torch_dtype" keeps tools pinned to 4.x informed.
    raw["dtype"] = raw["torch_dtype"] = dtype_name
    directory.mkdir(parents=True, exist_ok=True)
    # Weights first, config last, each renamed into place: a crash leaves no config.json that
    # points at missing or partial weights.
    weights_tmp = directory / f".{SINGLE_FILE}.tmp"
    save_file(tensors, str(weights_tmp), metadata={"format": "pt"})
    os.replace(weights_tmp, directory / SINGLE_FILE)
    config_tmp = directory / ".config.json.tmp"
    config_tmp.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    os.replace(config_tmp, directory / "config.json")
    return directory


def _meta_model(config: ModelConfig) -> LlamaModel:
    # Parameters on the meta device cost nothing; the loader replaces them with real tensors.
    with torch.device("meta"):
        return LlamaModel(config)


def _shapes_of(model: LlamaModel) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def _shard_files(directory: Path) -> list[Path]:
    if (directory / SINGLE_FILE).is_file():
        return [directory / SINGLE_FILE]
    index_path = directory / INDEX_FILE
    if not index_path.is_file():
        raise CheckpointError(
            f"{directory} has neither {SINGLE_FILE} nor {INDEX_FILE}; "
            "only safetensors checkpoints are supported (convert .bin files with transformers first)"
        )
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index_path} is not a safetensors index with a 'weight_map': {exc}") from exc
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"'weight_map' in {index_path} must map tensor names to shard files")
    shards: list[Path] = []
    root = directory.resolve()
    for shard_name in sorted(set(weight_map.values())):
        shard = directory / str(shard_name)
        if shard.resolve().parent != root:
            raise CheckpointError(f"{index_path} names shard {shard_name!r} outside the checkpoint directory")
        if not shard.is_file():
            raise CheckpointError(f"{index_path} names shard {shard_name}, which is missing from {directory}")
        shards.append(shard)
    return shards


def _read_headers(directory: Path) -> tuple[dict[str, Path], dict[str, tuple[int, ...]]]:
    """Which file holds each tensor and its shape, from the safetensors headers alone.

    The headers are the truth; an index only says which shard files to open.
    """
    tensor_files: dict[str, Path] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for file in _shard_files(directory):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    tensor_files[name] = file
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        except (OSError, SafetensorError) as exc:
            raise CheckpointError(f"cannot read safetensors header of {file}: {exc}") from exc
    return tensor_files, shapes


def _verify(expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]], directory: Path) -> None:
    # Extra tensors (rotary inv_freq buffers in old checkpoints, a tied lm_head) are ignored.
    missing = [name for name in expected if name not in found]
    if missing:
        shown = ", ".join(missing[:_MAX_NAMES_IN_ERROR])
        more = f" and {len(missing) - _MAX_NAMES_IN_ERROR} more" if len(missing) > _MAX_NAMES_IN_ERROR else ""
        raise CheckpointError(
            f"checkpoint {directory} is missing tensor(s) {shown}{more}; "
            "it does not match its config.json (architecture, layers, tie_word_embeddings)"
        )
    for name, shape in expected.items():
        if found[name] != shape:
            raise CheckpointError(
                f"tensor {name} in {directory} has shape {list(found[name])}, "
                f"config.json implies {list(shape)}"
            )


def has_chat_template(path: Path) -> bool:
    """Whether the checkpoint at ``path`` carries a chat template (Router.ListModels reports it)."""
    if (path / "chat_template.jinja").is_file():
        return True
    try:
        config = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(config.get("chat_template")) if isinstance(config, dict) else False
