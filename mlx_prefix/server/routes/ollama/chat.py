"""The Ollama family's generation routes: POST /api/chat and /api/generate. The body is
protocol/ollama/bodies.py's, the preamble every generation route's (routes/flow.py: the
model named as Ollama's clients name it, served/ollama.py), the reply's lines and
object replies/ollama.py's, streamed as NDJSON (replies/ndjson.py). Between the model
and the engine, Ollama's own steps: its keep_alive handed to the pool (served/pool.py's
one keep-alive, which served/idle.py's unloader applies), a request with nothing to
generate answered once the model is loaded (an unload, `keep_alive: 0`, of a model not
loaded answered at once, as Ollama does, never loading it: with --max-models 1 that
would evict the model serving), options.num_ctx. Errors leave as
`{"error": "..."}` (server/errors.py picks the shape by the /api/ path), and the
middleware's Host, Origin and API-key checks ran before this."""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from typing import Any, Literal

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlx_prefix.config import FOREVER
from mlx_prefix.errors import InvalidRequest, ModelNotFound
from mlx_prefix.records import ToolCallIds

from ...protocol.ollama.bodies import OllamaRequest, parse_ollama_chat, parse_ollama_generate
from ...protocol.ollama.options import log_ignored
from ...protocol.request import GenerationRequest, Limits
from ...replies.ndjson import NDJSONResponse
from ...replies.ollama import OllamaWriter, ReplyMeta
from ...served.ollama import listed_name, requested_name
from ..common import api, state
from ..flow import read_call

KEEP_ALIVE_REFUSED = (
    "keep_alive: this server cannot unload its model (it could not load it back: a "
    "sharded group); send a negative keep_alive or none"
)


@api
async def chat(request: Request) -> Response:
    return await _generate(request, "chat")


@api
async def generate(request: Request) -> Response:
    return await _generate(request, "generate")


async def _generate(request: Request, kind: Literal["chat", "generate"]) -> Response:
    began = time.perf_counter()
    pool = state(request).models
    parse = parse_ollama_chat if kind == "chat" else parse_ollama_generate

    def parsed_for(body: dict[str, Any], limits: Limits) -> OllamaRequest:
        parsed = parse(body, limits)
        if parsed.keep_alive not in (None, FOREVER) and not pool.can_unload:
            raise InvalidRequest(KEEP_ALIVE_REFUSED, param="keep_alive")
        return parsed

    sent: dict[str, str] = {}  # the model name as the client sent it, for messages

    def our_name(name: str) -> str:
        sent["model"] = name
        return requested_name(pool.selector, name)

    ids = ToolCallIds(f"ollama-{uuid.uuid4().hex}")
    loads = pool.loads
    try:
        read = await read_call(request, ids, parsed_for, our_name)
        parsed = read.parsed
        if parsed.load_only and parsed.keep_alive == 0:
            with read.logged():
                resident = pool.is_resident(parsed.model)
            if not resident:  # nothing to unload: loading it would evict what serves
                spec = pool.spec_for(parsed.model)
                read.record.write("200")
                unloaded = ReplyMeta(kind, listed_name(spec.id), began)
                return JSONResponse(unloaded.loaded("unload"))
        call = await read.open()
    except ModelNotFound as e:  # Ollama's wording, naming the model as the client did
        asked = sent.get("model", "")
        raise ModelNotFound(f"model '{asked}' not found: {e.message}", param="model") from None
    # load_duration: 0 when the model was resident, as Ollama reports it.
    load_s = time.perf_counter() - began if pool.loads != loads else 0.0
    meta = ReplyMeta(kind, listed_name(call.served.id), began, load_s)
    with call.logged():
        tokenizer = call.served.engine.model.tokenizer
        think = parsed.think
        if think is not None and think.enable and not getattr(tokenizer, "has_thinking", False):
            raise InvalidRequest(f"{sent['model']!r} does not support thinking", param="think")
        # Every Ollama request sets its model's keep-alive; one without resets it.
        pool.keep_alive(parsed.model, parsed.keep_alive)
        if parsed.load_only:
            call.record.write("200")
            return JSONResponse(meta.loaded("unload" if parsed.keep_alive == 0 else "load"))
        log_ignored(call.record.request_id, parsed.options)
        req = await _within_num_ctx(call.prepared(parsed.generation), parsed, call.served.engine)
    started = await call.submit(req)
    assembler = started.assembler(streaming=req.stream)
    return await started.respond(assembler, OllamaWriter(meta), NDJSONResponse)


async def _within_num_ctx(
    req: GenerationRequest, parsed: OllamaRequest, engine: Any
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
