"""The chat and completions families' replies: OpenAI's response bodies and SSE chunks,
built from plain values (one shape for both: `kind` picks chat's message and deltas or a
completion's text). No I/O here."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

from mlx_prefix.errors import MlxPrefixError
from mlx_prefix.records import ProgressEvent, Usage

from ..errors import body_for
from ..protocol.request import GenerationRequest
from .assembler import TokenLogprob
from .sse import DONE
from .sse import chunk as sse
from .stream import Collected

Kind = Literal["chat", "completion"]


@dataclass(frozen=True)
class ReplyMeta:
    """What every body and chunk of one response repeats."""

    kind: Kind
    model: str
    id: str
    created: int = field(default_factory=lambda: int(time.time()))
    # The request used the deprecated `functions`: its call goes out as `function_call`
    # (one call, finish_reason "function_call"), as OpenAI answered those requests.
    legacy_functions: bool = False

    def finish(self, reason: str) -> str:
        return "function_call" if self.legacy_functions and reason == "tool_calls" else reason

    def calls(self, tool_calls: list[dict[str, Any]]) -> dict[str, Any]:
        """The message (or delta) fields that carry the reply's calls."""
        if not tool_calls:
            return {}
        if self.legacy_functions:
            return {"function_call": tool_calls[0]["function"]}
        return {"tool_calls": tool_calls}

    def head(self, streaming: bool) -> dict[str, Any]:
        if self.kind == "chat":
            obj = "chat.completion.chunk" if streaming else "chat.completion"
        else:
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def logprobs_body(kind: str, logprobs: list[TokenLogprob]) -> dict[str, Any] | None:
    """OpenAI's shapes: chat `{"content": [{token, logprob, bytes, top_logprobs}]}`;
    completions `{tokens, token_logprobs, top_logprobs, text_offset}`, where each
    position's top_logprobs dict holds the N most likely tokens and the sampled one."""
    if not logprobs:
        return None
    if kind == "chat":
        content = [
            {
                **_token(lp.token, lp.logprob),
                "top_logprobs": [_token(a.token, a.logprob) for a in lp.top],
            }
            for lp in logprobs
        ]
        return {"content": content}
    offsets, offset = [], 0
    for lp in logprobs:
        offsets.append(offset)
        offset += len(lp.token)
    tops = []
    for lp in logprobs:
        top: dict[str, float] = {}
        for a in lp.top:  # most likely first: a text two tokens share keeps the higher
            top.setdefault(a.token, a.logprob)
        top.setdefault(lp.token, lp.logprob)
        tops.append(top)
    return {
        "tokens": [lp.token for lp in logprobs],
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def _token(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def completion_body(
    meta: ReplyMeta,
    *,
    text: str,
    tool_calls: list[dict[str, Any]],
    finish_reason: str,
    usage: Usage,
    logprobs: list[TokenLogprob] | None,
    reasoning: str = "",
) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "finish_reason": meta.finish(finish_reason)}
    if meta.kind == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": text or None}
        if reasoning:
            message.update(reasoning_fields(reasoning))
        message.update(meta.calls(tool_calls))
        choice["message"] = message
    else:
        choice["text"] = text
    choice["logprobs"] = logprobs_body(meta.kind, logprobs) if logprobs is not None else None
    return {**meta.head(False), "choices": [choice], "usage": usage_body(usage)}


def reasoning_fields(reasoning: str) -> dict[str, str]:
    """A chat reply's reasoning under both names clients read: `reasoning_content`
    (DeepSeek's, vLLM's, most clients') and `reasoning` (mlx_lm.server's, newer vLLM's)."""
    return {"reasoning_content": reasoning, "reasoning": reasoning}


def chunk(
    meta: ReplyMeta,
    *,
    text: str | None = None,
    reasoning: str = "",
    role: bool = False,
    tool_calls: list[dict[str, Any]] | None = None,
    finish_reason: str | None = None,
    logprobs: list[TokenLogprob] | None = None,
    include_usage: bool = False,
) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0}
    if meta.kind == "chat":
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if reasoning:
            delta.update(reasoning_fields(reasoning))
        if text is not None:
            delta["content"] = text
        delta.update(meta.calls(tool_calls or []))
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    choice["logprobs"] = logprobs_body(meta.kind, logprobs) if logprobs else None
    choice["finish_reason"] = None if finish_reason is None else meta.finish(finish_reason)
    body = {**meta.head(True), "choices": [choice]}
    if include_usage:
        # OpenAI sends usage: null on every chunk but the last when include_usage is on.
        body["usage"] = None
    return body


def usage_chunk(meta: ReplyMeta, usage: Usage) -> dict[str, Any]:
    return {**meta.head(True), "choices": [], "usage": usage_body(usage)}


@dataclass
class ChatWriter:
    """A chat or completion reply (a stream.ReplyWriter). Streamed: a role chunk first
    (chat), content and tool-call deltas, the finish chunk, optionally a usage chunk,
    then [DONE]; a failure is one error chunk. Whole: one completion body."""

    meta: ReplyMeta
    include_usage: bool
    logprobs: bool = False  # the request asked for them: the body carries them

    @classmethod
    def for_request(
        cls,
        kind: Literal["chat", "completion"],
        model: str,
        request_id: str,
        req: GenerationRequest,
    ) -> ChatWriter:
        meta = ReplyMeta(kind, model, request_id, legacy_functions=req.legacy_functions)
        return cls(meta, req.include_usage, req.sampling.logprobs)

    def opening(self) -> list[bytes]:
        if self.meta.kind != "chat":
            return []
        return [sse(chunk(self.meta, role=True, text="", include_usage=self.include_usage))]

    def delta(self, delta: Any) -> list[bytes]:
        body = chunk(
            self.meta,
            text=delta.text if delta.text or not (delta.tool_calls or delta.reasoning) else None,
            reasoning=delta.reasoning,
            tool_calls=delta.tool_calls,
            logprobs=delta.logprobs,
            include_usage=self.include_usage,
        )
        return [sse(body)]

    def progress(self, event: ProgressEvent) -> list[bytes]:
        """llama.cpp's progress chunk: an empty delta and `prompt_progress` (`processed`
        counts the cached tokens too, as llama.cpp's does)."""
        body = chunk(self.meta, include_usage=self.include_usage)
        body["prompt_progress"] = {
            "total": event.total,
            "cache": event.cached,
            "processed": event.processed,
            "time_ms": round(event.elapsed_s * 1000),
        }
        return [sse(body)]

    def closing(self, done: Any, finish: str) -> list[bytes]:
        out = [sse(chunk(self.meta, finish_reason=finish, include_usage=self.include_usage))]
        if self.include_usage:
            out.append(sse(usage_chunk(self.meta, done.usage)))
        return [*out, DONE]

    def failure(self, error: MlxPrefixError) -> list[bytes]:
        return [sse(body_for(error))]

    def whole(self, result: Collected, finish: str) -> dict[str, Any]:
        return completion_body(
            self.meta,
            text=result.text,
            reasoning=result.reasoning,
            tool_calls=result.tool_calls,
            finish_reason=finish,
            usage=result.done.usage,
            logprobs=result.logprobs if self.logprobs else None,
        )
