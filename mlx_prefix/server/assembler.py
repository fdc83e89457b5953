"""Engine token events -> reply deltas (reasoning, text, tool calls, logprobs), for every
API family (chat, completions, Anthropic messages, Responses).

Tool-call markup never leaks as text: the model's calls come out as structured calls in
OpenAI's `tool_calls` shape ({"id", "type": "function", "function": {"name",
"arguments": JSON text}}), the one form each family converts from, named by the
prompt's `reply_tool_call_ids`. Splitting, parsing and naming are prompt/tool_calls.py's,
shared with the engine's next-turn prefetch, so the prefetch renders the reply exactly as
the client receives it (whitespace-only text around calls dropped alike).

A reply whose prompt opened the assistant's turn (a forced tool call, server/tool_choice.py)
is read as continuing that opening. A chat reply's reasoning (prompt/thinking.py: at the
reply's start, or from its first token when the prompt left a think block open) is split
off before the text is searched for calls, so markup written while reasoning never
becomes a call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mlx_prefix.prompt.thinking import ThinkSplitter
from mlx_prefix.records import DoneEvent, PromptInput, TokenEvent

from . import chat_bodies as R
from .protocol.request import GenerationRequest
from .tools import ReplySplitter, Split, ToolCallFormatter, ToolSyntax


@dataclass(frozen=True)
class Delta:
    text: str
    tool_calls: list[dict[str, Any]]  # OpenAI's tool_calls shape
    logprobs: list[R.TokenLogprob]
    reasoning: str = ""

    def __bool__(self) -> bool:
        return bool(self.text or self.tool_calls or self.logprobs or self.reasoning)


@dataclass
class Assembler:
    logprobs: bool
    splitter: ReplySplitter | None = None
    formatter: ToolCallFormatter | None = None
    thinking: ThinkSplitter | None = None
    made_tool_call: bool = False
    tokenizer: Any = None  # decodes the tokens of logprobs
    reasoning_tokens: int = 0  # tokens fed while the reply was reasoning
    _texts: dict[int, str] = field(default_factory=dict)  # token id -> its text

    @classmethod
    def for_request(
        cls,
        req: GenerationRequest,
        tokenizer: Any,
        streaming: bool,
        *,
        opens_reasoning: bool = False,
    ) -> Assembler:
        """`opens_reasoning`: the prompt left a think block open (the engine handle's
        flag). A raw completion's text is never split."""
        syntax = ToolSyntax.of(tokenizer) if req.parse_tools else None
        chat = req.kind == "chat"
        thinking = ThinkSplitter.of(tokenizer, opens_reasoning) if chat else None
        return cls.build(
            req.sampling.logprobs, syntax, req.prompt, streaming, tokenizer, thinking=thinking
        )

    @classmethod
    def build(
        cls,
        logprobs: bool,
        syntax: ToolSyntax | None,
        prompt: PromptInput,
        streaming: bool,
        tokenizer: Any = None,
        *,
        thinking: ThinkSplitter | None = None,
    ) -> Assembler:
        """Tool calls are parsed when `syntax` is given (tools offered, the tokenizer
        knows their markup), named by the prompt's reply_tool_call_ids; reasoning is
        split off when `thinking` is given."""
        if syntax is None:
            return cls(logprobs=logprobs, thinking=thinking, tokenizer=tokenizer)
        splitter = ReplySplitter(syntax)
        if prompt.assistant_prefix:
            # The reply continues the forced call the prompt opened: no reasoning first.
            thinking = None
            split = splitter.feed(prompt.assistant_prefix)
            assert not split.text and not split.calls, "an opening is a call's start"
        ids = prompt.reply_tool_call_ids
        return cls(
            logprobs=logprobs,
            splitter=splitter,
            formatter=ToolCallFormatter(syntax, prompt.tools, streaming, ids),
            thinking=thinking,
            tokenizer=tokenizer,
        )

    def feed(self, event: TokenEvent) -> Delta:
        lps = []
        if self.logprobs and event.logprob is not None:
            # Each token as decoded on its own, the sampled one like its alternatives (the
            # text delta may hold back a stop string or an incomplete character).
            token = self._text(event.token) if event.token is not None else event.text
            top = tuple(R.Alternative(self._text(t.token), t.logprob) for t in event.top_logprobs)
            lps.append(R.TokenLogprob(token, event.logprob, top))
        if self.thinking is not None:
            before = self.thinking.reasoning
            reasoning, text = self.thinking.feed(event.text)
            self.reasoning_tokens += before or self.thinking.reasoning
        else:
            reasoning, text = "", event.text
        if self.splitter is None:
            return Delta(text, [], lps, reasoning)
        return self._split(self.splitter.feed(text), lps, reasoning)

    def finish(self) -> Delta:
        reasoning, text = self.thinking.finish() if self.thinking else ("", "")
        if self.splitter is None:
            return Delta(text, [], [], reasoning)
        head = self._split(self.splitter.feed(text), [], reasoning) if text else None
        tail = self._split(self.splitter.finish(), [], "" if head else reasoning)
        if head is None:
            return tail
        return Delta(head.text + tail.text, head.tool_calls + tail.tool_calls, [], reasoning)

    def finish_reason(self, done: DoneEvent) -> str:
        if done.finish_reason == "stop" and self.made_tool_call:
            return "tool_calls"
        return done.finish_reason

    def _text(self, token: int) -> str:
        if token not in self._texts:
            self._texts[token] = self.tokenizer.decode([token])
        return self._texts[token]

    def _split(self, split: Split, lps: list[R.TokenLogprob], reasoning: str) -> Delta:
        assert self.formatter is not None
        calls, failed = self.formatter.format(split.calls) if split.calls else ([], "")
        self.made_tool_call |= bool(calls)
        return Delta(split.text + failed, calls, lps, reasoning)
