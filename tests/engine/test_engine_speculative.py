"""Speculative decoding (engine/decode/speculative.py): the reply is exactly plain decoding's,
tokens and logprobs, greedy and seeded, cold and on a cache hit; a second request falls
back to the batched step; the draft must fit the model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from support.engine_helpers import chat, collect, run, submit_together
from support.models import TEST_CACHE, loaded_test_model

from mlx_prefix.cache.store import PromptCache
from mlx_prefix.config import EngineConfig
from mlx_prefix.engine.decode.speculative import DraftMismatch
from mlx_prefix.engine.engine import Engine
from mlx_prefix.errors import InvalidRequest
from mlx_prefix.models.layer_skip import make_layer_skip_draft
from mlx_prefix.models.load import load_model
from mlx_prefix.models.testing import cached_test_model
from mlx_prefix.records import SamplingParams

SYSTEM = "You are a careful assistant who answers about ships, harbours and the sea. " * 8
PROMPT = chat(("system", SYSTEM), ("user", "Tell me about the lighthouse at the harbour."))
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, logprobs=True, top_logprobs=2)
SEEDED = SamplingParams(max_tokens=24, temperature=0.9, seed=11, logprobs=True)


@pytest.fixture(scope="module")
def draft(tmp_path_factory) -> object:
    """The tiny dense model's first layer, as a draft (shares its tokenizer)."""
    folder = tmp_path_factory.mktemp("draft") / "layer-skip"
    return load_model(str(make_layer_skip_draft(cached_test_model("dense"), folder, 1)))


@pytest.fixture
def engines():
    made: list[Engine] = []

    def make(draft=None, **config) -> Engine:
        if draft is None:  # plain decoding: prompt lookup (on by default) verifies in one
            config.setdefault("prompt_lookup", 0)  # forward, whose last bits may differ
        engine = Engine(loaded_test_model("dense"), TEST_CACHE, EngineConfig(**config), draft=draft)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.shutdown()


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_speculative_reply_equals_plain_cold_and_warm(engines, draft, sampling):
    plain_engine = engines()
    plain = run(plain_engine, PROMPT, sampling=sampling)
    spec = engines(draft)
    cold = run(spec, PROMPT, sampling=sampling)
    # The same entries, each carrying the draft's KV of its prefix too (counted).
    plain_stats, spec_stats = plain_engine.views.cache_stats(), spec.views.cache_stats()
    assert spec_stats["entries"] == plain_stats["entries"] > 0
    assert spec_stats["bytes"] > plain_stats["bytes"]
    warm = run(spec, PROMPT, sampling=sampling)
    assert cold.usage.cached_tokens == 0 and warm.usage.cached_tokens > 0
    for reply in (cold, warm):
        assert reply.tokens == plain.tokens and reply.logprobs == plain.logprobs
        assert reply.text == plain.text and reply.finish_reason == plain.finish_reason
    stats = spec.loop.decode.speculator.stats
    assert stats is not None and stats.steps > 0 and stats.drafted > 0
    assert spec.views.cache_stats()["speculative"]["drafted"] == stats.drafted
    # The hit restored the draft's cache beside the model's: the draft computed only
    # the prompt's uncached rest.
    assert stats.draft_restored == warm.usage.cached_tokens
    prompt_tokens = cold.usage.prompt_tokens
    assert stats.draft_computed == 2 * prompt_tokens - warm.usage.cached_tokens


def test_an_entry_without_the_draft_part_restores_the_model_and_prefills_the_draft(draft):
    store = PromptCache(TEST_CACHE.budget_bytes)
    plain = Engine(
        loaded_test_model("dense"), TEST_CACHE, EngineConfig(prompt_lookup=0), store=store
    )
    spec = Engine(loaded_test_model("dense"), TEST_CACHE, store=store, draft=draft)
    try:
        cold = run(plain, PROMPT, sampling=GREEDY)
        warm = run(spec, PROMPT, sampling=GREEDY)
        assert warm.usage.cached_tokens > 0
        assert (warm.tokens, warm.logprobs) == (cold.tokens, cold.logprobs)
        stats = spec.loop.decode.speculator.stats
        assert stats.draft_restored == 0 and stats.draft_computed == warm.usage.prompt_tokens
    finally:
        plain.shutdown()
        spec.shutdown()


