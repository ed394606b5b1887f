"""KV-cache geometry of a model, read from its Hugging Face ``config.json`` (DESIGN §1).

    bits/token = planes × layers × kv_heads × head_dim × bits/element
      planes = 2 (K and V) for MHA, GQA and MQA
      planes = 1 for a latent cache (DeepSeek MLA: one vector of
               kv_lora_rank + qk_rope_head_dim elements per layer, shared by K and V)
    bytes/page = ceil(bits/token × page_size / 8)   (+ scales for fp8: ``page_layout``)

Sizes are kept in bits so fp4 (half a byte per element) stays exact; bytes are rounded
up only at the page, the unit a pool allocates.

Each supported family is one registry entry (``_FAMILIES``): how to find its KV heads,
its MLP width and whether its embeddings are tied when the config does not say. The
parameter count is an estimate from the config (embeddings, attention with GQA, MLP
including every MoE expert, norms, untied lm_head; bias vectors are left out, < 0.1 %
of any supported model). Given a checkpoint directory, weight bytes are summed exactly
from the safetensors headers instead.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import Any

from kvtier.domain.errors import InvalidArgument, NotFound
from kvtier.domain.hashing import KV_DTYPES
from kvtier.domain.page_layout import ELEMENT_BITS, PageLayout

_DTYPE_ALIASES: dict[str, str] = {
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp8": "fp8",
    "fp8_e4m3": "fp8",
    "fp8_e5m2": "fp8",
    "float8_e4m3fn": "fp8",
    "float8_e5m2": "fp8",
    "fp4": "fp4",
}
_DTYPE_BITS: dict[str, int] = ELEMENT_BITS
assert set(_DTYPE_BITS) == set(KV_DTYPES), "planner dtypes must match the namespace's KV dtypes"

# The safetensors format itself refuses headers above 100 MB; a larger length means a corrupt file.
_MAX_SAFETENSORS_HEADER_BYTES = 100_000_000


def _bits_to_bytes(num_bits: int) -> int:
    return -(-num_bits // 8)  # integer ceil: exact at any size, unlike float division


def parse_dtype(name: str, *, field: str = "kv_dtype") -> tuple[str, int]:
    """Canonical dtype name and bits per element; accepts torch spellings (``bfloat16``)."""
    # A namespace's FP8 scheme (fp8_e4m3@page-head) is counted as its element type.
    canonical = _DTYPE_ALIASES.get(str(name).strip().lower().partition("@")[0])
    if canonical is None:
        raise InvalidArgument(
            f"{field} {name!r} is not one of {', '.join(KV_DTYPES)} (or a torch name such as bfloat16)",
            field=field,
        )
    return canonical, _DTYPE_BITS[canonical]


@dataclass(frozen=True, slots=True)
class ModelGeometry:
    """What one token costs in KV cache, and what the weights cost, for one model.

    ``num_kv_heads`` × ``head_dim`` is what is cached per layer per plane: for a latent
    cache that is one shared vector of ``latent_dim`` elements (``num_kv_heads == 1``).
    """

    architecture: str  # family shown to people, e.g. "Llama"
    model_type: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    intermediate_size: int
    num_experts: int  # routed experts per MoE layer; 0 for a dense model
    is_latent: bool
    latent_dim: int  # kv_lora_rank + qk_rope_head_dim for MLA; 0 otherwise
    param_count: int  # estimated from the config
    weights_dtype: str
    weights_bits: int  # per parameter
    weights_bytes: int
    weights_source: str  # "estimate" or "safetensors"
    max_position_embeddings: int | None

    @property
    def num_kv_planes(self) -> int:
        return 1 if self.is_latent else 2

    @property
    def attention_kind(self) -> str:
        if self.is_latent:
            return "MLA"
        if self.num_kv_heads == 1 and self.num_attention_heads > 1:
            return "MQA"
        return "MHA" if self.num_kv_heads == self.num_attention_heads else "GQA"

    @property
    def kv_elements_per_token(self) -> int:
        return self.num_kv_planes * self.num_layers * self.num_kv_heads * self.head_dim

    @property
    def weights_bytes_per_param(self) -> Fraction:
        return Fraction(self.weights_bits, 8)

    def kv_bits_per_token(self, kv_dtype: str) -> int:
        return self.kv_elements_per_token * parse_dtype(kv_dtype)[1]

    def kv_bytes_per_token(self, kv_dtype: str) -> Fraction:
        return Fraction(self.kv_bits_per_token(kv_dtype), 8)

    def page_layout(self, kv_dtype: str, page_size: int) -> PageLayout:
        """Where the bytes of one page sit (codes, and scales for fp8)."""
        return PageLayout(
            kv_dtype=parse_dtype(kv_dtype)[0],
            num_layers=self.num_layers,
            num_planes=self.num_kv_planes,
            page_size=page_size,
            kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
        )

    def page_bytes(self, kv_dtype: str, page_size: int) -> int:
        """Exact bytes of one page in every tier; fp8 pages include their scales."""
        return self.page_layout(kv_dtype, page_size).page_bytes

    def with_weights_dtype(self, dtype: str) -> ModelGeometry:
        """The same model served in another weight dtype (replaces a safetensors sum too)."""
        name, bits = parse_dtype(dtype, field="weights_dtype")
        return replace(
            self,
            weights_dtype=name,
            weights_bits=bits,
            weights_bytes=_bits_to_bytes(self.param_count * bits),
            weights_source="estimate",
        )


class _ConfigReader:
    """Typed reads from a config.json mapping; every error names the field and the file."""

    __slots__ = ("raw", "source")

    def __init__(self, raw: Mapping[str, Any], source: str) -> None:
        self.raw = raw
        self.source = source

    def int_field(self, *names: str, default: int | None = None, minimum: int = 1) -> int:
        """First of ``names`` present (aliases across config generations), else ``default``."""
        for name in names:
            value = self.raw.get(name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
                raise InvalidArgument(
                    f"{self.source} field '{name}' must be {kind}, got {value!r}", field=name
                )
            return int(value)
        if default is not None:
            return default
        aliases = "".join(f" (or '{n}')" for n in names[1:])
        raise InvalidArgument(f"{self.source} is missing '{names[0]}'{aliases}", field=names[0])

    def optional_int(self, name: str) -> int | None:
        return self.int_field(name) if self.raw.get(name) is not None else None

    def flag(self, name: str, default: bool) -> bool:
        value = self.raw.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise InvalidArgument(
                f"{self.source} field '{name}' must be true or false, got {value!r}", field=name
            )
        return value


@dataclass(frozen=True, slots=True)
class _Shape:
    """A family reader's result: everything but the weight dtype."""

    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    intermediate_size: int
    num_experts: int
    is_latent: bool
    latent_dim: int
    param_count: int


