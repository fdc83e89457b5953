"""A reply's text read apart: reasoning, text and tool-call bodies, as the deltas arrive
and at the end, the same way for the server (server/replies/assembler.py) and the engine's
next-turn prefetch (`client_reply`).

Two formats of reply:
- think markers and tool-call markers in text (every family but gpt-oss): reasoning at
  the reply's start (prompt/reply/thinking.py; from the first token when the prompt left a
  think block open), then calls split off the text (prompt/reply/tool_calls.py), so markup
  written while reasoning never becomes a call;
- gpt-oss's harmony channels (prompt/reply/harmony.py): analysis messages are reasoning,
  messages to a function are calls, the rest is text.
Pure: no MLX.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from mlx_prefix.conversation import Message, ToolCall, decode_arguments
from mlx_prefix.prompt.reply.harmony import SYNTAX as HARMONY_SYNTAX
from mlx_prefix.prompt.reply.harmony import Harmony, HarmonyReader
from mlx_prefix.prompt.reply.thinking import NO_EDGES, ReasoningEdges, ThinkSplitter
from mlx_prefix.prompt.reply.tool_calls import (
    CallParser,
    ReplyCall,
    ReplySplitter,
    Split,
    ToolSyntax,
)
from mlx_prefix.records import ToolCallIds


class ReplyReader(Protocol):
    @property
    def reasoning(self) -> bool:
        """Inside reasoning now (the tokens fed are reasoning tokens)."""
        ...

    def feed(self, text: str) -> Split: ...

    def finish(self) -> Split: ...


@dataclass
class MarkerReader:
    """Think markers, then tool-call markers: the reply's leading reasoning split off
    first (`thinking`), its text then searched for calls (`splitter`); either may be
    absent."""

    thinking: ThinkSplitter | None
    splitter: ReplySplitter | None

    @property
    def reasoning(self) -> bool:
        return self.thinking is not None and self.thinking.reasoning

    def feed(self, text: str) -> Split:
        reasoning = ""
        if self.thinking is not None:
            reasoning, text = self.thinking.feed(text)
        if self.splitter is None:
            return Split(text, [], reasoning)
        split = self.splitter.feed(text)
        return Split(split.text, split.calls, reasoning)

    def finish(self) -> Split:
        reasoning, text = self.thinking.finish() if self.thinking is not None else ("", "")
        if self.splitter is None:
            return Split(text, [], reasoning)
        head = self.splitter.feed(text) if text else Split("", [])
        tail = self.splitter.finish()
        return Split(head.text + tail.text, head.calls + tail.calls, reasoning)


@dataclass(frozen=True)
class ReplyFormat:
    """How a model writes its replies, read once from its tokenizer (by its engine:
    `Engine.reply_format`) and handed to every reader of its replies."""

    tools: ToolSyntax | None = None  # its tool-call syntax (None: it has no markers)
    harmony: bool = False  # gpt-oss's channels, not think and tool-call markers
    think: tuple[str, str] | None = None  # its think start and end markers (None: none)

    @classmethod
    def of(cls, tokenizer: Any) -> ReplyFormat:
        marks = getattr(tokenizer, "has_thinking", False)
        think = (tokenizer.think_start, tokenizer.think_end) if marks else None
        return cls(tool_syntax(tokenizer), Harmony.of(tokenizer) is not None, think)


PLAIN_REPLIES = ReplyFormat()  # no markers of any kind: text as it comes


def tool_syntax(tokenizer: Any) -> ToolSyntax | None:
    """The tool-call syntax the server parses replies with: harmony's for gpt-oss, else
    the tokenizer's mlx-lm markers and parser (None: the model has none)."""
    if Harmony.of(tokenizer) is not None:
        return HARMONY_SYNTAX
    return ToolSyntax.of(tokenizer)


def reply_reader(
    form: ReplyFormat,
    syntax: ToolSyntax | None,
    *,
    opened: bool = False,
    prefix: str = "",
    reasoning: bool = True,
    edges: ReasoningEdges = NO_EDGES,
) -> ReplyReader:
    """How a reply in `form` is read. `syntax`: calls are parsed (tools were offered);
    `opened`: the prompt left a think block open, so the reply starts as reasoning;
    `prefix`: the opening the prompt forced (a tool call's start), read first,
    never reasoning; `reasoning`: split reasoning off at all (a raw completion's text is
    not read, harmony's neither); `edges`: what the reasoning drops where its model wrote
    it, the template writing it itself (ReasoningMarkers.reply_edges)."""
    if reasoning and form.harmony:
        reader: ReplyReader = HarmonyReader(calls=syntax is not None)
    else:
        wanted = reasoning and not prefix
        thinking = ThinkSplitter.of(form.think, opened, edges) if wanted else None
        reader = MarkerReader(thinking, ReplySplitter(syntax) if syntax is not None else None)
    if prefix and syntax is not None:  # a forced call's start: tools were offered
        split = reader.feed(prefix)
        assert not split.text and not split.calls and not split.reasoning, "a call's start"
    return reader


def answer_text(form: ReplyFormat, reply: str, opened: bool) -> str:
    """`reply`'s text without its reasoning: what a client shows and sends back."""
    reader = reply_reader(form, None, opened=opened)
    return reader.feed(reply).text + reader.finish().text


@dataclass(frozen=True)
class ClientReply:
    """A reply as the client sends it back: the assistant message (as every API family's
    parser reads it) and the ids of the calls it makes."""

    message: Message
    call_ids: tuple[str, ...]


def client_reply(
    syntax: ToolSyntax | None,
    reply: str,
    tools: Sequence[dict[str, Any]] | None,
    ids: ToolCallIds,
    reader: ReplyReader | None = None,
) -> ClientReply:
    """The whole `reply` split, parsed and named exactly as the server answered it, read
    by `reader` (its reasoning as the message's reasoning, as every API family's client
    sends it back), by default for calls only; tool calls only when tools were offered
    (the server parses them only then)."""
    parse = syntax is not None and bool(tools)
    if reader is None:
        reader = MarkerReader(None, ReplySplitter(syntax) if parse and syntax else None)
    parser = CallParser(syntax, tools, ids) if parse and syntax is not None else None
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[ReplyCall] = []
    for split in (reader.feed(reply), reader.finish()):
        found, failed = parser.parse(split.calls) if parser and split.calls else ([], "")
        texts.append(split.text + failed)
        reasoning.append(split.reasoning)
        calls.extend(found)
    message = Message(
        "assistant",
        "".join(texts),
        tool_calls=tuple(ToolCall(c.name, decode_arguments(c.arguments), c.id) for c in calls),
        reasoning="".join(reasoning) or None,
    )
    return ClientReply(message, tuple(c.id for c in calls))
