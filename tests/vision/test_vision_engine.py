"""Images through the engine: a hit computes what a miss computes, every token's logprob
bit for bit, with the restore point before, at and after an image, on a dense (Gemma 3,
all KV: trimmable) and a hybrid (Qwen3.5: recurrent layers, M-RoPE) vision model; what the
key shares and what it never shares; --deterministic batches rows with and without
images as each alone."""

from __future__ import annotations

import threading

import pytest
from support.engine_helpers import collect
from support.vision_models import SYSTEM, image, prompt, user, vision_engine

from mlx_prefix.errors import InvalidRequest
from mlx_prefix.prompt.request.render import common_prefix_length
from mlx_prefix.records import CachePreference, SamplingParams

GREEDY = SamplingParams(max_tokens=8, logprobs=True)


@pytest.fixture
def engines():
    made = []

    def make(kind):
        engine = vision_engine(kind)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.shutdown()


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


@pytest.mark.parametrize("kind", ["gemma3", "qwen3_5"])
def test_deterministic_rows_with_and_without_images_give_alone_logprobs_bit_for_bit(kind):
    """--deterministic: requests with images (two of the same size) and one without,
    arriving together, prefilled side by side and decoded in one batch, give every token's
    logprob of each run alone and cold; again from the cache, the image prompts restored
    past their image."""
    engine = vision_engine(kind, deterministic=True)
    try:
        prompts = [
            prompt(SYSTEM, user("Look:", image(7), "Describe.")),
            prompt(SYSTEM, user("Look:", image(9), "Describe.")),
            prompt(SYSTEM, user("Describe a sunset over the harbour.")),
        ]
        off = CachePreference(enabled=False)
        alone = [collect(engine.submit(p, GREEDY, off)) for p in prompts]
        for burst in range(2):
            together = _together(engine, prompts)
            for a, b in zip(alone, together, strict=True):
                assert b.tokens == a.tokens, "batching changed an answer"
                assert b.logprobs == a.logprobs, "batching changed the numbers"
            if burst:
                for p, r in zip(prompts[:2], together[:2], strict=True):
                    vision = engine.plan(p).vision
                    assert vision is not None and r.usage.cached_tokens >= vision.spans[0].end
        assert engine.loop.decode.peak_batch >= 2
    finally:
        engine.shutdown()


def _together(engine, prompts):
    """Serve `prompts` arriving together: the first prefill step waits until every one is
    submitted, whatever the machine's speed."""
    gate, step = threading.Event(), engine.loop.prefill.step

    def gated(*args, **kwargs):
        gate.wait(60)
        return step(*args, **kwargs)

    engine.loop.prefill.step = gated
    try:
        handles = [engine.submit(p, GREEDY) for p in prompts]
        gate.set()
        return [collect(h) for h in handles]
    finally:
        engine.loop.prefill.step = step


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
    first = vision_engine(kind, disk_config=disk)
    try:
        cold = answer(first, target)
    finally:
        first.shutdown()  # writes the queued saves
    files = list(tmp_path.rglob("*.safetensors"))
    assert files and all(b"IHDR" not in f.read_bytes() for f in files)  # no image bytes
    second = vision_engine(kind, disk_config=disk)
    try:
        end = second.plan(target).vision.spans[0].end
        warm = answer(second, target)
        other = answer(second, prompt(SYSTEM, user("My screen:", image(10), "What is on it?")))
    finally:
        second.shutdown()
    assert warm.usage.cached_tokens >= end and warm.tokens == cold.tokens
    assert warm.logprobs == cold.logprobs
    assert other.usage.cached_tokens <= second.plan(target).vision.spans[0].start
