"""Tool calls in generated text -> OpenAI chat `tool_calls`. Splitting, parsing and naming
live in prompt/reply/tool_calls.py (the engine's next-turn prefetch needs them too); this
module only shapes the calls for chat completions."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mlx_prefix.prompt.reply.tool_calls import (
    CallParser,
    ReplySplitter,
    Split,
    ToolCallSplitter,
    ToolSyntax,
)
from mlx_prefix.records import ToolCallIds

__all__ = ["ReplySplitter", "Split", "ToolCallFormatter", "ToolCallSplitter", "ToolSyntax"]


@dataclass
class ToolCallFormatter:
    syntax: ToolSyntax
    tools: Sequence[dict[str, Any]] | None
    streaming: bool
    ids: ToolCallIds | None  # None only where no route named them: a bug
    _parser: CallParser = field(init=False)
    _count: int = 0

    def __post_init__(self) -> None:
        assert self.ids is not None, "the route names the reply's tool calls"
        self._parser = CallParser(self.syntax, self.tools, self.ids)

    def format(self, bodies: list[str]) -> tuple[list[dict[str, Any]], str]:
        """OpenAI tool_calls for the bodies, and the text of those that failed to parse."""
        calls, failed = self._parser.parse(bodies)
        out = []
        for call in calls:
            shaped: dict[str, Any] = {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            if self.streaming:
                shaped["index"] = self._count
            self._count += 1
            out.append(shaped)
        return out, failed
