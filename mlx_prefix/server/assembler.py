"""Token events -> reply deltas: reasoning, text and structured tool calls, for every API
family (chat, completions, Anthropic messages, Responses).

Tool-call markup never leaks as text: the model's calls come out as structured calls in
OpenAI's `tool_calls` shape ({"id", "type": "function", "function": {"name",
"arguments": JSON text}}), the one form each family converts from. A reply whose prompt
opened the assistant's turn with text (a forced tool call, server/tool_choice.py) is
read as continuing that text. With `split_thinking`, a reply that opens with the
model's think marker (`<think>`) has its reasoning split off until the end marker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlx_prefix.records import DoneEvent, TokenEvent

from . import responses as R
from .protocol.request import GenerationRequest
from .tools import ToolCallFormatter, ToolCallSplitter, ToolSyntax, _partial_suffix


@dataclass(frozen=True)
class Delta:
    text: str
    tool_calls: list[dict[str, Any]]  # OpenAI's tool_calls shape
    logprobs: list[R.TokenLogprob]
    reasoning: str = ""

    def __bool__(self) -> bool:
        return bool(self.text or self.tool_calls or self.logprobs or self.reasoning)


@dataclass
class ThinkSplitter:
    """Reasoning at the reply's start, between the think markers, held apart from text."""

    start: str
    end: str
    _pending: str = ""
    _state: str = "opening"  # opening (may still see the start marker) | thinking | done

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, text) safe to hand out now."""
        self._pending += text
        if self._state == "opening":
            stripped = self._pending.lstrip()
            if stripped.startswith(self.start):
                self._pending, self._state = stripped[len(self.start) :], "thinking"
            elif self.start.startswith(stripped):
                return "", ""  # could still become the start marker
            else:
                self._state = "done"
        if self._state == "thinking":
            at = self._pending.find(self.end)
            if at < 0:
                keep = _partial_suffix(self._pending, self.end)
                cut = len(self._pending) - keep
                reasoning, self._pending = self._pending[:cut], self._pending[cut:]
                return reasoning, ""
            reasoning, rest = self._pending[:at], self._pending[at + len(self.end) :]
            self._pending, self._state = "", "done"
            return reasoning, rest.lstrip("\n")
        text, self._pending = self._pending, ""
        return "", text

    def finish(self) -> tuple[str, str]:
        pending, self._pending = self._pending, ""
        if self._state == "thinking":
            return pending, ""
        return "", pending


@dataclass
class Assembler:
    logprobs: bool
    splitter: ToolCallSplitter | None = None
    formatter: ToolCallFormatter | None = None
    thinking: ThinkSplitter | None = None
    made_tool_call: bool = False

    @classmethod
    def for_request(
        cls,
        req: GenerationRequest,
        tokenizer: Any,
        streaming: bool,
        *,
        split_thinking: bool = False,
    ) -> Assembler:
        thinking = None
        if split_thinking and getattr(tokenizer, "has_thinking", False):
            thinking = ThinkSplitter(tokenizer.think_start, tokenizer.think_end)
        syntax = ToolSyntax.of(tokenizer) if req.parse_tools else None
        if syntax is None:
            return cls(logprobs=req.sampling.logprobs, thinking=thinking)
        splitter = ToolCallSplitter(syntax)
        opening = req.prompt.assistant_prefix
        if opening:
            # The reply continues the forced call the prompt opened: no reasoning first.
            thinking = None
            split = splitter.feed(opening)
            assert not split.text and not split.calls, "an opening is a call's start"
        return cls(
            logprobs=req.sampling.logprobs,
            splitter=splitter,
            formatter=ToolCallFormatter(syntax, req.prompt.tools, streaming),
            thinking=thinking,
        )

    def feed(self, event: TokenEvent) -> Delta:
        lps = []
        if self.logprobs and event.logprob is not None:
            lps.append(R.TokenLogprob(event.text, event.logprob))
        reasoning, text = self.thinking.feed(event.text) if self.thinking else ("", event.text)
        if self.splitter is None:
            return Delta(text, [], lps, reasoning)
        return self._split(self.splitter.feed(text), lps, reasoning)

    def finish(self) -> Delta:
        reasoning, text = self.thinking.finish() if self.thinking else ("", "")
        if self.splitter is None:
            return Delta(text, [], [], reasoning)
        if text:
            head = self._split(self.splitter.feed(text), [], reasoning)
            tail = self._split(self.splitter.finish(), [], "")
            return Delta(head.text + tail.text, head.tool_calls + tail.tool_calls, [], reasoning)
        return self._split(self.splitter.finish(), [], reasoning)

    def finish_reason(self, done: DoneEvent) -> str:
        if done.finish_reason == "stop" and self.made_tool_call:
            return "tool_calls"
        return done.finish_reason

    def _split(self, split: Any, lps: list[R.TokenLogprob], reasoning: str) -> Delta:
        assert self.formatter is not None
        calls, failed = self.formatter.format(split.calls) if split.calls else ([], "")
        self.made_tool_call |= bool(calls)
        return Delta(split.text + failed, calls, lps, reasoning)
