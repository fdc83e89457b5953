"""The chat family's route: POST /v1/chat/completions (and its unprefixed twin). The body
is protocol/chat.py's, the preamble and the reply every generation route's
(routes/flow.py), the reply's shape replies/chat.py's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from mlx_prefix.records import ToolCallIds

from ..protocol.chat import parse_chat
from ..protocol.request import GenerationRequest, Limits
from ..replies.chat import ChatWriter, Kind
from ..replies.ids import new_id
from .common import api
from .flow import start


@api
async def chat_completions(request: Request) -> Response:
    return await chat_shaped(request, "chat", parse_chat)


async def chat_shaped(
    request: Request, kind: Kind, parse: Callable[[dict[str, Any], Limits], GenerationRequest]
) -> Response:
    """A request answered in chat's shape (chat, or completions' text choices)."""
    ids = ToolCallIds(new_id("chatcmpl-" if kind == "chat" else "cmpl-"))
    call = await start(request, ids, parse)
    writer = ChatWriter.for_request(kind, call.served.id, call.request_id, call.req)
    return await call.respond(call.assembler(streaming=call.req.stream), writer)