def _gqa_kv_heads(cfg: _ConfigReader, num_heads: int) -> int:
    # Absent num_key_value_heads means one KV head per query head (MHA); 1 is MQA.
    return cfg.int_field("num_key_value_heads", default=num_heads)


def _falcon_kv_heads(cfg: _ConfigReader, num_heads: int) -> int:
    # Falcon-40B/180B ("new decoder architecture", originally model_type RefinedWeb) name
    # their KV heads; Falcon-7B is multi-query, and FalconConfig defaults multi_query to true.
    if cfg.flag("new_decoder_architecture", False) or cfg.raw.get("model_type") == "RefinedWeb":
        return cfg.int_field("num_kv_heads", "n_head_kv", default=num_heads)
    return 1 if cfg.flag("multi_query", True) else num_heads


def _head_dim(cfg: _ConfigReader, hidden: int, num_heads: int) -> int:
    # Gemma, Qwen3 and Mistral-Nemo set head_dim explicitly and it differs from hidden/heads.
    if cfg.raw.get("head_dim") is not None:
        return cfg.int_field("head_dim")
    if hidden % num_heads:
        raise InvalidArgument(
            f"{cfg.source}: hidden_size {hidden} is not divisible by num_attention_heads {num_heads} "
            "and there is no 'head_dim'",
            field="head_dim",
        )
    return hidden // num_heads


def _embedding_params(cfg: _ConfigReader, family: _Family, vocab: int, hidden: int) -> int:
    tied = cfg.flag("tie_word_embeddings", family.ties_embeddings)
    params = vocab * hidden * (1 if tied else 2) + hidden  # + final norm
    if family.learned_positions:
        # OPT keeps two extra position rows (its position ids start at 2).
        params += (cfg.int_field("max_position_embeddings") + 2) * hidden
    return params


