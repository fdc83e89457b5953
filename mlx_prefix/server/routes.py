"""HTTP handlers. They parse (protocol), call the engine off the event loop, and shape the
answer (responses / generation). Engine calls that may block go through the threadpool."""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

import anyio
import anyio.to_thread
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from mlx_prefix.errors import ContextLengthExceeded, MlxPrefixError, ModelNotFound

from . import responses as R
from .errors import (
    PayloadTooLarge,
    UnsupportedMediaType,
    WarmTimeout,
    error_body,
    error_response,
)
from .generation import (
    Assembler,
    ClientGone,
    InFlight,
    RequestLog,
    collect,
    stream_events,
    until_disconnect,
)
from .metrics import CONTENT_TYPE, ServerMetrics
from .protocol.chat import parse_chat
from .protocol.completions import parse_completion
from .protocol.fields import parse_json_object
from .protocol.request import GenerationRequest, Limits
from .protocol.warm import parse_warm
from .settings import ServerSettings

log = logging.getLogger("mlx_prefix.server")


@dataclass(frozen=True)
class ServerState:
    engine: Any  # mlx_prefix.engine.Engine, or a fake with the same interface
    settings: ServerSettings
    metrics: ServerMetrics
    limits: Limits
    inflight: InFlight
    started: int  # unix time, reported as the model's `created`


def state(request: Request) -> ServerState:
    return request.app.state.server


Handler = Callable[[Request], Awaitable[Response]]


def api(handler: Handler) -> Handler:
    """Errors become the OpenAI error shape here, inside the middleware, so even a 500
    carries CORS headers a browser page can read."""

    @functools.wraps(handler)
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except MlxPrefixError as e:
            return error_response(e)
        except Exception as e:
            log.exception("unhandled error on %s %s", request.method, request.url.path)
            body = error_body(f"internal error: {type(e).__name__}: {e}", "server_error")
            return JSONResponse(body, status_code=500)

    return wrapped


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
    limit = state(request).settings.max_body_bytes
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


def resolve_model(engine: Any, requested: str | None) -> str:
    """The served id for any accepted spelling of it; ModelNotFound otherwise."""
    model = engine.model
    if requested is None:
        return model.name
    aliases = {model.name, "default"}
    if model.path is not None:
        aliases |= {str(model.path), model.path.name}
    if requested.rstrip("/") in aliases or requested in aliases:
        return model.name
    raise ModelNotFound(
        f"The model {requested!r} does not exist. Served models: {model.name}"
        + (f" (also accepted: its folder {model.path}, 'default')" if model.path else ""),
        param="model",
    )


@api
async def chat_completions(request: Request) -> Response:
    return await _generate(request, "chat")


@api
async def completions(request: Request) -> Response:
    return await _generate(request, "completion")


async def _generate(request: Request, kind: Literal["chat", "completion"]) -> Response:
    st = state(request)
    record = RequestLog(R.new_request_id(kind), request.url.path, st.metrics)
    try:
        body = await read_json(request)
        req = parse_chat(body, st.limits) if kind == "chat" else parse_completion(body, st.limits)
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


@api
async def list_models(request: Request) -> Response:
    st = state(request)
    return JSONResponse({"object": "list", "data": [_model_card(st)]})


@api
async def get_model(request: Request) -> Response:
    st = state(request)
    resolve_model(st.engine, request.path_params["model_id"])
    return JSONResponse(_model_card(st))


def _model_card(st: ServerState) -> dict[str, Any]:
    model = st.engine.model
    return {
        "id": model.name,
        "object": "model",
        "created": st.started,
        "owned_by": "mlx-prefix",
        "context_length": model.context_length,
    }


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok", "model": state(request).engine.model.name})


@api
async def cache_info(request: Request) -> Response:
    engine = state(request).engine
    stats = await run_in_threadpool(engine.cache_stats)
    entries = await run_in_threadpool(engine.cache_entries)
    # The store's CheckpointKind is an IntEnum: show "HISTORY", not 2.
    entries = [
        {k: v.name if isinstance(v, enum.Enum) else v for k, v in entry.items()}
        for entry in entries
    ]
    return JSONResponse({"stats": stats, "entries": entries})


@api
async def cache_warm(request: Request) -> Response:
    st = state(request)
    body = await read_json(request)
    resolve_model(st.engine, body.get("model") if isinstance(body.get("model"), str) else None)
    warm = parse_warm(body)
    started = time.perf_counter()
    timeout = st.settings.warm_timeout_s
    handle, future = await run_in_threadpool(st.engine.start_warm, warm.prompt, warm.pin)

    async def finished() -> Any:
        with anyio.fail_after(timeout):
            # Shielded: the engine owns the future; the handle is how to stop the job.
            return await asyncio.shield(asyncio.wrap_future(future))

    try:
        result = await until_disconnect(request, finished, on_gone=handle.cancel)
    except TimeoutError:
        handle.cancel()
        raise WarmTimeout(
            f"the warm-up did not finish within {timeout:g}s (the server's warm_timeout_s); "
            "it was cancelled"
        ) from None
    except ClientGone:
        log.info("warm client_disconnected after %.0fms", (time.perf_counter() - started) * 1000)
        return Response(status_code=499)
    log.info(
        "warm prompt=%d cached=%d pinned=%s took=%.0fms",
        result.prompt_tokens, result.cached_tokens, result.pinned,
        (time.perf_counter() - started) * 1000,
    )  # fmt: skip
    return JSONResponse(
        {
            "prompt_tokens": result.prompt_tokens,
            "cached_tokens": result.cached_tokens,
            "pinned": result.pinned,
        }
    )


@api
async def cache_flush(request: Request) -> Response:
    removed = await run_in_threadpool(state(request).engine.flush_cache)
    return JSONResponse({"removed": removed})


async def metrics(request: Request) -> Response:
    body = await run_in_threadpool(state(request).metrics.exposition)
    return Response(body, media_type=CONTENT_TYPE)


ROUTES = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/models/{model_id:path}", get_model, methods=["GET"]),
    Route("/v1/cache", cache_info, methods=["GET"]),
    Route("/v1/cache", cache_flush, methods=["DELETE"]),
    Route("/v1/cache/warm", cache_warm, methods=["POST"]),
    Route("/health", health, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
]
