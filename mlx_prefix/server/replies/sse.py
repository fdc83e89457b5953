"""Server-sent events, the one writer every API family streams through.

The framing: one `data:` line of JSON per event, named after its `type` where the
family names events (Anthropic's Messages and OpenAI's Responses), unnamed where it
does not (chat and completion chunks, which end with OpenAI's `[DONE]` marker).

The response: sse-starlette's EventSourceResponse sends these bytes as they are (LF
line ends), a comment ping every PING_S seconds so that proxies keep an idle stream
open (clients skip comments), and watches for the client leaving whatever ASGI spec
version the server speaks: a disconnect cancels the stream, whose generator's
`finally` cancels the engine request. Its own shutdown drain (every stream cut as soon
as uvicorn is told to exit) is switched off: the server's graceful shutdown lets
in-flight requests finish, then cancels the rest in the engine so that each client
gets an error event rather than a cut connection (app.py).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from sse_starlette import EventSourceResponse
from sse_starlette.sse import AppStatus
from starlette.types import Receive, Scope, Send

DONE = b"data: [DONE]\n\n"  # OpenAI's chat/completion streams end with it
PING_S = 15.0

AppStatus.disable_automatic_graceful_drain()


def event(payload: dict[str, Any], named: bool = True) -> bytes:
    """One event: `event: <payload type>` (when `named`) and its JSON data."""
    data = json.dumps(payload, ensure_ascii=False)
    return (f"event: {payload['type']}\n" if named else "").encode() + f"data: {data}\n\n".encode()


def chunk(payload: dict[str, Any]) -> bytes:
    """One unnamed event (an OpenAI chat or completion chunk)."""
    return event(payload, named=False)


class SSEResponse(EventSourceResponse):
    """An event stream of already framed events that runs `on_close` however it ends
    (done, client gone, server shutdown)."""

    def __init__(
        self,
        content: AsyncIterator[bytes],
        on_close: Callable[[], None],
        *,
        media_type: str = "text/event-stream",
        ping: float | None = None,  # None: PING_S (read now, so tests can shorten it)
    ):
        # media_type and ping: replies/ndjson.py streams Ollama's lines through this too.
        super().__init__(
            content,
            headers={"Cache-Control": "no-cache"},
            media_type=media_type,
            ping=PING_S if ping is None else ping,
            sep="\n",
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except OSError:
            pass  # the client went away mid-write
        finally:
            self._on_close()
