"""Responses API items -> the conversation every template renders
(mlx_prefix/conversation.py).

`input` items (and the `output` items of a stored response, which have the same shapes)
become messages: a run of assistant message and `function_call` items becomes ONE
assistant message with content and tool calls, exactly the message a chat completions
client sends back for the same reply, so all API shapes render a conversation to the
same tokens (and the engine's next-turn prefetch matches them). `function_call_output`
becomes a `tool` message. A `reasoning` item (its `reasoning_text` content, else the
text this server sealed in its `encrypted_content`, else its summary) becomes the
reasoning of the assistant message its run builds.
Function tools are turned from the
Responses' flat shape into the chat shape templates expect.

Pure: validates, never touches the engine. Fields this server cannot honour are refused
with InvalidRequest naming them; empty values (null, false, "", [], {}) count as absent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mlx_prefix.conversation import ImageAt, Message, Role, ToolCall, decode_arguments
from mlx_prefix.errors import InvalidRequest, json_type
from mlx_prefix.vision.intake import ImageLimits

from ..images import responses_image_part
from ..sealed import unseal
from ..spec import is_empty, refuse_unknown

# An input message's role and the role it renders as.
INPUT_ROLES: dict[str, Role] = {
    "user": "user",
    "system": "system",
    "developer": "system",
    "assistant": "assistant",
}
# Item fields that carry nothing the model sees (bookkeeping a client echoes back).
_ITEM_BOOKKEEPING = {"type", "id", "status", "phase"}


@dataclass
class _Reply:
    """The assistant message a run of items builds (mutated while reading the run)."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    reasoning: str | None = None

    def message(self) -> Message:
        return Message("assistant", self.content, tuple(self.calls), reasoning=self.reasoning)


def input_messages(
    value: Any, param: str = "input", images: ImageLimits | None = None
) -> list[Message]:
    """`input` (a string or an array of items) as the conversation's messages; a user
    message's `input_image` parts decoded under `images` (protocol/images.py)."""
    limits = images or ImageLimits()
    if isinstance(value, str):
        return [Message("user", value)]
    if not isinstance(value, list):
        raise InvalidRequest(f"'{param}' must be a string or an array of items", param=param)
    messages: list[Message | _Reply] = []
    reply: _Reply | None = None  # the assistant message a run of items builds
    for i, item in enumerate(value):
        where = f"{param}[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequest(f"{where} must be an object, not {json_type(item)}", param=where)
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message" and item.get("role") == "assistant":
            reply = reply or _new_reply(messages)
            reply.content += _content(item, where, "output_text")
        elif kind == "message":
            reply = None
            messages.append(_message(item, where, limits))
        elif kind == "function_call":
            reply = reply or _new_reply(messages)
            reply.calls.append(_function_call(item, where))
        elif kind == "function_call_output":
            reply = None
            messages.append(_function_call_output(item, where))
        elif kind == "reasoning":
            reply = reply or _new_reply(messages)
            reply.reasoning = (reply.reasoning or "") + _reasoning(item, where)
        else:
            raise InvalidRequest(
                f"{where}.type {kind!r} is not supported: give messages, reasoning, "
                "function_call and function_call_output items",
                param=f"{where}.type",
            )
    if not messages:
        raise InvalidRequest(f"'{param}' must not be empty", param=param)
    return [m.message() if isinstance(m, _Reply) else m for m in messages]


def reply_messages(output: list[dict[str, Any]]) -> list[Message]:
    """A response's output items as the messages a client sending them back produces
    (what `previous_response_id` chains onto): one assistant message."""
    return input_messages(output, "output") if output else [Message("assistant")]


def _new_reply(messages: list[Message | _Reply]) -> _Reply:
    reply = _Reply()
    messages.append(reply)
    return reply


def _message(item: dict[str, Any], where: str, limits: ImageLimits) -> Message:
    role = item.get("role")
    if role not in INPUT_ROLES:
        raise InvalidRequest(
            f"{where}.role must be one of {', '.join(INPUT_ROLES)}; got {role!r}",
            param=f"{where}.role",
        )
    content = item.get("content")
    if INPUT_ROLES[role] != "user" or not isinstance(content, list):
        return Message(INPUT_ROLES[role], _content(item, where, "input_text"))
    _no_other_fields(item, where, {"role", "content"})
    text, images = "", []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if isinstance(part, dict) and part.get("type") == "input_image":
            _no_other_fields(part, at, {"type", "image_url", "file_id", "detail"})
            images.append(ImageAt(len(text), responses_image_part(part, limits, at), at))
        else:
            text += _text_part(part, at)
    return Message("user", text, images=tuple(images))


def _content(item: dict[str, Any], where: str, part_type: str) -> str:
    _no_other_fields(item, where, {"role", "content"})
    content = item.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(
            f"{where}.content must be a string or an array of {part_type} parts",
            param=f"{where}.content",
        )
    return "".join(_text_part(part, f"{where}.content[{j}]") for j, part in enumerate(content))


