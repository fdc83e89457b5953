"""The Anthropic family's routes: POST /v1/messages (also with `?beta=true`, as Claude Code
sends it) and /v1/messages/count_tokens, and their unprefixed twins. The body is
protocol/anthropic/bodies.py's, the preamble and the reply every generation route's
(routes/flow.py), the reply's blocks and events replies/anthropic.py's. Errors leave in
Anthropic's shape (server/errors.py picks it by path)."""

from __future__ import annotations

from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlx_prefix.records import ToolCallIds

from ..guards.body import read_json
from ..protocol.anthropic.bodies import MessagesRequest, parse_count_tokens, parse_messages_request
from ..protocol.request import Limits
from ..replies.anthropic import AnthropicWriter, BlockWriter
from ..replies.ids import new_id
from .common import api, model_for, state
from .flow import check_images, start


@api
async def messages(request: Request) -> Response:
    # tool_use ids as Anthropic's start ("toolu_"), named after the message.
    ids = ToolCallIds(new_id("msg_"), prefix="toolu_")
    keep = state(request).settings.keep_billing_header

    def parse(body: dict[str, Any], limits: Limits) -> MessagesRequest:
        return parse_messages_request(body, limits, keep_billing_header=keep)

    call = await start(request, ids, parse, lambda parsed, _: parsed.generation)
    parsed = call.parsed
    writer = AnthropicWriter(
        call.request_id,
        call.served.id,
        call.handle,
        parsed.generation.sampling.stop,  # as the client sent them, before the tool choice
        BlockWriter(show_thinking=parsed.show_thinking),
    )
    return await call.respond(call.assembler(streaming=False), writer)


@api
async def count_tokens(request: Request) -> Response:
    st = state(request)
    body = await read_json(request)
    model, prompt = await run_in_threadpool(  # its image headers are read off the event loop
        parse_count_tokens,
        body,
        keep_billing_header=st.settings.keep_billing_header,
        images=st.settings.images,
    )
    served = await model_for(request, model)
    check_images(prompt, st.settings.images, served.engine)  # before any is decoded
    count = await run_in_threadpool(served.engine.count_tokens, prompt)
    return JSONResponse({"input_tokens": count})
