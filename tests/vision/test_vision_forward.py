"""A prompt with images through mlx-lm's text model and mlx-vlm's tower (vision/forward.py):
the model's answer (against mlx-vlm's whole model), M-RoPE positions (against mlx-vlm's
get_rope_index), and exactness: a snapshot restored before, at or after an image, then
the rest computed on the same chunks, gives the cold run's logits bit for bit."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import BatchKVCache
from support.vision_models import encoded, picture, vision_model_folder

from mlx_prefix.cache.snapshot import capture, restore
from mlx_prefix.models.load import load_model
from mlx_prefix.vision import rope
from mlx_prefix.vision.forward import chunk_inputs, decode_positions, forward_chunk
from mlx_prefix.vision.intake import ImageLimits, decode_image
from mlx_prefix.vision.key import inside_span, salt
from mlx_prefix.vision.prompt import VisionPrompt
from mlx_prefix.vision.tower import load_vision

LIMITS = ImageLimits()


_models: dict = {}


def _vision(kind):
    if kind not in _models:
        folder = vision_model_folder(kind)
        loaded = load_model(str(folder))
        family = load_vision(folder, mx.float32, loaded.tokenizer)
        family.install(loaded.model)
        _models[kind] = loaded, family
    return _models[kind]


@pytest.fixture
def qwen():
    return _vision("qwen3_5")


@pytest.fixture(params=["qwen3_5", "gemma3"])
def vision(request):
    return _vision(request.param)


def _prompt(loaded, family, images, text="What is in these pictures?"):
    parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    messages = [
        {"role": "system", "content": "You look at pictures. " * 6},
        {"role": "user", "content": parts},
    ]
    rendered = loaded.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    ids = loaded.tokenizer.encode(rendered, add_special_tokens=False)
    prepared = [family.prepare(decode_image(encoded(im), LIMITS, "image")) for im in images]
    ids, spans = family.expand(ids, prepared)
    prompt = VisionPrompt(
        family, tuple(spans), family.table(len(ids), spans), {p.key: p for p in prepared}
    )
    return ids, salt(ids, spans), prompt


def _features(family):
    memo = {}

    def get(image):
        if image.key not in memo:
            memo[image.key] = family.features(image)
            mx.eval(memo[image.key])
        return memo[image.key]

    return get


def _chunk_ends(key, prompt, size=16):
    """Chunks of `size` with a cut at every image's start and none inside an image."""
    opens = {s.start for s in prompt.spans}
    ends = [b for b in range(1, len(key)) if (b % size == 0 or b in opens)]
    ends = [b for b in ends if not inside_span(key, b)]
    return ends + [len(key)]


def _prefill(model, prompt, key, features, cache, start, ends, on_end=None):
    logits = None
    for end in [e for e in ends if e > start]:
        inputs = chunk_inputs(model, prompt, key, start, end, features)
        logits = forward_chunk(model, prompt.family, inputs, cache)[:, -1, :]
        mx.eval(logits, [c.state for c in cache])
        if on_end is not None:
            on_end(end, cache)
        start = end
    return logits


def test_the_answer_is_mlx_vlms_and_positions_are_its_rope_index(qwen):
    from mlx_vlm.utils import load_model as vlm_load

    loaded, family = qwen
    ids, key, prompt = _prompt(loaded, family, [picture(100, 70, 1), picture(128, 96, 2)])
    assert [s.tokens for s in prompt.spans] == [6, 12]  # 4x6 and 6x8 patches, 2x2 merged
    vlm = vlm_load(vision_model_folder("qwen3_5"))
    pixels = np.concatenate([prompt.images[s.key].pixel_values for s in prompt.spans])
    grids = mx.array([prompt.images[s.key].grid for s in prompt.spans])
    ref = vlm.get_input_embeddings(mx.array(ids)[None], mx.array(pixels), image_grid_thw=grids)
    np.testing.assert_array_equal(np.array(ref.position_ids)[:, 0], prompt.table.axes)
    assert int(ref.rope_deltas.reshape(-1)[0]) == prompt.delta < 0
    expected = vlm.language_model(
        mx.array(ids)[None], inputs_embeds=ref.inputs_embeds, position_ids=ref.position_ids
    ).logits
    cache = loaded.model.make_cache()
    ours = _prefill(loaded.model, prompt, key, _features(family), cache, 0, [len(key)])
    assert mx.abs(ours - expected[:, -1]).max().item() < 1e-3
    # One-axis RoPE (mlx-lm's text model as is) answers something else.
    plain = loaded.model(mx.array(ids)[None], input_embeddings=ref.inputs_embeds)[:, -1]
    assert mx.abs(plain - expected[:, -1]).max().item() > 1e-2


