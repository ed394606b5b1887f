"""KV geometry and weight estimates against hand-computed numbers for real model configs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvtier.domain.errors import InvalidArgument, NotFound
from kvtier.domain.geometry import SUPPORTED_ARCHITECTURES, geometry_from_config, load_geometry, parse_dtype

EXAMPLE = Path(__file__).parents[1] / "kvtier" / "examples" / "llama-3.1-8b.json"

LLAMA2_7B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
}
LLAMA3_70B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_hidden_layers": 80,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "rope_scaling": None,
    "torch_dtype": "bfloat16",
}
QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
}
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,  # irrelevant to a latent cache
    "num_hidden_layers": 61,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
    "vocab_size": 129280,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
}
FALCON_7B = {  # the original RefinedWebModel config: n_head / n_layer naming
    "architectures": ["RWForCausalLM"],
    "model_type": "RefinedWebModel",
    "hidden_size": 4544,
    "n_head": 71,
    "n_layer": 32,
    "multi_query": True,
    "parallel_attn": True,
    "bias": False,
    "vocab_size": 65024,
    "torch_dtype": "bfloat16",
}
FALCON_40B = {
    "architectures": ["FalconForCausalLM"],
    "model_type": "falcon",
    "hidden_size": 8192,
    "num_attention_heads": 128,
    "num_kv_heads": 8,
    "num_hidden_layers": 60,
    "new_decoder_architecture": True,
    "vocab_size": 65024,
}
GPT_NEOX_20B = {
    "architectures": ["GPTNeoXForCausalLM"],
    "model_type": "gpt_neox",
    "hidden_size": 6144,
    "intermediate_size": 24576,
    "num_attention_heads": 64,
    "num_hidden_layers": 44,
    "vocab_size": 50432,
    "tie_word_embeddings": False,
    "rotary_pct": 0.25,
}
PYTHIA_160M = {
    "architectures": ["GPTNeoXForCausalLM"],
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "vocab_size": 50304,
}
OPT_6_7B = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "hidden_size": 4096,
    "ffn_dim": 16384,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "max_position_embeddings": 2048,
    "vocab_size": 50272,
    "torch_dtype": "float16",
}
GEMMA_7B = {
    "architectures": ["GemmaForCausalLM"],
    "model_type": "gemma",
    "hidden_size": 3072,
    "head_dim": 256,
    "intermediate_size": 24576,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "num_hidden_layers": 28,
    "vocab_size": 256000,
}
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 32000,
}
QWEN3_8B = {
    "model_type": "qwen3",
    "hidden_size": 4096,
    "head_dim": 128,
    "intermediate_size": 12288,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 36,
    "vocab_size": 151936,
}
PHI3_MINI = {
    "architectures": ["Phi3ForCausalLM"],
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "num_hidden_layers": 32,
    "vocab_size": 32064,
}
MISTRAL_7B = {
    "model_type": "mistral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "vocab_size": 32768,
    "sliding_window": None,
}


def with_fields(config: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """A copy of ``config`` with fields replaced; a value of ... removes the field."""
    out = dict(config)
    for key, value in changes.items():
        if value is ...:
            out.pop(key, None)
        else:
            out[key] = value
    return out


@pytest.mark.parametrize(
    ("config", "bytes_per_token"),
    [
        (LLAMA2_7B, 2 * 32 * 32 * 128 * 2),  # 524,288
        (LLAMA3_70B, 2 * 80 * 8 * 128 * 2),  # 327,680
        (QWEN25_7B, 2 * 28 * 4 * 128 * 2),  # 57,344
        (DEEPSEEK_V3, 61 * (512 + 64) * 2),  # 70,272: latent, not x2 for K and V
        (FALCON_7B, 2 * 32 * 1 * 64 * 2),  # MQA: 4544 / 71 = 64
        (FALCON_40B, 2 * 60 * 8 * 64 * 2),
        (GPT_NEOX_20B, 2 * 44 * 64 * 96 * 2),
        (PYTHIA_160M, 2 * 12 * 12 * 64 * 2),
        (OPT_6_7B, 2 * 32 * 32 * 128 * 2),
        (GEMMA_7B, 2 * 28 * 16 * 256 * 2),  # explicit head_dim 256, not 3072 / 16
        (MIXTRAL_8X7B, 2 * 32 * 8 * 128 * 2),
        (QWEN3_8B, 2 * 36 * 8 * 128 * 2),
        (PHI3_MINI, 2 * 32 * 32 * 96 * 2),
        (MISTRAL_7B, 2 * 32 * 8 * 128 * 2),
    ],
)
def test_bf16_bytes_per_token(config: dict[str, Any], bytes_per_token: int) -> None:
    geometry = geometry_from_config(config)
    assert geometry.kv_bytes_per_token("bf16") == bytes_per_token
    assert geometry.kv_bytes_per_token("fp8") * 2 == bytes_per_token
    assert geometry.kv_bytes_per_token("fp32") == bytes_per_token * 2


def test_hand_computed_anchor_values() -> None:
    assert geometry_from_config(LLAMA2_7B).kv_bytes_per_token("bf16") == 524_288
    assert load_geometry(EXAMPLE).kv_bytes_per_token("bf16") == 131_072
    assert load_geometry(EXAMPLE).kv_bytes_per_token("fp8") == 65_536
    assert geometry_from_config(LLAMA3_70B).kv_bytes_per_token("bf16") == 327_680
    assert geometry_from_config(QWEN25_7B).kv_bytes_per_token("bf16") == 57_344
    assert geometry_from_config(DEEPSEEK_V3).kv_bytes_per_token("bf16") == 70_272
    assert geometry_from_config(DEEPSEEK_V3).kv_bytes_per_token("fp8") == 35_136


@pytest.mark.parametrize(
    ("config", "kind", "num_kv_heads", "head_dim"),
    [
        (LLAMA2_7B, "MHA", 32, 128),
        (LLAMA3_70B, "GQA", 8, 128),
        (FALCON_7B, "MQA", 1, 64),
        (FALCON_40B, "GQA", 8, 64),
        (with_fields(FALCON_7B, multi_query=False), "MHA", 71, 64),
        (GPT_NEOX_20B, "MHA", 64, 96),
        (OPT_6_7B, "MHA", 32, 128),
        (GEMMA_7B, "MHA", 16, 256),
        (DEEPSEEK_V3, "MLA", 1, 576),
    ],
)
def test_attention_kind_and_cached_shape(
    config: dict[str, Any], kind: str, num_kv_heads: int, head_dim: int
) -> None:
    geometry = geometry_from_config(config)
    assert geometry.attention_kind == kind
    assert (geometry.num_kv_heads, geometry.head_dim) == (num_kv_heads, head_dim)


def test_deepseek_is_a_latent_cache() -> None:
    geometry = geometry_from_config(DEEPSEEK_V3)
    assert geometry.is_latent and geometry.latent_dim == 576 and geometry.num_kv_planes == 1
    assert geometry.kv_elements_per_token == 61 * 576
    assert geometry.num_experts == 256


def test_llama_31_8b_example_parses_with_rope_scaling() -> None:
    geometry = load_geometry(EXAMPLE)
    assert geometry.architecture == "Llama"
    assert (geometry.num_layers, geometry.num_attention_heads, geometry.num_kv_heads) == (32, 32, 8)
    assert (geometry.hidden_size, geometry.intermediate_size, geometry.vocab_size) == (4096, 14336, 128256)
    assert geometry.max_position_embeddings == 131072
    assert geometry.weights_dtype == "bf16" and geometry.weights_bits == 16
    assert geometry.weights_source == "estimate"
    assert geometry.weights_bytes == geometry.param_count * 2


@pytest.mark.parametrize(
    ("config", "published_params"),
    [
        (json.loads(EXAMPLE.read_text()), 8.03e9),
        (LLAMA2_7B, 6.74e9),
        (LLAMA3_70B, 70.55e9),
        (QWEN25_7B, 7.62e9),
        (MIXTRAL_8X7B, 46.7e9),  # every expert counts toward weights
        (DEEPSEEK_V3, 671e9),
        (FALCON_7B, 6.92e9),
        (GPT_NEOX_20B, 20.55e9),
        (OPT_6_7B, 6.66e9),
        (GEMMA_7B, 8.54e9),
    ],
)
def test_param_estimate_within_3_percent(config: dict[str, Any], published_params: float) -> None:
    assert geometry_from_config(config).param_count == pytest.approx(published_params, rel=0.03)


def test_weight_dtype_sources() -> None:
    assert geometry_from_config(LLAMA2_7B).weights_dtype == "fp16"
    assert geometry_from_config(with_fields(LLAMA2_7B, torch_dtype=..., dtype="float32")).weights_bits == 32
    assert geometry_from_config(with_fields(LLAMA2_7B, torch_dtype=...)).weights_dtype == "bf16"  # default
    assert geometry_from_config(DEEPSEEK_V3).weights_dtype == "fp8"  # from quantization_config
    awq = with_fields(LLAMA2_7B, quantization_config={"quant_method": "awq", "bits": 4})
    assert geometry_from_config(awq).weights_bits == 4
    llama = load_geometry(EXAMPLE)
    fp8 = llama.with_weights_dtype("fp8")
    assert fp8.weights_bytes == llama.param_count and fp8.weights_dtype == "fp8"
    with pytest.raises(InvalidArgument, match="torch_dtype"):
        geometry_from_config(with_fields(LLAMA2_7B, torch_dtype="complex64"))


def test_detects_family_from_architectures_or_model_type() -> None:
    assert geometry_from_config(with_fields(LLAMA2_7B, model_type=...)).architecture == "Llama"
    assert geometry_from_config(with_fields(LLAMA2_7B, architectures=...)).architecture == "Llama"
    assert geometry_from_config(PYTHIA_160M).architecture == "GPT-NeoX"
    assert geometry_from_config(FALCON_7B).architecture == "Falcon"


def test_unknown_architecture_lists_supported() -> None:
    config = with_fields(LLAMA2_7B, architectures=["MambaForCausalLM"], model_type="mamba")
    with pytest.raises(InvalidArgument) as info:
        geometry_from_config(config)
    message = str(info.value)
    assert "MambaForCausalLM" in message
    for name in SUPPORTED_ARCHITECTURES:
        assert name in message
    with pytest.raises(InvalidArgument, match="neither 'model_type' nor 'architectures'"):
        geometry_from_config(with_fields(LLAMA2_7B, architectures=..., model_type=...))


@pytest.mark.parametrize(
    ("config", "field"),
    [
        (with_fields(LLAMA2_7B, num_hidden_layers=...), "num_hidden_layers"),
        (with_fields(LLAMA2_7B, vocab_size=...), "vocab_size"),
        (with_fields(FALCON_7B, n_head=...), "num_attention_heads"),
        (with_fields(DEEPSEEK_V3, kv_lora_rank=...), "kv_lora_rank"),
        (with_fields(OPT_6_7B, ffn_dim=...), "ffn_dim"),
        (with_fields(MIXTRAL_8X7B, num_local_experts=...), "num_local_experts"),
    ],
)
def test_missing_field_is_named(config: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidArgument, match=f"config.json is missing '{field}'") as info:
        geometry_from_config(config)
    assert info.value.field == field


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"num_hidden_layers": 0}, "num_hidden_layers"),
        ({"num_hidden_layers": "32"}, "num_hidden_layers"),
        ({"num_hidden_layers": True}, "num_hidden_layers"),
        ({"num_key_value_heads": 5}, "num_key_value_heads"),
        ({"num_key_value_heads": 64}, "num_key_value_heads"),
        ({"hidden_size": 4001}, "head_dim"),
        ({"tie_word_embeddings": "no"}, "tie_word_embeddings"),
    ],
)
def test_bad_field_values_are_named(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidArgument, match=field):
        geometry_from_config(with_fields(LLAMA2_7B, **changes))


def test_parse_dtype_accepts_torch_names() -> None:
    assert parse_dtype("bfloat16") == ("bf16", 16)
    assert parse_dtype("FP8") == ("fp8", 8)
    assert parse_dtype("fp4") == ("fp4", 4)
    with pytest.raises(InvalidArgument, match="kv_dtype 'int3'"):
        parse_dtype("int3")


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int], int]]) -> int:
    """A safetensors file with the given (dtype, shape, nbytes) tensors; returns its data bytes."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape, nbytes) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header).encode()
    path.write_bytes(len(encoded).to_bytes(8, "little") + encoded + bytes(offset))
    return offset


