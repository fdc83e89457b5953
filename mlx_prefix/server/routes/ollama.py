"""Ollama's generation routes: POST /api/chat and /api/generate. Parse the body
(protocol/ollama.py), pick the served model by its Ollama name (ollama_models.py), submit
through the steps every family shares (routes/flow.py), then stream NDJSON lines or
answer one object (ollama_stream.py). When the request ends, its keep_alive applies
(keep_alive.py). Errors leave as `{"error": "..."}` (server/errors.py picks the shape by
the /api/ path), and the middleware's Host, Origin and API-key checks ran before this."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Literal

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlx_prefix.errors import InvalidRequest, MlxPrefixError, ModelNotFound
from mlx_prefix.records import ToolCallIds

from ..assembler import Assembler
from ..generation import Collected, RequestLog
from ..model_names import ModelSpec, ServedModel
from ..namespaces import caller
from ..ndjson import NDJSONResponse
from ..ollama_models import listed_name, requested_name
from ..ollama_stream import OllamaStream, ReplyMeta, whole_body
from ..protocol.ollama import OllamaRequest, parse_ollama_chat, parse_ollama_generate
from ..protocol.ollama_options import log_ignored
from ..protocol.request import GenerationRequest, fit_to_model
from .common import api, model_for, read_json, state
from .flow import respond, submit

if TYPE_CHECKING:
    from mlx_prefix.engine.interface import EngineAPI


@api
async def chat(request: Request) -> Response:
    return await _generate(request, "chat")


@api
async def generate(request: Request) -> Response:
    return await _generate(request, "generate")


async def served_model(request: Request, name: str) -> tuple[ServedModel, ModelSpec, float]:
    """The served model an Ollama client's `name` selects, loaded if need be, what it
    was loaded as, and the seconds spent loading it. Not found: Ollama's wording."""
    st = state(request)
    ours = requested_name(st.models, name)
    began = time.perf_counter()
    try:
        served = await model_for(request, ours)
    except ModelNotFound as e:
        raise ModelNotFound(f"model '{name}' not found: {e.message}", param="model") from None
    return served, st.models.spec_for(ours), time.perf_counter() - began


async def _generate(request: Request, kind: Literal["chat", "generate"]) -> Response:
    st = state(request)
    started = time.perf_counter()
    who = caller(request)
    record = RequestLog(f"ollama-{uuid.uuid4().hex}", request.url.path, st.metrics,
                        who.namespace_id)  # fmt: skip
    try:
        body = await read_json(request)
        parse = parse_ollama_chat if kind == "chat" else parse_ollama_generate
        parsed = parse(body, st.limits)
        st.keep_alives.check(parsed.keep_alive)
        served, spec, load_s = await served_model(request, parsed.model)
        meta = ReplyMeta(kind, listed_name(served.id), started, load_s)
        tokenizer = served.engine.model.tokenizer
        think = parsed.think
        if think is not None and think.asked and not getattr(tokenizer, "has_thinking", False):
            raise InvalidRequest(f"{parsed.model!r} does not support thinking", param="think")
        if parsed.load_only:
            st.keep_alives.settle(spec, parsed.keep_alive)
            record.write("200")
            unload = parsed.keep_alive is not None and parsed.keep_alive.seconds == 0
            return JSONResponse(meta.loaded("unload" if unload else "load"))
        log_ignored(record.request_id, parsed.options)
        req = _prepared(parsed, record.request_id, who.namespace)
        req = fit_to_model(req, st.limits_for(served.engine))
        req = await _within_num_ctx(req, parsed, served.engine)
        handle = await submit(served.engine, req, record.request_id)
    except MlxPrefixError as e:
        record.write(str(e.status), error=e.message)
        raise
    assembler = Assembler.for_request(req, tokenizer, req.stream, handle)

    def settle() -> None:
        st.keep_alives.settle(spec, parsed.keep_alive)

    def ndjson(content: AsyncIterator[bytes], on_close: Callable[[], None]) -> Response:
        def closed() -> None:
            on_close()
            settle()

        return NDJSONResponse(content, closed)

    def whole(result: Collected, finish: str) -> dict:
        return whole_body(meta, result)

    try:
        shaper = OllamaStream(meta)
        return await respond(request, st, handle, req, record, assembler, shaper, whole, ndjson)
    finally:
        if not req.stream:
            settle()


def _prepared(parsed: OllamaRequest, request_id: str, namespace: str) -> GenerationRequest:
    """The request as the engine takes it: calls named after the request (the engine's
    next-turn prefetch names them alike), in the caller's cache namespace."""
    req = parsed.generation
    prompt = replace(req.prompt, reply_tool_call_ids=ToolCallIds(request_id))
    return replace(req, prompt=prompt, cache=replace(req.cache, namespace=namespace))


async def _within_num_ctx(
    req: GenerationRequest, parsed: OllamaRequest, engine: EngineAPI
) -> GenerationRequest:
    """options.num_ctx below the model's context bounds prompt and reply together. A
    prompt that alone reaches it is a 400: Ollama would drop the conversation's oldest
    part, and this server never cuts a prompt."""
    num_ctx = parsed.options.num_ctx
    context = engine.model.context_length
    if num_ctx is None or (context is not None and num_ctx >= context):
        return req
    count = await run_in_threadpool(engine.count_tokens, req.prompt)
    if count >= num_ctx:
        raise InvalidRequest(
            f"the prompt is {count} tokens and options.num_ctx is {num_ctx}: this server "
            "never cuts a prompt (Ollama would drop its oldest part); raise num_ctx or "
            "shorten the conversation",
            param="options.num_ctx",
        )
    left = num_ctx - count
    if req.sampling.max_tokens <= left:
        return req
    return replace(req, sampling=replace(req.sampling, max_tokens=left))
