"""Image intake (vision/intake.py): formats read from the bytes, limits checked before
decoding, every refusal an InvalidRequest naming the part; the pixel digest."""

from __future__ import annotations

import base64
import struct
import zlib

import pytest
from PIL import Image
from support.vision_models import encoded, picture

from mlx_prefix.errors import InvalidRequest
from mlx_prefix.vision import intake
from mlx_prefix.vision.intake import (
    ImageLimits,
    check_count,
    check_request,
    decode_base64,
    decode_data_url,
    decode_image,
    read_image,
)

LIMITS = ImageLimits()


@pytest.mark.parametrize(
    "fmt, kwargs",
    [("PNG", {}), ("JPEG", {"quality": 90}), ("WEBP", {"lossless": True}), ("GIF", {})],
)
def test_each_format_is_read_from_its_bytes(fmt, kwargs):
    img = decode_image(encoded(picture(40, 30), fmt, **kwargs), LIMITS, "p")
    assert (img.format, img.width, img.height) == (fmt.lower(), 40, 30)
    assert img.rgb().mode == "RGB"


def test_the_same_pixels_in_another_encoding_are_the_same_image():
    pic = picture(33, 17, seed=3)
    png = decode_image(encoded(pic, "PNG", compress_level=1), LIMITS, "p")
    webp = decode_image(encoded(pic, "WEBP", lossless=True), LIMITS, "p")
    assert png.digest == webp.digest and png == webp
    moved = decode_image(encoded(pic.transpose(Image.Transpose.TRANSPOSE)), LIMITS, "p")
    assert moved.digest != png.digest
    other = picture(33, 17, seed=4)
    assert decode_image(encoded(other), LIMITS, "p").digest != png.digest


def test_a_declared_type_is_checked_but_the_bytes_decide():
    png = encoded(picture(8, 8))
    url = "data:image/jpeg;base64," + base64.b64encode(png).decode()
    assert decode_image(decode_data_url(url, LIMITS, "u"), LIMITS, "u").format == "png"
    with pytest.raises(InvalidRequest) as e:
        decode_data_url("data:image/svg+xml;base64,PHN2Zz4=", LIMITS, "messages[0].content[1]")
    assert e.value.param == "messages[0].content[1]" and "svg" in e.value.message
    with pytest.raises(InvalidRequest, match="base64 data URL"):
        decode_data_url("data:image/png,rawbytes", LIMITS, "u")


def test_bytes_of_no_supported_format_are_refused():
    bmp = encoded(picture(8, 8), "BMP")
    with pytest.raises(InvalidRequest, match="not an image in a supported format") as e:
        decode_image(bmp, LIMITS, "source.data")
    assert e.value.param == "source.data"


def test_an_animated_gif_is_refused():
    frames = [picture(8, 8, seed=i) for i in range(3)]
    data = encoded(frames[0], "GIF", save_all=True, append_images=frames[1:])
    with pytest.raises(InvalidRequest, match="animated GIF"):
        decode_image(data, LIMITS, "p")


def test_a_multi_picture_jpeg_is_its_first_picture():
    """An MPO (a camera's stereo pair, an iPhone export's gain map) is no animation: it is
    accepted, and decodes to its first picture, as browsers show it."""
    first, second = picture(40, 30, seed=1), picture(40, 30, seed=2)
    data = encoded(first, "MPO", save_all=True, append_images=[second], quality=95)
    assert data.startswith(b"\xff\xd8\xff")
    img = decode_image(data, LIMITS, "p")
    assert (img.format, img.width, img.height) == ("jpeg", 40, 30)
    alone = decode_image(encoded(first, "JPEG", quality=95), LIMITS, "p")
    assert img.digest == alone.digest  # the first picture's pixels, as its JPEG decodes


