"""Generation routes: POST /v1/chat/completions and /v1/completions (and their
unprefixed twins). Parse the body, pick the served model, submit, then stream SSE
chunks or collect one JSON body (routes/flow.py)."""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

from starlette.requests import Request
from starlette.responses import Response

from mlx_prefix.errors import MlxPrefixError
from mlx_prefix.records import ToolCallIds

from .. import chat_bodies as R
from ..assembler import Assembler
from ..generation import Collected, RequestLog
from ..namespaces import caller
from ..protocol.chat import parse_chat
from ..protocol.completions import parse_completion
from ..protocol.request import fit_to_model
from ..tool_choice import with_tool_choice
from .common import api, model_for, read_json, state
from .flow import respond, submit


@api
async def chat_completions(request: Request) -> Response:
    return await _generate(request, "chat")


@api
async def completions(request: Request) -> Response:
    return await _generate(request, "completion")


async def _generate(request: Request, kind: Literal["chat", "completion"]) -> Response:
    st = state(request)
    who = caller(request)
    record = RequestLog(R.new_request_id(kind), request.url.path, st.metrics, who.namespace_id)
    try:
        body = await read_json(request)
        limits = st.limits_named(body)
        req = parse_chat(body, limits) if kind == "chat" else parse_completion(body, limits)
        # Calls named after the request: the engine's next-turn prefetch names them alike.
        ids = ToolCallIds(record.request_id)
        req = replace(req, prompt=replace(req.prompt, reply_tool_call_ids=ids))
        req = replace(req, cache=replace(req.cache, namespace=who.namespace))
        served = await model_for(request, req.model, req.adapter)
        req = fit_to_model(req, st.limits_for(served.engine, limits))
        tokenizer = served.engine.model.tokenizer
        req = with_tool_choice(req, tokenizer)
        handle = await submit(served.engine, req, record.request_id)
    except MlxPrefixError as e:
        record.write(str(e.status), error=e.message)
        raise
    meta = R.ResponseMeta(kind, served.id, record.request_id, legacy_functions=req.legacy_functions)
    assembler = Assembler.for_request(req, tokenizer, req.stream, handle)

    def whole(result: Collected, finish: str) -> dict:
        return R.completion_body(
            meta,
            text=result.text,
            reasoning=result.reasoning,
            tool_calls=result.tool_calls,
            finish_reason=finish,
            usage=result.done.usage,
            logprobs=result.logprobs if req.sampling.logprobs else None,
        )

    shaper = R.OpenAIStream(meta, req.include_usage)
    return await respond(request, st, handle, req, record, assembler, shaper, whole)
