"""One engine request's events -> a response in any API family: an SSE stream (through
the family's ReplyWriter) or the collected reply for the writer's one JSON body.

Whatever way a request ends (done, engine error, client gone, server shutdown), the
`finally` blocks cancel the engine handle (idempotent) and write the request's one
log line, so an abandoned request never keeps the engine decoding.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import anyio
from starlette.requests import Request

from mlx_prefix.errors import MlxPrefixError
from mlx_prefix.records import DoneEvent, ErrorEvent, ProgressEvent, TokenEvent

from ..errors import CancelledByServer, GenerationFailed
from ..monitor.metrics import RequestLog
from .assembler import Assembler, Delta, TokenLogprob

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


class ReplyWriter(Protocol):
    """One API family's reply, written from the assembler's deltas: streamed, the SSE
    bytes each step becomes; collected, one JSON body. Each family has one, in
    replies/<family>.py."""

    def opening(self) -> list[bytes]:
        """Sent at once, before the engine's first event."""
        ...

    def delta(self, delta: Delta) -> list[bytes]:
        """Text, reasoning or tool calls produced (possibly the first)."""
        ...

    def progress(self, event: ProgressEvent) -> list[bytes]:
        """The prompt's prefill moved on (only a request that asked gets any)."""
        ...

    def closing(self, done: DoneEvent, finish: str) -> list[bytes]:
        """The reply ended (`finish`: the assembler's finish reason); the stream's end."""
        ...

    def failure(self, error: MlxPrefixError) -> list[bytes]:
        """The request failed or was cancelled by the server; the stream's end."""
        ...

    def whole(self, result: Collected, finish: str) -> dict[str, Any]:
        """The reply not streamed: its JSON body (`finish`: the assembler's finish reason)."""
        ...


async def stream_events(
    handle: Any, assembler: Assembler, writer: ReplyWriter, record: RequestLog
) -> AsyncIterator[bytes]:
    """Engine events -> SSE bytes in `writer`'s family. Errors become the family's error
    events: the stream is the edge, it never cuts the connection."""
    status = "client_disconnected"  # stays so if the response task is cancelled mid-stream
    usage = finish = None
    try:
        for chunk in writer.opening():
            yield chunk
        try:
            async with aclosing(handle.aevents()) as events:
                async for event in events:
                    if isinstance(event, TokenEvent):
                        delta = assembler.feed(event)
                        if delta:
                            for chunk in writer.delta(delta):
                                yield chunk
                    elif isinstance(event, ProgressEvent):
                        for chunk in writer.progress(event):
                            yield chunk
                    elif isinstance(event, DoneEvent):
                        if event.finish_reason == "cancelled":
                            status = "cancelled"
                            for chunk in writer.failure(CancelledByServer(CANCELLED)):
                                yield chunk
                            return
                        delta = assembler.finish()
                        if delta:
                            for chunk in writer.delta(delta):
                                yield chunk
                        usage, finish = event.usage, assembler.finish_reason(event)
                        for chunk in writer.closing(event, finish):
                            yield chunk
                        status = "200"
                        return
                    elif isinstance(event, ErrorEvent):
                        status = "error"
                        log.error("%s generation failed: %s", record.request_id, event.message)
                        for chunk in writer.failure(as_error(event)):
                            yield chunk
                        return
            status = "error"
            ended = GenerationFailed("the engine ended the stream without a result")
            for chunk in writer.failure(ended):
                yield chunk
        except Exception as e:
            status = "error"
            log.exception("%s generation failed", record.request_id)
            for chunk in writer.failure(as_error(e)):
                yield chunk
    finally:
        handle.cancel()
        record.write(status, usage, finish)


class ClientGone(Exception):
    """The client closed the connection before its non-streaming answer was ready."""


@dataclass(frozen=True)
class Collected:
    """A whole reply: its deltas in order, and the joined views of them."""

    deltas: list[Delta]
    done: DoneEvent

    @property
    def text(self) -> str:
        return "".join(d.text for d in self.deltas)

    @property
    def reasoning(self) -> str:
        return "".join(d.reasoning for d in self.deltas)

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        return [call for d in self.deltas for call in d.tool_calls]

    @property
    def logprobs(self) -> list[TokenLogprob]:
        return [lp for d in self.deltas for lp in d.logprobs]


async def collect(handle: Any, assembler: Assembler, request: Request) -> Collected:
    """Runs a non-streaming request to its end. If the client goes away it cancels the
    request and returns at once (ClientGone), without waiting for the engine to stop."""
    deltas: list[Delta] = []

    async def events() -> DoneEvent | ErrorEvent | None:
        async with aclosing(handle.aevents()) as stream:
            async for event in stream:
                if not isinstance(event, TokenEvent):
                    return event
                deltas.append(assembler.feed(event))
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
    deltas.append(assembler.finish())
    return Collected([d for d in deltas if d], result)


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


def as_error(source: ErrorEvent | Exception) -> MlxPrefixError:
    if isinstance(source, MlxPrefixError):
        return source
    if isinstance(source, ErrorEvent):
        err = GenerationFailed(source.message)
        err.type = source.type
        return err
    return GenerationFailed(f"generation failed: {type(source).__name__}: {source}")
