"""Tool calls in generated text -> OpenAI `tool_calls`, using mlx-lm's per-model parsers.

mlx-lm's tokenizer wrapper knows, per model family, the markers around a tool call
(`tool_call_start` / `tool_call_end`) and a `tool_parser(text, tools)` returning
{"name", "arguments"} (or a list of them). The engine streams text deltas, so we split
on the markers in text, holding back a delta's tail while it could still be the start
of a marker.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("mlx_prefix.server")


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


@dataclass(frozen=True)
class Split:
    text: str  # plain text, safe to send now
    calls: list[str]  # complete tool-call bodies, markers stripped


@dataclass
class ToolCallSplitter:
    syntax: ToolSyntax
    _pending: str = ""  # text not yet classified
    _in_call: bool = False

    def feed(self, text: str) -> Split:
        self._pending += text
        out, calls = [], []
        while True:
            marker = self.syntax.end if self._in_call else self.syntax.start
            if self._in_call and not marker:
                break  # a call without an end marker runs to the end of the output
            at = self._pending.find(marker)
            if at < 0:
                break
            if self._in_call:
                calls.append(self._pending[:at])
            else:
                out.append(self._pending[:at])
            self._pending = self._pending[at + len(marker) :]
            self._in_call = not self._in_call
        if not self._in_call:
            keep = _partial_suffix(self._pending, self.syntax.start)
            out.append(self._pending[: len(self._pending) - keep])
            self._pending = self._pending[len(self._pending) - keep :]
        return Split(text="".join(out), calls=calls)

    def finish(self) -> Split:
        # An unterminated call (cut by max_tokens) is still offered to the parser,
        # as mlx_lm.server does; if it fails to parse it comes back as text.
        pending, self._pending = self._pending, ""
        if self._in_call:
            self._in_call = False
            return Split(text="", calls=[pending] if pending.strip() else [])
        return Split(text=pending, calls=[])


@dataclass
class ToolCallFormatter:
    syntax: ToolSyntax
    tools: Sequence[dict[str, Any]] | None
    streaming: bool
    _count: int = field(default=0)

    def format(self, bodies: list[str]) -> tuple[list[dict[str, Any]], str]:
        """OpenAI tool_calls for the bodies, and the text of those that failed to parse."""
        calls, failed = [], []
        for body in bodies:
            try:
                parsed = self.syntax.parser(body, self.tools)
            except Exception as e:  # a model's malformed call must not fail the response
                log.warning(
                    "tool call did not parse (%s: %s); returned as text", type(e).__name__, e
                )
                failed.append(f"{self.syntax.start}{body}{self.syntax.end}")
                continue
            for call in parsed if isinstance(parsed, list) else [parsed]:
                calls.append(self._openai(call))
        return calls, "".join(failed)

    def _openai(self, call: dict[str, Any]) -> dict[str, Any]:
        arguments = call.get("arguments", {})
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        out: dict[str, Any] = {
            "id": call.get("id") or f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": call.get("name", ""), "arguments": arguments},
        }
        if self.streaming:
            out["index"] = self._count
        self._count += 1
        return out


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
