"""The paged engine against the Hugging Face oracle on tiny random checkpoints."""

from __future__ import annotations

import pytest
import torch

from kvtier.domain.errors import InvalidArgument, ResourceExhausted
from kvtier.engine import Engine, FinishReason, SamplingParams, SchedulerConfig

from hf_checkpoints import build_checkpoint, hf_logits, load_hf

ATOL = 1e-4
PROMPT_LENS = (5, 16, 17, 33)  # below, at, just past and well past page boundaries


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {arch: build_checkpoint(root / arch, arch, seed=i) for i, arch in enumerate(["llama", "mistral", "qwen2"])}


@pytest.fixture(scope="module")
def hf_models(checkpoints):
    return {arch: load_hf(path) for arch, path in checkpoints.items()}


def prompts(n=4, lens=PROMPT_LENS, seed=0, vocab=256):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (lens[i % len(lens)],), generator=g).tolist() for i in range(n)]


def make_engine(path, *, page_size=4, num_pages=256, **kwargs) -> Engine:
    kwargs.setdefault("attention_backend", "auto")
    return Engine.from_pretrained(path, page_size=page_size, num_pages=num_pages, **kwargs)


def assert_matches_oracle(hf, result, steps):
    """Every sampled step's logits equal HF's at that position, and greedy tokens follow."""
    full = result.prompt_token_ids + result.token_ids
    ref = hf_logits(hf, full)
    p = len(result.prompt_token_ids)
    assert len(result.logits) == steps
    for i, row in enumerate(result.logits):
        torch.testing.assert_close(row, ref[p - 1 + i], atol=ATOL, rtol=0)
    assert result.token_ids == ref[p - 1 : p - 1 + steps].argmax(-1).tolist()


@pytest.mark.parametrize(
    "arch,page_size,backend",
    [(a, p, "auto") for a in ("llama", "mistral", "qwen2") for p in (1, 4, 16)]
    + [("llama", 4, "torch-reference"), ("qwen2", 16, "torch-reference")],
)
def test_greedy_batch_equals_transformers(checkpoints, hf_models, arch, page_size, backend):
    engine = make_engine(
        checkpoints[arch],
        page_size=page_size,
        num_pages=4096 // page_size,
        record_logits=True,
        attention_backend=backend,
    )
    assert engine.backend.name == ("cpu-fused" if backend == "auto" else backend)
    steps = 48
    params = SamplingParams(max_tokens=steps, ignore_eos=True)
    results = engine.generate(prompts(), params)
    for r in results:
        assert r.finish_reason is FinishReason.LENGTH
        assert_matches_oracle(hf_models[arch], r, steps)
    # Independent of teacher forcing: HF's own greedy generation agrees.
    hf = hf_models[arch]
    first = results[0]
    out = hf.generate(
        torch.tensor([first.prompt_token_ids]), max_new_tokens=steps, min_new_tokens=steps, do_sample=False
    )
    assert out[0, len(first.prompt_token_ids) :].tolist() == first.token_ids
    assert len(set(first.token_ids)) > 4, "the random model must produce a diverse continuation"
    engine.check_integrity()
    assert engine.pool.num_in_use == 0


def test_prefix_reuse_reports_cached_tokens_and_same_output(checkpoints, hf_models):
    ps = 4
    engine = make_engine(checkpoints["llama"], page_size=ps, record_logits=True)
    base = prompts(1, lens=(14,))[0]  # 3 full pages + 2 tokens
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    first = engine.generate([base], params)[0]
    assert first.num_cached_tokens == 0
    n = 2
    second_prompt = base[: n * ps] + [7, 8, 9]
    second = engine.generate([second_prompt], params)[0]
    assert second.num_cached_tokens == n * ps
    assert second.num_computed_tokens == len(second_prompt) - n * ps + params.max_tokens - 1
    fresh = make_engine(checkpoints["llama"], page_size=ps).generate([second_prompt], params)[0]
    assert second.token_ids == fresh.token_ids
    assert_matches_oracle(hf_models["llama"], second, params.max_tokens)
    # Generated pages are shared too: the first request's prompt + output as a new prompt.
    third_prompt = base + first.token_ids[:6]  # 20 tokens = 5 full pages, all cached
    third = engine.generate([third_prompt], params)[0]
    assert third.num_cached_tokens == len(third_prompt) - 1  # last token recomputed in a private copy
    assert_matches_oracle(hf_models["llama"], third, params.max_tokens)
    engine.check_integrity()


def test_sequences_diverging_inside_a_page_each_get_their_own_tail(checkpoints, hf_models):
    ps = 4
    engine = make_engine(checkpoints["qwen2"], page_size=ps, record_logits=True)
    shared = prompts(1, lens=(8,), seed=3)[0]
    warm = engine.generate([shared + [1]], SamplingParams(max_tokens=1))[0]
    assert warm.num_cached_tokens == 0
    a = shared + [10, 11]
    b = shared + [10, 12, 13]  # diverges inside the third page
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    ra, rb = engine.generate([a, b], params)
    assert ra.num_cached_tokens == rb.num_cached_tokens == 2 * ps
    assert_matches_oracle(hf_models["qwen2"], ra, 20)
    assert_matches_oracle(hf_models["qwen2"], rb, 20)
    engine.check_integrity()


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_preemption_gives_identical_outputs(checkpoints, sampling):
    ps = 4
    ps_prompts = prompts(8, lens=(6, 11, 9, 14), seed=5)
    if sampling == "greedy":
        params = [SamplingParams(max_tokens=24, ignore_eos=True)] * 8
    else:
        params = [SamplingParams(max_tokens=24, temperature=0.9, top_k=50, top_p=0.9, seed=100 + i) for i in range(8)]
    reference = make_engine(checkpoints["llama"], page_size=ps, num_pages=512).generate(ps_prompts, params)

    # A small output reservation lets more sequences in than can finish together.
    engine = make_engine(
        checkpoints["llama"], page_size=ps, num_pages=24, scheduler_config=SchedulerConfig(output_reservation_tokens=4)
    )
    rids = [engine.add_request(p, sp) for p, sp in zip(ps_prompts, params, strict=True)]
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
    constrained = [engine.pop_result(r) for r in rids]
    assert sum(r.num_preemptions for r in constrained) > 0, "the pool must be small enough to preempt"
    assert [r.token_ids for r in constrained] == [r.token_ids for r in reference]
    assert engine.pool.num_in_use == 0


