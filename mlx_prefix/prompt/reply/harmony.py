"""gpt-oss's harmony format: a reply is a run of messages on channels, not text with
think markers.

The generation prompt ends with `<|start|>assistant`; the model writes each message as
a header, `<|message|>`, its body and an end. A reply that reasons, then answers:

    <|channel|>analysis<|message|>The user greets me.<|end|>
    <|start|>assistant<|channel|>final<|message|>Hello.<|return|>

(one text, cut here after `<|end|>`), or, after its reasoning, calls a tool:

    <|start|>assistant<|channel|>commentary to=functions.read <|constrain|>json
    <|message|>{"path": "a"}<|call|>

(OpenAI's harmony format; the recipient may also follow the role, `<|start|>assistant
to=functions.read<|channel|>commentary json<|message|>`, as the chat template renders
calls.) `<|return|>` and `<|call|>` end a reply (the engine stops on them), `<|end|>`
ends one message of several. What each message is, by its header:
- the `analysis` channel: reasoning (chat `reasoning_content`, Anthropic `thinking`,
  Responses `reasoning`), whatever it is addressed to;
- a message to `functions.NAME` on any other channel: a call of the client's tool NAME;
  to another recipient (gpt-oss's built-in browser or python tools, which no client
  runs): reasoning;
- anything else (`final`, a `commentary` preamble): the reply's text.
The control tokens never reach a client. Pure: no MLX.
"""

from __future__ import annotations

import json
import re
import weakref
from dataclasses import dataclass, field
from typing import Any

from mlx_prefix.models.stops import (
    CALL,
    CHANNEL,
    CONSTRAIN,
    CONTROL,
    END,
    MESSAGE,
    START,
    harmony_stops,
)
from mlx_prefix.prompt.reply.thinking import partial_suffix
from mlx_prefix.prompt.reply.tool_calls import Split, ToolSyntax

# Reasoning as the model opens it right after the generation prompt, and the close a
# reasoning budget forces: the analysis message ended, the final answer begun.
ANALYSIS = f"{CHANNEL}analysis{MESSAGE}"
CLOSE = f"{END}{START}assistant{CHANNEL}final{MESSAGE}"
FUNCTIONS = "functions."

_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")


@dataclass(frozen=True)
class Harmony:
    """A harmony model: its chat template writes channels and its tokenizer holds every
    control token as one token."""

    stops: tuple[int, ...]  # <|return|> and <|call|>: each ends a reply

    @classmethod
    def of(cls, tokenizer: Any) -> Harmony | None:
        """Asked for every request: the template is looked at first, the tokens once
        per tokenizer."""
        template = getattr(tokenizer, "chat_template", None)
        if not isinstance(template, str) or CHANNEL not in template:
            return None
        try:
            return _known[tokenizer]
        except KeyError:
            pass
        stops = harmony_stops(tokenizer)
        found = cls(stops=stops) if stops is not None else None
        _known[tokenizer] = found
        return found


# tokenizer -> what `Harmony.of` found, for as long as the tokenizer lives
_known: weakref.WeakKeyDictionary[Any, Harmony | None] = weakref.WeakKeyDictionary()


def parse_call(body: str, tools: Any = None) -> dict[str, Any]:
    """A call body as HarmonyReader hands it out (`NAME<|message|>ARGUMENTS`) -> the
    {"name", "arguments"} mlx-lm's parsers return; ValueError when the arguments are not
    a JSON object (a call cut short), and the call comes back as its arguments' text."""
    name, _, arguments = body.partition(MESSAGE)
    value = json.loads(arguments) if arguments.strip() else {}
    if not isinstance(value, dict):
        raise ValueError("the arguments are not a JSON object")
    return {"name": name.strip(), "arguments": value}


@dataclass(frozen=True)
class HarmonyToolSyntax(ToolSyntax):
    """Harmony's calls: `start` opens a forced call after the generation prompt
    (server/routes/tool_choice.py); a call that does not parse is shown as its arguments."""

    def written(self, body: str) -> str:
        return body.partition(MESSAGE)[2]


SYNTAX = HarmonyToolSyntax(start=f"{CHANNEL}commentary to={FUNCTIONS}", end=CALL, parser=parse_call)


