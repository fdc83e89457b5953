"""Tool calls in a model's reply, with the tokenizer's mlx-lm parser: the reply split into
text and call bodies, the bodies parsed, the calls named.

mlx-lm's tokenizer wrapper knows, per model family, the markers around a tool call
(`tool_call_start` / `tool_call_end`) and a `tool_parser(text, tools)` returning
{"name", "arguments"} (or a list of them). The engine streams text deltas, so we split
on the markers in text, holding back a delta's tail while it could still be the start
of a marker.

The server answers with the calls this module finds; the engine's next-turn prefetch
renders the reply as the client will send it back (prompt/reply/reader.py's `client_reply`).
Both must split, parse and name a reply identically, so both use this module, whatever
API shape (chat `tool_calls`, Anthropic `tool_use`, Responses `function_call`) the calls
travel in. gpt-oss's harmony calls are read by prompt/reply/harmony.py and parsed here too.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mlx_prefix.prompt.reply.thinking import partial_suffix
from mlx_prefix.records import ToolCallIds

log = logging.getLogger("mlx_prefix.prompt")


@dataclass(frozen=True)
class ToolSyntax:
    start: str
    end: str
    parser: Callable[[str, Any], Any]

    @classmethod
    def of(cls, tokenizer: Any) -> ToolSyntax | None:
        if not getattr(tokenizer, "has_tool_calling", False):
            return None
        start, end = tokenizer.tool_call_start, tokenizer.tool_call_end
        parser = tokenizer.tool_parser
        if not start or parser is None:
            return None
        return cls(start=start, end=end or "", parser=parser)

    def written(self, body: str) -> str:
        """A call body as the model wrote it: what a call that fails to parse is shown as."""
        return f"{self.start}{body}{self.end}"


@dataclass(frozen=True)
class Split:
    text: str  # plain text, safe to send now
    calls: list[str]  # complete tool-call bodies, markers stripped
    reasoning: str = ""  # reasoning, safe to send now (a reader's, prompt/reply/reader.py)


# One piece of a reply, in order: (True, a call's body, markers stripped) or (False, text).
Piece = tuple[bool, str]


def joined(pieces: list[Piece]) -> Split:
    return Split(
        text="".join(t for is_call, t in pieces if not is_call),
        calls=[body for is_call, body in pieces if is_call],
    )


@dataclass
class ToolCallSplitter:
    syntax: ToolSyntax
    _pending: str = ""  # text not yet classified
    _in_call: bool = False

    def feed(self, text: str) -> Split:
        return joined(self.pieces(text))

    def finish(self) -> Split:
        return joined(self.last_pieces())

    def pieces(self, text: str) -> list[Piece]:
        """What `text` completes, in order: text safe to send now, and whole calls."""
        self._pending += text
        out: list[Piece] = []
        while True:
            marker = self.syntax.end if self._in_call else self.syntax.start
            if self._in_call and not marker:
                break  # a call without an end marker runs to the end of the output
            at = self._pending.find(marker)
            if at < 0:
                break
            out.append((self._in_call, self._pending[:at]))
            self._pending = self._pending[at + len(marker) :]
            self._in_call = not self._in_call
        if not self._in_call:
            keep = partial_suffix(self._pending, self.syntax.start)
            out.append((False, self._pending[: len(self._pending) - keep]))
            self._pending = self._pending[len(self._pending) - keep :]
        return [(is_call, t) for is_call, t in out if is_call or t]

    def last_pieces(self) -> list[Piece]:
        # An unterminated call (cut by max_tokens) is still offered to the parser,
        # as mlx_lm.server does; if it fails to parse it comes back as text.
        pending, self._pending = self._pending, ""
        if self._in_call:
            self._in_call = False
            return [(True, pending)] if pending.strip() else []
        return [(False, pending)] if pending else []


@dataclass
class ReplySplitter:
    """A ToolCallSplitter that also drops whitespace-only text around calls (the newlines
    a model writes before, between and after its calls): the text since the reply's
    start or the last call is held while it is only whitespace, released once anything
    else arrives, and dropped when a call follows or the reply ends after a call. A reply
    without calls keeps its text whatever it is. Anthropic's content blocks cannot carry
    whitespace-only text, and every family (and the prefetch) must see the same text.
    The result depends only on the whole reply, never on how it was cut into deltas."""

    syntax: ToolSyntax
    _splitter: ToolCallSplitter = field(init=False)
    _held: str = ""  # the current run of text, while it is only whitespace
    _spoke: bool = False  # the current run has non-whitespace text: nothing is held
    _called: bool = False

    def __post_init__(self) -> None:
        self._splitter = ToolCallSplitter(self.syntax)

    def feed(self, text: str) -> Split:
        return joined(self._hold(self._splitter.pieces(text)))

    def finish(self) -> Split:
        out = self._hold(self._splitter.last_pieces())
        if self._held and not self._called:
            out.append((False, self._held))
        self._held = ""
        return joined(out)

    def _hold(self, pieces: list[Piece]) -> list[Piece]:
        out: list[Piece] = []
        for is_call, text in pieces:
            if is_call:
                out.append((True, text))
                self._held, self._spoke, self._called = "", False, True
            elif self._spoke:
                out.append((False, text))
            else:
                self._held += text
                if self._held.strip():
                    out.append((False, self._held))
                    self._held, self._spoke = "", True
        return out


@dataclass(frozen=True)
class ReplyCall:
    """A call found in a reply, as the client receives it (conversation.ToolCall is the
    call as a conversation holds it, its arguments decoded)."""

    id: str
    name: str
    arguments: str  # JSON text, as the client receives it


@dataclass
class CallParser:
    """Call bodies -> ReplyCalls, named in order: the model's own id when its parser gives
    one (Kimi, Mistral), else `ids.id(i)` for the reply's i-th call."""

    syntax: ToolSyntax
    tools: Sequence[dict[str, Any]] | None
    ids: ToolCallIds
    _count: int = 0

    def parse(self, bodies: list[str]) -> tuple[list[ReplyCall], str]:
        """The calls in `bodies`, and the text of those that failed to parse (with their
        markers, as the model wrote them)."""
        calls, failed = [], []
        for body in bodies:
            try:
                parsed = self.syntax.parser(body, self.tools)
            except Exception as e:  # a model's malformed call must not fail the response
                log.warning(
                    "tool call did not parse (%s: %s); returned as text", type(e).__name__, e
                )
                failed.append(self.syntax.written(body))
                continue
            for call in parsed if isinstance(parsed, list) else [parsed]:
                arguments = call.get("arguments", {})
                if not isinstance(arguments, str):
                    arguments = json.dumps(arguments, ensure_ascii=False)
                call_id = call.get("id") or self.ids.id(self._count)
                calls.append(ReplyCall(call_id, call.get("name", ""), arguments))
                self._count += 1
        return calls, "".join(failed)