def test_seeded_sampling_is_deterministic_and_seed_sensitive(checkpoints):
    engine = make_engine(checkpoints["llama"])
    p = prompts(1)[0]
    a = engine.generate([p], SamplingParams(max_tokens=16, temperature=1.0, seed=1))[0].token_ids
    b = engine.generate([p], SamplingParams(max_tokens=16, temperature=1.0, seed=1))[0].token_ids
    c = engine.generate([p], SamplingParams(max_tokens=16, temperature=1.0, seed=2))[0].token_ids
    assert a == b
    assert a != c


def test_abort_mid_generation_releases_every_page(checkpoints):
    engine = make_engine(checkpoints["llama"], page_size=4, num_pages=64)
    rids = [engine.add_request(p, SamplingParams(max_tokens=40, ignore_eos=True)) for p in prompts(4)]
    for _ in range(5):
        engine.step()
    assert engine.pool.num_in_use > 0
    for rid in rids:
        assert engine.abort(rid)
        assert not engine.abort(rid)  # exactly once
    assert engine.pool.num_in_use == 0
    assert not engine.has_unfinished()
    assert engine.pop_result(rids[0]).finish_reason is FinishReason.ABORTED
    engine.check_integrity()


def test_stop_sequences_and_tool_call(checkpoints):
    engine = make_engine(checkpoints["llama"])
    p = prompts(1)[0]
    free = engine.generate([p], SamplingParams(max_tokens=20, ignore_eos=True))[0].token_ids
    stop_tok = free[5]
    r = engine.generate([p], SamplingParams(max_tokens=20, stop_token_ids=[stop_tok], ignore_eos=True))[0]
    assert r.finish_reason is FinishReason.STOP and r.token_ids == free[: free.index(stop_tok) + 1]
    seq = free[6:8]
    r = engine.generate([p], SamplingParams(max_tokens=20, tool_call_sequence=seq, ignore_eos=True))[0]
    assert r.finish_reason is FinishReason.TOOL_CALL and r.token_ids[-2:] == seq
    r = engine.generate([p], SamplingParams(max_tokens=20, stop_sequences=[free[9:11]], ignore_eos=True))[0]
    assert r.finish_reason is FinishReason.STOP and r.token_ids[-2:] == free[9:11]


def test_bad_requests_are_rejected_with_clear_errors(checkpoints):
    engine = make_engine(checkpoints["llama"], page_size=4, num_pages=8)
    with pytest.raises(InvalidArgument, match="token id 256 at index 1"):
        engine.add_request([1, 256, 3])
    with pytest.raises(InvalidArgument, match="must not be empty"):
        engine.add_request([])
    with pytest.raises(InvalidArgument, match="max_tokens"):
        engine.add_request([1, 2], SamplingParams(max_tokens=0))
    with pytest.raises(ResourceExhausted, match="at most 31 prompt tokens"):
        engine.add_request(list(range(40)))
    with pytest.raises(InvalidArgument, match="model context is 512"):
        make_engine(checkpoints["llama"]).add_request([1] * 512)
    # Rejections leave nothing behind; the engine still serves.
    assert not engine.has_unfinished()
    assert engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].finish_reason is FinishReason.LENGTH
    engine.check_integrity()


def test_sequence_that_outgrows_the_pool_finishes_with_length(checkpoints):
    engine = make_engine(checkpoints["llama"], page_size=4, num_pages=6)
    r = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=100, ignore_eos=True))[0]
    assert r.finish_reason is FinishReason.LENGTH
    assert len(r.prompt_token_ids) + len(r.token_ids) == 6 * 4 + 1  # every slot used, last token unfed
    assert engine.pool.num_in_use == 0
    engine.check_integrity()


def test_a_private_duplicate_keeps_running_when_the_cached_parent_goes_down_a_tier(checkpoints):
    """B computes the same prefix as A in the same step, so B runs on private copies while A's
    pages are what the index caches. Once A finishes, those cached pages are idle and a
    demotion (watermark, or a parked session) moves them to DRAM. B's next full page then has a
    parent below HBM: it stays private (a child may not be faster than its parent) instead of
    stopping the engine with "parent missing", and B's tokens are what they would have been."""
    from kvtier.domain.tiers import Tier
    from kvtier.tiers.manager import TierConfig

    prompt = list(range(10, 18))  # two full pages of 4
    reference = make_engine(checkpoints["llama"]).generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))
    engine = make_engine(checkpoints["llama"], num_pages=64, tier_config=TierConfig(dram_pages=32))
    a = engine.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    b = engine.add_request(prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    engine.step()  # both prefill; A finishes, its pages become the cached (idle) copies
    engine.pop_result(a)
    assert engine.tiers.demote_all(Tier.DRAM) == 2
    engine.tiers.wait_idle()
    engine.tiers.poll()
    while engine.has_unfinished():
        engine.step()
    assert engine.pop_result(b).token_ids == reference[0].token_ids
    engine.check_integrity()
