"""mlx_lm.server's sampling fields (issue 18): top_k, min_p, XTC, logit_bias and the
three penalties each change what they should, per request: seeded, batched next to
other requests, and on a cache hit exactly as on a cold run."""

from __future__ import annotations

from dataclasses import replace

import pytest
from support.engine_helpers import chat, run, submit_together
from test_engine_batch import collect

from mlx_prefix.errors import InvalidRequest
from mlx_prefix.records import PromptInput, SamplingParams

PROMPT = chat(
    ("system", "You are a careful assistant who answers in full sentences. " * 6),
    ("user", "Tell me a story about a lighthouse keeper and a storm."),
)
GREEDY = SamplingParams(max_tokens=12)
HOT = SamplingParams(max_tokens=12, temperature=1.5, seed=11)  # far from greedy


@pytest.fixture(scope="module")
def engine():
    from support.models import TEST_CACHE, loaded_test_model

    from mlx_prefix.config import EngineConfig
    from mlx_prefix.engine.engine import Engine

    # Batch-invariant: a batch's samples are compared with alone ones.
    engine = Engine(loaded_test_model("dense"), TEST_CACHE, EngineConfig(deterministic=True))
    yield engine
    engine.shutdown()


def tokens(engine, sampling: SamplingParams, prompt: PromptInput = PROMPT, cache=True):
    return run(engine, prompt, sampling=sampling, cache=cache).tokens


def test_the_hot_baseline_is_not_greedy(engine):
    # The tests below would pass trivially if temperature 1.5 happened to be greedy.
    assert tokens(engine, HOT) != tokens(engine, GREEDY)


def test_top_k_one_at_temperature_one_and_a_half_is_greedy(engine):
    assert tokens(engine, replace(HOT, top_k=1)) == tokens(engine, GREEDY)


def test_top_k_above_one_limits_seeded_sampling(engine):
    limited = tokens(engine, replace(HOT, top_k=3))
    assert limited == tokens(engine, replace(HOT, top_k=3))  # seeded
    assert limited != tokens(engine, HOT)


def test_a_high_min_p_keeps_only_the_top_token(engine):
    assert tokens(engine, replace(HOT, min_p=1.0)) == tokens(engine, GREEDY)
    some = tokens(engine, replace(HOT, min_p=0.05))
    assert some not in (tokens(engine, HOT), tokens(engine, GREEDY))


def test_logit_bias_bans_and_forces_tokens(engine):
    greedy = tokens(engine, GREEDY)
    banned = tokens(engine, replace(GREEDY, logit_bias=((greedy[0], -100.0),)))
    assert banned[0] != greedy[0] and greedy[0] not in banned
    forced = tokens(engine, replace(GREEDY, logit_bias=((1234, 100.0),)))
    assert forced == [1234] * len(forced)


@pytest.mark.parametrize("field", ["repetition_penalty", "presence_penalty", "frequency_penalty"])
def test_each_penalty_changes_a_repeating_greedy_reply(engine, field):
    greedy = tokens(engine, GREEDY)
    assert len(set(greedy)) < len(greedy) / 2  # the tiny model repeats itself
    value = 1.5 if field == "repetition_penalty" else 2.0
    penalized = tokens(engine, replace(GREEDY, **{field: value}))
    assert penalized != greedy
    assert len(set(penalized)) > len(set(greedy))


def test_penalties_read_the_prompt_too_and_only_their_context(engine):
    # As mlx_lm on a cold run: the history is the prompt, then the reply. A completion
    # whose greedy next token is the prompt's last one is steered off it by a presence
    # penalty whose window reaches back one token, and by no other setting.
    greedy = tokens(engine, GREEDY, PromptInput(text="hello"))
    prompt = PromptInput(text="hello" + engine.model.tokenizer.decode(greedy[:1]))
    assert tokens(engine, GREEDY, prompt)[0] == greedy[0]  # it would repeat the token
    one_back = replace(GREEDY, presence_penalty=2.0, presence_context_size=1)
    assert tokens(engine, one_back, prompt)[0] != greedy[0]


def test_xtc_changes_seeded_sampling_and_stays_seeded(engine):
    # The random-weight model's distribution is flat (top token ~0.001): a threshold
    # of 0.0005 puts a dozen tokens above it, which XTC then cuts but the least likely.
    plain = tokens(engine, replace(HOT, temperature=1.0))
    xtc = replace(HOT, temperature=1.0, xtc_probability=1.0, xtc_threshold=0.0005)
    cut = tokens(engine, xtc)
    assert cut != plain
    assert tokens(engine, xtc) == cut
    # The token draws are the plain ones (XTC's coins come from another chain): a
    # probability that almost never cuts samples the plain tokens, whatever the threshold.
    assert tokens(engine, replace(xtc, xtc_probability=1e-9)) == plain


SETTINGS = {
    "top_k": replace(HOT, top_k=5),
    "min_p": replace(HOT, min_p=0.1),
    "xtc": replace(HOT, xtc_probability=0.5, xtc_threshold=0.0005),
    "logit_bias": replace(HOT, logit_bias=((1234, 5.0), (77, -100.0))),
    "repetition": replace(GREEDY, repetition_penalty=1.3, repetition_context_size=64),
    "presence": replace(HOT, presence_penalty=1.0, presence_context_size=8),
    "frequency": replace(GREEDY, frequency_penalty=0.7),
}


@pytest.mark.parametrize("kind", ["dense", "qwen3_5"])
def test_a_cache_hit_samples_as_a_cold_run_under_each_setting(make_engine, kind):
    engine = make_engine(kind)
    run(engine, PROMPT)  # the prompt is cached from here on
    for name, sampling in SETTINGS.items():
        warm = run(engine, PROMPT, sampling=sampling)
        cold = run(engine, PROMPT, sampling=sampling, cache=False)
        assert warm.usage.cached_tokens > 0, name
        assert cold.usage.cached_tokens == 0
        assert warm.tokens == cold.tokens, name


def test_each_setting_samples_the_same_in_a_batch_as_alone(engine):
    alone = {name: tokens(engine, s) for name, s in SETTINGS.items()}
    handles = submit_together(engine, [PROMPT] * len(SETTINGS), list(SETTINGS.values()))
    batched = {name: collect(handle)[0] for name, handle in zip(SETTINGS, handles, strict=True)}
    assert batched == alone
    assert engine.loop.decode.peak_batch > 1


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"logit_bias": ((10**6, 1.0),)}, "logit_bias"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"xtc_threshold": 0.7}, "xtc_threshold"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"frequency_context_size": 0}, "frequency_context_size"),
    ],
)
def test_the_engine_refuses_values_it_cannot_honour(engine, change, param):
    with pytest.raises(InvalidRequest) as info:
        engine.submit(PROMPT, replace(GREEDY, **change))
    assert info.value.param == param
