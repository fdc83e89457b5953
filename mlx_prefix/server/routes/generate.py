"""Generation routes: POST /v1/chat/completions and /v1/completions. Parse the body,
submit to the engine, then stream SSE chunks or collect one JSON body."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any, Literal

import anyio
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from mlx_prefix.errors import ContextLengthExceeded, MlxPrefixError
from mlx_prefix.records import ToolCallIds

from .. import responses as R
from ..assembler import Assembler
from ..generation import ClientGone, RequestLog, collect, stream_events
from ..namespaces import caller
from ..protocol.chat import parse_chat
from ..protocol.completions import parse_completion
from ..protocol.request import GenerationRequest
from .common import api, read_json, resolve_model, state


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
        req = parse_chat(body, st.limits) if kind == "chat" else parse_completion(body, st.limits)
        # Calls named after the request: the engine's next-turn prefetch names them alike.
        ids = ToolCallIds(record.request_id)
        req = replace(req, prompt=replace(req.prompt, reply_tool_call_ids=ids))
        req = replace(req, cache=replace(req.cache, namespace=who.namespace))
        meta = R.ResponseMeta(kind, resolve_model(st.engine, req.model), record.request_id)
        # Shielded: a handle created while the caller was being cancelled must still be
        # returned here, or nobody would cancel it and the engine would decode for no one.
        with anyio.CancelScope(shield=True):
            handle = await run_in_threadpool(submit, st.engine, req, meta.id)
    except MlxPrefixError as e:
        record.write(str(e.status), error=e.message)
        raise
    record.prompt_tokens = handle.prompt_tokens
    st.inflight.add(handle)
    assembler = Assembler.for_request(req, st.engine.model.tokenizer, req.stream)
    if req.stream:

        def on_close() -> None:
            handle.cancel()
            st.inflight.discard(handle)
            record.write("client_disconnected")

        return SSEResponse(stream_events(handle, req, meta, assembler, record), on_close)
    try:
        result = await collect(handle, assembler, request)
    except MlxPrefixError as e:
        record.write(str(e.status), error=e.message)
        raise
    except ClientGone:
        record.write("client_disconnected")
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
    except BaseException:
        record.write("client_disconnected")
        raise
    finally:
        handle.cancel()
        st.inflight.discard(handle)
    finish = assembler.finish_reason(result.done)
    record.write("200", result.done.usage, finish)
    body = R.completion_body(
        meta,
        text=result.text,
        tool_calls=result.tool_calls,
        finish_reason=finish,
        usage=result.done.usage,
        logprobs=result.logprobs if req.sampling.logprobs else None,
    )
    return JSONResponse(body)


def submit(engine: Any, req: GenerationRequest, request_id: str) -> Any:
    """engine.submit, with OpenAI's rule: a prompt and an explicit max_tokens that do not
    fit the context together are a 400 (the default max_tokens is clamped instead)."""
    try:
        return engine.submit(
            req.prompt,
            req.sampling,
            req.cache,
            request_id,
            fit_reply=req.max_tokens_param is not None,
        )
    except ContextLengthExceeded as e:
        if req.max_tokens_param is not None and req.max_tokens_param != "max_tokens":
            e.message = e.message.replace("max_tokens", req.max_tokens_param)
        raise


class SSEResponse(StreamingResponse):
    """A StreamingResponse that always watches for the client leaving, whatever ASGI spec
    version the server speaks, and runs `on_close` however the response ends."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass  # the client went away mid-write
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            self._on_close()
