"""Engine token events -> reply deltas (reasoning, text, tool calls, logprobs), for every
API family (chat, completions, Anthropic messages, Responses).

Tool-call markup never leaks as text: the model's calls come out as structured calls in
OpenAI's `tool_calls` shape ({"id", "type": "function", "function": {"name",
"arguments": JSON text}}), the one form each family converts from, named by the
prompt's `reply_tool_call_ids`. Splitting, parsing and naming are prompt/reply/tool_calls.py's,
shared with the engine's next-turn prefetch, so the prefetch renders the reply exactly as
the client receives it (whitespace-only text around calls dropped alike).

A reply whose prompt opened the assistant's turn (a forced tool call, server/routes/tool_choice.py)
is read as continuing that opening. A chat reply is read by prompt/reply/reader.py's reader:
its reasoning (at the reply's start, or from its first token when the prompt left a
think block open; gpt-oss's analysis channel) is split off before the text is searched
for calls, so markup written while reasoning never becomes a call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mlx_prefix.prompt.reply.reader import ReplyFormat, ReplyReader, reply_reader
from mlx_prefix.prompt.reply.thinking import NO_EDGES, ReasoningEdges
from mlx_prefix.records import DoneEvent, PromptInput, TokenEvent

from ..protocol.request import GenerationRequest
from .tools import Split, ToolCallFormatter, ToolSyntax

if TYPE_CHECKING:
    from mlx_prefix.engine.requests.handle import RequestHandle


@dataclass(frozen=True)
class Alternative:
    token: str  # the token decoded on its own
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    logprob: float
    top: tuple[Alternative, ...] = ()  # the most likely tokens here, when asked for


@dataclass(frozen=True)
class Delta:
    text: str
    tool_calls: list[dict[str, Any]]  # OpenAI's tool_calls shape
    logprobs: list[TokenLogprob]
    reasoning: str = ""

    def __bool__(self) -> bool:
        return bool(self.text or self.tool_calls or self.logprobs or self.reasoning)


@dataclass
class Assembler:
    logprobs: bool
    reader: ReplyReader | None = None  # None: the text as it comes (nothing to split)
    formatter: ToolCallFormatter | None = None  # calls are parsed (tools offered)
    made_tool_call: bool = False
    tokenizer: Any = None  # decodes the tokens of logprobs
    reasoning_tokens: int = 0  # tokens fed while the reply was reasoning
    _texts: dict[int, str] = field(default_factory=dict)  # token id -> its text

    @classmethod
    def for_request(
        cls,
        req: GenerationRequest,
        form: ReplyFormat,
        tokenizer: Any,
        streaming: bool,
        handle: RequestHandle | None = None,
    ) -> Assembler:
        """The reply, in its model's `form` (its engine's), as `handle`'s prompt left it
        (the engine's handle of the request): inside a think block it opened, its
        reasoning dropping the edges the template writes itself; its calls parsed when
        tools were offered. A raw completion's text is never split."""
        return cls.build(
            req.sampling.logprobs,
            form,
            form.tools if req.parse_tools else None,
            req.prompt,
            streaming,
            tokenizer,
            opened=handle is not None and handle.opens_reasoning,
            reasoning=req.kind == "chat",
            edges=handle.reasoning_edges if handle is not None else NO_EDGES,
        )

    @classmethod
    def build(
        cls,
        logprobs: bool,
        form: ReplyFormat,
        syntax: ToolSyntax | None,
        prompt: PromptInput,
        streaming: bool,
        tokenizer: Any = None,
        *,
        opened: bool = False,
        reasoning: bool = False,
        edges: ReasoningEdges = NO_EDGES,
    ) -> Assembler:
        """Tool calls are parsed when `syntax` is given (tools offered, the model knows
        their markup), named by the prompt's reply_tool_call_ids; reasoning is split off
        when `reasoning` (and the model marks it)."""
        if syntax is None and not reasoning:
            return cls(logprobs=logprobs, tokenizer=tokenizer)
        reader = reply_reader(
            form,
            syntax,
            opened=opened,
            prefix=prompt.assistant_prefix,
            reasoning=reasoning,
            edges=edges,
        )
        formatter = (
            ToolCallFormatter(syntax, prompt.tools, streaming, prompt.reply_tool_call_ids)
            if syntax is not None
            else None
        )
        return cls(logprobs=logprobs, reader=reader, formatter=formatter, tokenizer=tokenizer)

    def feed(self, event: TokenEvent) -> Delta:
        lps = []
        if self.logprobs and event.logprob is not None:
            # Each token as decoded on its own, the sampled one like its alternatives (the
            # text delta may hold back a stop string or an incomplete character).
            token = self._text(event.token) if event.token is not None else event.text
            top = tuple(Alternative(self._text(t.token), t.logprob) for t in event.top_logprobs)
            lps.append(TokenLogprob(token, event.logprob, top))
        if self.reader is None:
            return Delta(event.text, [], lps)
        before = self.reader.reasoning
        split = self.reader.feed(event.text)
        self.reasoning_tokens += before or self.reader.reasoning
        return self._split(split, lps)

    def finish(self) -> Delta:
        if self.reader is None:
            return Delta("", [], [])
        return self._split(self.reader.finish(), [])

    def finish_reason(self, done: DoneEvent) -> str:
        if done.finish_reason == "stop" and self.made_tool_call:
            return "tool_calls"
        return done.finish_reason

    def _text(self, token: int) -> str:
        if token not in self._texts:
            self._texts[token] = self.tokenizer.decode([token])
        return self._texts[token]

    def _split(self, split: Split, lps: list[TokenLogprob]) -> Delta:
        if not split.calls or self.formatter is None:
            return Delta(split.text, [], lps, split.reasoning)
        calls, failed = self.formatter.format(split.calls)
        self.made_tool_call |= bool(calls)
        return Delta(split.text + failed, calls, lps, split.reasoning)