def test_checkpoint_directory_sums_safetensors_headers(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_7B))
    first = write_safetensors(tmp_path / "model-00001-of-00002.safetensors", {"a": ("BF16", [2, 3], 12)})
    second = write_safetensors(
        tmp_path / "model-00002-of-00002.safetensors", {"b": ("F32", [4], 16), "c": ("F8_E4M3", [5], 5)}
    )
    geometry = load_geometry(tmp_path)
    assert geometry.weights_source == "safetensors"
    assert geometry.weights_bytes == first + second == 33
    assert geometry.param_count == geometry_from_config(LLAMA2_7B).param_count  # still the estimate
    assert geometry.with_weights_dtype("bf16").weights_source == "estimate"


def test_safetensors_index_excludes_duplicate_consolidated_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(MISTRAL_7B))
    write_safetensors(tmp_path / "consolidated.safetensors", {"w": ("BF16", [8], 16)})
    write_safetensors(tmp_path / "model-00001-of-00001.safetensors", {"w": ("BF16", [8], 16)})
    index = {"metadata": {"total_size": 16}, "weight_map": {"w": "model-00001-of-00001.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert load_geometry(tmp_path).weights_bytes == 16


def test_directory_without_safetensors_keeps_the_estimate(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_7B))
    assert load_geometry(tmp_path).weights_source == "estimate"


def test_corrupt_safetensors_header_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_7B))
    (tmp_path / "model.safetensors").write_bytes((2**62).to_bytes(8, "little") + b"{}")
    with pytest.raises(InvalidArgument, match="model.safetensors is not a safetensors file"):
        load_geometry(tmp_path)


def test_load_geometry_file_errors(tmp_path: Path) -> None:
    with pytest.raises(NotFound, match="does not exist"):
        load_geometry(tmp_path / "nope.json")
    with pytest.raises(NotFound, match="has no config.json"):
        load_geometry(tmp_path)
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(InvalidArgument, match="not valid JSON"):
        load_geometry(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(InvalidArgument, match="JSON object"):
        load_geometry(bad)
