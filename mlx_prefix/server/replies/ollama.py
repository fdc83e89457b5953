"""The Ollama family's replies to /api/chat and /api/generate: OllamaWriter, the NDJSON
lines of a stream (`done: false` chunks, then one `done: true` object carrying the
counts and durations; framed by replies/ndjson.py) and the same object whole for
`stream: false`.

Durations are nanoseconds, as Ollama reports them: `total_duration` from the request's
arrival, `load_duration` the time spent loading the model for it (0 when resident),
`prompt_eval_duration` until the first token (queueing and prefill), `eval_duration`
from the first token to the last. `prompt_eval_count` counts every prompt token, as
Ollama does, cached or not; `prompt_eval_cached_count` (an extra field Ollama's clients
ignore) says how many of them came from the prefix cache. A tool call's arguments are an
object, as Ollama sends them, and a reply that calls a tool ends with `done_reason`
"stop", as Ollama's does.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass
from typing import Any, Literal

from mlx_prefix.conversation import decode_arguments
from mlx_prefix.errors import MlxPrefixError
from mlx_prefix.records import DoneEvent, ProgressEvent, Usage

from .assembler import Delta, TokenLogprob
from .ndjson import line
from .stream import Collected

CACHED_FIELD = "prompt_eval_cached_count"


def created_at() -> str:
    """Now, in UTC, as Ollama writes `created_at` (RFC 3339 with fractional seconds)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    return now.isoformat(timespec="microseconds").replace("+00:00", "Z")


def ns(seconds: float) -> int:
    return max(0, round(seconds * 1e9))


@dataclass(frozen=True)
class ReplyMeta:
    """What every object of one reply carries, and when the request began."""

    kind: Literal["chat", "generate"]
    model: str  # the served model, named as /api/tags lists it
    started: float  # time.perf_counter() when the request arrived
    load_s: float = 0.0  # spent loading the model for this request

    def base(self) -> dict[str, Any]:
        return {"model": self.model, "created_at": created_at()}

    def metrics(self, usage: Usage) -> dict[str, Any]:
        decode_s = (
            (usage.completion_tokens - 1) / usage.decode_tokens_per_s
            if usage.decode_tokens_per_s > 0
            else 0.0
        )
        return {
            "total_duration": ns(time.perf_counter() - self.started),
            "load_duration": ns(self.load_s),
            "prompt_eval_count": usage.prompt_tokens,
            "prompt_eval_duration": ns(usage.ttft_s),
            "eval_count": usage.completion_tokens,
            "eval_duration": ns(decode_s),
            CACHED_FIELD: usage.cached_tokens,
        }

    def body(
        self,
        text: str,
        reasoning: str = "",
        tool_calls: list[dict[str, Any]] | None = None,
        logprobs: list[TokenLogprob] | None = None,
    ) -> dict[str, Any]:
        """One object's reply part: chat's `message`, or generate's `response`."""
        out = self.base()
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if reasoning:
                message["thinking"] = reasoning
            if tool_calls:
                message["tool_calls"] = [ollama_call(c, i) for i, c in enumerate(tool_calls)]
            out["message"] = message
        else:
            out["response"] = text
            if reasoning:
                out["thinking"] = reasoning
        if logprobs:
            out["logprobs"] = [logprob_body(lp) for lp in logprobs]
        return out

    def final(self, body: dict[str, Any], done: DoneEvent) -> dict[str, Any]:
        return {
            **body,
            "done": True,
            "done_reason": done_reason(done),
            **self.metrics(done.usage),
        }

    def loaded(self, reason: Literal["load", "unload"]) -> dict[str, Any]:
        """The answer to a request with nothing to generate (it loaded or unloaded)."""
        return {**self.body(""), "done": True, "done_reason": reason}


def done_reason(done: DoneEvent) -> str:
    return "length" if done.finish_reason == "length" else "stop"


def ollama_call(call: dict[str, Any], index: int) -> dict[str, Any]:
    """An OpenAI-shaped call (replies/tools.py) as Ollama's: arguments as an object."""
    function = call["function"]
    arguments = decode_arguments(function["arguments"])
    return {
        "id": call["id"],
        "function": {
            "index": call.get("index", index),
            "name": function["name"],
            "arguments": arguments if isinstance(arguments, dict) else {},
        },
    }


def logprob_body(lp: TokenLogprob) -> dict[str, Any]:
    out: dict[str, Any] = {"token": lp.token, "logprob": lp.logprob}
    if lp.top:
        out["top_logprobs"] = [{"token": a.token, "logprob": a.logprob} for a in lp.top]
    return out


class OllamaWriter:
    """The Ollama family's ReplyWriter (replies/stream.py): NDJSON lines when streamed,
    one object when not."""

    def __init__(self, meta: ReplyMeta):
        self.meta = meta

    def opening(self) -> list[bytes]:
        return []

    def delta(self, delta: Delta) -> list[bytes]:
        body = self.meta.body(delta.text, delta.reasoning, delta.tool_calls, delta.logprobs)
        return [line({**body, "done": False})]

    def progress(self, event: ProgressEvent) -> list[bytes]:
        return []  # only chat and completions streams offer `return_progress`

    def closing(self, done: DoneEvent, finish: str) -> list[bytes]:
        return [line(self.meta.final(self.meta.body(""), done))]

    def failure(self, error: MlxPrefixError) -> list[bytes]:
        # Ollama's clients raise on a line carrying "error" (the status is already sent).
        return [line({"error": error.message})]

    def whole(self, result: Collected, finish: str) -> dict[str, Any]:
        """`stream: false`: the whole reply in the final object."""
        body = self.meta.body(
            result.text, result.reasoning, result.tool_calls, result.logprobs or None
        )
        return self.meta.final(body, result.done)
