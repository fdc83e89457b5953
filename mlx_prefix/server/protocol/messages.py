"""Chat completions' `messages` -> the typed conversation (mlx_prefix/conversation.py):
the one validating entry for chat-shaped dicts, whoever sends them (this server's chat
route, Ollama's messages once mapped, the CLI's --messages file, the library, tests).

Content parts are joined into one string with each image at its offset; OpenAI's
`developer` role is `system`, the deprecated `function` role a `tool` message; tool-call
arguments are decoded JSON. InvalidRequest names the field for anything that cannot be
rendered faithfully.
"""

from __future__ import annotations

from typing import Any

from mlx_prefix.conversation import (
    ROLES,
    Conversation,
    ImageAt,
    Message,
    Role,
    ToolCall,
    decode_arguments,
)
from mlx_prefix.errors import InvalidRequest, json_type
from mlx_prefix.vision.intake import ImageLimits

from .images import openai_image_part

# Chat completions' roles and the role each renders as.
CHAT_ROLES: dict[str, Role] = {
    **{role: role for role in ROLES},
    "developer": "system",  # OpenAI's newer name for it; templates know only "system"
    "function": "tool",  # the deprecated form of a tool result
}
_MISSING = object()


def conversation_from_dicts(
    messages: Any, param: str = "messages", images: ImageLimits | None = None
) -> Conversation:
    """Chat completions' `messages` (OpenAI's shape, the deprecated `function_call` and
    `function` role included) as the conversation. InvalidRequest naming the field for
    anything that cannot be rendered faithfully. `image_url` parts are decoded under
    `images` (the server's limits; the defaults when None)."""
    if not isinstance(messages, (list, tuple)):
        raise InvalidRequest(f"'{param}' must be an array, not {json_type(messages)}", param=param)
    if not messages:
        raise InvalidRequest(f"'{param}' must not be empty", param=param)
    limits = images or ImageLimits()
    return tuple(_message(m, f"{param}[{i}]", i, limits) for i, m in enumerate(messages))


def _message(message: Any, param: str, index: int, limits: ImageLimits) -> Message:
    if not isinstance(message, dict):
        raise InvalidRequest(f"{param} must be an object", param=param)
    role = message.get("role")
    if not isinstance(role, str):
        raise InvalidRequest(
            f"{param}.role is required and must be a string", param=f"{param}.role"
        )
    if role not in CHAT_ROLES:
        raise InvalidRequest(
            f"{param}.role {role!r} is not one of {', '.join(sorted(CHAT_ROLES))}",
            param=f"{param}.role",
        )
    name, call_id = (_optional_text(message, key, param) for key in ("name", "tool_call_id"))
    if role == "function" and name is None:
        raise InvalidRequest(
            f"{param}.name is required on a function message", param=f"{param}.name"
        )
    calls = _tool_calls(message, role, param, index)
    reasoning = None
    for key in ("reasoning_content", "reasoning"):
        # `reasoning`: mlx_lm.server's and newer vLLM's name for the same field.
        value = message.get(key)
        if value is not None and (role != "assistant" or not isinstance(value, str)):
            raise InvalidRequest(
                f"{param}.{key} must be a string on an assistant message", param=f"{param}.{key}"
            )
        reasoning = value if reasoning is None else reasoning
    content = message.get("content", _MISSING)
    if content is _MISSING or content is None:
        if role != "assistant":
            raise InvalidRequest(f"{param}.content is required", param=f"{param}.content")
        content = ""
    text, images = _content(content, f"{param}.content", limits)
    return Message(
        CHAT_ROLES[role],
        text,
        tool_calls=calls,
        tool_call_id=call_id,
        name=name,
        reasoning=reasoning,
        images=images,
    )


def _optional_text(message: dict[str, Any], key: str, param: str) -> str | None:
    value = message.get(key)
    if value is not None and not isinstance(value, str):
        raise InvalidRequest(f"{param}.{key} must be a string", param=f"{param}.{key}")
    return value


def _tool_calls(message: dict[str, Any], role: str, param: str, index: int) -> tuple[ToolCall, ...]:
    calls = message.get("tool_calls")
    function_call = message.get("function_call")
    if function_call is not None:
        if role != "assistant" or not isinstance(function_call, dict):
            raise InvalidRequest(
                f"{param}.function_call must be an object on an assistant message",
                param=f"{param}.function_call",
            )
        if calls is not None:
            raise InvalidRequest(
                f"{param}: function_call and tool_calls both given", param=f"{param}.function_call"
            )
        return (_tool_call({"id": f"call_{index}", "function": function_call}, param),)
    if calls is None:
        return ()
    if role != "assistant" or not isinstance(calls, list):
        raise InvalidRequest(
            f"{param}.tool_calls must be an array on an assistant message",
            param=f"{param}.tool_calls",
        )
    return tuple(_tool_call(c, f"{param}.tool_calls[{j}]") for j, c in enumerate(calls))


def _tool_call(call: Any, param: str) -> ToolCall:
    if not isinstance(call, dict):
        raise InvalidRequest(f"{param} must be an object", param=param)
    if call.get("type", "function") != "function":
        raise InvalidRequest(
            f"{param}.type {call['type']!r} is not supported: only function calls",
            param=f"{param}.type",
        )
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidRequest(
            f"{param}.function must be an object with a string 'name'", param=f"{param}.function"
        )
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        arguments = decode_arguments(arguments)
    call_id = call.get("id")
    if call_id is not None and not isinstance(call_id, str):
        raise InvalidRequest(f"{param}.id must be a string", param=f"{param}.id")
    return ToolCall(function["name"], arguments, call_id)


def _content(content: Any, param: str, limits: ImageLimits) -> tuple[str, tuple[ImageAt, ...]]:
    # Parts are joined so that ["a", "b"] as parts renders exactly like the string "ab":
    # both must produce the same tokens, or the prefix cache would miss.
    if isinstance(content, str):
        return content, ()
    if not isinstance(content, list):
        raise InvalidRequest(f"{param} must be a string or an array of text parts", param=param)
    text, images = "", []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else json_type(part)
        if kind == "image_url":
            image = openai_image_part(part, limits, f"{param}[{j}]")
            images.append(ImageAt(len(text), image, f"{param}[{j}]"))
            continue
        if kind != "text":
            raise InvalidRequest(
                f"{param}[{j}]: content parts of type {kind!r} are not supported (text and "
                "image_url are)",
                param=f"{param}[{j}]",
            )
        if not isinstance(part.get("text"), str):
            raise InvalidRequest(f"{param}[{j}].text must be a string", param=f"{param}[{j}].text")
        text += part["text"]
    return text, tuple(images)