def named_opening(name: str) -> str:
    """The opening that forces a call of `name`."""
    return f"{SYNTAX.start}{name} {CONSTRAIN}json{MESSAGE}"


@dataclass
class _Out:
    reasoning: list[str] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)

    def split(self) -> Split:
        return Split("".join(self.text), self.calls, "".join(self.reasoning))


@dataclass
class HarmonyReader:
    """A harmony reply's text deltas -> reasoning, text and call bodies, as they complete.
    A control token cut across deltas is held back until it is whole. `calls`: tools were
    offered, so messages to a function are calls (else their arguments are text)."""

    calls: bool
    _pending: str = ""
    _kind: str | None = None  # the open message's: reasoning | text | call; None: a header
    _name: str = ""  # the open call's function
    _body: str = ""  # the open call's arguments so far
    _fresh: bool = True  # no header read yet: a reply without one is plain text

    @property
    def reasoning(self) -> bool:
        """Inside an analysis message now."""
        return self._kind == "reasoning"

    def feed(self, text: str) -> Split:
        self._pending += text
        out = _Out()
        while self._header(out) if self._kind is None else self._body_step(out):
            pass
        return out.split()

    def finish(self) -> Split:
        """The rest: an open message ends with the reply (a call's `<|call|>` is a stop
        token, never in the text); an unfinished header is dropped."""
        out = _Out()
        pending, self._pending = self._pending, ""
        if self._kind is not None:
            self._emit(out, pending[: len(pending) - _held(pending)])
            self._close(out)
        elif self._fresh:
            out.text.append(_without_control(pending))
        return out.split()

    def _header(self, out: _Out) -> bool:
        at = self._pending.find(MESSAGE)
        if at < 0:
            head = self._pending.lstrip()
            if self._fresh and head and not _may_open(head):
                self._kind, self._fresh = "text", False  # no harmony here: plain text
                return True
            return False
        header, self._pending = self._pending[:at], self._pending[at + len(MESSAGE) :]
        self._open(header)
        return True

    def _open(self, header: str) -> None:
        self._fresh = False
        found = _CHANNEL.search(header)
        channel = found.group(1) if found else "final"
        found = _RECIPIENT.search(header)
        recipient = found.group(1) if found else ""
        if channel == "analysis" or (recipient and not recipient.startswith(FUNCTIONS)):
            self._kind = "reasoning"
        elif recipient:
            self._kind, self._name, self._body = "call", recipient[len(FUNCTIONS) :], ""
        else:
            self._kind = "text"

    def _body_step(self, out: _Out) -> bool:
        pending = self._pending
        hits = [(i, token) for token in CONTROL if (i := pending.find(token)) >= 0]
        if not hits:
            cut = len(pending) - _held(pending)
            self._emit(out, pending[:cut])
            self._pending = pending[cut:]
            return False
        at, token = min(hits)
        self._emit(out, pending[:at])
        if token in (MESSAGE, CONSTRAIN):  # stray inside a body: dropped
            self._pending = pending[at + len(token) :]
            return True
        self._close(out)
        # <|start|> and <|channel|> begin the next header (a message left without its end).
        self._pending = pending[at:] if token in (START, CHANNEL) else pending[at + len(token) :]
        return True

    def _emit(self, out: _Out, text: str) -> None:
        if not text:
            return
        if self._kind == "reasoning":
            out.reasoning.append(text)
        elif self._kind == "call":
            self._body += text
        else:
            out.text.append(text)

    def _close(self, out: _Out) -> None:
        if self._kind == "call":
            if self.calls:
                out.calls.append(f"{self._name}{MESSAGE}{self._body}")
            elif self._body:
                out.text.append(self._body)
        self._kind, self._name, self._body = None, "", ""


def _may_open(head: str) -> bool:
    """Whether the start of a reply may still be a header: a control token, or the
    recipient written before the channel (` to=functions.X<|channel|>...`)."""
    return any(head.startswith(p) or p.startswith(head) for p in ("<|", "to="))


def _held(text: str) -> int:
    """The tail of `text` that may be the start of a control token."""
    return max(partial_suffix(text, token) for token in CONTROL)


def _without_control(text: str) -> str:
    for token in CONTROL:
        text = text.replace(token, "")
    return text
