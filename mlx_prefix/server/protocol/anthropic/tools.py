"""Anthropic's `tools` and `tool_choice` -> the OpenAI-shaped tools the template renders
and the server's ToolChoice.

Custom tools only (`name`, `input_schema`, `description`); server tools and `strict` are
refused. A `defer_loading` tool stays out of the prompt until a `tool_reference` block
loads it (blocks.py); a tool's `cache_control` is a breakpoint at its place among the
rendered tools. `tool_choice` auto / any / tool / none with `disable_parallel_tool_use`;
forcing a call is refused beside extended thinking, as Anthropic refuses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlx_prefix.errors import InvalidRequest
from mlx_prefix.records import Breakpoint

from ..fields import field
from ..request import ToolChoice


@dataclass(frozen=True)
class Tools:
    rendered: tuple[dict[str, Any], ...] | None  # OpenAI-shaped, for the template
    names: tuple[str, ...]  # of the rendered tools
    deferred: dict[str, dict[str, Any]]  # defer_loading tools by name
    breakpoints: tuple[Breakpoint, ...]


def read_tools(body: dict[str, Any]) -> Tools:
    tools = field(body, "tools", list, None) or []
    rendered: list[dict[str, Any]] = []
    names: list[str] = []
    deferred: dict[str, dict[str, Any]] = {}
    breakpoints: list[Breakpoint] = []
    for i, tool in enumerate(tools):
        param = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise InvalidRequest(f"{param} must be an object", param=param)
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise InvalidRequest(
                f"{param}.type {kind!r}: only custom tools (name, input_schema) are supported; "
                "Anthropic's server tools run on Anthropic's servers",
                param=f"{param}.type",
            )
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequest(f"{param}.name must be a non-empty string", param=f"{param}.name")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise InvalidRequest(
                f"{param}.input_schema is required and must be an object",
                param=f"{param}.input_schema",
            )
        if tool.get("strict") is True:
            raise InvalidRequest(
                f"{param}.strict: tool inputs are not constrained to their schema here",
                param=f"{param}.strict",
            )
        function: dict[str, Any] = {"name": name, "parameters": schema}
        description = tool.get("description")
        if description is not None:
            if not isinstance(description, str):
                raise InvalidRequest(
                    f"{param}.description must be a string", param=f"{param}.description"
                )
            function["description"] = description
        definition: dict[str, Any] = {"type": "function", "function": function}
        if tool.get("defer_loading") is True:
            deferred[name] = definition
            continue
        if tool.get("cache_control") is not None:
            breakpoints.append(Breakpoint(tool=len(rendered)))
        rendered.append(definition)
        names.append(name)
    return Tools(tuple(rendered) or None, tuple(names), deferred, tuple(breakpoints))


def read_tool_choice(body: dict[str, Any], tools: Tools, thinking: bool | None) -> ToolChoice:
    choice = field(body, "tool_choice", dict, None)
    if choice is None:
        return ToolChoice()
    kind = choice.get("type")
    parallel = choice.get("disable_parallel_tool_use", False)
    if not isinstance(parallel, bool):
        raise InvalidRequest(
            "tool_choice.disable_parallel_tool_use must be a boolean",
            param="tool_choice.disable_parallel_tool_use",
        )
    if kind == "auto":
        return ToolChoice(parallel=not parallel)
    if kind == "none":
        return ToolChoice("none")
    if kind not in ("any", "tool"):
        raise InvalidRequest(
            "tool_choice.type must be 'auto', 'any', 'tool' or 'none'", param="tool_choice.type"
        )
    if not tools.names:
        raise InvalidRequest(
            "tool_choice forces a tool call, but no tools were given", param="tool_choice"
        )
    if thinking:
        raise InvalidRequest(
            "tool_choice 'any' or 'tool' cannot be combined with extended thinking",
            param="tool_choice",
        )
    if kind == "any":
        return ToolChoice("required", parallel=not parallel)
    name = choice.get("name")
    if name not in tools.names:
        raise InvalidRequest(
            f"tool_choice.name {name!r} is not among the tools ({', '.join(tools.names)})",
            param="tool_choice.name",
        )
    return ToolChoice("named", name, parallel=not parallel)
