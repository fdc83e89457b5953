"""Anthropic Messages replies: content blocks, usage, stop reasons, and the SSE stream.

One block writer serves both forms, so a streamed reply and a whole one carry the same
blocks: reasoning becomes a `thinking` block, text a `text` block, each tool call a
`tool_use` block whose input arrives as one `input_json_delta`. With
`thinking.display: "omitted"` a thinking block's text is empty, as Anthropic sends it,
and its `signature` (one `signature_delta`) carries the reasoning for the client to send
back, so the next turn renders the reasoning the model wrote and its prefix stays cached.
Whitespace between blocks (the "\\n\\n" a model writes before a call) is held back and
dropped unless text follows, since Anthropic refuses whitespace-only text blocks when a
client sends them back.

The stream is the event sequence the official SDKs accumulate: message_start (sent
when the prompt has been prefilled, so its usage already says what came from the
cache), ping, then per block content_block_start / content_block_delta... /
content_block_stop, then message_delta (stop_reason, stop_sequence, the final usage)
and message_stop. A failure is one `error` event. Plain values only, no I/O.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from mlx_prefix.errors import MlxPrefixError
from mlx_prefix.records import DoneEvent, ProgressEvent, Usage

from ..errors import anthropic_error_body
from ..protocol.sealed import seal
from .assembler import Delta
from .sse import event as sse
from .stream import Collected


def usage_body(
    prompt_tokens: int, cached: int, stored_to: int, breakpoint_end: int, output_tokens: int
) -> dict[str, int]:
    """Anthropic's split of the prompt: read from the cache; written to it at the client's
    `cache_control` breakpoints (computed here up to the furthest breakpoint, which this
    request stored: `stored_to` is the furthest position it stored); every other computed
    token is plain input. A request without breakpoints writes nothing by Anthropic's
    count, whatever this server keeps for itself."""
    written = max(0, min(stored_to, breakpoint_end, prompt_tokens) - cached)
    return {
        "input_tokens": prompt_tokens - cached - written,
        "cache_creation_input_tokens": written,
        "cache_read_input_tokens": cached,
        "output_tokens": output_tokens,
    }


def final_usage(usage: Usage, breakpoint_end: int) -> dict[str, int]:
    stored_to = usage.cached_tokens + usage.cache_written_tokens
    return usage_body(
        usage.prompt_tokens,
        usage.cached_tokens,
        stored_to,
        breakpoint_end,
        usage.completion_tokens,
    )


def stop_reason(
    done: DoneEvent, made_tool_call: bool, stop_sequences: tuple[str, ...]
) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished reply."""
    if made_tool_call:
        return "tool_use", None
    if done.finish_reason == "length":
        return "max_tokens", None
    if done.stop_sequence is not None and done.stop_sequence in stop_sequences:
        return "stop_sequence", done.stop_sequence
    return "end_turn", None


