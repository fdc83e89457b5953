"""Newline-delimited JSON, the streaming format of Ollama's API: one JSON object per
line (`application/x-ndjson`), no event framing and no keep-alive pings (a client parses
every line as JSON, so a comment line would break it).

The lines go out through replies/sse.py's response, which watches for the client leaving
whatever ASGI spec version the server speaks: a disconnect cancels the stream, whose
generator's `finally` cancels the engine request, as on the SSE routes."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from .sse import SSEResponse

MEDIA_TYPE = "application/x-ndjson"


def line(payload: dict[str, Any]) -> bytes:
    """One object on one line, compact as Ollama writes it (JSON escapes any newline
    inside a string, so the object never spans two lines)."""
    return (json.dumps(payload, ensure_ascii=False, separators=(",", ":")) + "\n").encode()


class NDJSONResponse(SSEResponse):
    """A stream of already encoded lines that runs `on_close` however it ends."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]):
        super().__init__(content, on_close, media_type=MEDIA_TYPE, ping=0)
