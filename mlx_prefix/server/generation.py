"""One engine request's events -> an OpenAI response: an SSE stream or one JSON body.

Whatever way a request ends (done, engine error, client gone, server shutdown), the
`finally` blocks cancel the engine handle (idempotent) and write the request's one
log line, so an abandoned request never keeps the engine decoding.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
from starlette.requests import Request

from mlx_prefix.errors import MlxPrefixError
from mlx_prefix.records import DoneEvent, ErrorEvent, TokenEvent, Usage

from . import responses as R
from .assembler import Assembler, Delta
from .errors import CancelledByServer, GenerationFailed, body_for
from .metrics import ServerMetrics
from .protocol.request import GenerationRequest

log = logging.getLogger("mlx_prefix.server")

T = TypeVar("T")
CANCELLED = "the server cancelled this request before it finished (shutting down)"


class InFlight:
    """Handles of the requests being served, so that a shutdown can cancel those still
    running when the grace period ends. Touched only from the event loop's thread."""

    def __init__(self) -> None:
        self._handles: set[Any] = set()

    def __len__(self) -> int:
        return len(self._handles)

    def add(self, handle: Any) -> None:
        self._handles.add(handle)

    def discard(self, handle: Any) -> None:
        self._handles.discard(handle)

    def cancel_all(self) -> int:
        handles = list(self._handles)
        for handle in handles:
            handle.cancel()
        return len(handles)


@dataclass
class RequestLog:
    """The per-request log line and token metrics, written exactly once."""

    request_id: str
    endpoint: str
    metrics: ServerMetrics
    namespace: str | None = None  # the sender's cache namespace id: who sees the record
    prompt_tokens: int = 0
    started: float = field(default_factory=time.perf_counter)
    _written: bool = False

    def write(
        self,
        status: str,
        usage: Usage | None = None,
        finish: str | None = None,
        error: str | None = None,
    ) -> None:
        if self._written:
            return
        self._written = True
        total_ms = (time.perf_counter() - self.started) * 1000
        self.metrics.recent.add(
            self.request_id, self.endpoint, status, total_ms, self.prompt_tokens, usage, finish,
            self.namespace,
        )  # fmt: skip
        if usage is None:
            log.info(
                "%s %s prompt=%d cached=- ttft=- decode=- status=%s total=%.0fms%s",
                self.request_id, self.endpoint, self.prompt_tokens, status, total_ms,
                f" error={error!r}" if error else "",
            )  # fmt: skip
            return
        self.metrics.observe_generation(usage)
        log.info(
            "%s %s prompt=%d cached=%d completion=%d ttft=%.1fms decode=%.1ftok/s "
            "finish=%s status=%s total=%.0fms",
            self.request_id, self.endpoint, usage.prompt_tokens, usage.cached_tokens,
            usage.completion_tokens, usage.ttft_s * 1000, usage.decode_tokens_per_s,
            finish, status, total_ms,
        )  # fmt: skip


async def stream_events(
    handle: Any,
    req: GenerationRequest,
    meta: R.ResponseMeta,
    assembler: Assembler,
    record: RequestLog,
) -> AsyncIterator[bytes]:
    status = "client_disconnected"  # stays so if the response task is cancelled mid-stream
    usage = finish = None
    try:
        if meta.kind == "chat":
            yield R.sse(R.chunk(meta, role=True, text="", include_usage=req.include_usage))
        try:
            async with aclosing(handle.aevents()) as events:
                async for event in events:
                    if isinstance(event, TokenEvent):
                        delta = assembler.feed(event)
                        if delta:
                            yield R.sse(_delta_chunk(meta, delta, req))
                    elif isinstance(event, DoneEvent):
                        if event.finish_reason == "cancelled":
                            status = "cancelled"
                            yield R.sse(body_for(CancelledByServer(CANCELLED)))
                            return
                        delta = assembler.finish()
                        if delta:
                            yield R.sse(_delta_chunk(meta, delta, req))
                        usage, finish = event.usage, assembler.finish_reason(event)
                        yield R.sse(
                            R.chunk(meta, finish_reason=finish, include_usage=req.include_usage)
                        )
                        if req.include_usage:
                            yield R.sse(R.usage_chunk(meta, event.usage))
                        yield R.SSE_DONE
                        status = "200"
                        return
                    elif isinstance(event, ErrorEvent):
                        status = "error"
                        log.error("%s generation failed: %s", record.request_id, event.message)
                        yield R.sse(body_for(as_error(event)))
                        return
            status = "error"
            yield R.sse(body_for(GenerationFailed("the engine ended the stream without a result")))
        except Exception as e:  # the stream is the edge: report, never cut the connection
            status = "error"
            log.exception("%s generation failed", record.request_id)
            yield R.sse(body_for(as_error(e)))
    finally:
        handle.cancel()
        record.write(status, usage, finish)


