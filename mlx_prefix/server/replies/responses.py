"""The Responses family's replies: API objects and stream events, built from the engine's
assembled deltas.

One OutputEvents per response builds its output items (a `reasoning` item holding the
reply's reasoning as one `reasoning_text` part, one assistant message holding all the
reply's text, one function_call item per tool call) and, as it goes, the stream events
announcing them, each with its sequence number: response.created and
response.in_progress; per item output_item.added, its content (output_text or
reasoning_text) or argument events, output_item.done; then response.completed (or
.incomplete when max_output_tokens cut the reply, .failed on an error). A non-streaming
response is built by the same code with the events dropped, so both give the same
output. No I/O here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mlx_prefix.errors import MlxPrefixError
from mlx_prefix.records import DoneEvent, ProgressEvent, Usage

from ..protocol.sealed import seal
from .assembler import Assembler, Delta
from .ids import new_id
from .sse import event as sse
from .stream import Collected


@dataclass(frozen=True)
class ReplyMeta:
    """What the response object repeats in every state."""

    id: str
    model: str
    instructions: str | None
    max_output_tokens: int | None
    previous_response_id: str | None
    store: bool
    temperature: float
    top_p: float
    echo: dict[str, Any]  # tools, tool_choice, metadata, ... as the request gave them
    created_at: int = field(default_factory=lambda: int(time.time()))


def response_body(
    head: ReplyMeta,
    status: str,
    output: list[dict[str, Any]],
    usage: Usage | None = None,
    *,
    error: dict[str, Any] | None = None,
    incomplete: str | None = None,
    reasoning_tokens: int = 0,
) -> dict[str, Any]:
    return {
        "id": head.id,
        "object": "response",
        "created_at": head.created_at,
        "status": status,
        "completed_at": int(time.time()) if status == "completed" else None,
        "error": error,
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        "instructions": head.instructions,
        "max_output_tokens": head.max_output_tokens,
        "model": head.model,
        "output": output,
        "previous_response_id": head.previous_response_id,
        "store": head.store,
        "temperature": head.temperature,
        "top_p": head.top_p,
        "usage": usage_body(usage, reasoning_tokens) if usage is not None else None,
        "background": False,
        **head.echo,
    }


def usage_body(usage: Usage, reasoning_tokens: int = 0) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        # The tokens of the reasoning item (shown, not hidden, here).
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


@dataclass
class _Message:
    index: int
    id: str
    texts: list[str] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)

    def part(self, with_logprobs: bool) -> dict[str, Any]:
        part: dict[str, Any] = {"type": "output_text", "text": "".join(self.texts)}
        part["annotations"] = []
        part["logprobs"] = self.logprobs if with_logprobs else []
        return part

    def item(self, status: str, with_logprobs: bool) -> dict[str, Any]:
        content = [self.part(with_logprobs)] if status != "in_progress" else []
        return {"id": self.id, "type": "message", "status": status, "role": "assistant",
                "content": content}  # fmt: skip


@dataclass
class _Reasoning:
    index: int
    id: str
    texts: list[str] = field(default_factory=list)

    def part(self) -> dict[str, Any]:
        return {"type": "reasoning_text", "text": "".join(self.texts)}

    def item(self, status: str) -> dict[str, Any]:
        content = [self.part()] if status != "in_progress" else []
        # encrypted_content carries the text back for clients that drop `content` (Codex).
        sealed = seal(self.part()["text"]) if status != "in_progress" else None
        return {"id": self.id, "type": "reasoning", "status": status, "summary": [],
                "content": content, "encrypted_content": sealed}  # fmt: skip


@dataclass
class OutputEvents:
    head: ReplyMeta
    logprobs: bool  # include: ["message.output_text.logprobs"]
    single_call: bool  # parallel_tool_calls: false: calls after the first are dropped
    items: dict[int, dict[str, Any]] = field(default_factory=dict)  # finished, by index
    calls: int = 0
    _seq: int = 0
    _next: int = 0  # the next output index
    _message: _Message | None = None
    _reasoning: _Reasoning | None = None  # the open reasoning item
    _pending_logprobs: list[dict[str, Any]] = field(default_factory=list)
    reasoning_tokens: int = 0  # usage's output_tokens_details (set by the route)

    def start(self) -> list[dict[str, Any]]:
        return [
            self._event("response.created", response=self.body("in_progress")),
            self._event("response.in_progress", response=self.body("in_progress")),
        ]

    def add(self, delta: Delta) -> list[dict[str, Any]]:
        events = []
        lps: list[dict[str, Any]]
        lps = [{"token": lp.token, "logprob": lp.logprob, "top_logprobs": []}
               for lp in delta.logprobs]  # fmt: skip
        self._pending_logprobs += [{**lp, "bytes": list(lp["token"].encode())} for lp in lps]
        if delta.reasoning:
            events += self._add_reasoning(delta.reasoning)
        if delta.text or delta.tool_calls:
            events += self._close_reasoning("completed")
        if delta.text:
            if self._message is None:
                events += self._open_message()
            message = self._message
            assert message is not None
            message.texts.append(delta.text)
            message.logprobs += self._pending_logprobs
            self._pending_logprobs = []
            events.append(
                self._event(
                    "response.output_text.delta",
                    item_id=message.id,
                    output_index=message.index,
                    content_index=0,
                    delta=delta.text,
                    logprobs=lps if self.logprobs else [],
                )  # fmt: skip
            )
        for call in delta.tool_calls:
            if self.single_call and self.calls:
                continue
            events += self._function_call(call)
        return events

    def finish(self, done: DoneEvent) -> list[dict[str, Any]]:
        """Close the message, then the terminal event: completed, or incomplete when the
        reply was cut at max_output_tokens."""
        cut = done.finish_reason == "length"
        events = self._close_reasoning("incomplete" if cut else "completed")
        events += self._close_message("incomplete" if cut else "completed")
        status = "incomplete" if cut else "completed"
        incomplete = "max_output_tokens" if cut else None
        body = self.body(
            status, done.usage, incomplete=incomplete, reasoning_tokens=self.reasoning_tokens
        )
        return [*events, self._event(f"response.{status}", response=body)]

    def fail(self, message: str) -> dict[str, Any]:
        error = {"code": "server_error", "message": message}
        return self._event("response.failed", response=self.body("failed", error=error))

    def body(self, status: str, usage: Usage | None = None, **extra: Any) -> dict[str, Any]:
        output = [self.items[i] for i in sorted(self.items)]
        return response_body(self.head, status, output, usage, **extra)

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def _index(self) -> int:
        self._next += 1
        return self._next - 1

    def _add_reasoning(self, text: str) -> list[dict[str, Any]]:
        events = []
        item = self._reasoning
        if item is None:
            item = self._reasoning = _Reasoning(self._index(), new_id("rs_"))
            events += [
                self._event("response.output_item.added", output_index=item.index,
                            item=item.item("in_progress")),
                self._event("response.content_part.added", item_id=item.id,
                            output_index=item.index, content_index=0,
                            part={"type": "reasoning_text", "text": ""}),
            ]  # fmt: skip
        item.texts.append(text)
        events.append(
            self._event("response.reasoning_text.delta", item_id=item.id,
                        output_index=item.index, content_index=0, delta=text)
        )  # fmt: skip
        return events

    def _close_reasoning(self, status: str) -> list[dict[str, Any]]:
        item, self._reasoning = self._reasoning, None
        if item is None:
            return []
        part, done = item.part(), item.item(status)
        self.items[item.index] = done
        where = {"item_id": item.id, "output_index": item.index, "content_index": 0}
        return [
            self._event("response.reasoning_text.done", **where, text=part["text"]),
            self._event("response.content_part.done", **where, part=part),
            self._event("response.output_item.done", output_index=item.index, item=done),
        ]

    def _open_message(self) -> list[dict[str, Any]]:
        message = self._message = _Message(self._index(), new_id("msg_"))
        return [
            self._event("response.output_item.added", output_index=message.index,
                        item=message.item("in_progress", self.logprobs)),
            self._event("response.content_part.added", item_id=message.id,
                        output_index=message.index, content_index=0,
                        part={"type": "output_text", "text": "", "annotations": [],
                              "logprobs": []}),
        ]  # fmt: skip

    def _close_message(self, status: str) -> list[dict[str, Any]]:
        message = self._message
        if message is None:
            return []
        part, item = message.part(self.logprobs), message.item(status, self.logprobs)
        self.items[message.index] = item
        where = {"item_id": message.id, "output_index": message.index, "content_index": 0}
        return [
            self._event("response.output_text.done", **where, text=part["text"],
                        logprobs=[{k: lp[k] for k in ("token", "logprob", "top_logprobs")}
                                  for lp in part["logprobs"]]),
            self._event("response.content_part.done", **where, part=part),
            self._event("response.output_item.done", output_index=message.index, item=item),
        ]  # fmt: skip

    def _function_call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        index, item_id = self._index(), new_id("fc_")
        self.calls += 1
        function = call["function"]
        item = {"id": item_id, "type": "function_call", "status": "in_progress",
                "call_id": call["id"], "name": function["name"], "arguments": ""}  # fmt: skip
        done = {**item, "status": "completed", "arguments": function["arguments"]}
        self.items[index] = done
        where = {"item_id": item_id, "output_index": index}
        return [
            self._event("response.output_item.added", output_index=index, item=item),
            self._event("response.function_call_arguments.delta", **where,
                        delta=function["arguments"]),
            self._event("response.function_call_arguments.done", **where,
                        arguments=function["arguments"]),
            self._event("response.output_item.done", output_index=index, item=done),
        ]  # fmt: skip


@dataclass
class ResponsesWriter:
    """A Responses reply (a stream.ReplyWriter): the stream's events or the whole response
    object, both from one OutputEvents; the finished response is stored (`save`) before
    the stream's last event goes out, so the client can chain on it."""

    output: OutputEvents
    save: Callable[[dict[str, Any]], None]
    assembler: Assembler  # counts the reply's reasoning tokens

    def opening(self) -> list[bytes]:
        return [sse(e) for e in self.output.start()]

    def delta(self, delta: Delta) -> list[bytes]:
        return [sse(e) for e in self.output.add(delta)]

    def progress(self, event: ProgressEvent) -> list[bytes]:
        return []  # only chat and completions streams offer `return_progress`

    def closing(self, done: DoneEvent, finish: str) -> list[bytes]:
        self.output.reasoning_tokens = self.assembler.reasoning_tokens
        events = self.output.finish(done)
        self.save(events[-1]["response"])
        return [sse(e) for e in events]

    def failure(self, error: MlxPrefixError) -> list[bytes]:
        return [sse(self.output.fail(error.message))]

    def whole(self, result: Collected, finish: str) -> dict[str, Any]:
        for delta in result.deltas:
            self.output.add(delta)
        self.output.reasoning_tokens = self.assembler.reasoning_tokens
        body = self.output.finish(result.done)[-1]["response"]
        self.save(body)
        return body