def _read_decoder(cfg: _ConfigReader, family: _Family) -> _Shape:
    """Llama-style and GPT-style decoders: per-head K and V, dense or MoE MLP."""
    num_layers = cfg.int_field("num_hidden_layers", "n_layer")
    num_heads = cfg.int_field("num_attention_heads", "n_head")
    hidden = cfg.int_field("hidden_size")
    vocab = cfg.int_field("vocab_size")
    num_kv_heads = family.kv_heads(cfg, num_heads)
    if num_kv_heads > num_heads or num_heads % num_kv_heads:
        raise InvalidArgument(
            f"{cfg.source}: {family.kv_heads_field} ({num_kv_heads}) must divide "
            f"num_attention_heads ({num_heads})",
            field=family.kv_heads_field,
        )
    head_dim = _head_dim(cfg, hidden, num_heads)
    intermediate = cfg.int_field(
        *family.intermediate_fields, default=family.intermediate_per_hidden * hidden or None
    )
    num_experts = cfg.int_field(family.experts_field) if family.experts_field else 0

    # q and o span every query head; k and v only the KV heads.
    attention = hidden * head_dim * (2 * num_heads + 2 * num_kv_heads)
    mlp = (3 if family.gated_mlp else 2) * hidden * intermediate
    if num_experts:
        mlp = num_experts * mlp + num_experts * hidden  # experts + router
    per_layer = attention + mlp + 2 * hidden  # + two norms
    return _Shape(
        num_layers=num_layers,
        num_attention_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        hidden_size=hidden,
        vocab_size=vocab,
        intermediate_size=intermediate,
        num_experts=num_experts,
        is_latent=False,
        latent_dim=0,
        param_count=num_layers * per_layer + _embedding_params(cfg, family, vocab, hidden),
    )


def _read_mla(cfg: _ConfigReader, family: _Family) -> _Shape:
    """DeepSeek-V2/V3 multi-head latent attention with shared + routed MoE experts."""
    num_layers = cfg.int_field("num_hidden_layers")
    num_heads = cfg.int_field("num_attention_heads")
    hidden = cfg.int_field("hidden_size")
    vocab = cfg.int_field("vocab_size")
    kv_lora_rank = cfg.int_field("kv_lora_rank")
    rope_dim = cfg.int_field("qk_rope_head_dim")
    nope_dim = cfg.int_field("qk_nope_head_dim")
    v_dim = cfg.int_field("v_head_dim")
    q_lora_rank = cfg.optional_int("q_lora_rank")  # null in V2-Lite: q is one plain projection
    intermediate = cfg.int_field("intermediate_size")
    num_routed = cfg.int_field("n_routed_experts", default=0, minimum=0)
    num_shared = cfg.int_field("n_shared_experts", default=0, minimum=0)
    first_dense = cfg.int_field("first_k_dense_replace", default=0, minimum=0)
    moe_every = cfg.int_field("moe_layer_freq", default=1)
    moe_intermediate = cfg.int_field("moe_intermediate_size") if num_routed else 0

    # What is cached: the compressed KV latent plus the decoupled RoPE key, once per layer.
    latent_dim = kv_lora_rank + rope_dim
    q_head = nope_dim + rope_dim
    if q_lora_rank:
        q_proj = hidden * q_lora_rank + q_lora_rank + q_lora_rank * num_heads * q_head
    else:
        q_proj = hidden * num_heads * q_head
    kv_proj = hidden * latent_dim + kv_lora_rank + kv_lora_rank * num_heads * (nope_dim + v_dim)
    attention = q_proj + kv_proj + num_heads * v_dim * hidden

    num_moe_layers = sum(
        1 for i in range(num_layers) if num_routed and i >= first_dense and i % moe_every == 0
    )
    dense_mlp = 3 * hidden * intermediate
    moe_mlp = (num_routed + num_shared) * 3 * hidden * moe_intermediate + num_routed * hidden
    params = (
        num_layers * (attention + 2 * hidden)
        + num_moe_layers * moe_mlp
        + (num_layers - num_moe_layers) * dense_mlp
        + _embedding_params(cfg, family, vocab, hidden)
    )
    return _Shape(
        num_layers=num_layers,
        num_attention_heads=num_heads,
        num_kv_heads=1,
        head_dim=latent_dim,
        hidden_size=hidden,
        vocab_size=vocab,
        intermediate_size=intermediate,
        num_experts=num_routed,
        is_latent=True,
        latent_dim=latent_dim,
        param_count=params,
    )


