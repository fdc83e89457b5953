"""A conversation with images planned into its cache key (prompt/request/plan.py with a
vision model): spans salted with the image's key, the chunk grid and every checkpoint out
of every span, an image's start on the grid; what shares and what does not."""

from __future__ import annotations

import base64
import random

import mlx.core as mx
import pytest
from PIL import Image
from support.models import TEST_CACHE
from support.vision_models import encoded, picture, vision_model_folder

from mlx_prefix.models.load import load_model
from mlx_prefix.prompt.request.plan import PromptPlanner
from mlx_prefix.prompt.request.render import common_prefix_length
from mlx_prefix.records import PromptInput
from mlx_prefix.server.protocol.messages import conversation_from_dicts
from mlx_prefix.vision.key import inside_span
from mlx_prefix.vision.tower import load_vision

_planners: dict = {}


def planner(kind: str = "qwen3_5") -> PromptPlanner:
    if kind not in _planners:
        folder = vision_model_folder(kind)
        loaded = load_model(str(folder))
        family = load_vision(folder, mx.float32, loaded.tokenizer)
        _planners[kind] = PromptPlanner(loaded.tokenizer, TEST_CACHE, vision=family)
    return _planners[kind]


def image_part(img: Image.Image, detail: str | None = None) -> dict:
    url = "data:image/png;base64," + base64.b64encode(encoded(img)).decode()
    body = {"url": url} | ({"detail": detail} if detail else {})
    return {"type": "image_url", "image_url": body}


def user(*parts) -> dict:
    return {
        "role": "user",
        "content": [p if isinstance(p, dict) else {"type": "text", "text": p} for p in parts],
    }


SYSTEM = {"role": "system", "content": "You are a careful assistant who reads screenshots. " * 3}


def plan(*messages, kind="qwen3_5"):
    return planner(kind).plan(PromptInput(messages=conversation_from_dicts(list(messages))))


def check_grid(rendered, kind="qwen3_5"):
    grid = planner(kind).grid
    tokens = rendered.tokens
    spans = rendered.vision.spans
    for s in spans:
        assert grid.is_point(tokens, s.start), "an image's start is a grid point"
        assert not any(grid.is_point(tokens, b) for b in range(s.start + 1, s.end))
    for cp in rendered.checkpoints:
        assert not any(s.start < cp.position < s.end for s in spans)
        assert grid.is_point(tokens, cp.position)
    for b in grid.points(tokens):
        assert not inside_span(tokens, b)


@pytest.mark.parametrize("kind", ["qwen3_5", "gemma3"])
def test_no_grid_point_or_checkpoint_falls_inside_an_image(kind):
    rng = random.Random(7)
    for trial in range(12):
        messages = [SYSTEM]
        for turn in range(rng.randint(1, 3)):
            parts = []
            for _ in range(rng.randint(1, 3)):
                if rng.random() < 0.5:
                    size = (rng.choice([32, 64, 96, 160]), rng.choice([32, 64, 128]))
                    parts.append(image_part(picture(*size, seed=trial * 10 + turn)))
                else:
                    parts.append("word " * rng.randint(1, 40))
            messages.append(user(*parts))
            messages.append({"role": "assistant", "content": "Seen. " * rng.randint(1, 9)})
        messages.append(user(image_part(picture(64, 64, seed=trial)), "And this one?"))
        rendered = plan(*messages, kind=kind)
        assert rendered.vision is not None and rendered.vision.spans
        check_grid(rendered, kind)


def test_the_key_holds_the_image():
    first = picture(96, 64, seed=1)
    same_size = picture(96, 64, seed=2)
    a = plan(SYSTEM, user("Compare:", image_part(first), "with", image_part(same_size)))
    start = a.vision.spans[0].start
    resend = plan(SYSTEM, user("Compare:", image_part(first), "with", image_part(same_size)))
    assert resend.tokens == a.tokens
    other = plan(SYSTEM, user("Compare:", image_part(same_size), "with", image_part(first)))
    assert common_prefix_length(a.tokens, other.tokens) == start  # swapped order
    moved = plan(SYSTEM, user("Compare:", image_part(first.transpose(Image.Transpose.TRANSPOSE)),
                              "with", image_part(same_size)))  # fmt: skip
    assert common_prefix_length(a.tokens, moved.tokens) == start
    low = plan(SYSTEM, user("Compare:", image_part(first, "low"), "with", image_part(same_size)))
    assert common_prefix_length(a.tokens, low.tokens) == start  # another detail
    # Text before the first image is shared with a text-only prompt.
    text_only = plan(SYSTEM, user("Compare: the two"))
    assert common_prefix_length(a.tokens, text_only.tokens) >= start - 3


def test_a_new_image_in_turn_three_keeps_turns_one_and_two():
    shot = image_part(picture(160, 96, seed=3))
    turn1 = [SYSTEM, user("What does this screen show?", shot)]
    turn2 = turn1 + [{"role": "assistant", "content": "A settings page."},
                     user("Which option is selected?")]  # fmt: skip
    turn3 = turn2 + [{"role": "assistant", "content": "Dark mode."},
                     user("And now?", image_part(picture(160, 96, seed=4)))]  # fmt: skip
    p1, p2, p3 = plan(*turn1), plan(*turn2), plan(*turn3)
    assert len(p3.vision.spans) == 2 and p3.vision.spans[0] == p1.vision.spans[0]
    shared_12 = common_prefix_length(p1.tokens, p2.tokens)
    assert shared_12 >= p1.vision.spans[0].end  # turn 2 reads turn 1's image from the cache
    assert common_prefix_length(p2.tokens, p3.tokens) >= len(p2.tokens) - 8
    check_grid(p3)
    # Positions follow the images: text after the first image is shifted, the second
    # image shifts it further.
    deltas = [p.vision.delta for p in (p1, p3)]
    assert deltas[1] < deltas[0] < 0


def test_too_many_placeholders_is_a_400_naming_messages():
    from mlx_prefix.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="placeholders") as e:
        plan(SYSTEM, user("<|image_pad|> sneaks in", image_part(picture(32, 32))))
    assert e.value.param == "messages"
