"""Anthropic Messages routes: POST /v1/messages (also with `?beta=true`, as Claude Code
sends it) and /v1/messages/count_tokens, and their unprefixed twins. Errors leave in
Anthropic's shape (server/errors.py picks it by path)."""

from __future__ import annotations

from dataclasses import replace

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlx_prefix.errors import MlxPrefixError
from mlx_prefix.records import ToolCallIds

from ..anthropic_stream import (
    AnthropicStream,
    BlockWriter,
    final_usage,
    message_body,
    new_message_id,
    stop_reason,
)
from ..assembler import Assembler
from ..generation import Collected, RequestLog
from ..namespaces import caller
from ..protocol.messages import parse_count_tokens, parse_messages_request
from ..protocol.request import fit_to_model
from ..tool_choice import with_tool_choice
from .common import api, model_for, read_json, state
from .flow import respond, submit


@api
async def messages(request: Request) -> Response:
    st = state(request)
    message_id = new_message_id()
    who = caller(request)
    record = RequestLog(message_id, request.url.path, st.metrics, who.namespace_id)
    keep = st.settings.keep_billing_header
    try:
        body = await read_json(request)
        limits = st.limits_named(body)
        parsed = parse_messages_request(body, limits, keep_billing_header=keep)
        served = await model_for(request, parsed.generation.model, parsed.generation.adapter)
        tokenizer = served.engine.model.tokenizer
        # tool_use ids named after the message, as the engine's next-turn prefetch names
        # them, so the client's next turn (which sends them back) finds its prefix cached.
        ids = ToolCallIds(message_id, prefix="toolu_")
        prompt = replace(parsed.generation.prompt, reply_tool_call_ids=ids)
        req = fit_to_model(
            replace(parsed.generation, prompt=prompt), st.limits_for(served.engine, limits)
        )
        req = with_tool_choice(req, tokenizer)
        req = replace(req, cache=replace(req.cache, namespace=who.namespace))
        handle = await submit(served.engine, req, message_id)
    except MlxPrefixError as e:
        record.write(str(e.status), error=e.message)
        raise
    # The client's own stop sequences: a parallel-call stop added above is not one.
    stops = parsed.generation.sampling.stop
    assembler = Assembler.for_request(req, tokenizer, streaming=False, handle=handle)
    writer = BlockWriter(show_thinking=parsed.show_thinking)

    def whole(result: Collected, finish: str) -> dict:
        for delta in result.deltas:
            writer.feed(delta)
        writer.close()
        reason = stop_reason(result.done, writer.made_tool_use, stops)
        return message_body(
            message_id,
            served.id,
            writer,
            reason,
            final_usage(result.done.usage, handle.breakpoint_end),
        )

    shaper = AnthropicStream(message_id, served.id, handle, stops, writer)
    return await respond(request, st, handle, req, record, assembler, shaper, whole)


@api
async def count_tokens(request: Request) -> Response:
    st = state(request)
    body = await read_json(request)
    model, prompt = parse_count_tokens(body, keep_billing_header=st.settings.keep_billing_header)
    served = await model_for(request, model)
    count = await run_in_threadpool(served.engine.count_tokens, prompt)
    return JSONResponse({"input_tokens": count})