class ClientGone(Exception):
    """The client closed the connection before its non-streaming answer was ready."""


@dataclass(frozen=True)
class Collected:
    text: str
    tool_calls: list[dict[str, Any]]
    logprobs: list[R.TokenLogprob]
    done: DoneEvent


async def collect(handle: Any, assembler: Assembler, request: Request) -> Collected:
    """Runs a non-streaming request to its end. If the client goes away it cancels the
    request and returns at once (ClientGone), without waiting for the engine to stop."""
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    lps: list[R.TokenLogprob] = []

    async def events() -> DoneEvent | ErrorEvent | None:
        async with aclosing(handle.aevents()) as stream:
            async for event in stream:
                if not isinstance(event, TokenEvent):
                    return event
                _add(assembler.feed(event), texts, calls, lps)
        return None

    try:
        result = await until_disconnect(request, events, on_gone=handle.cancel)
    finally:
        handle.cancel()
    if isinstance(result, ErrorEvent):
        raise as_error(result)
    if result is None:
        raise GenerationFailed("the engine ended the request without a result")
    if result.finish_reason == "cancelled":
        raise CancelledByServer(CANCELLED)
    _add(assembler.finish(), texts, calls, lps)
    return Collected("".join(texts), calls, lps, result)


async def until_disconnect(
    request: Request, work: Callable[[], Awaitable[T]], on_gone: Callable[[], None]
) -> T:
    """`await work()`, unless the client disconnects first: then `on_gone()`, stop
    waiting (work is cancelled at its next await) and raise ClientGone, so no handler
    outlives its client. For use once the request body has been read: the next ASGI
    message is then the disconnect (uvicorn sends it when the socket closes, or after
    the response is sent)."""
    done: list[T] = []
    failed: list[Exception] = []
    gone = False

    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            nonlocal gone
            while (await request.receive())["type"] != "http.disconnect":
                pass
            gone = True
            on_gone()
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        try:
            done.append(await work())
        except Exception as e:  # raised below: inside the group it would become a group
            failed.append(e)
        finally:
            tg.cancel_scope.cancel()
    if gone:
        raise ClientGone()
    if failed:
        raise failed[0]
    return done[0]


def _add(delta: Delta, texts: list[str], calls: list[dict[str, Any]], lps: list[Any]) -> None:
    texts.append(delta.text)
    calls.extend(delta.tool_calls)
    lps.extend(delta.logprobs)


def _delta_chunk(meta: R.ResponseMeta, delta: Delta, req: GenerationRequest) -> dict[str, Any]:
    return R.chunk(
        meta,
        text=delta.text if delta.text or not delta.tool_calls else None,
        tool_calls=delta.tool_calls,
        logprobs=delta.logprobs,
        include_usage=req.include_usage,
    )


def as_error(source: ErrorEvent | Exception) -> MlxPrefixError:
    if isinstance(source, MlxPrefixError):
        return source
    if isinstance(source, ErrorEvent):
        err = GenerationFailed(source.message)
        err.type = source.type
        return err
    return GenerationFailed(f"generation failed: {type(source).__name__}: {source}")
