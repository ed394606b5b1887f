"""kvtier.engine.model against the Hugging Face oracle on tiny random-weight checkpoints.

Every checkpoint is built here with transformers (never downloaded). Weights use
``initializer_range=0.3`` so greedy continuations are diverse, and biases and norm weights
(which HF initialises to 0 and 1) are perturbed so a mis-wired bias or norm shows up.
The pool starts as NaN: reading a slot nobody wrote poisons the logits.
"""

from __future__ import annotations

import json
import shutil
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvtier.domain.errors import CheckpointError, InvalidArgument
from kvtier.engine.attention.base import AttentionMetadata, ReferenceBackend
from kvtier.engine.model import (
    SUPPORTED_ARCHITECTURES,
    TINY_LLAMA_CONFIG,
    LlamaModel,
    ModelConfig,
    load_model,
    write_random_checkpoint,
)
from kvtier.engine.model.llama import RotaryEmbedding
from kvtier.engine.model.loader import expected_tensor_shapes

transformers = pytest.importorskip("transformers")

ATOL = 1e-4
VOCAB = 256
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.3,
    rms_norm_eps=1e-6,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # head_dim 16 gives wavelengths 6, 20, 63, 199, ...: some kept, one smoothed, the rest scaled.
    "original_max_position_embeddings": 64,
}


def hf_configs() -> dict:
    t = transformers
    return {
        "llama": t.LlamaConfig(**COMMON),
        "llama3_rope": t.LlamaConfig(**COMMON, rope_parameters=dict(LLAMA3_ROPE)),
        "llama_tied_bias": t.LlamaConfig(
            **COMMON, tie_word_embeddings=True, attention_bias=True, mlp_bias=True
        ),
        "mistral_linear_rope": t.MistralConfig(
            **COMMON,
            sliding_window=None,
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5e4},
        ),
        "qwen2": t.Qwen2Config(**COMMON),
        "qwen3": t.Qwen3Config(**COMMON, head_dim=32),  # head_dim != hidden / heads
    }


ARCHS = list(hf_configs())


def perturb_(hf_model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            elif "norm" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)


@dataclass
class Case:
    path: Path
    hf: torch.nn.Module
    ours: LlamaModel


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, Case]:
    root = tmp_path_factory.mktemp("hf_ckpt")
    out = {}
    for i, (name, config) in enumerate(hf_configs().items()):
        torch.manual_seed(i)
        hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        perturb_(hf, seed=100 + i)
        hf.save_pretrained(root / name)
        out[name] = Case(root / name, hf, load_model(root / name))
    return out


@torch.inference_mode()
def hf_logits(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    return hf(input_ids=torch.tensor([tokens])).logits[0].float()


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@dataclass
class Seq:
    tokens: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)


class PagedRunner:
    """A minimal stand-in for the engine: hands out scattered pages and builds the metadata."""

    def __init__(self, model: LlamaModel, page_size: int, num_pages: int = 96, seed: int = 0) -> None:
        num_layers, kv_heads, head_dim = model.kv_geometry
        self.model = model
        self.page_size = page_size
        self.pool = torch.full((num_pages, num_layers, 2, page_size, kv_heads, head_dim), float("nan"))
        self.free = deque(torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist())
        self.backend = ReferenceBackend()

    def feed(self, batch: list[tuple[Seq, list[int]]]) -> list[torch.Tensor]:
        """Run the new tokens of every sequence in one forward; logits per sequence."""
        for seq, new in batch:
            seq.tokens.extend(new)
            while len(seq.pages) * self.page_size < len(seq.tokens):
                seq.pages.append(self.free.popleft())
        query_lens = [len(new) for _, new in batch]
        context_lens = [len(seq.tokens) for seq, _ in batch]
        md = AttentionMetadata.build(
            query_lens, context_lens, [seq.pages for seq, _ in batch], self.page_size
        )
        ids = torch.tensor([t for _, new in batch for t in new])
        positions = torch.cat([torch.arange(c - q, c) for q, c in zip(query_lens, context_lens, strict=True)])
        with torch.inference_mode():
            logits = self.model.compute_logits(self.model(ids, positions, self.pool, md, self.backend))
        return list(logits.split(query_lens))


