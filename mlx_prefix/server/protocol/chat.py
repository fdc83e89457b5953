"""POST /v1/chat/completions bodies: messages (read into the typed conversation by
protocol/messages.py, content parts, tool calls and the deprecated `function` role
and `function_call` included), tools, tool_choice, logprobs, reasoning_effort and
thinking_token_budget (protocol/effort.py), and the deprecated `functions` /
`function_call`, read as tools."""

from __future__ import annotations

import dataclasses
from typing import Any

from mlx_prefix.conversation import Conversation
from mlx_prefix.errors import InvalidRequest, json_type
from mlx_prefix.records import PromptInput
from mlx_prefix.vision.intake import ImageLimits

from .effort import effort_bound, token_budget
from .fields import MISSING, field, integer
from .messages import conversation_from_dicts
from .request import GenerationRequest, Limits, ToolChoice, generation_request


def parse_chat(body: dict[str, Any], limits: Limits) -> GenerationRequest:
    legacy = body.get("functions") is not None or body.get("function_call") is not None
    if legacy:
        body = _functions_as_tools(body)
    tools = read_tools(body)
    choice = _tool_choice(body, tools)
    offer_tools = tools is not None and choice.mode != "none"
    bound = effort_bound(body.get("reasoning_effort"), "reasoning_effort")
    budget = token_budget(body.get("thinking_token_budget"), "thinking_token_budget")
    prompt = PromptInput(
        messages=parse_messages(body.get("messages", MISSING), limits.images),
        tools=tools if offer_tools else None,
        chat_template_kwargs=bound.kwargs_under(
            field(body, "chat_template_kwargs", dict, None) or {}
        ),
    )
    logprobs = bool(field(body, "logprobs", bool, False))
    top = integer(body, "top_logprobs", 0, lo=0, hi=20)
    if top and not logprobs:
        raise InvalidRequest("top_logprobs requires logprobs: true", param="top_logprobs")
    req = generation_request(
        "chat",
        body,
        prompt,
        limits,
        logprobs,
        top_logprobs=top,
        parse_tools=offer_tools,
        tool_choice=choice,
    )
    budget = budget if budget is not None else bound.budget
    req = dataclasses.replace(
        req, sampling=dataclasses.replace(req.sampling, reasoning_budget=budget)
    )
    return dataclasses.replace(req, legacy_functions=True) if legacy else req


def _functions_as_tools(body: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's deprecated `functions` and `function_call` -> `tools` and `tool_choice`.
    They answered with at most one call, so parallel calls are off."""
    for new, old in (("tools", "functions"), ("tool_choice", "function_call")):
        if body.get(new) is not None and body.get(old) is not None:
            raise InvalidRequest(f"{old} and {new} both given; send {new} alone", param=old)
    functions = field(body, "functions", list, None) or []
    for i, function in enumerate(functions):
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidRequest(
                f"functions[{i}] must be an object with a name", param=f"functions[{i}]"
            )
    choice = field(body, "function_call", (str, dict), None)
    if isinstance(choice, dict):
        if not isinstance(choice.get("name"), str):
            raise InvalidRequest('function_call must be {"name": ...}', param="function_call")
        if choice["name"] not in [f["name"] for f in functions]:
            raise InvalidRequest(
                f"function_call names {choice['name']!r}, which is not among the functions",
                param="function_call",
            )
        choice = {"type": "function", "function": {"name": choice["name"]}}
    elif choice not in (None, "auto", "none"):
        raise InvalidRequest(
            "function_call must be 'none', 'auto' or an object naming a function",
            param="function_call",
        )
    out = {k: v for k, v in body.items() if k not in ("functions", "function_call")}
    out["tools"] = [{"type": "function", "function": f} for f in functions] or None
    out["tool_choice"] = choice
    out["parallel_tool_calls"] = False
    return out


def _tool_choice(body: dict[str, Any], tools: tuple[dict[str, Any], ...] | None) -> ToolChoice:
    """OpenAI's tool_choice: "none" | "auto" | "required" | {"type": "function",
    "function": {"name": ...}}. A forced choice needs tools that offer it."""
    value = field(body, "tool_choice", (str, dict), None)
    parallel = field(body, "parallel_tool_calls", bool, True)
    if value is None or value == "auto":
        return ToolChoice(parallel=parallel)
    if value == "none":
        return ToolChoice("none")
    if value == "required":
        choice = ToolChoice("required", parallel=parallel)
    elif isinstance(value, dict):
        function = value.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if value.get("type", "function") != "function" or not isinstance(name, str):
            raise InvalidRequest(
                'tool_choice as an object must be {"type": "function", "function": {"name": ...}}',
                param="tool_choice",
            )
        choice = ToolChoice("named", name, parallel=parallel)
    else:
        raise InvalidRequest(
            "tool_choice must be 'none', 'auto', 'required' or an object", param="tool_choice"
        )
    functions = [t.get("function") for t in tools or ()]
    names = [f.get("name") for f in functions if isinstance(f, dict)]
    if not names:
        raise InvalidRequest(
            "tool_choice forces a tool call, but no tools were given", param="tool_choice"
        )
    if choice.name is not None and choice.name not in names:
        raise InvalidRequest(
            f"tool_choice names {choice.name!r}, which is not among the tools "
            f"({', '.join(str(n) for n in names)})",
            param="tool_choice",
        )
    return choice


def parse_messages(messages: Any, images: ImageLimits | None = None) -> Conversation:
    """`messages`, OpenAI's chat shape (messages.py reads it for every caller)."""
    if messages is MISSING:
        raise InvalidRequest("'messages' is required", param="messages")
    if not isinstance(messages, list):
        raise InvalidRequest(
            f"'messages' must be an array, not {json_type(messages)}", param="messages"
        )
    return conversation_from_dicts(messages, images=images)


def read_tools(body: dict[str, Any]) -> tuple[dict[str, Any], ...] | None:
    tools = field(body, "tools", list, None)
    if not tools:
        return None
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise InvalidRequest(f"tools[{i}] must be an object", param=f"tools[{i}]")
    return tuple(tools)