@dataclass(frozen=True, slots=True)
class _Family:
    name: str
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]
    read: Callable[[_ConfigReader, _Family], _Shape] = _read_decoder
    kv_heads: Callable[[_ConfigReader, int], int] = _gqa_kv_heads
    kv_heads_field: str = "num_key_value_heads"
    gated_mlp: bool = True  # SwiGLU/GeGLU: gate, up and down projections
    ties_embeddings: bool = False  # the transformers default when config.json omits it
    intermediate_fields: tuple[str, ...] = ("intermediate_size",)
    intermediate_per_hidden: int = 0  # MLP width when the config omits it (Falcon: 4 × hidden)
    learned_positions: bool = False
    experts_field: str = ""


_FAMILIES: tuple[_Family, ...] = (
    _Family("Llama", ("llama",), ("LlamaForCausalLM",)),
    _Family("Mistral", ("mistral",), ("MistralForCausalLM",)),
    _Family("Mixtral", ("mixtral",), ("MixtralForCausalLM",), experts_field="num_local_experts"),
    _Family("Qwen2", ("qwen2",), ("Qwen2ForCausalLM",)),
    _Family("Qwen3", ("qwen3",), ("Qwen3ForCausalLM",)),
    _Family(
        "Gemma",
        ("gemma", "gemma2", "gemma3_text"),
        ("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM"),
        ties_embeddings=True,
    ),
    _Family("Phi-3", ("phi3",), ("Phi3ForCausalLM",)),
    _Family("GPT-NeoX", ("gpt_neox",), ("GPTNeoXForCausalLM",), gated_mlp=False),
    _Family(
        "OPT",
        ("opt",),
        ("OPTForCausalLM",),
        gated_mlp=False,
        ties_embeddings=True,
        intermediate_fields=("ffn_dim",),
        learned_positions=True,
    ),
    _Family(
        "Falcon",
        ("falcon", "RefinedWeb", "RefinedWebModel"),
        ("FalconForCausalLM", "RWForCausalLM"),
        kv_heads=_falcon_kv_heads,
        kv_heads_field="num_kv_heads",
        gated_mlp=False,
        ties_embeddings=True,
        intermediate_fields=("ffn_hidden_size",),
        intermediate_per_hidden=4,
    ),
    _Family(
        "DeepSeek",
        ("deepseek_v2", "deepseek_v3"),
        ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"),
        read=_read_mla,
    ),
)
_BY_MODEL_TYPE = {t: f for f in _FAMILIES for t in f.model_types}
_BY_ARCHITECTURE = {a: f for f in _FAMILIES for a in f.architectures}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(f.name for f in _FAMILIES)


def _find_family(cfg: _ConfigReader) -> _Family:
    model_type = cfg.raw.get("model_type")
    model_type = model_type if isinstance(model_type, str) else None
    architectures = cfg.raw.get("architectures")
    first = architectures[0] if isinstance(architectures, list) and architectures else None
    first = first if isinstance(first, str) else None
    family = _BY_MODEL_TYPE.get(model_type or "") or _BY_ARCHITECTURE.get(first or "")
    if family is not None:
        return family
    if model_type is None and first is None:
        raise InvalidArgument(
            f"{cfg.source} has neither 'model_type' nor 'architectures'; "
            f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}",
            field="model_type",
        )
    raise InvalidArgument(
        f"unsupported architecture {first!r} (model_type {model_type!r}) in {cfg.source}; "
        f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}",
        field="architectures",
    )