@pytest.mark.parametrize("where", ["before", "at", "after"])
def test_a_snapshot_before_at_or_after_an_image_restores_bit_for_bit(vision, where):
    loaded, family = vision
    model = loaded.model
    _, key, prompt = _prompt(loaded, family, [picture(120, 90, 3)], "Describe it. " * 8)
    span = prompt.spans[0]
    ends = _chunk_ends(key, prompt)
    assert span.start in ends and not [e for e in ends if span.start < e < span.end]
    features = _features(family)
    snaps = {}
    cold = _prefill(
        model, prompt, key, features, model.make_cache(), 0, ends,
        lambda end, cache: snaps.__setitem__(end, capture(cache, end)),
    )  # fmt: skip
    point = {
        "before": max(e for e in ends if e < span.start),
        "at": span.start,
        "after": min(e for e in ends if e >= span.end),
    }[where]
    warm = _prefill(model, prompt, key, features, restore(snaps[point]), point, ends)
    assert mx.array_equal(warm, cold)
    # The next token's step too: decode rotates at offset + delta.
    token = mx.argmax(cold, axis=-1)[:, None]
    cache_cold, cache_warm = restore(snaps[ends[-1]]), restore(snaps[ends[-1]])
    with rope.positions(decode_positions([prompt.delta])):
        a = model(token, cache=cache_cold)
        b = model(token, cache=cache_warm)
    assert mx.array_equal(a, b)


def test_two_images_of_one_size_share_ids_and_positions_but_not_key_or_answer(vision):
    loaded, family = vision
    ids_a, key_a, prompt_a = _prompt(loaded, family, [picture(80, 80, 4)])
    ids_b, key_b, prompt_b = _prompt(loaded, family, [picture(80, 80, 5)])
    assert ids_a == ids_b
    np.testing.assert_array_equal(prompt_a.table.axes, prompt_b.table.axes)
    start = prompt_a.spans[0].start
    assert key_a[:start] == key_b[:start] and key_a[start] != key_b[start]
    logits = [
        _prefill(loaded.model, p, k, _features(family), loaded.model.make_cache(), 0, [len(k)])
        for p, k in ((prompt_a, key_a), (prompt_b, key_b))
    ]
    assert not mx.array_equal(*logits)
    # The same picture sent again (another encoding of the same pixels) is the same key.
    _, key_again, _ = _prompt(loaded, family, [picture(80, 80, 4)])
    assert key_again == key_a


def test_a_batched_decode_step_rotates_each_row_at_its_own_delta(qwen):
    loaded, family = qwen
    model = loaded.model
    layer = next(layer.self_attn for layer in model.layers if hasattr(layer, "self_attn"))
    x = mx.random.normal((2, 4, 1, 16))
    alone = []
    for row, (offset, delta) in enumerate(((7, -3), (5, 0))):
        with rope.positions(decode_positions([delta])):
            alone.append(layer.rope(x[row : row + 1], offset=offset))
    batch = BatchKVCache([0, 0])
    batch.offset = mx.array([7, 5])
    with rope.positions(decode_positions([-3, 0])):
        both = layer.rope(x, offset=batch.offset)
    assert mx.allclose(both, mx.concatenate(alone), atol=1e-6)
    # Each row turned at its offset plus its own delta: row 0 as the layer's own RoPE
    # turns position 7 - 3, not 7 (a shift ignored, or one row's used for both, fails).
    assert isinstance(layer.rope, rope.PositionedRoPE)
    inner = layer.rope.rope
    assert mx.allclose(alone[0], inner(x[0:1], offset=4), atol=1e-6)
    assert not mx.allclose(alone[0], inner(x[0:1], offset=7), atol=1e-3)
    assert mx.allclose(both[1:], inner(x[1:2], offset=5), atol=1e-6)
    assert not mx.allclose(both[1:], inner(x[1:2], offset=2), atol=1e-3)


def test_gemma_images_attend_both_ways_and_text_before_them_is_unchanged():
    loaded, family = _vision("gemma3")
    model = loaded.model
    _, key, prompt = _prompt(loaded, family, [picture(50, 40, 6)], "And this?")
    span = prompt.spans[0]
    inputs = chunk_inputs(model, prompt, key, 0, len(key), _features(family))
    assert inputs.blocks == ((span.start, span.end),)
    both = forward_chunk(model, family, inputs, model.make_cache())
    # Fresh inputs: gemma3_text scales its input embeddings in place (h *= ...).
    again = chunk_inputs(model, prompt, key, 0, len(key), _features(family))
    causal = model(again.ids, cache=model.make_cache(), input_embeddings=again.embeddings)
    before = slice(0, span.start)
    assert mx.allclose(both[:, before], causal[:, before], atol=1e-5)
    assert not mx.allclose(both[:, span.start], causal[:, span.start], atol=1e-4)


def test_the_feature_cache_serves_an_image_once_computed_and_stays_in_its_bytes(qwen):
    from mlx_prefix.vision.features import FeatureCache

    loaded, family = qwen
    images = [
        family.prepare(decode_image(encoded(picture(64, 64, s)), LIMITS, "p")) for s in (7, 8, 9)
    ]
    one = family.features(images[0]).nbytes  # 4 tokens x 128 floats
    cache = FeatureCache(family, max_bytes=2 * one)
    first = cache(images[0])
    assert mx.array_equal(cache(images[0]), first) and cache.stats().hits == 1
    cache(images[1])
    cache(images[2])  # evicts images[0], the least recently used
    stats = cache.stats()
    assert (stats.entries, stats.nbytes, stats.misses) == (2, 2 * one, 3)
    assert mx.array_equal(cache(images[0]), first) and cache.stats().misses == 4