@pytest.mark.parametrize("fmt", ["GIF", "PNG", "WEBP"])
def test_a_real_animation_is_still_refused(fmt):
    frames = [picture(8, 8, seed=i) for i in range(3)]
    data = encoded(frames[0], fmt, save_all=True, append_images=frames[1:])
    with pytest.raises(InvalidRequest, match=f"animated {fmt}"):
        read_image(data, LIMITS, "p")


def test_reading_an_image_decodes_nothing_until_its_pixels_are_asked_for(monkeypatch):
    data = encoded(picture(40, 30, seed=5))
    decoded = []
    load = Image.Image.load
    monkeypatch.setattr(Image.Image, "load", lambda self: decoded.append(1) or load(self))
    img = read_image(data, LIMITS, "messages[0].content[1]")
    assert (img.width, img.height, img.pixel_count, img.encoded_bytes) == (40, 30, 1200, len(data))
    assert not decoded and "digest" not in vars(img)
    assert img.digest == decode_image(data, LIMITS, "p").digest and decoded
    assert not any(hasattr(v, "tobytes") for v in vars(img).values())  # no pixels kept


def test_a_request_s_images_are_bounded_in_count_and_in_pixels_together():
    limits = ImageLimits(max_images=4, max_request_pixels=1000)
    params = [f"messages[{i}].content[0]" for i in range(5)]
    check_request([250, 250, 250, 250], params[:4], limits)
    with pytest.raises(InvalidRequest) as e:
        check_request([1, 1, 1, 1, 1], params, limits)
    assert e.value.code == "too_many_images" and e.value.param == params[4]
    with pytest.raises(InvalidRequest, match="1,200 pixels together") as e:
        check_request([400, 400, 400], params[:3], limits)
    assert e.value.code == "image_too_large" and e.value.param == params[2]
    assert ImageLimits().max_request_pixels == 4 * 3840 * 2160


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height with one row of data: a bomb's shape."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * (1 + 3 * min(width, 64)))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


@pytest.mark.parametrize("side", [6000, 30000])  # over our limit; over PIL's own too
def test_a_decompression_bomb_is_refused_from_its_header(monkeypatch, side):
    decoded = []
    monkeypatch.setattr(Image.Image, "load", lambda self: decoded.append(self))
    data = _png_header_only(side, side)
    assert len(data) < 1000
    with pytest.raises(InvalidRequest, match="pixels") as e:
        decode_image(data, LIMITS, "p")
    assert e.value.code == "image_too_large" and not decoded


def test_corrupt_or_truncated_data_is_a_400():
    data = encoded(picture(64, 64))
    with pytest.raises(InvalidRequest, match="corrupt or truncated"):
        decode_image(data[: len(data) // 2], LIMITS, "p")


def test_bad_base64_and_oversize_text_are_refused_before_decoding(monkeypatch):
    with pytest.raises(InvalidRequest, match="not valid base64"):
        decode_base64("not*base64!", LIMITS, "p")
    small = ImageLimits(max_bytes=1000)
    calls = []
    monkeypatch.setattr(intake.base64, "b64decode", lambda *a, **k: calls.append(a))
    with pytest.raises(InvalidRequest, match="limit of 1,000") as e:
        decode_base64("A" * 5000, small, "p")
    assert e.value.code == "image_too_large" and not calls


def test_base64_with_line_breaks_decodes():
    data = encoded(picture(8, 8))
    text = base64.encodebytes(data).decode()  # 76-character lines
    assert "\n" in text and decode_base64(text, LIMITS, "p") == data


def test_encoded_bytes_over_the_limit_are_refused():
    data = encoded(picture(64, 64))
    with pytest.raises(InvalidRequest, match="limit"):
        decode_image(data, ImageLimits(max_bytes=len(data) - 1), "p")


def test_images_per_request_are_counted():
    check_count(2, ImageLimits(max_images=2), "messages")
    with pytest.raises(InvalidRequest, match="3 images") as e:
        check_count(3, ImageLimits(max_images=2), "messages")
    assert e.value.code == "too_many_images"
