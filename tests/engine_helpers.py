"""Run requests through an Engine and compare warm answers to cold ones."""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlx_prefix.conversation import Message
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

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


@dataclass
class Result:
    text: str
    tokens: list[int]
    usage: Usage
    finish_reason: str
    logprobs: list[float]  # of each token, when the sampling asked for them


def run(engine: Engine, prompt: PromptInput, *, cache: bool = True, sampling=GREEDY) -> Result:
    return collect(engine.submit(prompt, sampling, CachePreference(enabled=cache)))


def collect(handle: RequestHandle, timeout: float = 120) -> Result:
    """A submitted request's whole answer (an engine error fails the test)."""
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


def wait_for(condition, timeout: float = 60.0) -> bool:
    """Poll `condition` until it holds (True) or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


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
