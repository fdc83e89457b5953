"""Library API: generate with prefix reuse from a script, no server needed.

from mlx_prefix import PrefixCacheSession
with PrefixCacheSession() as session:            # bundled default model
    r = session.generate("Summarize ...", system=LONG_SYSTEM_PROMPT)
    r = session.generate("And now ...", system=LONG_SYSTEM_PROMPT)
    print(r.text, r.usage.cached_tokens)         # the system prompt was reused
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass
from typing import Any

from mlx_prefix.config import CacheConfig, DiskConfig, EngineConfig
from mlx_prefix.conversation import Message
from mlx_prefix.engine.engine import Engine
from mlx_prefix.engine.requests.handle import RequestHandle
from mlx_prefix.errors import MlxPrefixError
from mlx_prefix.models.load import LoadedModel, load_model
from mlx_prefix.records import (
    CachePreference,
    DoneEvent,
    ErrorEvent,
    ProgressEvent,
    PromptInput,
    SamplingParams,
    TokenEvent,
    Usage,
)
from mlx_prefix.server.protocol.messages import conversation_from_dicts


@dataclass(frozen=True, slots=True)
class GenerationResult:
    text: str
    tokens: tuple[int, ...]
    finish_reason: str
    usage: Usage


def chat_prompt(
    prompt: str | None = None,
    *,
    system: str | None = None,
    messages: Sequence[dict[str, Any]] | None = None,
    **template_kwargs: Any,
) -> PromptInput:
    """Messages from a user prompt and an optional system prompt (or given messages, in
    chat completions' shape: InvalidRequest naming the field if one is malformed)."""
    chat = list(conversation_from_dicts(list(messages))) if messages else []
    if system is not None and not (chat and chat[0].role == "system"):
        chat.insert(0, Message("system", system))
    if prompt is not None:
        chat.append(Message("user", prompt))
    return PromptInput(messages=tuple(chat), chat_template_kwargs=template_kwargs)


class PrefixCacheSession:
    """An engine on one model whose prefix cache lives as long as the session."""

    def __init__(
        self,
        model: str | LoadedModel | None = None,
        *,
        cache_config: CacheConfig | None = None,
        engine_config: EngineConfig | None = None,
        disk_config: DiskConfig | None = None,
        draft: LoadedModel | None = None,
    ):
        """`disk_config`: persist checkpoints across processes (None: memory only).
        `draft`: a draft model for speculative decoding (engine/decode/speculative.py)."""
        loaded = model if isinstance(model, LoadedModel) else load_model(model)
        self.engine = Engine(
            loaded, cache_config, engine_config, disk_config=disk_config, draft=draft
        )

    def __enter__(self) -> PrefixCacheSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.engine.shutdown()

    def submit(
        self,
        prompt: PromptInput,
        sampling: SamplingParams | None = None,
        cache: bool = True,
        *,
        progress: bool = False,
    ) -> RequestHandle:
        return self.engine.submit(
            prompt, sampling or SamplingParams(), CachePreference(cache), progress=progress
        )

    def stream(
        self,
        prompt: PromptInput,
        sampling: SamplingParams | None = None,
        cache: bool = True,
        *,
        progress: bool = False,
    ) -> Iterator[TokenEvent | DoneEvent | ProgressEvent]:
        """Token events, then one DoneEvent (`progress`: ProgressEvents first, while the
        prompt is prefilled). Raises MlxPrefixError on an engine error. Stopping early
        (break, an exception, Ctrl-C) cancels the request."""
        handle = self.submit(prompt, sampling, cache, progress=progress)
        with closing(handle.events()) as events:
            for event in events:
                if isinstance(event, ErrorEvent):
                    raise MlxPrefixError(event.message)
                yield event

    def generate(
        self,
        prompt: str | PromptInput,
        *,
        system: str | None = None,
        max_tokens: int = 256,
        temperature: float = 0.0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        cache: bool = True,
    ) -> GenerationResult:
        if isinstance(prompt, str):
            prompt = chat_prompt(prompt, system=system)
        sampling = SamplingParams(max_tokens, temperature, seed=seed, stop=tuple(stop))
        parts: list[str] = []
        tokens: list[int] = []
        for event in self.stream(prompt, sampling, cache):
            if isinstance(event, TokenEvent):
                parts.append(event.text)
                if event.token is not None:
                    tokens.append(event.token)
            elif isinstance(event, DoneEvent):
                return GenerationResult(
                    "".join(parts), tuple(tokens), event.finish_reason, event.usage
                )
        raise MlxPrefixError("the engine ended the request without a result")

    def warm(self, prompt: str | PromptInput, *, system: str | None = None, pin: bool = False):
        if isinstance(prompt, str):
            prompt = chat_prompt(prompt, system=system)
        return self.engine.warm(prompt, pin=pin)
