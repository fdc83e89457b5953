"""An image a request carries: its bytes decoded under limits, its content hashed.

What comes in is base64 (a `data:` URL or Anthropic's base64 source) or, with the
operator's --allow-image-urls, bytes fetched by vision/fetch.py; either way it arrives
here as bytes, and this module alone turns bytes into pixels, in two steps:
- `read_image`, while the body is parsed: the encoded size is checked before decoding
  (base64 text before it is decoded); the format is read from the bytes (magic numbers),
  never from a declared media type or a file name: PNG, JPEG, WebP and GIF; the header's
  width and height are read and the pixel count checked; an animated GIF, PNG or WebP is
  refused (one image is one still picture), a multi-picture JPEG (MPO: an iPhone's
  gain map, a camera's second view) is its first picture, as a browser shows it. Nothing
  is decoded: the result (EncodedImage) holds the bytes and what the header says;
- `check_request`, once the whole request is read (the server's routes/flow.py): the
  count (--max-images) and the pixels of all its images together (--max-request-pixels),
  so a body of many small-looking files that decode to gigabytes is refused unread;
- decoding (`EncodedImage.rgb`), only after every check passed: RGB (mlx-vlm's processors
  convert the same), JPEG's EXIF orientation applied (as a browser shows it). Decoded
  pixels are never kept: the digest is computed once, and the tower's preparation
  decodes again when it needs them (vision/tower.py), so a stored image costs its encoded
  bytes, not width x height x 3.
Every refusal is an InvalidRequest naming the request's part (`param`), so each API
family answers a 400 in its own shape.

`pixel_digest` is the image's identity for the cache: a hash of its size and RGB pixels,
so the same picture re-encoded (another PNG compressor, base64 line breaks) is the same
image, and any changed pixel is another one (vision/key.py adds how it was processed).
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import io
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from mlx_prefix.errors import InvalidRequest

FORMATS = ("png", "jpeg", "webp", "gif")
MEDIA_TYPES = {f"image/{f}": f for f in FORMATS} | {"image/jpg": "jpeg"}


@dataclass(frozen=True, slots=True)
class ImageLimits:
    """What one request may send (`serve --image-*` flags; config.py maps them)."""

    max_bytes: int = 20 * 1024 * 1024  # encoded, per image
    max_pixels: int = 32_000_000  # width x height, per image, read from the header
    max_images: int = 32  # per request, the history's included
    # All a request's images together (the history's included), from their headers:
    # four 4K screenshots (3840 x 2160 each). What a request may make the server decode
    # (~100 MB of RGB), whatever the count and the encoded sizes say.
    max_request_pixels: int = 4 * 3840 * 2160
    allow_urls: bool = False  # --allow-image-urls: fetch http(s) URLs (vision/fetch.py)
    fetch_timeout_s: float = 10.0  # the whole fetch of one URL


@dataclass(frozen=True, eq=False)
class EncodedImage:
    """An image as sent: its bytes and what their header says, checked; decoded only by
    `rgb` (and once for `digest`), never kept decoded. Equal when the pixels are."""

    format: str  # one of FORMATS, read from the bytes
    width: int  # from the header (before a JPEG's EXIF orientation)
    height: int
    data: bytes = field(repr=False)
    param: str = ""  # the request part it came from, named by a decoding failure

    @property
    def pixel_count(self) -> int:
        return self.width * self.height

    @property
    def encoded_bytes(self) -> int:
        return len(self.data)

    def rgb(self) -> Any:
        """The still picture in RGB (a PIL image), decoded now (the digest taken from it
        too, the first time); InvalidRequest naming `param` when the data is corrupt or
        truncated."""
        picture = _decode(self.data, self.format, self.param)
        if not self.digested:
            self.__dict__["digest"] = pixel_digest(picture)  # the cached_property's slot
        return picture

    @functools.cached_property
    def digest(self) -> str:
        """pixel_digest of the picture, computed once (a decode)."""
        self.rgb()
        return str(self.__dict__["digest"])

    @property
    def digested(self) -> bool:
        """Whether the digest is known (the image was decoded once)."""
        return "digest" in self.__dict__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EncodedImage) and other.digest == self.digest

    def __hash__(self) -> int:
        return hash(self.digest)


_DATA_URL = re.compile(r"data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^,;]*)*?);base64,", re.I)
_SPACE = re.compile(rb"[\s]+")


def sniff(data: bytes) -> str | None:
    """The format the bytes are in (FORMATS), from their magic numbers; None if none."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if data.startswith(b"\xff\xd8\xff"):
        return "jpeg"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "gif"
    return None


def media_format(media_type: str, param: str) -> str:
    """A declared media type, checked: it must name a supported format (the bytes still
    decide how they are read)."""
    fmt = MEDIA_TYPES.get(media_type.strip().lower())
    if fmt is None:
        raise InvalidRequest(
            f"{param}: media type {media_type!r} is not supported; send "
            f"{', '.join(sorted(MEDIA_TYPES))}",
            param=param,
        )
    return fmt


