"""The request body, read once for every route that takes one: JSON only from a page (the
second fence after the origin check), under the server's size limit whatever the
headers say, parsed into one JSON object (lone surrogates refused: protocol/fields.py)."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from ..errors import PayloadTooLarge, UnsupportedMediaType
from ..protocol.fields import parse_json_object


async def read_json(request: Request) -> dict[str, Any]:
    # A browser page must send JSON: a form or text/plain body is what a page can send
    # without a preflight (refused origins never get here; this is the second fence).
    # Other clients (`curl -d`, scripts) often omit the header: their body is parsed as
    # JSON whatever it says.
    content_type = request.headers.get("content-type", "")
    from_page = "origin" in request.headers
    if from_page and content_type.partition(";")[0].strip().lower() != "application/json":
        raise UnsupportedMediaType(
            "send the request body as JSON with 'Content-Type: application/json'"
            + (f" (got {content_type!r})" if content_type else " (none was sent)")
        )
    limit = request.app.state.server.settings.max_body_bytes  # routes/common.ServerState
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body is {declared} bytes; the limit is {limit}")
    # Content-Length may be absent (chunked) or lie, so count what actually arrives.
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return parse_json_object(b"".join(chunks))