def _text_part(part: Any, where: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else json_type(part)
    if kind not in ("input_text", "output_text"):
        raise InvalidRequest(
            f"{where}: only text parts (input_text, output_text) and, in a user message, "
            f"input_image parts are supported, got {kind!r}",
            param=where,
        )
    assert isinstance(part, dict)
    if not isinstance(part.get("text"), str):
        raise InvalidRequest(f"{where}.text must be a string", param=f"{where}.text")
    # Annotations and logprobs come back on output_text parts the server sent: not prompt.
    _no_other_fields(part, where, {"type", "text", "annotations", "logprobs"})
    return part["text"]


def _reasoning(item: dict[str, Any], where: str) -> str:
    """A reasoning item's text: its reasoning_text (or text) parts, else what this
    server sealed in its encrypted_content (protocol/sealed.py), else its summary."""
    _no_other_fields(item, where, {"summary", "content", "encrypted_content"})
    sealed = item.get("encrypted_content")
    opened = unseal(sealed) if isinstance(sealed, str) else None
    if not is_empty(sealed) and opened is None:
        raise InvalidRequest(
            f"{where}.encrypted_content: reasoning encrypted by another server cannot be "
            "rendered here; send its content (reasoning_text parts) instead",
            param=f"{where}.encrypted_content",
        )
    texts: dict[str, list[str]] = {}
    for key, kinds in (("content", ("reasoning_text", "text")), ("summary", ("summary_text",))):
        parts = item.get(key) or []
        if not isinstance(parts, list):
            raise InvalidRequest(f"{where}.{key} must be an array", param=f"{where}.{key}")
        texts[key] = []
        for j, part in enumerate(parts):
            at = f"{where}.{key}[{j}]"
            if not isinstance(part, dict) or part.get("type") not in kinds:
                raise InvalidRequest(f"{at} must be a {' or '.join(kinds)} part", param=at)
            if not isinstance(part.get("text"), str):
                raise InvalidRequest(f"{at}.text must be a string", param=f"{at}.text")
            texts[key].append(part["text"])
    if texts["content"]:
        return "".join(texts["content"])
    if opened is not None:
        return opened
    return "\n\n".join(texts["summary"])


def _function_call(item: dict[str, Any], where: str) -> ToolCall:
    _no_other_fields(item, where, {"call_id", "name", "arguments"})
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise InvalidRequest(f"{where}.{key} must be a string", param=f"{where}.{key}")
    return ToolCall(item["name"], decode_arguments(item["arguments"]), item["call_id"])


def _function_call_output(item: dict[str, Any], where: str) -> Message:
    # `name` is the called function's, echoed by some clients; templates print the result.
    _no_other_fields(item, where, {"call_id", "output", "name"})
    if not isinstance(item.get("call_id"), str):
        raise InvalidRequest(f"{where}.call_id must be a string", param=f"{where}.call_id")
    output = item.get("output")
    if isinstance(output, list):
        output = "".join(_text_part(p, f"{where}.output[{j}]") for j, p in enumerate(output))
    if not isinstance(output, str):
        raise InvalidRequest(
            f"{where}.output must be a string or an array of input_text parts",
            param=f"{where}.output",
        )
    return Message("tool", output, tool_call_id=item["call_id"])


def _no_other_fields(obj: dict[str, Any], where: str, known: set[str]) -> None:
    refuse_unknown(obj, known | _ITEM_BOOKKEEPING, what=where, where=f"{where}.", empty_ok=True)


def chat_tools(value: Any) -> tuple[tuple[dict[str, Any], ...], list[dict[str, Any]]] | None:
    """Function tools: (the chat shape templates render, the flat shape echoed back)."""
    if is_empty(value):
        return None
    if not isinstance(value, list):
        raise InvalidRequest("'tools' must be an array", param="tools")
    nested, flat = [], []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise InvalidRequest(f"{where} must be an object", param=where)
        if tool.get("type") != "function":
            raise InvalidRequest(
                f"{where}.type {tool.get('type')!r} is not supported: only function tools "
                "(this server runs no built-in tools)",
                param=f"{where}.type",
            )
        if tool.get("strict") is True:
            raise InvalidRequest(
                f"{where}.strict: arguments constrained to the schema are not supported; "
                "send strict: false",
                param=f"{where}.strict",
            )
        _no_other_fields(tool, where, {"name", "description", "parameters", "strict"})
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise InvalidRequest(f"{where}.name must be a string", param=f"{where}.name")
        parameters = tool.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise InvalidRequest(
                f"{where}.parameters must be an object", param=f"{where}.parameters"
            )
        function: dict[str, Any] = {"name": tool["name"]}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        no_parameters = {"type": "object", "properties": {}}
        function["parameters"] = no_parameters if parameters is None else parameters
        nested.append({"type": "function", "function": function})
        flat.append({"type": "function", **function, "strict": False})
    return tuple(nested), flat
