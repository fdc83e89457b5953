"""Honouring a forced tool choice (OpenAI's "required" or {"function": {"name"}},
Anthropic's {"type": "any"} or {"type": "tool", "name"}) with no grammar engine: the
assistant's turn is opened with the model's own tool-call start marker, and for a named
tool with the start of that call in the model's format, so the reply can only continue
a call (to that tool). The assembler reads the reply as continuing that opening.

Formats whose call start names the function in a known way (mlx-lm's `json_tools`:
Qwen 2.5/3, Hermes; `qwen3_coder`: Qwen3-Coder, Qwen3.5; gpt-oss's harmony, whose
forced call skips the analysis message) support the named form; for
other formats it is refused with a 400 naming `tool_choice`, as is any forced choice for
a model without tool-call markers.
"""

from __future__ import annotations

import dataclasses
import json

from mlx_prefix.errors import InvalidRequest
from mlx_prefix.prompt.reply import harmony

from ..protocol.request import GenerationRequest, ToolChoice
from ..replies.tools import ToolSyntax


def _named_opening(syntax: ToolSyntax, name: str) -> str | None:
    if syntax is harmony.SYNTAX:
        return harmony.named_opening(name)
    module = getattr(syntax.parser, "__module__", "") or ""
    if module.endswith("json_tools"):
        return f'{syntax.start}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '
    if module.endswith("qwen3_coder"):
        return f"{syntax.start}\n<function={name}>\n"
    return None


def forced_opening(syntax: ToolSyntax | None, choice: ToolChoice) -> str:
    """The text the assistant's turn must open with for `choice` ("" when not forced),
    in the model's tool-call `syntax` (None: it has none). InvalidRequest (param
    tool_choice) when this model cannot be forced that way."""
    if choice.mode in ("auto", "none"):
        return ""
    if syntax is None:
        raise InvalidRequest(
            "this model has no tool-call markers, so a tool call cannot be forced: use "
            "tool_choice auto",
            param="tool_choice",
        )
    if choice.mode == "required":
        return syntax.start
    assert choice.name is not None
    opening = _named_opening(syntax, choice.name)
    if opening is None:
        raise InvalidRequest(
            "naming the tool to call is not supported for this model's tool-call format "
            f"({syntax.parser.__module__.rsplit('.', 1)[-1]}); force any tool instead",
            param="tool_choice",
        )
    return opening


def with_tool_choice(req: GenerationRequest, syntax: ToolSyntax | None) -> GenerationRequest:
    """`req`, for a model writing tool calls in `syntax`, with its prompt opening the
    forced call, if its tool choice forces one, and, when parallel calls are off, the
    tool-call end marker as a stop string: the reply ends after its first call (whose
    unterminated body the assembler still parses). A format without an end marker
    closes a call only at the reply's end anyway."""
    choice = req.tool_choice
    opening = forced_opening(syntax, choice)
    if opening:
        prompt = dataclasses.replace(req.prompt, assistant_prefix=opening)
        req = dataclasses.replace(req, prompt=prompt)
    one_call = req.parse_tools and not choice.parallel
    if one_call and syntax is not None and syntax.end:
        stop = (*req.sampling.stop, syntax.end)
        req = dataclasses.replace(req, sampling=dataclasses.replace(req.sampling, stop=stop))
    return req