def _weights_dtype(cfg: _ConfigReader) -> tuple[str, int]:
    # Pre-quantized checkpoints (DeepSeek-V3 ships fp8) keep torch_dtype for activations;
    # the stored weight width is in quantization_config. Scales and zero points are not counted.
    quant = cfg.raw.get("quantization_config")
    if isinstance(quant, Mapping):
        if quant.get("quant_method") == "fp8":
            return "fp8", 8
        bits = quant.get("bits")
        if isinstance(bits, int) and not isinstance(bits, bool) and 1 <= bits <= 16:
            return f"int{bits}", bits
    for key in ("torch_dtype", "dtype"):  # transformers 5 writes "dtype"
        value = cfg.raw.get(key)
        if value is not None and value != "auto":
            return parse_dtype(value, field=key)
    return "bf16", 16


def geometry_from_config(config: Mapping[str, Any], *, source: str = "config.json") -> ModelGeometry:
    """Geometry and estimated weights of the model a ``config.json`` mapping describes."""
    if not isinstance(config, Mapping):
        raise InvalidArgument(
            f"{source} must hold a JSON object, got {type(config).__name__}", field="config"
        )
    cfg = _ConfigReader(config, source)
    family = _find_family(cfg)
    shape = family.read(cfg, family)
    dtype, bits = _weights_dtype(cfg)
    max_positions = cfg.optional_int("max_position_embeddings")
    return ModelGeometry(
        architecture=family.name,
        model_type=str(config.get("model_type") or family.model_types[0]),
        num_layers=shape.num_layers,
        num_attention_heads=shape.num_attention_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        hidden_size=shape.hidden_size,
        vocab_size=shape.vocab_size,
        intermediate_size=shape.intermediate_size,
        num_experts=shape.num_experts,
        is_latent=shape.is_latent,
        latent_dim=shape.latent_dim,
        param_count=shape.param_count,
        weights_dtype=dtype,
        weights_bits=bits,
        weights_bytes=_bits_to_bytes(shape.param_count * bits),
        weights_source="estimate",
        max_position_embeddings=max_positions,
    )


def load_geometry(path: str | Path) -> ModelGeometry:
    """Geometry from a ``config.json`` file, or from a checkpoint directory.

    For a directory the weight bytes are the exact sum over its safetensors files, read
    from their headers (the tensors themselves are never loaded).
    """
    path = Path(path).expanduser()
    config_path = path / "config.json" if path.is_dir() else path
    if not config_path.is_file():
        where = f"{path} has no config.json" if path.is_dir() else f"model config {path} does not exist"
        raise NotFound(where, field="model_config")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise InvalidArgument(f"cannot read {config_path}: {exc.strerror}", field="model_config") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"{config_path} is not valid JSON: {exc}", field="model_config") from exc
    geometry = geometry_from_config(config, source=str(config_path))
    if path.is_dir():
        exact = _safetensors_bytes(path)
        if exact is not None:
            geometry = replace(geometry, weights_bytes=exact, weights_source="safetensors")
    return geometry


def _checkpoint_files(directory: Path) -> list[Path]:
    # Some repositories (Mistral's) hold the same weights twice: consolidated.safetensors
    # next to sharded model-*.safetensors. The index names the files transformers loads.
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            return sorted(directory / name for name in set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise InvalidArgument(
                f"{index} is not a valid safetensors index: {exc}", field="model_config"
            ) from exc
    return sorted(directory.glob("*.safetensors"))


def _safetensors_bytes(directory: Path) -> int | None:
    files = _checkpoint_files(directory)
    return sum(_tensor_bytes(f) for f in files) if files else None


def _tensor_bytes(path: Path) -> int:
    """Data bytes of one safetensors file: u64 little-endian header length, JSON header, data."""
    try:
        with path.open("rb") as fh:
            prefix = fh.read(8)
            header_len = int.from_bytes(prefix, "little")
            if len(prefix) < 8 or header_len > _MAX_SAFETENSORS_HEADER_BYTES:
                raise InvalidArgument(
                    f"{path} is not a safetensors file (bad header length)", field="model_config"
                )
            header = json.loads(fh.read(header_len))
    except OSError as exc:
        raise InvalidArgument(f"cannot read {path}: {exc.strerror}", field="model_config") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidArgument(
            f"{path} has a corrupt safetensors header: {exc}", field="model_config"
        ) from exc
    total = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            start, end = entry["data_offsets"]
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgument(
                f"{path}: tensor {name!r} has no valid data_offsets", field="model_config"
            ) from exc
        total += end - start
    return total
