"""Each API family's image parts read into ImageInput (server/protocol/images.py): the shapes the
SDKs send, detail honoured, file ids and (without the flag) URLs refused naming the field,
with the network monkeypatched to prove nothing is fetched."""

from __future__ import annotations

import base64
import socket

import pytest
from support.vision_models import encoded, picture

from mlx_prefix.errors import InvalidRequest
from mlx_prefix.server.protocol.images import (
    anthropic_image_block,
    openai_image_part,
    responses_image_part,
)
from mlx_prefix.vision.family import low_detail
from mlx_prefix.vision.intake import ImageLimits

LIMITS = ImageLimits()
PNG = encoded(picture(20, 10))
B64 = base64.b64encode(PNG).decode()
DATA_URL = "data:image/png;base64," + B64


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"network touched: {args}")

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


def test_the_three_families_shapes_give_the_same_image():
    chat = openai_image_part({"type": "image_url", "image_url": {"url": DATA_URL}}, LIMITS, "p")
    bare = openai_image_part({"type": "image_url", "image_url": DATA_URL}, LIMITS, "p")
    resp = responses_image_part(
        {"type": "input_image", "image_url": DATA_URL, "detail": "auto"}, LIMITS, "p"
    )
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": B64}}
    claude = anthropic_image_block(block, LIMITS, "p")
    assert chat == bare == resp == claude
    assert (chat.image.width, chat.image.height) == (20, 10)


def test_detail_is_honoured_and_low_is_another_image_for_the_cache():
    part = {"type": "image_url", "image_url": {"url": DATA_URL, "detail": "low"}}
    low = openai_image_part(part, LIMITS, "p")
    high = openai_image_part(
        {**part, "image_url": {"url": DATA_URL, "detail": "high"}}, LIMITS, "p"
    )
    assert low.detail == "low" and low != high
    big = openai_image_part(
        {"image_url": {"url": "data:image/png;base64,"
                       + base64.b64encode(encoded(picture(1200, 600))).decode()}},
        LIMITS, "p",
    )  # fmt: skip
    assert low_detail(big.image.rgb()).size == (512, 256)
    with pytest.raises(InvalidRequest) as e:
        openai_image_part({"image_url": {"url": DATA_URL, "detail": "max"}}, LIMITS, "m[0]")
    assert e.value.param == "m[0].image_url.detail"


@pytest.mark.parametrize(
    "read, part, param",
    [
        (openai_image_part, {"image_url": {"url": "https://example.com/a.png"}},
         "m.image_url.url"),
        (responses_image_part, {"image_url": "http://169.254.169.254/latest"}, "m.image_url"),
        (responses_image_part, {"file_id": "file-123"}, "m.file_id"),
        (anthropic_image_block, {"source": {"type": "url", "url": "https://a.test/x.png"}},
         "m.source.url"),
        (anthropic_image_block, {"source": {"type": "file", "file_id": "f"}}, "m.source.type"),
        (anthropic_image_block, {"source": {"type": "base64", "media_type": "image/png",
                                            "data": "%%%"}}, "m.source.data"),
        (anthropic_image_block, {"source": {"type": "base64", "media_type": "text/plain",
                                            "data": B64}}, "m.source.media_type"),
        (openai_image_part, {"image_url": {"url": "ftp://a/b.png"}}, "m.image_url.url"),
    ],
)  # fmt: skip
def test_refusals_name_the_field_and_fetch_nothing(read, part, param):
    with pytest.raises(InvalidRequest) as e:
        read(part, LIMITS, "m")
    assert e.value.param == param
