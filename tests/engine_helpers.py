"""Run requests through an Engine and compare warm answers to cold ones."""

from __future__ import annotations

from dataclasses import dataclass

from mlx_prefix.engine.engine import Engine
from mlx_prefix.engine.request import (
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


def run(engine: Engine, prompt: PromptInput, *, cache: bool = True, sampling=GREEDY) -> Result:
    handle = engine.submit(prompt, sampling, CachePreference(enabled=cache))
    text, tokens = [], []
    for event in handle.events(timeout=120):
        if isinstance(event, TokenEvent):
            text.append(event.text)
            if event.token is not None:
                tokens.append(event.token)
        elif isinstance(event, ErrorEvent):
            raise AssertionError(f"engine error: {event.message}")
        elif isinstance(event, DoneEvent):
            return Result("".join(text), tokens, event.usage, event.finish_reason)
    raise AssertionError("no DoneEvent")


def chat(*messages: tuple[str, str], **kwargs) -> PromptInput:
    return PromptInput(
        messages=tuple({"role": r, "content": c} for r, c in messages), chat_template_kwargs=kwargs
    )


def warm_equals_cold(engine: Engine, prompt: PromptInput) -> Result:
    """Serve `prompt` with the cache, then again without it; the answers must match."""
    warm = run(engine, prompt)
    cold = run(engine, prompt, cache=False)
    assert cold.usage.cached_tokens == 0
    assert warm.tokens == cold.tokens, "a cache hit changed the answer"
    return warm
