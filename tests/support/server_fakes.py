"""A fake engine with the real engine's interface, and a live uvicorn server for tests.

The fake "tokenizes" into words, "generates" a scripted reply word by word on its own
thread (like the real engine thread), and reports cached_tokens as the longest common
word prefix with earlier prompts. Directives in the prompt steer one request:
  [[reply:TEXT]]   reply with TEXT instead of the engine's default reply
  [[delay:S]]      sleep S seconds before each token (a warm-up: S seconds in all)
  [[hang:S]]       sleep S seconds before the first token, deaf to cancel (a long step;
                   FakeEngine.unhang ends it sooner)
  [[fail_after:N]] emit N tokens, then an ErrorEvent
  [[busy]]         raise EngineBusy at submit
  [[crash]]        raise RuntimeError at submit (an engine bug)
  [[think]]        the prompt leaves a think block open: the reply starts as reasoning
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn

from mlx_prefix.cache.store import CheckpointKind
from mlx_prefix.cache.types import EntryInfo, EvictOutcome, StoredTokens, covers
from mlx_prefix.engine.activity import Activity, JobView
from mlx_prefix.engine.keys import entry_key, namespace_key, namespace_of
from mlx_prefix.errors import ContextLengthExceeded, EngineBusy, InvalidRequest
from mlx_prefix.prompt.reply.reader import ReplyFormat
from mlx_prefix.prompt.reply.thinking import NO_EDGES
from mlx_prefix.records import (
    CachePreference,
    DoneEvent,
    ErrorEvent,
    Event,
    PromptInput,
    SamplingParams,
    TokenEvent,
    Usage,
)

_NO_PREFERENCE = CachePreference()
MODEL_KEY = "fake-model-key"  # the fake's cache key; entries are keyed as the engine's are
DEFAULT_REPLY = "Hello from the fake engine, one word at a time."
# How long a live server may take to start or stop before the test calls it hung: a
# deadline, never a measurement (a loaded machine may take seconds where an idle one
# takes ms; an app's startup may load a model).
HANG_S = 120.0
_DIRECTIVE = re.compile(r"\[\[(reply|delay|hang|fail_after|busy|crash|think)(?::(.*?))?\]\]", re.S)


_IDS_LOCK = threading.Lock()


@dataclass
class FakeTokenizer:
    has_tool_calling: bool = False
    tool_call_start: str | None = None
    tool_call_end: str | None = None
    tool_parser: Callable[[str, Any], Any] | None = None
    has_thinking: bool = False
    think_start: str | None = None
    think_end: str | None = None

    # The fake engine's tokens: one id per word it emits, never reused (see `token_for`).
    pieces: dict[int, str] = field(default_factory=dict)

    def token_for(self, piece: str) -> int:
        with _IDS_LOCK:
            token = 1000 + len(self.pieces)
            self.pieces[token] = piece
            return token

    # A prompt word's id, stable for the fake's life (what listings with token ids show).
    vocab: dict[str, int] = field(default_factory=dict)

    def ids(self, *words: str) -> tuple[int, ...]:
        with _IDS_LOCK:
            return tuple(self.vocab.setdefault(w, -1 - len(self.vocab)) for w in words)

    def decode(self, ids: list[int]) -> str:
        words = {i: w for w, i in self.vocab.items()} if any(i < 0 for i in ids) else {}
        return "".join(self.pieces[i] if i >= 0 else words[i] for i in ids)

    @classmethod
    def with_json_tools(cls) -> FakeTokenizer:
        """The `json_tools` syntax of mlx-lm (Qwen-style <tool_call>{json}</tool_call>)."""
        from mlx_lm.tool_parsers import json_tools

        return cls(
            has_tool_calling=True,
            tool_call_start=json_tools.tool_call_start,
            tool_call_end=json_tools.tool_call_end,
            tool_parser=json_tools.parse_tool_call,
            has_thinking=True,
            think_start="<think>",
            think_end="</think>",
        )


@dataclass
class FakeModel:
    name: str = "fake-model"
    path: Path = Path("/models/org/fake-model")
    identity: str = "fake-model@test"
    context_length: int | None = 4096
    tokenizer: FakeTokenizer = field(default_factory=FakeTokenizer)
    # LoadedModel.vision: None is a text-only model (a request's images are refused
    # before any is decoded); anything else takes them.
    vision: Any = None


@dataclass(frozen=True)
class WarmResult:
    prompt_tokens: int
    cached_tokens: int
    pinned: bool


@dataclass(frozen=True)
class Submission:
    prompt: PromptInput
    sampling: SamplingParams
    cache: CachePreference
    request_id: str | None


def render(prompt: PromptInput) -> str:
    if prompt.text is not None:
        return prompt.text
    assert prompt.messages is not None
    parts = [f"<{m.role}> {m.content}" for m in prompt.messages]
    if prompt.tools:
        parts.insert(0, f"<tools> {json.dumps(prompt.tools)}")
    return " ".join(parts) + " <assistant>"


def words(text: str) -> list[str]:
    return re.findall(r"\s*\S+", text) or [""]


class FakeHandle:
    def __init__(self, request_id: str, prompt_tokens: int, namespace: str | None = None):
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.cached_tokens: int | None = None
        self.cache_written_tokens: int | None = None
        self.opens_reasoning = False  # the prompt left a think block open
        self.reasoning_edges = NO_EDGES  # what the reasoning drops where written
        self.breakpoint_end = 0  # the furthest client breakpoint's position
        self.namespace = namespace  # its cache namespace's id
        self.trace = None  # no CacheTrace: the fake engine's requests go unexplained
        self.cancelled = threading.Event()
        self._events: list[Event] = []
        self._cond = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self.thread: threading.Thread | None = None

    def cancel(self) -> None:
        self.cancelled.set()

    @property
    def finished(self) -> bool:
        with self._cond:
            return bool(self._events) and not isinstance(self._events[-1], TokenEvent)

    def push(self, event: Event) -> None:
        with self._cond:
            self._events.append(event)
            self._cond.notify_all()
            waiters = list(self._waiters)
        for loop, flag in waiters:
            if not loop.is_closed():
                loop.call_soon_threadsafe(flag.set)

    def events(self) -> Iterator[Event]:
        i = 0
        while True:
            with self._cond:
                while i >= len(self._events):
                    self._cond.wait()
                event = self._events[i]
            i += 1
            yield event
            if not isinstance(event, TokenEvent):
                return

    async def aevents(self) -> AsyncIterator[Event]:
        waiter = (asyncio.get_running_loop(), asyncio.Event())
        with self._cond:
            self._waiters.append(waiter)
        i = 0
        try:
            while True:
                with self._cond:
                    ready = self._events[i:]
                    if not ready:
                        waiter[1].clear()
                if not ready:
                    await waiter[1].wait()
                    continue
                for event in ready:
                    i += 1
                    yield event
                    if not isinstance(event, TokenEvent):
                        return
        finally:
            with self._cond:
                self._waiters.remove(waiter)


class FakeViews:
    """The fake engine's cache views (engine/interface.py CacheViewsAPI), over the
    fake's own stored prompts: `engine.views`, as the real engine's CacheViews."""

    def __init__(self, engine: FakeEngine):
        self.engine = engine

    def cache_stats(self) -> dict[str, Any]:
        with self.engine._lock:
            nbytes = sum(len(t) * 1000 for _, t in self.engine._stored)
            lookups = self.engine._stats["hits"] + self.engine._stats["misses"]
            return {
                **self.engine._stats,
                "entries": len(self.engine._stored),
                "bytes": nbytes,
                "bytes_by_kind": {"LAST_MESSAGE": nbytes},
                "entries_by_kind": {"LAST_MESSAGE": len(self.engine._stored)},
                "active_bytes": 0,
                "active_requests": 0,
                "pinned": sum(e["pinned"] for e in self.engine._stored.values()),
                "locked": 0,
                "budget_bytes": 1 << 30,
                "hit_ratio": self.engine._stats["hits"] / lookups if lookups else 0.0,
            }

    def cache_entries(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        with self.engine._lock:
            return [  # the real engine's schema: asdict(EntryInfo)
                {
                    "entry_id": e["id"],
                    "model_key": key,
                    "tokens": len(t),
                    "nbytes": len(t) * 1000,
                    "kind": CheckpointKind.LAST_MESSAGE,  # an IntEnum, as the store's
                    "trimmable": True,
                    "hits": e["hits"],
                    "age_s": now - e["created"],
                    "idle_s": now - e["created"],
                    "pinned": e["pinned"],
                    "refs": 0,
                    "shared_bytes": 0,
                }
                for (key, t), e in self.engine._stored.items()
            ]

    def cache_sequences(self) -> list[StoredTokens[EntryInfo]]:
        now = time.monotonic()
        with self.engine._lock:
            return [
                StoredTokens(
                    EntryInfo(
                        entry_id=e["id"],
                        model_key=key,
                        tokens=len(t),
                        nbytes=len(t) * 1000,
                        kind=CheckpointKind.LAST_MESSAGE,
                        trimmable=True,
                        hits=e["hits"],
                        age_s=now - e["created"],
                        idle_s=now - e["created"],
                        pinned=e["pinned"],
                        refs=0,
                    ),
                    self.engine.model.tokenizer.ids(*t),
                )
                for (key, t), e in self.engine._stored.items()
            ]

    def disk_sequences(self) -> list:
        return []

    def set_pinned(self, entry_id: int, pinned: bool) -> bool:
        with self.engine._lock:
            for e in self.engine._stored.values():
                if e["id"] == entry_id:
                    e["pinned"] = pinned
                    return True
            return False

    def evict_entry(self, entry_id: int) -> EvictOutcome:
        with self.engine._lock:
            for t, e in self.engine._stored.items():
                if e["id"] == entry_id:
                    if e["pinned"]:
                        return EvictOutcome.PINNED
                    del self.engine._stored[t]
                    return EvictOutcome.EVICTED
            return EvictOutcome.MISSING

    def activity(self) -> Activity:
        """The requests still generating, as the real engine reports decoding ones."""
        with self.engine._lock:
            running = [h for h in self.engine.handles if not h.finished]
        jobs = tuple(
            JobView(h.request_id, "request", "decoding", h.prompt_tokens, 0, h.prompt_tokens,
                    len(h._events), 0, time.perf_counter(), h.namespace)
            for h in running
        )  # fmt: skip
        return Activity(jobs, 8, time.perf_counter())

    def flush_cache(self, namespace: str | None = None) -> int:
        selector = MODEL_KEY if namespace is None else namespace_key(MODEL_KEY, namespace)
        with self.engine._lock:
            gone = [k for k in self.engine._stored if covers(selector, k[0])]
            for k in gone:
                del self.engine._stored[k]
            return len(gone)


class FakeEngine:
    def __init__(self, model: FakeModel | None = None, reply: str = DEFAULT_REPLY):
        self.model = model or FakeModel()
        self.model_key = MODEL_KEY
        self.reply = reply
        self.submissions: list[Submission] = []
        self.handles: list[FakeHandle] = []
        self.shutdown_calls = 0
        self.warms_running = 0  # warm() calls blocked in their thread
        self.unhang = threading.Event()  # set: a [[hang:S]] ends now (a test let it go)
        self._lock = threading.Lock()
        self._stored: dict[tuple[str, tuple[str, ...]], dict[str, Any]] = {}  # (key, words)
        self._stats = {"hits": 0, "misses": 0, "tokens_reused": 0, "evictions": 0}
        self._closed = False
        self._ids = 0
        self.views = FakeViews(self)

    # The engine interface

    @property
    def reply_format(self) -> ReplyFormat:
        return ReplyFormat.of(self.model.tokenizer)  # a test may change the tokenizer

    def submit(
        self,
        prompt: PromptInput,
        sampling: SamplingParams,
        cache: CachePreference = _NO_PREFERENCE,
        request_id: str | None = None,
        *,
        fit_reply: bool = False,
        progress: bool = False,
    ) -> FakeHandle:
        if progress:
            raise InvalidRequest("the fake engine sends no progress", param="return_progress")
        if self._closed:
            raise EngineBusy("the engine is shutting down")
        if (prompt.messages is None) == (prompt.text is None):
            raise InvalidRequest("exactly one of messages or text")
        text = render(prompt)
        directives = {m.group(1): m.group(2) for m in _DIRECTIVE.finditer(text)}
        if "busy" in directives:
            raise EngineBusy("the engine queue is full")
        if "crash" in directives:
            raise RuntimeError("fake engine crashed at submit")
        tokens = tuple(words(text))
        limit = self.model.context_length
        if fit_reply and limit and len(tokens) + sampling.max_tokens > limit:
            raise ContextLengthExceeded(  # the real engine's wording
                f"this model's context is {limit} tokens, but {len(tokens) + sampling.max_tokens}"
                f" were requested ({len(tokens)} in the prompt, {sampling.max_tokens} for the "
                "completion); shorten the prompt or lower max_tokens",
                param="messages" if prompt.messages is not None else "prompt",
            )
        if self.model.context_length and len(tokens) > self.model.context_length:
            raise ContextLengthExceeded(
                f"prompt is {len(tokens)} tokens; the context is {self.model.context_length}",
                param="messages" if prompt.messages is not None else "prompt",
            )
        key = entry_key(MODEL_KEY, cache)
        cached = self._lookup(key, tokens, store=cache.enabled) if cache.enabled else 0
        with self._lock:
            self._ids += 1
            handle = FakeHandle(request_id or f"fake-{self._ids}", len(tokens), namespace_of(key))
            self.submissions.append(Submission(prompt, sampling, cache, request_id))
            self.handles.append(handle)
        # The fake stores every prompt it sees whole (like a trimmable cache's end).
        handle.cached_tokens = cached
        handle.opens_reasoning = "think" in directives
        handle.cache_written_tokens = len(tokens) - cached if cache.enabled else 0
        handle.thread = threading.Thread(
            target=self._generate,
            args=(handle, directives, sampling, len(tokens), cached),
            daemon=True,
        )
        handle.thread.start()
        return handle

    def count_tokens(self, prompt: PromptInput) -> int:
        return len(words(render(prompt)))

    def start_warm(
        self, prompt: PromptInput, pin: bool = False, cache: CachePreference = _NO_PREFERENCE
    ) -> tuple[FakeHandle, Future]:
        """Like Engine.start_warm: a cancellable warm-up whose future gives a WarmResult.
        `[[delay:S]]` in the prompt makes it take S seconds (cancelling ends it early)."""
        text = render(prompt)
        delay = float(
            next((m.group(2) for m in _DIRECTIVE.finditer(text) if m.group(1) == "delay"), 0)
        )
        key = entry_key(MODEL_KEY, cache)
        handle = FakeHandle(f"warm-{len(self.handles)}", len(words(text)), namespace_of(key))
        future: Future = Future()

        def run() -> None:
            with self._lock:
                self.warms_running += 1
            try:
                if handle.cancelled.wait(delay):
                    if not future.done():
                        future.set_exception(EngineBusy("the warm-up was cancelled"))
                    return
                tokens = tuple(words(text))
                cached = self._lookup(key, tokens, store=True)
                if pin:
                    with self._lock:
                        self._stored[(key, tokens)]["pinned"] = True
                if not future.done():
                    future.set_result(
                        WarmResult(prompt_tokens=len(tokens), cached_tokens=cached, pinned=pin)
                    )
            finally:
                with self._lock:
                    self.warms_running -= 1

        threading.Thread(target=run, daemon=True).start()
        return handle, future

    def shutdown(self, timeout: float = 10.0, save_timeout: float = 10.0) -> None:
        self.shutdown_calls += 1
        self._closed = True
        for handle in list(self.handles):
            handle.cancel()
        for handle in list(self.handles):
            if handle.thread is not None:
                handle.thread.join(timeout)

    # Internals

    def _lookup(self, key: str, tokens: tuple[str, ...], store: bool) -> int:
        """Longest common word prefix with the stored prompts of entry key `key` only."""
        with self._lock:
            best, best_key = 0, None
            for stored_key, stored in self._stored:
                if stored_key != key:
                    continue
                n = 0
                for a, b in zip(stored, tokens, strict=False):
                    if a != b:
                        break
                    n += 1
                if n > best:
                    best, best_key = n, (stored_key, stored)
            best = min(best, len(tokens) - 1)  # at least one token is always computed
            if best > 0 and best_key is not None:
                self._stats["hits"] += 1
                self._stats["tokens_reused"] += best
                self._stored[best_key]["hits"] += 1
            else:
                self._stats["misses"] += 1
            if store and (key, tokens) not in self._stored:
                self._ids += 1
                self._stored[(key, tokens)] = {
                    "id": self._ids,
                    "hits": 0,
                    "created": time.monotonic(),
                    "pinned": False,
                }
            return max(best, 0)

    def _generate(
        self,
        handle: FakeHandle,
        directives: dict[str, str | None],
        sampling: SamplingParams,
        prompt_tokens: int,
        cached: int,
    ) -> None:
        reply = directives.get("reply") or self.reply
        delay = float(directives.get("delay") or 0)
        self.unhang.wait(float(directives.get("hang") or 0))
        fail_after = directives.get("fail_after")
        start = time.perf_counter()
        first = None
        emitted, text = 0, ""

        def usage() -> Usage:
            now = time.perf_counter()
            ttft = (first or now) - start
            decode_s = now - (first or now)
            return Usage(
                prompt_tokens=prompt_tokens,
                completion_tokens=emitted,
                cached_tokens=cached,
                ttft_s=ttft,
                prefill_tokens_per_s=(prompt_tokens - cached) / max(ttft, 1e-6),
                cache_written_tokens=handle.cache_written_tokens or 0,
                decode_tokens_per_s=(emitted - 1) / decode_s if emitted > 1 and decode_s else 0.0,
            )

        tokenizer = self.model.tokenizer
        for piece in words(reply):
            if delay:
                handle.cancelled.wait(delay)
            if handle.cancelled.is_set():
                handle.push(DoneEvent("cancelled", usage()))
                return
            if fail_after is not None and emitted >= int(fail_after):
                handle.push(ErrorEvent("fake engine failed mid-stream"))
                return
            if emitted >= sampling.max_tokens:
                handle.push(DoneEvent("length", usage()))
                return
            before, text = text, text + piece
            found = [(text.find(s, max(0, len(before) - len(s) + 1)), s) for s in sampling.stop]
            hits = [h for h, _ in found if h >= 0]
            first = first or time.perf_counter()
            emitted += 1
            logprob = -0.25 if sampling.logprobs else None
            if hits:
                cut = min(hits)
                if cut > len(before):
                    cut_piece = text[len(before) : cut]
                    handle.push(TokenEvent(cut_piece, tokenizer.token_for(cut_piece), logprob))
                matched = next(s for h, s in found if h == cut)
                handle.push(DoneEvent("stop", usage(), matched))
                return
            handle.push(TokenEvent(piece, tokenizer.token_for(piece), logprob))
        handle.push(DoneEvent("stop", usage()))


class LiveServer:
    """uvicorn on 127.0.0.1 with a free port, in a background thread."""

    def __init__(self, app: Any):
        self.app = app
        self.port = 0
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LiveServer:
        # proto=IPPROTO_TCP, or asyncio skips TCP_NODELAY on accepted connections and
        # every keep-alive request waits ~40 ms on Nagle + delayed ACK.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self._sock = sock
        config = uvicorn.Config(
            self.app,
            log_config=None,
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=2,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, daemon=True
        )
        self._thread.start()
        # Started: the app's startup ran and the socket accepts. The deadline is for a
        # hang only (a loaded machine takes seconds where an idle one takes ms); a
        # server that died in its startup says so at once.
        if not wait_until(lambda: self._server.started or not self._thread.is_alive(), HANG_S):
            self._stop()
            raise RuntimeError(f"uvicorn did not start within {HANG_S:.0f} s")
        if not self._server.started:
            self._stop()
            raise RuntimeError("uvicorn stopped during its startup (see its log)")
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._stop(), f"uvicorn did not stop within {HANG_S:.0f} s"

    def _stop(self) -> bool:
        """Ask the server to exit and wait for its thread: whether it ended."""
        assert self._server is not None and self._thread is not None
        self._server.should_exit = True
        self._thread.join(HANG_S)
        if self._thread.is_alive():
            return False
        if self._sock is not None:
            self._sock.close()  # uvicorn leaves it open when its startup failed
        return True


def wait_until(predicate: Callable[[], bool], timeout: float = 60.0) -> bool:
    """Poll until `predicate()` holds; `timeout` is a deadline for a hang, never a
    measurement (a loaded machine may take seconds where an idle one takes ms)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


@contextlib.contextmanager
def serving(
    engine: FakeEngine | None = None, *, embeddings: Any = None, **settings: Any
) -> Iterator[tuple[str, FakeEngine]]:
    """A live server for `engine` (a fresh FakeEngine by default), and the embedding model
    `embeddings` beside it on its own worker: yields (base URL, engine)."""
    from mlx_prefix.embeddings.worker import EmbeddingWorker
    from mlx_prefix.server import ServerSettings, create_app

    engine = engine or FakeEngine()
    worker = EmbeddingWorker(embeddings) if embeddings is not None else None
    try:
        app = create_app(engine, ServerSettings(**settings), embeddings=worker)
        with LiveServer(app) as server:
            yield server.url, engine
        engine.shutdown(timeout=5)
    finally:
        if worker is not None:
            worker.close()


@contextlib.contextmanager
def raw_post(url: str, path: str, body: bytes) -> Iterator[socket.socket]:
    """A JSON POST sent over a bare socket; leaving the block hangs up (a client gone)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        yield sock
