"""The image parts of each API family's messages, read into one ImageInput
(vision/intake.py).

- OpenAI chat: `{"type": "image_url", "image_url": {"url": ..., "detail": ...}}` (the url
  also as a bare string, as some clients send it);
- Responses: `{"type": "input_image", "image_url": ..., "detail": ...}`; a `file_id` is
  refused (this server keeps no files);
- Anthropic: `{"type": "image", "source": {"type": "base64", "media_type": ..., "data":
  ...}}`, also inside a tool_result's content (Claude Code's Read tool returns a PNG
  that way); a `url` source is fetched only under --allow-image-urls, a `file` source
  refused.
Every URL is a base64 `data:` URL, or http(s) (vision/fetch.py: refused by default).
`detail` is honoured: "low" fits the image in 512 x 512 before the model's own
preprocessing (OpenAI's low-resolution mode: fewer tokens), "high" and "auto" leave it
to the model's processor (vision/family.py); it is part of the image's cache key.
"""

from __future__ import annotations

from typing import Any

from mlx_prefix.errors import InvalidRequest
from mlx_prefix.vision.fetch import fetch_image
from mlx_prefix.vision.intake import (
    DETAILS,
    Detail,
    ImageInput,
    ImageLimits,
    decode_base64,
    decode_data_url,
    media_format,
    read_image,
)


def image_from_url(
    url: Any, limits: ImageLimits, param: str, detail: Detail = "auto"
) -> ImageInput:
    if not isinstance(url, str) or not url:
        raise InvalidRequest(f"{param} must be a non-empty string URL", param=param)
    if url[:5].lower() == "data:":
        data = decode_data_url(url, limits, param)
    elif url.split(":", 1)[0].lower() in ("http", "https"):
        data = fetch_image(url, limits, param)
    else:
        raise InvalidRequest(
            f"{param} must be a data:image/...;base64 URL or an http(s) URL", param=param
        )
    return ImageInput(read_image(data, limits, param), detail)


def openai_image_part(part: dict[str, Any], limits: ImageLimits, param: str) -> ImageInput:
    """A chat completions `image_url` part."""
    value = part.get("image_url")
    if isinstance(value, str):
        return image_from_url(value, limits, f"{param}.image_url")
    if not isinstance(value, dict):
        raise InvalidRequest(
            f"{param}.image_url must be an object with a 'url'", param=f"{param}.image_url"
        )
    detail = _detail(value.get("detail"), f"{param}.image_url.detail")
    return image_from_url(value.get("url"), limits, f"{param}.image_url.url", detail)


def responses_image_part(part: dict[str, Any], limits: ImageLimits, param: str) -> ImageInput:
    """A Responses `input_image` item part."""
    if part.get("file_id") is not None:
        raise InvalidRequest(
            f"{param}.file_id: this server keeps no files; send the image as a base64 "
            "data URL in image_url",
            param=f"{param}.file_id",
        )
    detail = _detail(part.get("detail"), f"{param}.detail")
    return image_from_url(part.get("image_url"), limits, f"{param}.image_url", detail)


def anthropic_image_block(block: dict[str, Any], limits: ImageLimits, param: str) -> ImageInput:
    """An Anthropic `image` content block (in a message or a tool_result's content)."""
    source = block.get("source")
    where = f"{param}.source"
    if not isinstance(source, dict):
        raise InvalidRequest(f"{where} must be an object", param=where)
    kind = source.get("type")
    if kind == "base64":
        media = source.get("media_type")
        if not isinstance(media, str):
            raise InvalidRequest(
                f"{where}.media_type is required (image/png, image/jpeg, image/webp, image/gif)",
                param=f"{where}.media_type",
            )
        media_format(media, f"{where}.media_type")
        data = decode_base64(source.get("data"), limits, f"{where}.data")  # checks the type
        return ImageInput(read_image(data, limits, f"{where}.data"))
    if kind == "url":
        return image_from_url(source.get("url"), limits, f"{where}.url")
    if kind == "file":
        raise InvalidRequest(
            f"{where}: file sources are not supported (this server keeps no files); send "
            "the image as a base64 source",
            param=f"{where}.type",
        )
    raise InvalidRequest(
        f"{where}.type must be 'base64' or 'url', not {kind!r}", param=f"{where}.type"
    )


def _detail(value: Any, param: str) -> Detail:
    if value is None:
        return "auto"
    if value not in DETAILS:
        raise InvalidRequest(
            f"{param} must be one of {', '.join(DETAILS)}, not {value!r}", param=param
        )
    return value
