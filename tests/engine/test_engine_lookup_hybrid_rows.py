"""Several requests on a hybrid or sliding-window model verify their own drafts in one
forward (engine/decode/verify_rows.py): rows of different lengths through recurrent
layers (qwen3_5's GatedDeltaNet; Mamba-2 in nemotron_h, mamba2, falcon_h1,
granitemoehybrid and plamo2; Mamba-1 in mamba and jamba; lfm2's short convolutions;
recurrent_gemma's RG-LRU; rwkv7: tests/support/recurrent_models.py) and a sliding window
that wrapped.
A row that kept fewer than it verified is taken back (its recurrent state put back and
its kept positions computed again), and each reply is that request's plain decoding
alone. An oracle drafts each request's own plain reply: all right, all wrong, or wrong
from the second token on, the three side by side (the random weights copy nothing)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
from support.engine_helpers import chat, collect, run, same_reply, submit_together
from support.models import TEST_CACHE, loaded_test_model
from support.recurrent_models import RECURRENT_CONFIGS, loaded_recurrent_model

from mlx_prefix.config import EngineConfig
from mlx_prefix.engine.decode import lookup
from mlx_prefix.engine.engine import Engine
from mlx_prefix.engine.lookup import ngram
from mlx_prefix.records import SamplingParams

PROMPTS = [
    chat(("user", "Tell me about the lighthouse keeper and the harbour wall, please.")),
    chat(("user", "Describe the fishing boats that left the quay before dawn.")),
    chat(("user", "What did the children collect on the beach on Sundays?")),
]
CUTS = (None, 0, 2)  # each request's oracle: all right, all wrong, wrong from index 2
LOOKUP = 4


def _samplings(temperature: float) -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=16, temperature=temperature, seed=s, logprobs=True)
        for s in (11, 12, 13)
    ]


@contextlib.contextmanager
def _engine(model, **config: Any) -> Iterator[Engine]:
    config.setdefault("prompt_lookup", 0)
    engine = Engine(model, TEST_CACHE, EngineConfig(**config))
    try:
        yield engine
    finally:
        engine.shutdown()


def _oracle(requests: dict[int, tuple[list[int], int | None]], vocab: int):
    """NgramIndex.propose drafting its request's plain reply (the request known by its
    prompt's length, `_prompted`), wrong from draft index `cut` on (None: all right)."""

    def propose(self, k: int) -> list[int]:
        self.matched = ngram.MATCH_CAP  # a copy's match: a cold request drafts from it
        reply, cut = requests[self.prompt_length]
        at = len(self.tokens) - self.prompt_length
        right = [*reply[at : at + k], *[0] * k][:k]
        return [t if cut is None or i < cut else (t + 1) % vocab for i, t in enumerate(right)]

    return propose


def _prompted(monkeypatch) -> None:
    """Each request's index knows its prompt's length."""
    state = lookup.PromptLookup._state

    def spy(self, running, limit):
        found = state(self, running, limit)
        found.index.prompt_length = len(running.job.tokens)
        return found

    monkeypatch.setattr(lookup.PromptLookup, "_state", spy)


# Lookup's startup check finds these models' verify forward unlike their decode steps
# with --deterministic and turns lookup off (lookup.py `check`): plain steps, as on main.
INEXACT_VERIFY = {"plamo2": "plamo2's attention calls mx.fast's own, past the per-row one"}


def _model(kind: str):
    return loaded_recurrent_model(kind) if kind in RECURRENT_CONFIGS else loaded_test_model(kind)


@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h", "sliding", *RECURRENT_CONFIGS])
@pytest.mark.parametrize(
    ("deterministic", "temperature"),
    # By default a row's numbers are batching's (last bits): a seeded draw from the
    # random weights' flat distribution may then move by a token, a greedy one not here.
    [(True, 0.0), (True, 0.9), (False, 0.0)],
    ids=["deterministic-greedy", "deterministic-seeded", "default-greedy"],
)
def test_hybrid_requests_verify_their_own_drafts_together_and_reply_as_alone(
    kind, deterministic, temperature, verified_rows, monkeypatch
):
    if kind in INEXACT_VERIFY and deterministic:
        pytest.skip(INEXACT_VERIFY[kind])
    model = _model(kind)
    samplings = _samplings(temperature)
    with _engine(model, deterministic=deterministic) as engine:
        plain = [run(engine, p, sampling=s) for p, s in zip(PROMPTS, samplings, strict=True)]
    lengths = [alone.usage.prompt_tokens for alone in plain]
    assert len(set(lengths)) == len(lengths)  # the oracle knows a request by it
    requests = {n: (alone.tokens, cut) for n, alone, cut in zip(lengths, plain, CUTS, strict=True)}
    vocab = len(model.tokenizer.get_vocab())
    _prompted(monkeypatch)
    monkeypatch.setattr(lookup.NgramIndex, "propose", _oracle(requests, vocab))
    with _engine(model, deterministic=deterministic, prompt_lookup=LOOKUP) as engine:
        handles = submit_together(engine, PROMPTS, samplings)
        together = [collect(h) for h in handles]
        assert engine.loop.decode.peak_batch == 3
        stats = engine.loop.decode.lookup.stats
    for looked, alone in zip(together, plain, strict=True):
        if deterministic:
            same_reply(looked, alone)
        else:  # batching's last bits: the tokens are plain decoding's
            assert (looked.tokens, looked.text) == (alone.tokens, alone.text)
            assert looked.logprobs == pytest.approx(alone.logprobs, abs=1e-3)
    # Several rows drafted in one forward, some kept all and some not.
    assert any(sum(n > 0 for n in row) >= 2 for row in verified_rows)
    assert 0 < stats.accepted < stats.drafted