# ---- the oracle ---------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match_transformers_at_every_position(cases, arch):
    case = cases[arch]
    tokens = random_tokens(37, seed=1)
    (ours,) = PagedRunner(case.ours, page_size=4).feed([(Seq(), tokens)])
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, hf_logits(case.hf, tokens), atol=ATOL, rtol=0)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("arch", ARCHS)
def test_incremental_decode_matches_transformers(cases, arch, page_size):
    case = cases[arch]
    runner = PagedRunner(case.ours, page_size=page_size)
    seq = Seq()
    prompt = random_tokens(7, seed=2)
    step_logits = [runner.feed([(seq, prompt)])[0][-1]]
    for _ in range(14):  # greedy: 7 + 14 tokens cross a 16-token page too
        (logits,) = runner.feed([(seq, [int(step_logits[-1].argmax())])])
        step_logits.append(logits[0])
    ref = hf_logits(case.hf, seq.tokens)
    torch.testing.assert_close(torch.stack(step_logits[:-1]), ref[len(prompt) - 1 : -1], atol=ATOL, rtol=0)
    torch.testing.assert_close(step_logits[-1], ref[-1], atol=ATOL, rtol=0)
    assert len(set(seq.tokens[len(prompt) :])) > 3, "a random model with std 0.3 should not repeat one token"


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_batch_with_shared_prefix_matches_transformers(cases, arch):
    """One forward holding a fresh prefill, a prefill over a shared cached prefix, a decode, a 1-token prompt.

    P  prefilled first, 10 tokens: pages [a b c]   (c partial)
    B  reuses P's full pages [a b], adds 5 tokens of its own in new pages
    C  continues P by one token (decode, lands in c)
    """
    case = cases[arch]
    runner = PagedRunner(case.ours, page_size=4, seed=3)
    p_seq = Seq()
    (p_logits,) = runner.feed([(p_seq, random_tokens(10, seed=4))])
    a_seq, d_seq = Seq(), Seq()
    b_seq = Seq(tokens=p_seq.tokens[:8], pages=p_seq.pages[:2])
    a_new, b_new, c_new, d_new = random_tokens(13, seed=5), random_tokens(5, seed=6), [7], [42]
    a_out, b_out, c_out, d_out = runner.feed([(a_seq, a_new), (b_seq, b_new), (p_seq, c_new), (d_seq, d_new)])

    torch.testing.assert_close(p_logits, hf_logits(case.hf, p_seq.tokens[:10]), atol=ATOL, rtol=0)
    torch.testing.assert_close(a_out, hf_logits(case.hf, a_seq.tokens), atol=ATOL, rtol=0)
    torch.testing.assert_close(b_out, hf_logits(case.hf, b_seq.tokens)[8:], atol=ATOL, rtol=0)
    torch.testing.assert_close(c_out, hf_logits(case.hf, p_seq.tokens)[-1:], atol=ATOL, rtol=0)
    torch.testing.assert_close(d_out, hf_logits(case.hf, d_seq.tokens), atol=ATOL, rtol=0)


RANDOM_CONFIGS = {
    "tiny_llama": TINY_LLAMA_CONFIG,
    "qwen2_bias": {
        **TINY_LLAMA_CONFIG,
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "num_hidden_layers": 2,
    },
    "qwen3_qk_norm_tied": {
        **TINY_LLAMA_CONFIG,
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "num_hidden_layers": 2,
        "head_dim": 48,
        "tie_word_embeddings": True,
    },
}


@pytest.mark.parametrize("name", list(RANDOM_CONFIGS))
def test_write_random_checkpoint_loads_in_transformers_with_equal_logits(tmp_path, name):
    path = write_random_checkpoint(tmp_path / name, RANDOM_CONFIGS[name], seed=7, init_std=0.3)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True
    )
    assert {k: v for k, v in info.items() if v} == {}, "HF saw missing, unexpected or mismatched tensors"
    ours = load_model(path)
    tokens = random_tokens(21, seed=8)
    (logits,) = PagedRunner(ours, page_size=8).feed([(Seq(), tokens)])
    torch.testing.assert_close(logits, hf_logits(hf.eval(), tokens), atol=ATOL, rtol=0)


def test_write_random_checkpoint_is_deterministic(tmp_path):
    a = write_random_checkpoint(tmp_path / "a", TINY_LLAMA_CONFIG, seed=3)
    b = write_random_checkpoint(tmp_path / "b", TINY_LLAMA_CONFIG, seed=3)
    c = write_random_checkpoint(tmp_path / "c", TINY_LLAMA_CONFIG, seed=4)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert json.loads((a / "config.json").read_text())["dtype"] == "float32"
    assert "dtype" not in TINY_LLAMA_CONFIG, "writing a checkpoint must not mutate the caller's config"


