"""RequestHandle: the caller's end of one request, safe to use from any thread or event loop."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Generator
from typing import TYPE_CHECKING

from mlx_prefix.prompt.reply.thinking import NO_EDGES, ReasoningEdges
from mlx_prefix.records import DoneEvent, ErrorEvent, Event

if TYPE_CHECKING:
    from mlx_prefix.explain.trace import CacheTrace


class RequestHandle:
    """Events flow engine thread -> caller through a thread-safe queue.

    An async consumer gets them through an asyncio.Queue fed with call_soon_threadsafe,
    so no thread-pool thread is parked per streaming request.
    """

    def __init__(
        self,
        request_id: str,
        prompt_tokens: int,
        *,
        progress: bool = False,
        opens_reasoning: bool = False,
        reasoning_edges: ReasoningEdges = NO_EDGES,
        breakpoint_end: int = 0,
        trace: CacheTrace | None = None,
    ):
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        # The caller reads ProgressEvents while the prompt is prefilled (generate's
        # progress bar, a stream's `return_progress`); nobody else gets any.
        self.progress = progress
        # Set by the engine thread once the prompt is prefilled, before the first event
        # (the event queue orders the write before a consumer's read of that event).
        self.cached_tokens: int | None = None  # restored from the cache
        self.cache_written_tokens: int | None = None  # computed and stored in the cache
        # From the rendered prompt: the reply starts as reasoning (the prompt left a
        # think block open), what its reasoning drops where written (the template writes
        # it), and the furthest position of the client's cache breakpoints (0: none).
        self.opens_reasoning = opens_reasoning
        self.reasoning_edges = reasoning_edges
        self.breakpoint_end = breakpoint_end
        # The request's CacheTrace (explain/trace.py), filled at admission; the server
        # hands it to the request explainer after the final event.
        self.trace = trace
        self.cancelled = threading.Event()
        self._queue: queue.Queue[Event] = queue.Queue()
        self._lock = threading.Lock()
        self._async: tuple[asyncio.AbstractEventLoop, asyncio.Queue[Event]] | None = None
        self._backlog: list[Event] = []

    # -- engine side -------------------------------------------------------------
    def emit(self, event: Event) -> None:
        with self._lock:
            if self._async is None:
                self._queue.put(event)
                return
            loop, aqueue = self._async
        try:
            loop.call_soon_threadsafe(aqueue.put_nowait, event)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening
            self.cancel()

    # -- caller side -------------------------------------------------------------
    def cancel(self) -> None:
        """Ask the engine to stop this request; idempotent. A DoneEvent('cancelled') follows."""
        self.cancelled.set()

    def events(self, timeout: float | None = None) -> Generator[Event, None, None]:
        """Blocking iterator; ends after a DoneEvent or ErrorEvent. A consumer that stops
        early (break, an exception, Ctrl-C) cancels the request."""
        ended = False
        try:
            while not ended:
                event = self._queue.get(timeout=timeout)
                ended = isinstance(event, (DoneEvent, ErrorEvent))
                yield event
        finally:
            if not ended:
                self.cancel()

    async def aevents(self) -> AsyncIterator[Event]:
        """As `events`, for an asyncio consumer (no thread parked per request)."""
        aqueue: asyncio.Queue[Event] = asyncio.Queue()
        with self._lock:
            while not self._queue.empty():
                aqueue.put_nowait(self._queue.get_nowait())
            self._async = (asyncio.get_running_loop(), aqueue)
        ended = False
        try:
            while not ended:
                event = await aqueue.get()
                ended = isinstance(event, (DoneEvent, ErrorEvent))
                yield event
        finally:
            if not ended:
                self.cancel()
