"""Images through the engine: a hit computes what a miss computes, every token's logprob
bit for bit, with the restore point before, at and after an image, on a dense (Gemma 3,
all KV: trimmable) and a hybrid (Qwen3.5: recurrent layers, M-RoPE) vision model; what the
key shares and what it never shares; batching rows with and without images."""

from __future__ import annotations

import base64

import pytest
from conftest import TEST_CACHE
from engine_helpers import collect
from vision_models import encoded, picture, vision_model_folder

from mlx_prefix.config import EngineConfig
from mlx_prefix.conversation import conversation_from_dicts
from mlx_prefix.engine.engine import Engine
from mlx_prefix.errors import InvalidRequest
from mlx_prefix.models.load import load_model
from mlx_prefix.prompt.request.render import common_prefix_length
from mlx_prefix.records import PromptInput, SamplingParams

GREEDY = SamplingParams(max_tokens=8, logprobs=True)
_loaded: dict = {}


def loaded(kind):
    if kind not in _loaded:
        _loaded[kind] = load_model(str(vision_model_folder(kind)))
    return _loaded[kind]


@pytest.fixture
def engines():
    made = []

    def make(kind):
        engine = Engine(loaded(kind), TEST_CACHE, EngineConfig(prefetch_next_turn=False))
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.shutdown()


def image(seed, size=(96, 64)):
    url = "data:image/png;base64," + base64.b64encode(encoded(picture(*size, seed=seed))).decode()
    return {"type": "image_url", "image_url": {"url": url}}


SYSTEM = {"role": "system", "content": "You read screenshots for a developer. " * 4}


def prompt(*messages) -> PromptInput:
    return PromptInput(messages=conversation_from_dicts(list(messages)))


def user(*parts):
    return {
        "role": "user",
        "content": [p if isinstance(p, dict) else {"type": "text", "text": p} for p in parts],
    }


def answer(engine, p, sampling=GREEDY):
    return collect(engine.submit(p, sampling))


@pytest.mark.parametrize("kind", ["gemma3", "qwen3_5"])
@pytest.mark.parametrize("where", ["before", "at", "after"])
def test_a_hit_computes_what_a_miss_computes(engines, kind, where):
    target = prompt(SYSTEM, user("Here is my screen:", image(1), "What is wrong with it? " * 3))
    cold = answer(engines(kind), target)
    assert cold.usage.cached_tokens == 0
    engine = engines(kind)
    span = engine.plan(target).vision.spans[0]
    earlier = {
        "before": prompt(SYSTEM, user("Here is my screen: nothing to see")),
        "at": prompt(SYSTEM, user("Here is my screen:", image(2), "What is wrong with it?")),
        "after": prompt(SYSTEM, user("Here is my screen:", image(1), "Describe the colours.")),
    }[where]
    answer(engine, earlier, SamplingParams(max_tokens=1))
    warm = answer(engine, target)
    reused = warm.usage.cached_tokens
    assert reused > 0
    if where == "before":
        assert reused < span.start
    elif where == "at":
        assert reused == span.start  # the other image shares everything up to its start
    else:
        assert reused >= span.end
    assert warm.tokens == cold.tokens and warm.logprobs == cold.logprobs


@pytest.mark.parametrize("kind", ["gemma3", "qwen3_5"])
def test_another_image_of_the_same_size_never_reuses_past_its_start(engines, kind):
    engine = engines(kind)
    first = prompt(SYSTEM, user("Page:", image(3), "Which page number is shown?"))
    second = prompt(SYSTEM, user("Page:", image(4), "Which page number is shown?"))
    start = engine.plan(first).vision.spans[0].start
    assert engine.plan(second).vision.spans[0].start == start
    answer(engine, first)
    again = answer(engine, second)
    assert 0 < again.usage.cached_tokens <= start
    same = answer(engine, first)  # the byte-identical resend hits past the image
    assert same.usage.cached_tokens > engine.plan(first).vision.spans[0].end


@pytest.mark.parametrize("kind", ["gemma3", "qwen3_5"])
def test_a_new_image_in_turn_three_reuses_turns_one_and_two(engines, kind):
    engine = engines(kind)
    turn1 = [SYSTEM, user("What does this screen show?", image(5, (160, 96)))]
    r1 = answer(engine, prompt(*turn1))
    turn2 = turn1 + [{"role": "assistant", "content": r1.text}, user("Which option is on?")]
    r2 = answer(engine, prompt(*turn2))
    first_end = engine.plan(prompt(*turn1)).vision.spans[0].end
    assert r2.usage.cached_tokens >= first_end
    turn3 = turn2 + [{"role": "assistant", "content": r2.text}, user("Now?", image(6, (160, 96)))]
    p3 = prompt(*turn3)
    r3 = answer(engine, p3)
    # Turns 1-2 from the cache: turn 2's prompt up to its generation prompt (the reply's
    # own state is never stored: invariant 12).
    shared = common_prefix_length(engine.plan(prompt(*turn2)).tokens, engine.plan(p3).tokens)
    assert shared >= r2.usage.prompt_tokens - 8
    assert r3.usage.cached_tokens >= shared - 8
    cold = answer(engines(kind), p3)
    assert r3.tokens == cold.tokens and r3.logprobs == cold.logprobs


def test_rows_with_and_without_images_decode_together_each_as_alone(engines):
    engine = engines("qwen3_5")
    with_image = prompt(SYSTEM, user("Look:", image(7), "Describe."))
    text_only = prompt(SYSTEM, user("Describe a sunset."))
    alone = [answer(engines("qwen3_5"), p) for p in (with_image, text_only)]
    handles = [engine.submit(p, GREEDY) for p in (with_image, text_only)]
    together = [collect(h) for h in handles]
    for a, b in zip(alone, together, strict=True):
        assert a.tokens == b.tokens


def test_an_image_prompt_refuses_draft_tokens_it_cannot_use(engines):
    engine = engines("qwen3_5")
    p = prompt(user("Look:", image(8)))
    with pytest.raises(InvalidRequest) as e:
        engine.submit(p, SamplingParams(max_tokens=2, num_draft_tokens=4))
    assert e.value.param == "num_draft_tokens"


@pytest.mark.parametrize("kind", ["gemma3", "qwen3_5"])
def test_the_disk_tier_keeps_image_keys_across_a_restart(tmp_path, kind):
    from mlx_prefix.config import DiskConfig

    disk = DiskConfig(scope="full", directory=str(tmp_path), min_tokens=16)
    target = prompt(SYSTEM, user("My screen:", image(9), "What is on it?"))
    first = Engine(
        loaded(kind), TEST_CACHE, EngineConfig(prefetch_next_turn=False), disk_config=disk
    )
    try:
        cold = answer(first, target)
    finally:
        first.shutdown()  # writes the queued saves
    files = list(tmp_path.rglob("*.safetensors"))
    assert files and all(b"IHDR" not in f.read_bytes() for f in files)  # no image bytes
    second = Engine(
        loaded(kind), TEST_CACHE, EngineConfig(prefetch_next_turn=False), disk_config=disk
    )
    try:
        end = second.plan(target).vision.spans[0].end
        warm = answer(second, target)
        other = answer(second, prompt(SYSTEM, user("My screen:", image(10), "What is on it?")))
    finally:
        second.shutdown()
    assert warm.usage.cached_tokens >= end and warm.tokens == cold.tokens
    assert warm.logprobs == cold.logprobs
    assert other.usage.cached_tokens <= second.plan(target).vision.spans[0].start