def test_sharded_checkpoint_loads_like_single_file(cases, tmp_path):
    case = cases["qwen2"]
    case.hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert not (tmp_path / "model.safetensors").exists()
    sharded = load_model(tmp_path)
    for (name, a), (_, b) in zip(sharded.state_dict().items(), case.ours.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_tied_checkpoint_has_no_lm_head_and_reuses_embeddings(cases):
    case = cases["llama_tied_bias"]
    assert "lm_head.weight" not in load_file(case.path / "model.safetensors")
    assert case.ours.lm_head is None
    assert "lm_head.weight" not in expected_tensor_shapes(case.ours.config)


def test_load_in_bfloat16(cases):
    case = cases["llama"]
    model = load_model(case.path, dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    tokens = random_tokens(12, seed=9)
    (low,) = PagedRunner(model, page_size=4).feed([(Seq(), tokens)])
    ref = hf_logits(case.hf, tokens)
    assert low.dtype == torch.float32
    # bf16 keeps ~3 significant digits; this only catches a broken cast, not rounding.
    assert (low - ref).abs().max() < 0.1 * ref.abs().max()


def test_model_geometry_and_input_checks(cases):
    model = cases["qwen3"].ours
    assert model.kv_geometry == (2, 2, 32)
    runner = PagedRunner(model, page_size=4)
    md = AttentionMetadata.build([3], [3], [[0]], page_size=4)
    with pytest.raises(InvalidArgument, match="pool") as err:
        model(torch.tensor([1, 2, 3]), torch.arange(3), runner.pool[:, :1], md, runner.backend)
    assert err.value.field == "pool"
    with pytest.raises(InvalidArgument) as err:
        model(torch.tensor([1, 2]), torch.arange(3), runner.pool, md, runner.backend)
    assert err.value.field == "input_ids"
    long_md = AttentionMetadata.build([1], [257], [list(range(65))], page_size=4)
    with pytest.raises(InvalidArgument, match="exact up to 256") as err:
        model(torch.tensor([1]), torch.tensor([256]), runner.pool, long_md, runner.backend)
    assert err.value.field == "context_lens"


def test_rope_table_grows_on_demand_and_matches_a_full_build():
    rope = ModelConfig.from_dict(base_config(rope_parameters=dict(LLAMA3_ROPE))).rope
    grown = RotaryEmbedding(rope, head_dim=32, max_positions=2048)
    full = RotaryEmbedding(rope, head_dim=32, max_positions=2048)
    grown.cos_sin(torch.arange(3), 3, torch.float32)
    positions = torch.tensor([0, 255, 256, 1000, 2047])
    cos, sin = grown.cos_sin(positions, 2048, torch.float32)
    full_cos, full_sin = full.cos_sin(positions, 2048, torch.float32)
    assert torch.equal(cos, full_cos) and torch.equal(sin, full_sin)


def test_load_model_gives_an_inference_model(cases):
    model = load_model(cases["mistral_linear_rope"].path, dtype=torch.float32)
    assert not any(p.requires_grad for p in model.parameters()) and not model.training
    assert model.config.rope_scaling == {"rope_type": "linear", "factor": 2.0}


# ---- bad checkpoints ----------------------------------------------------------------------


@pytest.fixture
def llama_copy(cases, tmp_path) -> Path:
    return Path(shutil.copytree(cases["llama"].path, tmp_path / "ckpt"))


def edit_tensors(path: Path, edit) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def edit_config(path: Path, edit) -> None:
    raw = json.loads((path / "config.json").read_text())
    edit(raw)
    (path / "config.json").write_text(json.dumps(raw))


def test_missing_tensor_is_named(llama_copy):
    edit_tensors(llama_copy, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(llama_copy)


def test_missing_lm_head_is_an_error_unless_tied(llama_copy):
    edit_tensors(llama_copy, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        load_model(llama_copy)
    edit_config(llama_copy, lambda raw: raw.update(tie_word_embeddings=True))
    assert load_model(llama_copy).lm_head is None


def test_wrong_shape_names_tensor_and_both_shapes(llama_copy):
    edit_tensors(
        llama_copy, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(48, 64)})
    )
    with pytest.raises(CheckpointError) as err:
        load_model(llama_copy)
    msg = str(err.value)
    assert "model.layers.0.self_attn.k_proj.weight" in msg and "[48, 64]" in msg and "[32, 64]" in msg


def test_unsupported_architecture_lists_supported(llama_copy):
    edit_config(llama_copy, lambda raw: raw.update(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(CheckpointError, match="GPT2LMHeadModel") as err:
        load_model(llama_copy)
    assert all(name in str(err.value) for name in SUPPORTED_ARCHITECTURES)
    assert err.value.field == "architectures"


def test_missing_config_field_is_named(llama_copy):
    edit_config(llama_copy, lambda raw: raw.pop("hidden_size"))
    with pytest.raises(CheckpointError, match="hidden_size") as err:
        load_model(llama_copy)
    assert err.value.field == "hidden_size"


def test_missing_shard_is_named(cases, tmp_path):
    cases["llama"].hf.save_pretrained(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    (tmp_path / shard).unlink()
    with pytest.raises(CheckpointError, match=shard):
        load_model(tmp_path)


def test_no_weights_and_no_config(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA_CONFIG))
    with pytest.raises(CheckpointError, match="neither model.safetensors nor"):
        load_model(tmp_path)


def test_unsupported_dtype(cases):
    with pytest.raises(InvalidArgument, match="float64"):
        load_model(cases["llama"].path, dtype=torch.float64)


# ---- config parsing -----------------------------------------------------------------------


def base_config(**overrides) -> dict:
    return {**TINY_LLAMA_CONFIG, **overrides}


def test_legacy_rope_spelling_parses_like_rope_parameters():
    new = ModelConfig.from_dict(base_config(rope_parameters={**LLAMA3_ROPE, "rope_theta": 5e5}))
    legacy = ModelConfig.from_dict(
        {
            **{k: v for k, v in TINY_LLAMA_CONFIG.items() if k != "rope_parameters"},
            "rope_theta": 5e5,
            "rope_scaling": {k: v for k, v in LLAMA3_ROPE.items() if k not in ("rope_theta", "rope_type")}
            | {"type": "llama3"},
        }
    )
    assert new.rope == legacy.rope
    assert new.rope_theta == 5e5
    assert new.rope_scaling == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    plain = ModelConfig.from_dict({k: v for k, v in TINY_LLAMA_CONFIG.items() if k != "rope_parameters"})
    assert plain.rope_scaling is None and plain.rope_theta == 10000.0


def test_llama3_original_max_positions_defaults_to_max_position_embeddings():
    rope = {k: v for k, v in LLAMA3_ROPE.items() if k != "original_max_position_embeddings"}
    assert (
        ModelConfig.from_dict(base_config(rope_parameters=rope)).rope.original_max_position_embeddings == 2048
    )


@pytest.mark.parametrize("rope_type", ["yarn", "dynamic", "longrope"])
def test_unsupported_rope_type_is_named(rope_type):
    with pytest.raises(CheckpointError, match=rope_type) as err:
        ModelConfig.from_dict(base_config(rope_scaling={"type": rope_type, "factor": 2.0}))
    assert "llama3" in str(err.value)


def test_derived_fields():
    cfg = ModelConfig.from_dict(
        base_config(head_dim=None, num_key_value_heads=None, eos_token_id=[2, 7], torch_dtype="bfloat16")
    )
    assert (cfg.head_dim, cfg.num_key_value_heads, cfg.num_query_groups) == (32, 4, 1)
    assert cfg.eos_token_ids == (2, 7) and cfg.bos_token_id == 1 and cfg.torch_dtype == "bfloat16"
    assert not (cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias or cfg.qk_norm or cfg.tie_word_embeddings)
    qwen2 = ModelConfig.from_dict(base_config(architectures=["Qwen2ForCausalLM"], attention_bias=False))
    assert qwen2.qkv_bias and not qwen2.o_bias
    qwen3 = ModelConfig.from_dict(base_config(architectures=["Qwen3ForCausalLM"]))
    assert qwen3.qk_norm and not qwen3.qkv_bias


def test_sliding_window_caps_the_exact_context():
    mistral = ModelConfig.from_dict(base_config(architectures=["MistralForCausalLM"], sliding_window=1024))
    assert mistral.sliding_window == 1024 and mistral.max_context_len == 1024
    qwen_off = ModelConfig.from_dict(base_config(architectures=["Qwen2ForCausalLM"], sliding_window=1024))
    assert qwen_off.sliding_window is None and qwen_off.max_context_len == 2048
    qwen_on = ModelConfig.from_dict(
        base_config(architectures=["Qwen2ForCausalLM"], sliding_window=1024, use_sliding_window=True)
    )
    assert qwen_on.max_context_len == 1024


@pytest.mark.parametrize(
    ("overrides", "field_name"),
    [
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"num_hidden_layers": "4"}, "num_hidden_layers"),
        ({"max_position_embeddings": None}, "max_position_embeddings"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"architectures": []}, "architectures"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
    ],
)
def test_bad_config_fields_are_named(overrides, field_name):
    with pytest.raises(CheckpointError, match=field_name) as err:
        ModelConfig.from_dict(base_config(**overrides))
    assert err.value.field == field_name