def test_self_draft_accepts_every_greedy_token(engines):
    spec = engines(loaded_test_model("dense"))
    reply = run(spec, PROMPT, sampling=GREEDY)
    assert reply.tokens == run(engines(), PROMPT, sampling=GREEDY).tokens
    stats = spec.loop.decode.speculator.stats
    assert stats.accepted == stats.drafted > 0
    # k drafted + the target's own token per step: fewer steps than tokens.
    assert stats.steps < len(reply.tokens)


def test_rejected_drafts_are_trimmed_and_the_reply_stays_exact(engines, tmp_path):
    # A draft with other weights agrees with the model only now and then: most of its
    # tokens are rejected, so both caches are trimmed at almost every step.
    other = load_model(str(_other_weights(tmp_path)))
    spec = engines(other)
    for sampling in (GREEDY, SEEDED):
        assert (
            run(spec, PROMPT, sampling=sampling).tokens
            == run(engines(), PROMPT, sampling=sampling).tokens
        )
    stats = spec.loop.decode.speculator.stats
    assert stats.accepted < stats.drafted


def test_a_second_request_falls_back_to_the_batched_step(engines, draft):
    other = chat(("system", SYSTEM), ("user", "And what about the old fishing boats?"))
    alone = [run(engines(), p, sampling=GREEDY) for p in (PROMPT, other)]
    spec = engines(draft, deterministic=True)  # batched == alone is batch invariance
    handles = submit_together(spec, [PROMPT, other], GREEDY)
    together = [collect(h) for h in handles]
    assert spec.loop.decode.peak_batch == 2
    for a, t in zip(alone, together, strict=True):
        assert (t.tokens, t.logprobs) == (a.tokens, a.logprobs)


def test_a_requests_num_draft_tokens_is_honoured(engines, draft):
    spec = engines(draft, num_draft_tokens=2)
    stats = spec.loop.decode.speculator.stats
    run(spec, PROMPT, sampling=SamplingParams(max_tokens=8, num_draft_tokens=0))
    assert stats.steps == 0
    run(spec, PROMPT, sampling=SamplingParams(max_tokens=30, num_draft_tokens=5))
    first = (stats.steps, stats.drafted)
    assert first[1] > 0 and first[1] <= 5 * first[0] and first[1] > 2 * first[0]
    run(spec, PROMPT, sampling=SamplingParams(max_tokens=30))  # the server's 2
    assert stats.drafted - first[1] <= 2 * (stats.steps - first[0])
    with pytest.raises(InvalidRequest) as refused:
        spec.submit(PROMPT, SamplingParams(num_draft_tokens=99))
    assert refused.value.param == "num_draft_tokens"
    with pytest.raises(InvalidRequest) as refused:
        engines().submit(PROMPT, SamplingParams(num_draft_tokens=2))
    assert refused.value.param == "num_draft_tokens"


def test_a_draft_with_another_vocabulary_is_refused(tmp_path):
    folder = make_layer_skip_draft(cached_test_model("dense"), tmp_path / "d", 1)
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    top = max(t["id"] for t in tokenizer["added_tokens"])
    extra = {"id": top + 1, "content": "<|extra|>", "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": True}  # fmt: skip
    tokenizer["added_tokens"].append(extra)
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(DraftMismatch, match="tokenizer differs"):
        Engine(loaded_test_model("dense"), TEST_CACHE, draft=load_model(str(folder)))


def _other_weights(tmp_path: Path) -> Path:
    from mlx_prefix.models.testing import make_test_model

    folder = make_test_model("dense", tmp_path / "other", seed=5)
    shutil.rmtree(folder / "unused", ignore_errors=True)
    return folder


def test_the_startup_check_holds_and_fails_when_the_verify_forward_is_not_exact(monkeypatch):
    from mlx_prefix.engine.decode.speculative import verify_matches
    from mlx_prefix.engine.forward import rowwise, verify_positions

    model = loaded_test_model("dense").model
    rowwise.install(model)
    vocab = loaded_test_model("dense").tokenizer.vocab_size
    assert verify_matches(model, rowwise.consistent_rows(model), vocab)

    def shifted(base, length, width, row, queries, keys, values, cache, scale, mask, sinks):
        # Every query over all the keys (a later position's too): not a decode step.
        return base(queries, keys, values, cache=cache, scale=scale, mask=None, sinks=sinks)

    monkeypatch.setattr(verify_positions, "verify_sdpa", shifted)
    assert not verify_matches(model, rowwise.consistent_rows(model), vocab)
