"""A request's images are checked whole before any is decoded (issue 52): while the body
is parsed only each image's header is read (vision/intake.py), then routes/flow.py counts
them (--max-images), adds up their pixels (--max-request-pixels) and refuses them for a
text-only model; only a request that passed every check has an image decoded (by the
engine's plan). Through the server, for every route that takes images (OpenAI chat,
Anthropic messages and count_tokens, Responses, Ollama's /api/chat, /v1/cache/warm): the
refusal is a 400 in the family's shape naming the image past the limit, nothing is
decoded, nothing reaches the engine, and the server goes on serving."""

from __future__ import annotations

import base64
import io

import httpx
import pytest
from PIL import Image
from support.server_fakes import FakeEngine, FakeModel, serving

from mlx_prefix.vision import intake

SIDE = 4000  # 16 Mpx each: two fit the default 33,177,600, a third passes it


def flat_png(side: int = SIDE) -> str:
    """A flat grey side x side PNG: ~16 KB that decodes to side * side * 3 bytes of RGB."""
    out = io.BytesIO()
    Image.new("L", (side, side), 128).save(out, format="PNG", compress_level=9)
    return base64.b64encode(out.getvalue()).decode()


FLAT = flat_png()
SMALL = flat_png(8)


def _user(content):
    return [{"role": "user", "content": content}]


def chat(images):
    url = "data:image/png;base64,{}"
    parts = [{"type": "image_url", "image_url": {"url": url.format(b)}} for b in images]
    content = [*parts, {"type": "text", "text": "what is this?"}]
    return "/v1/chat/completions", {"model": "m", "max_tokens": 2, "messages": _user(content)}


def anthropic(images, path="/v1/messages"):
    source = {"type": "base64", "media_type": "image/png"}
    blocks = [{"type": "image", "source": {**source, "data": b}} for b in images]
    content = [*blocks, {"type": "text", "text": "what is this?"}]
    return path, {"model": "m", "max_tokens": 2, "messages": _user(content)}


def responses(images):
    parts = [{"type": "input_image", "image_url": f"data:image/png;base64,{b}"} for b in images]
    content = [*parts, {"type": "input_text", "text": "what is this?"}]
    return "/v1/responses", {"model": "m", "max_output_tokens": 2, "input": _user(content)}


def ollama(images):
    message = {"role": "user", "content": "what is this?", "images": list(images)}
    return "/api/chat", {"model": "m", "stream": False, "messages": [message]}


def count_tokens(images):
    return anthropic(images, "/v1/messages/count_tokens")


def warm(images):
    path, body = chat(images)
    return "/v1/cache/warm", {"model": "m", "messages": body["messages"]}


FAMILIES = {  # how each names its n-th image, and where its error's message is
    "chat": (chat, "messages[0].content[{n}]"),
    "anthropic": (anthropic, "messages[0].content[{n}]"),
    "count_tokens": (count_tokens, "messages[0].content[{n}]"),
    "responses": (responses, "input[0].content[{n}]"),
    "warm": (warm, "messages[0].content[{n}]"),
    "ollama": (ollama, "messages[0].images[{n}]"),
}


def error_message(family: str, r: httpx.Response) -> str:
    body = r.json()
    if family == "ollama":
        return body["error"]
    if family in ("anthropic", "count_tokens"):
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        return body["error"]["message"]
    assert body["error"]["type"] == "invalid_request_error"
    return body["error"]["message"]


def post(http: httpx.Client, request: tuple[str, dict]) -> httpx.Response:
    path, body = request
    return http.post(path, json=body)


@pytest.fixture
def decoded(monkeypatch):
    """Every image decoded in this process (the server runs in it)."""
    seen = []
    original = intake.EncodedImage.rgb

    def rgb(self):
        seen.append(self.param)
        return original(self)

    monkeypatch.setattr(intake.EncodedImage, "rgb", rgb)
    return seen


class Seeing(FakeEngine):
    """A fake engine whose model takes images, keeping every prompt it is handed (to
    generate from, to warm or to count)."""

    def __init__(self):
        super().__init__(FakeModel(vision=object()))
        self.prompts = []

    def submit(self, prompt, *args, **kwargs):
        self.prompts.append(prompt)
        return super().submit(prompt, *args, **kwargs)

    def start_warm(self, prompt, *args, **kwargs):
        self.prompts.append(prompt)
        return super().start_warm(prompt, *args, **kwargs)

    def count_tokens(self, prompt):
        self.prompts.append(prompt)
        return super().count_tokens(prompt)


@pytest.fixture(scope="module")
def seeing():
    """A server whose (fake) model takes images, default limits but four images at most."""
    with serving(Seeing(), max_images=4) as (url, engine):
        yield url, engine


@pytest.mark.parametrize("family", FAMILIES)
def test_images_past_the_request_s_pixels_are_refused_before_any_is_decoded(
    seeing, decoded, family
):
    url, engine = seeing
    body, part = FAMILIES[family]
    before = len(engine.prompts)
    with httpx.Client(base_url=url, timeout=60) as http:
        r = post(http, body([FLAT, FLAT, FLAT]))
        assert r.status_code == 400, r.text
        message = error_message(family, r)
        assert part.format(n=2) in message and "33,177,600" in message
        assert decoded == [] and len(engine.prompts) == before
        assert post(http, body([FLAT, FLAT])).status_code == 200  # two fit: served
        assert len(engine.prompts) == before + 1


@pytest.mark.parametrize("family", FAMILIES)
def test_too_many_images_are_refused_before_any_is_decoded(seeing, decoded, family):
    url, engine = seeing
    body, part = FAMILIES[family]
    before = len(engine.prompts)
    with httpx.Client(base_url=url, timeout=60) as http:
        r = post(http, body([SMALL] * 5))
    assert r.status_code == 400 and part.format(n=4) in error_message(family, r)
    assert decoded == [] and len(engine.prompts) == before


@pytest.mark.parametrize("family", FAMILIES)
def test_a_text_only_model_refuses_images_before_any_is_decoded(decoded, family):
    body, part = FAMILIES[family]
    with serving(FakeEngine()) as (url, engine), httpx.Client(base_url=url, timeout=60) as http:
        r = post(http, body([SMALL, SMALL]))
        assert r.status_code == 400
        message = error_message(family, r)
        assert part.format(n=0) in message and "text-only" in message
        assert decoded == [] and not engine.submissions
