"""Prepared images kept between requests (vision/prepared.py, VisionFamily.prepare_input):
bounded in bytes, least recently used out, a plan's probes preparing each image once
whatever the cap keeps, and the images themselves kept encoded (issue 52, 2)."""

from __future__ import annotations

import base64

import mlx.core as mx
import numpy as np
from support.models import TEST_CACHE
from support.vision_models import encoded, picture, vision_model_folder

from mlx_prefix.models.load import load_model
from mlx_prefix.prompt.request.plan import PromptPlanner
from mlx_prefix.records import PromptInput
from mlx_prefix.server.protocol.messages import conversation_from_dicts
from mlx_prefix.vision.intake import ImageInput, ImageLimits, read_image
from mlx_prefix.vision.prepared import PreparedCache
from mlx_prefix.vision.tower import load_vision


def test_the_cache_holds_bytes_under_its_cap_least_recently_used_out():
    cache: PreparedCache[np.ndarray] = PreparedCache(lambda a: a.nbytes, max_bytes=10_000)
    made = []

    def make(n: int):
        def build() -> np.ndarray:
            made.append(n)
            return np.zeros(n, dtype=np.uint8)

        return build

    for i in range(20):
        cache.get(f"k{i}", make(3000))
        assert cache.held_bytes <= 10_000
    assert len(cache) == 3 and cache.held_bytes == 9000
    cache.get("k17", make(3000))  # a hit: made nothing, and is now the most recent
    cache.get("k20", make(3000))
    assert len(made) == 21 and cache.get("k17", make(1)) is not None and len(made) == 21
    cache.get("big", make(20_000))  # larger than the whole cap: made, not kept
    assert cache.held_bytes <= 10_000 and cache.get("big", make(20_000)) is not None
    assert made.count(20_000) == 2


def test_a_vision_family_keeps_prepared_images_in_bytes_and_a_plan_prepares_each_once():
    folder = vision_model_folder("qwen3_5")
    loaded = load_model(str(folder))
    family = load_vision(folder, mx.float32, loaded.tokenizer)
    assert family is not None
    images = [ImageInput(read_image(encoded(picture(64, 64, seed=i)), ImageLimits(), "p"))
              for i in range(12)]  # fmt: skip
    one = family.prepare_input(images[0]).pixel_values.nbytes
    family.prepared.max_bytes = 3 * one
    for image in images:
        family.prepare_input(image)
        assert family.prepared.held_bytes <= 3 * one
    assert len(family.prepared) == 3

    family.prepared.max_bytes = 0  # keeps nothing across requests
    prepared = []
    original = family.prepare
    family.prepare = lambda image, *more: prepared.append(image) or original(image, *more)
    url = "data:image/png;base64,{}"
    parts = [{"type": "image_url", "image_url": {"url": url.format(base64.b64encode(
        encoded(picture(64, 64, seed=100 + i))).decode())}} for i in range(2)]  # fmt: skip
    messages = conversation_from_dicts([
        {"role": "system", "content": "You read screenshots."},
        {"role": "user", "content": [parts[0], {"type": "text", "text": "This one,"}]},
        {"role": "assistant", "content": "Seen."},
        {"role": "user", "content": [parts[1], {"type": "text", "text": "and this one?"}]},
    ])  # fmt: skip
    planner = PromptPlanner(loaded.tokenizer, TEST_CACHE, vision=family)
    rendered = planner.plan(PromptInput(messages=messages))
    assert rendered.vision is not None and len(rendered.vision.spans) == 2
    assert len(prepared) == 2  # the probes rendered them again from the plan's own memo


def test_an_image_seen_the_first_time_is_decoded_once_for_its_key_and_its_preparation(
    monkeypatch,
):
    from mlx_prefix.vision import intake

    folder = vision_model_folder("qwen3_5")
    family = load_vision(folder, mx.float32, load_model(str(folder)).tokenizer)
    assert family is not None
    decodes = []
    original = intake._decode
    monkeypatch.setattr(intake, "_decode", lambda *a: decodes.append(a) or original(*a))
    item = ImageInput(read_image(encoded(picture(64, 48, seed=200)), ImageLimits(), "p"))
    prepared = family.prepare_input(item)
    assert len(decodes) == 1 and prepared.key  # the digest and the pixel values, one decode
    assert family.prepare_input(item) is prepared and len(decodes) == 1  # kept: no decode
