"""The decoder's shape and variant flags, parsed from a Hugging Face ``config.json``.

One ``ModelConfig`` describes every supported architecture; the differences between
Llama, Mistral, Qwen2 and Qwen3 are flags (biases, q/k norm, sliding window) chosen by
an ``ArchitectureSpec`` looked up in ``ARCHITECTURES``. Parsing is strict: a missing or
malformed field raises ``CheckpointError`` naming it, so a bad checkpoint fails at start-up
rather than producing wrong logits.

RoPE parameters arrive in two spellings, both handled here:

    transformers >= 5   "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8, ...}
    legacy              "rope_theta": 5e5, "rope_scaling": {"type" | "rope_type": "llama3", "factor": 8, ...}

As in transformers, a legacy ``rope_scaling`` wins over ``rope_parameters`` when both are set.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kvtier.domain.errors import CheckpointError

# transformers' default when a config names no theta (RotaryEmbeddingConfigMixin.default_theta).
DEFAULT_ROPE_THETA = 10_000.0
DEFAULT_RMS_NORM_EPS = 1e-6

BiasRule = Literal["never", "always", "attention_bias_flag"]
SlidingWindowRule = Literal["never", "when_set", "when_enabled"]


@dataclass(frozen=True, slots=True)
class ArchitectureSpec:
    """How one HF architecture maps onto the shared decoder.

    ``qkv_bias``/``o_bias``: "attention_bias_flag" reads ``attention_bias`` from the config.
    ``sliding_window``: "when_set" applies ``sliding_window`` whenever it is not null (Mistral);
    "when_enabled" only when ``use_sliding_window`` is true (Qwen).
    """

    model_type: str
    qkv_bias: BiasRule
    o_bias: BiasRule
    has_mlp_bias_flag: bool
    qk_norm: bool
    sliding_window: SlidingWindowRule


ARCHITECTURES: dict[str, ArchitectureSpec] = {
    "LlamaForCausalLM": ArchitectureSpec(
        model_type="llama",
        qkv_bias="attention_bias_flag",
        o_bias="attention_bias_flag",
        has_mlp_bias_flag=True,
        qk_norm=False,
        sliding_window="never",
    ),
    "MistralForCausalLM": ArchitectureSpec(
        model_type="mistral",
        qkv_bias="never",
        o_bias="never",
        has_mlp_bias_flag=False,
        qk_norm=False,
        sliding_window="when_set",
    ),
    "Qwen2ForCausalLM": ArchitectureSpec(
        model_type="qwen2",
        qkv_bias="always",
        o_bias="never",
        has_mlp_bias_flag=False,
        qk_norm=False,
        sliding_window="when_enabled",
    ),
    "Qwen3ForCausalLM": ArchitectureSpec(
        model_type="qwen3",
        qkv_bias="attention_bias_flag",
        o_bias="attention_bias_flag",
        has_mlp_bias_flag=False,
        qk_norm=True,
        sliding_window="when_enabled",
    ),
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(ARCHITECTURES)

# Keys each supported rope type needs besides rope_theta; "original_max_position_embeddings"
# falls back to max_position_embeddings, as transformers' standardize_rope_params does.
ROPE_TYPE_KEYS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
SUPPORTED_ROPE_TYPES: tuple[str, ...] = tuple(ROPE_TYPE_KEYS)


@dataclass(frozen=True, slots=True)
class RopeConfig:
    rope_type: str  # one of SUPPORTED_ROPE_TYPES
    theta: float
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 1.0
    original_max_position_embeddings: int | None = None


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Everything the decoder, the loader and pool sizing need; parsed once, never mutated.

    ``sliding_window`` is conservative for Qwen: when ``use_sliding_window`` is on it caps
    ``max_context_len`` even if ``max_window_layers`` leaves every layer on full attention.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None  # None when no layer uses a window
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    torch_dtype: str | None  # dtype the checkpoint was saved in ("bfloat16", ...), if stated

    @property
    def rope_theta(self) -> float:
        return self.rope.theta

    @property
    def rope_scaling(self) -> dict[str, Any] | None:
        """HF-style scaling dict (``{"rope_type": "llama3", "factor": 8.0, ...}``), None without scaling.

        Plain JSON values, so it can go into a namespace digest as is.
        """
        if self.rope.rope_type == "default":
            return None
        keys = ROPE_TYPE_KEYS[self.rope.rope_type]
        return {"rope_type": self.rope.rope_type, **{key: getattr(self.rope, key) for key in keys}}

    @property
    def num_query_groups(self) -> int:
        """Query heads that share one KV head (GQA)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def max_context_len(self) -> int:
        """Longest context whose attention is exact.

        Attention backends attend over the whole context, so a sliding-window model is only
        faithful up to its window; the engine must not admit longer sequences.
        """
        if self.sliding_window is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window)

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        """Parse ``path`` (a ``config.json`` file or a checkpoint directory holding one)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise CheckpointError(f"no config.json at {path}; point at a Hugging Face checkpoint directory")
        try:
            raw = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"cannot read {path}: {exc}") from exc
        if not isinstance(raw, dict):
            raise CheckpointError(f"{path} must hold a JSON object")
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        architecture = _architecture(raw)
        spec = ARCHITECTURES[architecture]
        hidden_size = _positive_int(raw, "hidden_size")
        num_heads = _positive_int(raw, "num_attention_heads")
        num_kv_heads = _positive_int(raw, "num_key_value_heads", default=num_heads)
        if num_heads % num_kv_heads:
            raise CheckpointError(
                f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}",
                field="num_key_value_heads",
            )
        if raw.get("head_dim") is not None:
            head_dim = _positive_int(raw, "head_dim")
        elif hidden_size % num_heads:
            raise CheckpointError(
                f"hidden_size={hidden_size} is not a multiple of num_attention_heads={num_heads} "
                "and config.json sets no head_dim",
                field="head_dim",
            )
        else:
            head_dim = hidden_size // num_heads
        if head_dim % 2:
            raise CheckpointError(f"head_dim={head_dim} must be even for RoPE", field="head_dim")
        hidden_act = raw.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise CheckpointError(
                f"hidden_act={hidden_act!r} is not supported; only 'silu'", field="hidden_act"
            )
        max_positions = _positive_int(raw, "max_position_embeddings")
        attention_bias = _bool(raw, "attention_bias", default=False)
        bias_of = {"never": False, "always": True, "attention_bias_flag": attention_bias}
        return cls(
            architecture=architecture,
            vocab_size=_positive_int(raw, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=_positive_int(raw, "intermediate_size"),
            num_hidden_layers=_positive_int(raw, "num_hidden_layers"),
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=_positive_float(raw, "rms_norm_eps", default=DEFAULT_RMS_NORM_EPS),
            rope=_rope(raw, max_positions),
            max_position_embeddings=max_positions,
            tie_word_embeddings=_bool(raw, "tie_word_embeddings", default=False),
            qkv_bias=bias_of[spec.qkv_bias],
            o_bias=bias_of[spec.o_bias],
            mlp_bias=_bool(raw, "mlp_bias", default=False) if spec.has_mlp_bias_flag else False,
            qk_norm=spec.qk_norm,
            sliding_window=_sliding_window(raw, spec),
            eos_token_ids=_token_ids(raw, "eos_token_id"),
            bos_token_id=_optional_token_id(raw, "bos_token_id"),
            torch_dtype=_dtype_name(raw),
        )


def _architecture(raw: dict[str, Any]) -> str:
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    names = raw.get("architectures")
    if not names:
        raise CheckpointError(
            f"config.json has no 'architectures'; expected one of {supported}", field="architectures"
        )
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise CheckpointError("'architectures' must be a list of names", field="architectures")
    for name in names:
        if name in ARCHITECTURES:
            return name
    raise CheckpointError(
        f"architecture {', '.join(names)} is not supported; supported: {supported}", field="architectures"
    )


def _rope(raw: dict[str, Any], max_positions: int) -> RopeConfig:
    params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    field = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
    if not isinstance(params, dict):
        raise CheckpointError(f"{field} must be an object", field=field)
    if params and all(isinstance(v, dict) for v in params.values()):
        raise CheckpointError(f"per-layer-type {field} is not supported by Llama-family models", field=field)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPE_KEYS:
        raise CheckpointError(
            f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}",
            field=f"{field}.rope_type",
        )
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise CheckpointError(
            f"partial_rotary_factor={partial} is not supported; Llama-family models rotate the whole head",
            field="partial_rotary_factor",
        )
    theta = params.get("rope_theta", raw.get("rope_theta", DEFAULT_ROPE_THETA))
    if isinstance(theta, bool) or not isinstance(theta, int | float) or not theta > 0:
        raise CheckpointError(f"rope_theta={theta!r} must be a positive number", field="rope_theta")
    values: dict[str, Any] = {}
    for key in ROPE_TYPE_KEYS[rope_type]:
        value = params.get(key)
        if value is None and key == "original_max_position_embeddings":
            value = max_positions
        if value is None:
            raise CheckpointError(f"rope type {rope_type!r} needs {field}.{key}", field=f"{field}.{key}")
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or value <= 0
        ):
            raise CheckpointError(
                f"{field}.{key}={value!r} must be a positive number", field=f"{field}.{key}"
            )
        values[key] = value
    if "original_max_position_embeddings" in values:
        values["original_max_position_embeddings"] = int(values["original_max_position_embeddings"])
    if rope_type == "llama3" and values["high_freq_factor"] <= values["low_freq_factor"]:
        raise CheckpointError(
            f"{field}.high_freq_factor must exceed low_freq_factor", field=f"{field}.high_freq_factor"
        )
    return RopeConfig(rope_type=rope_type, theta=float(theta), **values)


def _sliding_window(raw: dict[str, Any], spec: ArchitectureSpec) -> int | None:
    enabled = {
        "never": lambda: False,
        "when_set": lambda: raw.get("sliding_window") is not None,
        "when_enabled": lambda: (
            _bool(raw, "use_sliding_window", default=False) and raw.get("sliding_window") is not None
        ),
    }[spec.sliding_window]()
    return _positive_int(raw, "sliding_window") if enabled else None


def _positive_int(raw: dict[str, Any], key: str, default: int | None = None) -> int:
    value = raw.get(key)
    if value is None:
        if default is None:
            raise CheckpointError(f"config.json is missing required field {key!r}", field=key)
        value = default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CheckpointError(f"config field {key}={value!r} must be a positive integer", field=key)
    return value


def _positive_float(raw: dict[str, Any], key: str, default: float) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise CheckpointError(f"config field {key}={value!r} must be a positive number", field=key)
    return float(value)


def _bool(raw: dict[str, Any], key: str, default: bool) -> bool:
    value = raw.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise CheckpointError(f"config field {key}={value!r} must be true or false", field=key)
    return value


def _optional_token_id(raw: dict[str, Any], key: str) -> int | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointError(f"config field {key}={value!r} must be a token id", field=key)
    return value


def _token_ids(raw: dict[str, Any], key: str) -> tuple[int, ...]:
    value = raw.get(key)
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise CheckpointError(
                f"config field {key}={value!r} must be a token id or a list of them", field=key
            )
    return tuple(values)


def _dtype_name(raw: dict[str, Any]) -> str | None:
    # transformers 5 writes "dtype"; older checkpoints say "torch_dtype".
    value = raw.get("dtype") or raw.get("torch_dtype")
    if value is None:
        return None
    if not isinstance(value, str):
        raise CheckpointError(
            f"config field dtype={value!r} must be a name such as 'bfloat16'", field="dtype"
        )
    return value.removeprefix("torch.")