def decode_base64(text: Any, limits: ImageLimits, param: str) -> bytes:
    """Base64 text (line breaks allowed) to bytes, its size checked before decoding."""
    if not isinstance(text, str) or not text:
        raise InvalidRequest(f"{param} must be a non-empty base64 string", param=param)
    raw = text.encode("ascii", "replace")
    if len(raw) > (limits.max_bytes + 2) // 3 * 4 + len(raw) // 76 * 2 + 4:
        raise _too_large(param, limits, at_least=len(raw) * 3 // 4)
    try:
        data = base64.b64decode(_SPACE.sub(b"", raw), validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(f"{param} is not valid base64", param=param) from None
    if len(data) > limits.max_bytes:
        raise _too_large(param, limits, at_least=len(data))
    return data


def decode_data_url(url: str, limits: ImageLimits, param: str) -> bytes:
    """A `data:image/...;base64,...` URL to bytes (the media type, when given, checked)."""
    m = _DATA_URL.match(url)
    if m is None:
        raise InvalidRequest(
            f"{param} must be a base64 data URL (data:image/png;base64,...)", param=param
        )
    if m.group("type"):
        media_format(m.group("type"), param)
    return decode_base64(url[m.end() :], limits, param)


def read_image(data: bytes, limits: ImageLimits, param: str) -> EncodedImage:
    """Bytes to an EncodedImage under `limits`, reading only the header (nothing is
    decoded); InvalidRequest naming `param` otherwise."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > limits.max_bytes:
        raise _too_large(param, limits, at_least=len(data))
    fmt = sniff(data)
    if fmt is None:
        raise InvalidRequest(
            f"{param}: the bytes are not an image in a supported format "
            f"({', '.join(f.upper() for f in FORMATS)})",
            param=param,
        )
    try:
        with warnings.catch_warnings():
            # PIL warns on big images itself; the limit below decides instead.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=[fmt.upper()])
            width, height = img.size  # from the header: nothing decoded yet
            if width <= 0 or height <= 0:
                raise InvalidRequest(f"{param}: the image has no pixels", param=param)
            if width * height > limits.max_pixels:
                raise InvalidRequest(
                    f"{param}: the image is {width}x{height} = {width * height:,} pixels, "
                    f"more than the server's limit of {limits.max_pixels:,}",
                    param=param,
                    code="image_too_large",
                )
            # A JPEG holding more pictures (MPO: a gain map, a stereo pair) is no
            # animation: its first picture is the image, as browsers show it.
            if fmt != "jpeg" and getattr(img, "n_frames", 1) > 1:
                raise InvalidRequest(
                    f"{param}: an animated {fmt.upper()} is not supported; send a still image",
                    param=param,
                )
    except InvalidRequest:
        raise
    except Image.DecompressionBombError:  # past PIL's own limit, at open
        raise InvalidRequest(
            f"{param}: the image has more pixels than the server's limit of {limits.max_pixels:,}",
            param=param,
            code="image_too_large",
        ) from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        raise _corrupt(param, fmt) from None
    return EncodedImage(format=fmt, width=width, height=height, data=data, param=param)


def decode_image(data: bytes, limits: ImageLimits, param: str) -> EncodedImage:
    """read_image, then decoded at once (its digest computed): for one image on its own
    (`generate --image`), where no request's other images are to be checked first."""
    image = read_image(data, limits, param)
    image.digest  # noqa: B018  (decodes: a corrupt file is refused here)
    return image


def check_request(pixels: Sequence[int], params: Sequence[str], limits: ImageLimits) -> None:
    """A whole request's images, from their headers, before any is decoded: at most
    `max_images` of them and `max_request_pixels` pixels together. The refusal names the
    first image past the limit (`params[i]` is image i's part)."""
    if len(pixels) > limits.max_images:
        check_count(len(pixels), limits, params[limits.max_images])
    total = 0
    for count, param in zip(pixels, params, strict=True):
        total += count
        if total > limits.max_request_pixels:
            raise InvalidRequest(
                f"{param}: the request's images hold {sum(pixels):,} pixels together, more "
                f"than the server's limit of {limits.max_request_pixels:,} per request "
                "(--max-request-pixels); send fewer or smaller images",
                param=param,
                code="image_too_large",
            )


def _decode(data: bytes, fmt: str, param: str) -> Any:
    from PIL import Image, ImageOps, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=[fmt.upper()])
            img.load()  # an MPO's first picture: the frame open stands on
            still: Image.Image = img
            if fmt == "jpeg":
                still = ImageOps.exif_transpose(img)
            return still.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        raise _corrupt(param, fmt) from None


def _corrupt(param: str, fmt: str) -> InvalidRequest:
    return InvalidRequest(f"{param}: the {fmt.upper()} data is corrupt or truncated", param=param)


def pixel_digest(rgb: object) -> str:
    """sha256 over the picture's size and RGB bytes (row-major), hex."""
    h = hashlib.sha256(b"mlx-prefix-image-v1")
    h.update(f"{rgb.width}x{rgb.height};RGB;".encode())  # type: ignore[attr-defined]
    h.update(rgb.tobytes())  # type: ignore[attr-defined]
    return h.hexdigest()


def check_count(count: int, limits: ImageLimits, param: str) -> None:
    if count > limits.max_images:
        raise InvalidRequest(
            f"{param}: {count} images in one request, more than the server's limit of "
            f"{limits.max_images}",
            param=param,
            code="too_many_images",
        )


def _too_large(param: str, limits: ImageLimits, at_least: int) -> InvalidRequest:
    return InvalidRequest(
        f"{param}: the image is at least {at_least:,} bytes, more than the server's limit of "
        f"{limits.max_bytes:,}",
        param=param,
        code="image_too_large",
    )


Detail = Literal["auto", "low", "high"]
DETAILS: tuple[Detail, ...] = ("auto", "low", "high")


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One image of a message, as the model will be given it (its header read and
    checked; decoded once every image of the request passed: vision/intake.py)."""

    image: EncodedImage
    detail: Detail = "auto"

    @property
    def identity(self) -> str:
        """What makes two inputs the same image for the model (the cache key's source)."""
        return f"{self.image.digest};detail={'low' if self.detail == 'low' else 'auto'}"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ImageInput) and other.identity == self.identity

    def __hash__(self) -> int:
        return hash(self.identity)
