"""Speculative verify on models with recurrent layers (qwen3_5's GatedDeltaNet,
nemotron_h's Mamba-2: conv and SSM state) and sliding-window layers (a rotating KV
cache that wraps): a rejected draft is taken back by putting the cache back as it was
before the verify and computing the kept positions again (cache/layers/rewind.py), so
the reply is plain decoding's, tokens and logprobs, whether the drafts are all kept,
all rejected or cut mid-way. An oracle drives the verify: it drafts the plain reply's
own next tokens, or wrong ones (the random weights copy nothing by themselves)."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from typing import Any

import pytest
from support.engine_helpers import chat, run, same_reply
from support.models import TEST_CACHE, loaded_test_model

from mlx_prefix.config import EngineConfig
from mlx_prefix.engine.decode import lookup
from mlx_prefix.engine.engine import Engine
from mlx_prefix.engine.lookup import ngram
from mlx_prefix.models.layer_skip import make_layer_skip_draft
from mlx_prefix.models.load import load_model
from mlx_prefix.models.testing import SLIDING_WINDOW, cached_test_model, make_test_model
from mlx_prefix.records import SamplingParams

PROMPT = chat(("user", "Tell me about the lighthouse keeper and the harbour wall, please."))
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, logprobs=True, top_logprobs=2)
SEEDED = SamplingParams(max_tokens=24, temperature=0.9, seed=11, logprobs=True)
SAMPLINGS = pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
KINDS = pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h", "sliding"])
LOOKUP = 6


@contextlib.contextmanager
def _engine(model, **config: Any) -> Iterator[Engine]:
    config.setdefault("prompt_lookup", 0)  # plain decoding unless asked (on by default)
    engine = Engine(model, TEST_CACHE, EngineConfig(deterministic=True, **config))
    try:
        yield engine
    finally:
        engine.shutdown()


def _oracle(reply: list[int], prompt_tokens: int, vocab: int, cut: int | None):
    """NgramIndex.propose drafting `reply`'s next tokens (the request's sequence is the
    prompt and the reply so far), wrong from draft index `cut` on (None: all right)."""

    def propose(self, k: int) -> list[int]:
        self.matched = ngram.MATCH_CAP  # a copy's match: a cold request drafts from it
        at = len(self.tokens) - prompt_tokens
        right = [*reply[at : at + k], *[0] * k][:k]
        return [t if cut is None or i < cut else (t + 1) % vocab for i, t in enumerate(right)]

    return propose


@KINDS
@SAMPLINGS
@pytest.mark.parametrize("cut", [None, 0, 2], ids=["all-kept", "all-rejected", "cut-mid-way"])
def test_lookup_on_a_hybrid_or_sliding_model_replies_as_plain_decoding(
    kind, sampling, cut, monkeypatch
):
    model = loaded_test_model(kind)
    with _engine(model) as engine:
        plain = run(engine, PROMPT, sampling=sampling)
        assert engine.loop.decode.lookup.stats.steps == 0
    if kind == "sliding":  # the window wraps during the prompt: no trim could take a draft back
        assert plain.usage.prompt_tokens > SLIDING_WINDOW
    oracle = _oracle(plain.tokens, plain.usage.prompt_tokens, len(model.tokenizer.get_vocab()), cut)
    monkeypatch.setattr(lookup.NgramIndex, "propose", oracle)
    with _engine(model, prompt_lookup=LOOKUP) as engine:
        looked = run(engine, PROMPT, sampling=sampling)
        stats = engine.loop.decode.lookup.stats
    same_reply(looked, plain)
    assert stats.steps > 0 and stats.drafted > 0
    if cut is None:
        assert stats.accepted == stats.drafted
        assert stats.steps < len(plain.tokens) // 2  # several tokens a step
    elif cut == 0:
        assert stats.accepted == 0
    else:
        assert 0 < stats.accepted < stats.drafted


@pytest.fixture(scope="module")
def other_hybrid(tmp_path_factory) -> object:
    """A qwen3_5 test model with other weights: its drafts are mostly rejected."""
    folder = make_test_model("qwen3_5", tmp_path_factory.mktemp("other") / "qwen3_5", seed=5)
    shutil.rmtree(folder / "unused", ignore_errors=True)
    return load_model(str(folder))


@pytest.fixture(scope="module")
def dense_draft(tmp_path_factory) -> object:
    """The tiny dense model's first layer (the same tokenizer as every test model)."""
    folder = tmp_path_factory.mktemp("draft") / "layer-skip"
    return load_model(str(make_layer_skip_draft(cached_test_model("dense"), folder, 1)))


@SAMPLINGS
@pytest.mark.parametrize("drafter", ["self", "other-hybrid", "dense"])
def test_a_draft_model_serves_a_hybrid_model_and_the_reply_is_plain_decodings(
    sampling, drafter, other_hybrid, dense_draft
):
    model = loaded_test_model("qwen3_5")
    draft = {"self": model, "other-hybrid": other_hybrid, "dense": dense_draft}[drafter]
    with _engine(model) as engine:
        plain = run(engine, PROMPT, sampling=sampling)
    with contextlib.closing(_Closing(model, draft)) as spec:
        for _ in range(2):  # cold, then restored from the cache (the draft's part too)
            same_reply(run(spec.engine, PROMPT, sampling=sampling), plain)
        stats = spec.engine.loop.decode.speculator.stats
    assert stats is not None and stats.steps > 0
    if drafter == "self" and sampling.temperature == 0:
        assert stats.accepted == stats.drafted  # the model drafts its own greedy reply
    elif drafter != "self":
        assert stats.accepted < stats.drafted  # taken back from the model (and draft)


class _Closing:
    def __init__(self, model, draft):
        self.engine = Engine(
            model, TEST_CACHE, EngineConfig(deterministic=True, num_draft_tokens=4), draft=draft
        )

    def close(self) -> None:
        self.engine.shutdown()
