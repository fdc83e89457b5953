"""The steps every generation route shares, whatever its API family: submit to the
served model's engine, then stream SSE (through the family's StreamShaper) or collect
the reply into one JSON body, writing the request's one log line either way."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import anyio
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlx_prefix.errors import ContextLengthExceeded, MlxPrefixError

from ..assembler import Assembler
from ..generation import ClientGone, Collected, RequestLog, StreamShaper, collect, stream_events
from ..protocol.request import GenerationRequest
from ..sse import SSEResponse
from .common import ServerState

if TYPE_CHECKING:
    from mlx_prefix.engine.interface import EngineAPI
    from mlx_prefix.engine.requests.handle import RequestHandle

# (the stream's bytes, what to run however it ends) -> the streaming response
StreamResponse = Callable[[AsyncIterator[bytes], Callable[[], None]], Response]


async def submit(engine: EngineAPI, req: GenerationRequest, request_id: str) -> RequestHandle:
    """engine.submit off the event loop. Shielded: a handle created while the caller was
    being cancelled must still be returned, or nobody would cancel it and the engine
    would decode for no one."""
    with anyio.CancelScope(shield=True):
        return await run_in_threadpool(_submit, engine, req, request_id)


def _submit(engine: EngineAPI, req: GenerationRequest, request_id: str) -> RequestHandle:
    """OpenAI's rule: a prompt and an explicit max_tokens that do not fit the context
    together are a 400 (the default max_tokens is clamped instead)."""
    try:
        return engine.submit(
            req.prompt,
            req.sampling,
            req.cache,
            request_id,
            fit_reply=req.fit_reply and req.max_tokens_param is not None,
        )
    except ContextLengthExceeded as e:
        if req.max_tokens_param is not None and req.max_tokens_param != "max_tokens":
            e.message = e.message.replace("max_tokens", req.max_tokens_param)
        raise


async def respond(
    request: Request,
    st: ServerState,
    handle: RequestHandle,
    req: GenerationRequest,
    record: RequestLog,
    assembler: Assembler,
    shaper: StreamShaper,
    whole: Callable[[Collected, str], dict[str, Any]],
    stream_response: StreamResponse = SSEResponse,
) -> Response:
    """The reply to a submitted request: a stream of `shaper`'s bytes when streaming (SSE
    by default; `stream_response` frames another format: Ollama's NDJSON), else the
    collected reply as `whole(collected, finish_reason)`."""
    record.prompt_tokens = handle.prompt_tokens
    st.inflight.add(handle)
    if req.stream:

        def on_close() -> None:
            handle.cancel()
            st.inflight.discard(handle)
            record.write("client_disconnected")

        return stream_response(stream_events(handle, assembler, shaper, record), on_close)
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
    return JSONResponse(whole(result, finish))
