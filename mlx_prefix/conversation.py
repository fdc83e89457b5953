"""A request's conversation, typed: what every API family's parser builds once and
prompt/ renders without checking it again.

Data only: chat completions, Anthropic Messages, Responses and Ollama each turn their own
shapes into these records (server/protocol/: validation and the API's own 400s stay
there); callers with plain chat-completions dicts (the CLI's --messages file, the
library, tests) go through server/protocol/messages.py's `conversation_from_dicts`. The
records hold the conversation in the one form every template renders, so the same
conversation renders the same tokens whoever sends it (the prefix cache depends on it):
- content is one string: text parts are joined when parsed, so ["a", "b"] as parts and
  "ab" are the same message; images stand between its characters (`images`: each at its
  offset), and a message with images reaches the template as parts (text, image, text);
- roles are the four every template knows (OpenAI's `developer` is `system`, a
  `function` result a `tool` message);
- tool-call arguments are decoded JSON, dicts with sorted keys (templates print a mapping
  or its JSON; either way deterministically), kept as the client's text only when it is
  not JSON.
`template_messages` is the list of dicts a chat template receives.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from mlx_prefix.vision.intake import ImageInput

Role = Literal["system", "user", "assistant", "tool"]
ROLES: tuple[Role, ...] = get_args(Role)


def canonical_json(value: Any) -> Any:
    """`value` rebuilt with every dict's keys sorted, so templates' tojson is order-stable."""
    if isinstance(value, dict):
        return {k: canonical_json(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [canonical_json(v) for v in value]
    return value


def decode_arguments(text: str) -> Any:
    """A call's JSON-encoded arguments (what OpenAI clients send back) decoded: templates
    iterate over them as a mapping, as mlx_lm.server decodes them. Blank is no arguments;
    text that is not JSON stays as sent."""
    if not text.strip():
        return {}
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call an assistant turn made."""

    name: str
    # The decoded JSON arguments (dict keys sorted on construction), or the client's text
    # when it was not JSON. Left out of the hash (a dict is not hashable); equality
    # compares it.
    arguments: Any = field(default_factory=dict, hash=False)
    id: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "arguments", canonical_json(self.arguments))


@dataclass(frozen=True, slots=True)
class ImageAt:
    """An image in a message's content, after its first `offset` characters."""

    offset: int
    image: ImageInput
    param: str = field(default="", compare=False)  # the request part it came from


@dataclass(frozen=True, slots=True)
class Message:
    role: Role
    content: str = ""  # text parts joined
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool result: the call it answers
    name: str | None = None  # a tool result's function, or a participant's name
    # An assistant turn's reasoning, rendered where the template puts it; None: none sent
    # ("" is sent and empty: templates may tell the two apart).
    reasoning: str | None = None
    images: tuple[ImageAt, ...] = ()  # ascending offsets, each <= len(content)

    def __post_init__(self) -> None:
        if self.role not in ROLES:  # a caller's bug: requests are validated before this
            raise ValueError(f"Message.role must be one of {', '.join(ROLES)}, not {self.role!r}")
        offsets = [i.offset for i in self.images]
        if offsets != sorted(offsets) or any(not 0 <= o <= len(self.content) for o in offsets):
            raise ValueError("Message.images must stand in the content, in order")


Conversation = tuple[Message, ...]


def template_messages(
    messages: Sequence[Message], contents: Mapping[int, str] | None = None
) -> list[dict[str, Any]]:
    """The messages as the chat template receives them. `contents` replaces the content of
    the messages at those indices (a planner's probe of where a message begins; its images
    go with it) after everything else is derived from the real content."""
    contents = contents or {}
    return [_template_message(m, contents.get(i)) for i, m in enumerate(messages)]


def rendered_images(
    messages: Sequence[Message], contents: Mapping[int, str] | None = None
) -> list[ImageAt]:
    """The images `template_messages(messages, contents)` hands the template, in order."""
    contents = contents or {}
    return [im for i, m in enumerate(messages) if i not in contents for im in m.images]


def _content_parts(message: Message) -> list[dict[str, Any]]:
    """A message with images as the parts templates iterate over: text and image parts in
    the order they were sent (empty text between two images left out)."""
    parts: list[dict[str, Any]] = []
    at = 0
    for image in message.images:
        if image.offset > at:
            parts.append({"type": "text", "text": message.content[at : image.offset]})
        parts.append({"type": "image"})
        at = image.offset
    if at < len(message.content):
        parts.append({"type": "text", "text": message.content[at:]})
    return parts


def _template_message(message: Message, content: str | None) -> dict[str, Any]:
    # The keys, their order and when each appears are part of the rendered prompt: keep
    # them as they are, or every cached conversation renders anew.
    if content is None:
        content = _content_parts(message) if message.images else message.content  # type: ignore[assignment]
    out: dict[str, Any] = {"role": message.role, "content": content}
    if message.tool_calls:
        out["tool_calls"] = [_template_call(c) for c in message.tool_calls]
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    reasoning = message.reasoning
    if reasoning is not None:
        out["reasoning_content"] = reasoning
        if reasoning and not (message.content and message.tool_calls):
            # gpt-oss's template reads an assistant turn's analysis from `thinking` (and
            # refuses it beside both text and a tool call, where it renders the text).
            out["thinking"] = reasoning
    return out


def _template_call(call: ToolCall) -> dict[str, Any]:
    # A fresh copy of the arguments for every render: templates never see shared state.
    function = {"name": call.name, "arguments": canonical_json(call.arguments)}
    out: dict[str, Any] = {"type": "function", "function": function}
    if call.id is not None:
        out["id"] = call.id
    return out


# -- chat completions' message dicts -> the conversation --------------------------------
