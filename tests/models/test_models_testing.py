from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache
from support.paths import DATA

from mlx_prefix.models.load import load_model
from mlx_prefix.models.testing import (
    SLIDING_WINDOW,
    TEST_MODEL_KINDS,
    cached_test_model,
    make_test_model,
)

EXPECTED_CACHES: dict[str, set[type]] = {
    "dense": {KVCache},
    "qwen3_5": {ArraysCache, KVCache},
    "nemotron_h": {ArraysCache, KVCache},
    "sliding": {RotatingKVCache, KVCache},
}


def _greedy(model: object, prompt: mx.array, n: int) -> list[int]:
    steps = generate_step(prompt, model, max_tokens=n)  # type: ignore[arg-type]
    return [int(tok) for tok, _ in steps]


def test_kinds_cover_expected_caches() -> None:
    assert set(TEST_MODEL_KINDS) == set(EXPECTED_CACHES)


@pytest.mark.parametrize("kind", TEST_MODEL_KINDS)
def test_kind_loads_with_expected_cache_mix_and_runs(kind: str) -> None:
    lm = load_model(str(cached_test_model(kind)))
    vocab = len(lm.tokenizer.get_vocab())

    cache = make_prompt_cache(lm.model)
    assert {type(c) for c in cache} == EXPECTED_CACHES[kind]
    if kind == "sliding":
        assert {c.max_size for c in cache if isinstance(c, RotatingKVCache)} == {SLIDING_WINDOW}

    tokens = mx.array(lm.tokenizer.encode("In the beginning God created the heaven and the earth."))
    logits = lm.model(tokens[None], cache=cache)
    assert logits.shape == (1, tokens.size, vocab)
    assert mx.isfinite(logits).all().item()
    assert all(c.offset == tokens.size for c in cache if isinstance(c, KVCache))

    first = _greedy(lm.model, tokens, 6)
    assert first == _greedy(lm.model, tokens, 6)
    assert len(first) == 6 and all(0 <= t < vocab for t in first)


@pytest.mark.parametrize("kind", TEST_MODEL_KINDS)
def test_saved_weights_round_trip_through_loader(kind: str) -> None:
    path = cached_test_model(kind)
    saved = mx.load(str(path / "model.safetensors"))
    loaded = dict(tree_flatten(load_model(str(path)).model.parameters()))
    assert saved.keys() == loaded.keys()
    for name, value in saved.items():
        assert mx.array_equal(value, loaded[name]).item(), name


def test_same_seed_same_weights_other_seed_differs(tmp_path: Path) -> None:
    a = load_model(str(make_test_model("dense", tmp_path / "a", seed=3))).identity
    b = load_model(str(make_test_model("dense", tmp_path / "b", seed=3))).identity
    c = load_model(str(make_test_model("dense", tmp_path / "c", seed=4))).identity
    assert a.weights_fingerprint == b.weights_fingerprint
    assert a.weights_fingerprint != c.weights_fingerprint


def test_unknown_kind_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown test model kind"):
        make_test_model("transformer-xl", tmp_path)


def test_cached_test_model_writes_once() -> None:
    first = cached_test_model("dense")
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert cached_test_model("dense") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime


def test_think_template_strips_earlier_reasoning_only() -> None:
    lm = load_model(str(cached_test_model("dense", think_template=True)))
    tok = lm.tokenizer
    assert tok.has_thinking
    assert len(tok.encode("<think>", add_special_tokens=False)) == 1
    assert lm.model.model.embed_tokens.weight.shape[0] == len(tok.get_vocab())
    messages = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "<think>\nearlier reasoning\n</think>\n\na1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "<think>\nlatest reasoning\n</think>\n\na2"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert "earlier reasoning" not in text
    assert "<|im_start|>assistant\na1<|im_end|>" in text
    assert "<think>\nlatest reasoning\n</think>\n\na2<|im_end|>" in text

    # The same turn, once a new user query follows it, renders without its reasoning:
    # the rendered conversation is not an extension of the previous render.
    followup = tok.apply_chat_template(
        [*messages, {"role": "user", "content": "q3"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert "latest reasoning" not in followup
    assert not followup.startswith(text)
    assert followup.endswith("<|im_start|>user\nq3<|im_end|>\n<|im_start|>assistant\n")


def test_plain_template_is_chatml() -> None:
    tok = load_model(str(cached_test_model("dense"))).tokenizer
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_a_real_tokenizer_brings_its_vocabulary_think_and_tool_tokens() -> None:
    folder = cached_test_model("dense", tokenizer=DATA / "tokenizers/qwen3")
    loaded = load_model(str(folder))
    tok = loaded.tokenizer
    assert tok.has_thinking and tok.has_tool_calling  # <think>, <tool_call>: single tokens
    assert len(tok.encode("<think>", add_special_tokens=False)) == 1
    assert tok.eos_token_ids >= {tok.convert_tokens_to_ids("<|im_end|>")}
    embed = dict(tree_flatten(loaded.model.parameters()))["model.embed_tokens.weight"]
    assert embed.shape == (len(tok.get_vocab()), 128)  # every id embedded, 128 wide