@dataclass
class BlockWriter:
    """Deltas -> content block events; `blocks` accumulates the whole reply's content."""

    show_thinking: bool = True  # False: display "omitted"
    blocks: list[dict[str, Any]] = field(default_factory=list)
    made_tool_use: bool = False
    _open: str | None = None  # type of the open block
    _space: str = ""  # whitespace held back before a text block opens
    _hidden: str = ""  # the open omitted thinking block's reasoning

    def feed(self, delta: Delta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if delta.reasoning and self.show_thinking:
            events += self._continue("thinking", "thinking", delta.reasoning)
        elif delta.reasoning:
            if self._open != "thinking":
                events += self._start("thinking", "thinking")
            self._hidden += delta.reasoning
        if delta.text:
            text = self._space + delta.text
            if self._open != "text" and not text.strip():
                self._space = text  # nothing but whitespace yet
            else:
                self._space = ""
                events += self._continue("text", "text", text)
        for call in delta.tool_calls:
            events += self._close()
            self._space = ""
            events += self._tool_use(call)
        return events

    def close(self) -> list[dict[str, Any]]:
        return self._close()

    def _start(self, kind: str, key: str) -> list[dict[str, Any]]:
        events = self._close()
        start = {"type": kind, key: ""}
        if kind == "thinking":
            start["signature"] = ""  # no signer here; clients send it back as given
        self.blocks.append(dict(start))
        events.append(self._event("content_block_start", content_block=start))
        self._open = kind
        return events

    def _continue(self, kind: str, key: str, text: str) -> list[dict[str, Any]]:
        events = []
        if self._open != kind:
            events += self._start(kind, key)
        self.blocks[-1][key] += text
        delta = {"type": f"{kind}_delta", key: text}
        events.append(self._event("content_block_delta", delta=delta))
        return events

    def _tool_use(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        function = call["function"]
        arguments = function["arguments"]
        try:
            value = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            value = None
        if not isinstance(value, dict):  # Anthropic's input is an object: back as text
            text = json.dumps({"name": function["name"], "arguments": arguments})
            return self._continue("text", "text", text)
        self.made_tool_use = True
        block = {"type": "tool_use", "id": call["id"], "name": function["name"], "input": value}
        self.blocks.append(block)
        partial = json.dumps(value, ensure_ascii=False)
        return [
            self._event("content_block_start", content_block={**block, "input": {}}),
            self._event(
                "content_block_delta", delta={"type": "input_json_delta", "partial_json": partial}
            ),
            self._event("content_block_stop"),
        ]

    def _close(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        events = []
        if self._open == "thinking" and not self.show_thinking:
            signature = seal(self._hidden)
            self.blocks[-1]["signature"], self._hidden = signature, ""
            delta = {"type": "signature_delta", "signature": signature}
            events.append(self._event("content_block_delta", delta=delta))
        self._open = None
        return [*events, self._event("content_block_stop")]

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "index": len(self.blocks) - 1, **fields}


def message_body(
    message_id: str,
    model: str,
    writer: BlockWriter,
    reason: tuple[str, str | None],
    usage: dict[str, int],
) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": writer.blocks,
        "stop_reason": reason[0],
        "stop_sequence": reason[1],
        "usage": usage,
    }


@dataclass
class AnthropicWriter:
    """A Messages reply (a stream.ReplyWriter): the SSE events above, or the whole
    message; either way its content written by one BlockWriter."""

    message_id: str
    model: str
    handle: Any  # the engine's RequestHandle: prompt size, and cache use once prefilled
    stop_sequences: tuple[str, ...]  # the client's own (not a parallel-call stop added)
    blocks: BlockWriter
    _started: bool = False

    def opening(self) -> list[bytes]:
        return []

    def delta(self, delta: Delta) -> list[bytes]:
        return [*self._start(None), *(sse(e) for e in self.blocks.feed(delta))]

    def progress(self, event: ProgressEvent) -> list[bytes]:
        return []  # only chat and completions streams offer `return_progress`

    def closing(self, done: DoneEvent, finish: str) -> list[bytes]:
        out = [*self._start(done.usage), *(sse(e) for e in self.blocks.close())]
        reason, sequence = stop_reason(done, self.blocks.made_tool_use, self.stop_sequences)
        out.append(
            sse(
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": final_usage(done.usage, self.handle.breakpoint_end),
                }
            )
        )
        out.append(sse({"type": "message_stop"}))
        return out

    def failure(self, error: MlxPrefixError) -> list[bytes]:
        return [sse(anthropic_error_body(error))]

    def whole(self, result: Collected, finish: str) -> dict[str, Any]:
        for delta in result.deltas:
            self.blocks.feed(delta)
        self.blocks.close()
        reason = stop_reason(result.done, self.blocks.made_tool_use, self.stop_sequences)
        usage = final_usage(result.done.usage, self.handle.breakpoint_end)
        return message_body(self.message_id, self.model, self.blocks, reason, usage)

    def _start(self, usage: Usage | None) -> list[bytes]:
        if self._started:
            return []
        self._started = True
        if usage is not None:
            counts = final_usage(usage, self.handle.breakpoint_end)
            counts["output_tokens"] = 0
        else:
            cached = self.handle.cached_tokens or 0
            counts = usage_body(
                self.handle.prompt_tokens,
                cached,
                cached + (self.handle.cache_written_tokens or 0),
                self.handle.breakpoint_end,
                0,
            )
        message: dict[str, Any] = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": counts,
        }
        return [sse({"type": "message_start", "message": message}), sse({"type": "ping"})]
