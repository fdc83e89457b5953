"""Run requests through an Engine and compare warm answers to cold ones; engines that
shut down however a `with` block ends."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlx_prefix.cache.store import CheckpointKind
from mlx_prefix.config import EngineConfig
from mlx_prefix.conversation import Message
from mlx_prefix.engine.decode import arrival
from mlx_prefix.engine.decode.sampling import TokenSampler
from mlx_prefix.engine.engine import Engine
from mlx_prefix.engine.forward.runner import prefill
from mlx_prefix.engine.requests.handle import RequestHandle
from mlx_prefix.records import (
    CachePreference,
    DoneEvent,
    ErrorEvent,
    PromptInput,
    SamplingParams,
    TokenEvent,
    Usage,
)
from support.models import TEST_CACHE

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


@contextlib.contextmanager
def open_engine(*args: Any, **kwargs: Any) -> Iterator[Engine]:
    """`Engine(*args, **kwargs)` for the `with` block, shut down however the block ends
    (a failed assertion included: no engine thread outlives its test)."""
    engine = Engine(*args, **kwargs)
    try:
        yield engine
    finally:
        engine.shutdown()


class ScriptedSampler:
    """The script's tokens in turn, then EOS, whatever the logits say."""

    def __init__(self, tokens: list[int], eos: int):
        self.tokens, self.eos = list(tokens), eos

    def __call__(self, logits: mx.array, logprobs: mx.array | None = None) -> mx.array:
        return mx.array([self.tokens.pop(0) if self.tokens else self.eos], dtype=mx.uint32)


@contextlib.contextmanager
def scripted_engine(model: Any, scripts: Mapping[int, str]) -> Iterator[Engine]:
    """An engine (prefetching at once) whose requests seeded with a key of `scripts`
    reply with its text, token for token, then EOS, through the real engine's path
    (prefill, cache, prefetch); other requests sample as usual. The engine is made, and
    must be used, inside the block: the sampler is patched for as long as it lasts."""
    tokenizer = model.tokenizer
    ids = {s: tokenizer.encode(t, add_special_tokens=False) for s, t in scripts.items()}
    assert all(tokenizer.decode(ids[s]) == t for s, t in scripts.items())
    eos = min(tokenizer.eos_token_ids)

    def sampler(params: SamplingParams, *args: Any) -> Any:
        if params.seed in ids:
            return ScriptedSampler(ids[params.seed], eos)
        return TokenSampler(params, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(arrival, "TokenSampler", sampler)
        yield Engine(model, TEST_CACHE, EngineConfig(prefetch_delay_s=0))


@dataclass
class Result:
    text: str
    tokens: list[int]
    usage: Usage
    finish_reason: str
    logprobs: list[float]  # of each token, when the sampling asked for them


def run(engine: Engine, prompt: PromptInput, *, cache: bool = True, sampling=GREEDY) -> Result:
    return collect(engine.submit(prompt, sampling, CachePreference(enabled=cache)))


def same_reply(a: Result, b: Result) -> None:
    """Two answers are one: the same tokens, logprobs, text and finish reason."""
    assert (a.tokens, a.logprobs, a.text, a.finish_reason) == (
        b.tokens,
        b.logprobs,
        b.text,
        b.finish_reason,
    )


def history_before_tool(engine: Engine, prompt: PromptInput) -> list[int]:
    """`prompt`'s tokens up to where its first tool result begins (a grid point): the
    history and the turn that called the tool."""
    assert prompt.messages is not None
    first = next(i for i, m in enumerate(prompt.messages) if m.role == "tool")
    cut = PromptInput(messages=prompt.messages[: first + 1], tools=prompt.tools)
    plan = engine.planner.plan(cut)
    end = max(c.position for c in plan.checkpoints if c.kind is CheckpointKind.LAST_MESSAGE)
    return list(plan.tokens[:end])


def collect(handle: RequestHandle, timeout: float = 600) -> Result:
    """A submitted request's whole answer (an engine error fails the test). `timeout`:
    the longest wait for one event, a deadline for a hang only (a cold 16K-token prefill
    took over 120 s before its first token on a loaded 2-core machine)."""
    text, tokens, logprobs = [], [], []
    for event in handle.events(timeout=timeout):
        if isinstance(event, TokenEvent):
            text.append(event.text)
            if event.token is not None:
                tokens.append(event.token)
            if event.logprob is not None:
                logprobs.append(event.logprob)
        elif isinstance(event, ErrorEvent):
            raise AssertionError(f"engine error: {event.message}")
        elif isinstance(event, DoneEvent):
            return Result("".join(text), tokens, event.usage, event.finish_reason, logprobs)
    raise AssertionError("no DoneEvent")


def chat(*messages: tuple[str, str], **kwargs) -> PromptInput:
    return PromptInput(
        messages=tuple(Message(r, c) for r, c in messages), chat_template_kwargs=kwargs
    )


EXACT = SamplingParams(max_tokens=12, temperature=0.0, logprobs=True)


def warm_equals_cold(engine: Engine, prompt: PromptInput) -> Result:
    """Serve `prompt` with the cache, then again without it; the answers must match,
    down to the bits of every token's logprob (greedy tokens alone would hide a drift of
    1e-6 that, some day, flips a token)."""
    warm = run(engine, prompt, sampling=EXACT)
    cold = run(engine, prompt, cache=False, sampling=EXACT)
    assert cold.usage.cached_tokens == 0
    assert warm.tokens == cold.tokens, "a cache hit changed the answer"
    assert warm.logprobs == cold.logprobs, "a cache hit changed the numbers"
    assert len(warm.logprobs) == len(warm.tokens)
    return warm


@contextmanager
def prefill_held(engine: Engine, when: Callable[[], bool] = lambda: True) -> Iterator[None]:
    """Hold the engine's next prefill step (one taken while `when()` holds) until the
    block ends (60 s at most): what the block submits is in the engine's inbox when that
    step ends, and is scheduled right after it, whatever the machine's speed. A request
    the engine took before the block has been scheduled, but computes nothing until then."""
    gate, step = threading.Event(), engine.loop.prefill.step

    def held(*args, **kwargs):
        if when():
            gate.wait(60)
        return step(*args, **kwargs)

    engine.loop.prefill.step = held
    try:
        yield
    finally:
        gate.set()
        engine.loop.prefill.step = step


def submit_together(
    engine: Engine,
    prompts: Sequence[PromptInput],
    sampling: SamplingParams | Sequence[SamplingParams],
    prefs: Sequence[CachePreference] | None = None,
) -> list[RequestHandle]:
    """Submit `prompts` as a burst that arrives together whatever the machine's speed:
    the first may start, but its first prefill step waits until every one is submitted
    (the rest are scheduled at its next step)."""
    samplings = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else sampling
    prefs = prefs or [CachePreference()] * len(prompts)
    with prefill_held(engine):
        return [engine.submit(p, s, c) for p, s, c in zip(prompts, samplings, prefs, strict=True)]


_client = threading.local()  # what the submitting thread's next handle does (PacedHandle)


class PacedHandle(RequestHandle):
    """A handle whose client decides when its request goes on, however late the client's
    thread runs. Created in `paced_submit`: cancelled before the engine sees it
    (`at_once`), or the engine waits after emitting its `after`-th token until the
    client cancels or `release()`s it (60 s at most: a deadline for a hang), as if that
    token took until then to compute. Install with `engine.handle_type = PacedHandle`;
    a plain `submit` paces nothing."""

    def __init__(self, request_id: str, prompt_tokens: int, **prompt):
        super().__init__(request_id, prompt_tokens, **prompt)
        self.after: int | None = getattr(_client, "after", None)
        self._tokens = 0
        self._go = threading.Event()
        if getattr(_client, "at_once", False):
            self.cancel()

    def cancel(self) -> None:
        super().cancel()
        self._go.set()

    def release(self) -> None:
        """Let the engine go on past the `after`-th token."""
        self._go.set()

    def emit(self, event) -> None:
        super().emit(event)
        if isinstance(event, TokenEvent) and event.token is not None:
            self._tokens += 1
            if self._tokens == self.after:
                self._go.wait(60)


@contextmanager
def paced(*, at_once: bool = False, after: int | None = None) -> Iterator[None]:
    """What the PacedHandles this thread creates inside the block do (see PacedHandle)."""
    _client.at_once, _client.after = at_once, after
    try:
        yield
    finally:
        _client.at_once, _client.after = False, None


def paced_submit(
    engine: Engine,
    prompt: PromptInput,
    sampling: SamplingParams,
    pref: CachePreference | None = None,
    *,
    at_once: bool = False,
    after: int | None = None,
) -> RequestHandle:
    """Submit through a PacedHandle (see there) from this thread."""
    assert engine.handle_type is PacedHandle
    with paced(at_once=at_once, after=after):
        return engine.submit(prompt, sampling, pref or CachePreference())


def wait_for(condition, timeout: float = 60.0) -> bool:
    """Poll `condition` until it holds (True) or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def wait_stored(engine, prefix: Sequence[int], timeout: float = 60.0) -> bool:
    """Poll until the engine's cache holds an entry that starts with `prefix` (what a
    prefetch or a request stores). Waiting for a count instead (prefetch.completed > n)
    can be met by an earlier request's late prefetch while the one awaited is still on
    its way: the request sent next then misses it."""
    want = tuple(prefix)

    def held() -> bool:
        stored = engine.store.sequences(engine.model_key)
        return any(tuple(s.tokens[: len(want)]) == want for s in stored)

    return wait_for(held, timeout)


def cache_states(cache: list) -> list[mx.array]:
    """Every array of a cache's state (a KV layer's up to its offset: past it the
    step-padded buffer holds junk)."""
    out: list[mx.array] = []
    for c in cache:
        state = c.state
        if type(c).__name__ == "KVCache":
            state = [a[..., : c.offset, :] for a in state[:2]]
        stack = list(state) if isinstance(state, (list, tuple)) else [state]
        while stack:
            a = stack.pop(0)
            if isinstance(a, (list, tuple)):
                stack[:0] = list(a)
            elif isinstance(a, mx.array):
                out.append(a)
    return out


def alone_prefill(engine: Engine, tokens: tuple[int, ...]) -> list[mx.array]:
    """The prefill of `tokens` alone, cold, on the engine's grid (the caller's thread:
    the engine is idle, its model's arrays are immutable)."""
    model = engine.model.model
    cache = make_prompt_cache(model)
    prefill(model, cache, tokens, 0, engine.planner.grid, lambda p: None)
    return cache_states(cache)


@contextmanager
def cancelling(
    engine: Engine, at: int, which: Callable[[PromptInput | None], bool] = lambda s: True
) -> Iterator[list[int]]:
    """Cancel each request `which` selects once its prefill has passed `at` prompt
    tokens, from inside the engine's prefill step: the cancel lands between two chunks.
    Yields the positions the cancels landed at."""
    step, landed = engine.loop.prefill.step, []

    def cancel_after(*args, **kwargs):
        out = step(*args, **kwargs)
        for task in engine.loop.prefill.tasks:
            handle = task.job.handle
            if task.position >= at and not handle.cancelled.is_set() and which(task.job.source):
                landed.append(task.position)
                handle.cancel()
        return out

    engine.loop.prefill.step = cancel_after
    try:
        yield landed
    finally:
        engine.loop.prefill.step = step
