"""Anthropic `system` and `messages` content blocks -> the conversation the template
renders (mlx_prefix/conversation.py), plus the client's cache breakpoints
(`cache_control`) found on them.

- `system` (a string or text blocks) becomes the first system message, its blocks joined
  as one string (text blocks render exactly like that string, so a client switching
  between the two forms keeps its prefix). A system block shaped like Claude Code's
  `x-anthropic-billing-header: cc_version=...; cch=...;` is left out unless kept: some
  versions change it on every request, and rendered first it would wipe the prefix.
- user text and `image` blocks join into one user message (each image where it stands:
  protocol/images.py reads its base64 source); each `tool_result` becomes a `tool`
  message answering the `tool_use` of the previous assistant message (one that answers
  nothing is a 400), its `is_error` marked as an `Error: ` prefix, its images kept (Claude
  Code's Read tool returns a screenshot as one). A `tool_reference`
  inside a result renders the referenced (deferred) tool's definition there.
- assistant text blocks join into the content, `tool_use` blocks become `tool_calls`,
  `thinking` blocks the `reasoning_content` templates render (a block this server sent
  with its text omitted carries the reasoning in its signature); `redacted_thinking` holds
  only reasoning encrypted by Anthropic's servers, which no local template can render,
  so it is left out.
- Other block types (documents, server tools) are refused with a 400 naming them.
Pure: no engine, no I/O.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from mlx_prefix.conversation import ImageAt, Message, Role, ToolCall
from mlx_prefix.errors import InvalidRequest, json_type
from mlx_prefix.records import Breakpoint
from mlx_prefix.vision.intake import ImageLimits

from ..images import anthropic_image_block
from ..sealed import unseal

# The roles a Messages request may give (a system turn in `messages` is read as one).
ROLES: tuple[Role, ...] = ("user", "assistant", "system")
_BILLING_HEADER = re.compile(
    r"\s*x-[A-Za-z0-9-]+:\s*[A-Za-z0-9_.-]+=[^;\n]*(?:;\s*[A-Za-z0-9_.-]+=[^;\n]*)*;?\s*"
)


def _block_reasoning(block: dict[str, Any]) -> str:
    """A thinking block's reasoning: its text, or what its signature carries when this
    server omitted the text (protocol/sealed.py)."""
    text, signature = block["thinking"], block.get("signature")
    if text or not isinstance(signature, str):
        return text
    return unseal(signature) or ""


def is_billing_header(text: str) -> bool:
    """A system block that is one `x-...: key=value; key=value;` header line."""
    return _BILLING_HEADER.fullmatch(text) is not None


@dataclass
class Converted:
    """The converted conversation (mutated while converting)."""

    messages: list[Message] = field(default_factory=list)
    breakpoints: list[Breakpoint] = field(default_factory=list)
    limits: ImageLimits = field(default_factory=ImageLimits)

    def mark(self, index: int, chars: int | None = None) -> None:
        self.breakpoints.append(Breakpoint(message=index, chars=chars))


def convert(
    system: Any,
    messages: Any,
    *,
    deferred_tools: dict[str, dict[str, Any]],
    keep_billing_header: bool,
    keep_thinking_turns: int | None,
    images: ImageLimits | None = None,
) -> Converted:
    """Anthropic `system` + `messages` -> the conversation and breakpoints. InvalidRequest
    (naming the field) for anything that cannot be rendered faithfully. `image` blocks
    (in a user message or a tool_result's content) are decoded under `images`."""
    conv = Converted(limits=images or ImageLimits())
    _system(conv, system, keep_billing_header)
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty array", param="messages")
    assistants = [
        i for i, m in enumerate(messages) if isinstance(m, dict) and _role(m) == "assistant"
    ]
    if keep_thinking_turns is not None:  # context_management: only the last N turns' thinking
        assistants = (
            assistants[len(assistants) - keep_thinking_turns :] if keep_thinking_turns else []
        )
    keep_thinking = set(assistants)
    tool_uses: dict[str, str] = {}  # the previous assistant message's tool_use id -> name
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidRequest(f"{param} must be an object", param=param)
        role = _role(message)
        if role not in ROLES:
            raise InvalidRequest(
                f"{param}.role must be 'user' or 'assistant', not {role!r}", param=f"{param}.role"
            )
        content = message.get("content")
        if isinstance(content, str):
            conv.messages.append(Message(role, content))
            continue
        if not isinstance(content, list):
            raise InvalidRequest(
                f"{param}.content must be a string or an array of content blocks",
                param=f"{param}.content",
            )
        if role == "assistant":
            tool_uses = _assistant(conv, content, param, keep_thinking=i in keep_thinking)
        elif role == "user":
            _user(conv, content, param, tool_uses, deferred_tools)
        else:
            _texts_message(conv, "system", content, param)
    if messages[-1].get("role") == "assistant":
        raise InvalidRequest(
            "a final assistant message (a prefilled reply for the model to continue) is not "
            "supported: end with a user message",
            param=f"messages[{len(messages) - 1}]",
        )
    return conv


def _role(message: dict[str, Any]) -> Any:
    return message.get("role")


def _system(conv: Converted, system: Any, keep_billing_header: bool) -> None:
    if system is None:
        return
    if isinstance(system, str):
        if system:
            conv.messages.append(Message("system", system))
        return
    if not isinstance(system, list):
        raise InvalidRequest("'system' must be a string or an array of text blocks", param="system")
    blocks = [
        (j, b)
        for j, b in enumerate(system)
        if keep_billing_header
        or not (isinstance(b, dict) and is_billing_header(str(b.get("text", ""))))
    ]
    if blocks:
        _texts_message(
            conv, "system", [b for _, b in blocks], "system", indices=[j for j, _ in blocks]
        )


def _texts_message(
    conv: Converted,
    role: Role,
    blocks: list[Any],
    param: str,
    indices: list[int] | None = None,
) -> None:
    """Text (and, in a user message, image) blocks -> one message, joined; a breakpoint
    on a block marks its end (an image's: where it stands)."""
    text, marks, images = "", [], []
    for j, block in zip(indices or range(len(blocks)), blocks, strict=True):
        where = f"{param}[{j}]" if param == "system" else f"{param}.content[{j}]"
        if role == "user" and isinstance(block, dict) and block.get("type") == "image":
            image = anthropic_image_block(block, conv.limits, where)
            images.append(ImageAt(len(text), image, where))
        else:
            text += _text(block, where)
        if block.get("cache_control") is not None:
            marks.append(len(text))
    conv.messages.append(Message(role, text, images=tuple(images)))
    for chars in marks:
        conv.mark(len(conv.messages) - 1, None if chars == len(text) else chars)


def _text(block: Any, param: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text":
        kind = block.get("type") if isinstance(block, dict) else json_type(block)
        raise InvalidRequest(f"{param}: expected a text block, got {kind!r}", param=param)
    if not isinstance(block.get("text"), str):
        raise InvalidRequest(f"{param}.text must be a string", param=f"{param}.text")
    return block["text"]


def _assistant(
    conv: Converted, blocks: list[Any], param: str, *, keep_thinking: bool
) -> dict[str, str]:
    texts, reasoning, calls, marked = [], [], [], False
    for j, block in enumerate(blocks):
        where = f"{param}.content[{j}]"
        kind = _kind(block, where)
        if kind == "text":
            texts.append(_text(block, where))
        elif kind == "tool_use":
            calls.append(_tool_use(block, where))
        elif kind == "thinking":
            if not isinstance(block.get("thinking"), str):
                raise InvalidRequest(
                    f"{where}.thinking must be a string", param=f"{where}.thinking"
                )
            if keep_thinking:
                reasoning.append(_block_reasoning(block))
        elif kind != "redacted_thinking":
            raise _unsupported(kind, where)
        marked |= block.get("cache_control") is not None
    conv.messages.append(
        Message(
            "assistant",
            "".join(texts),
            tool_calls=tuple(calls),
            reasoning="".join(reasoning) if reasoning else None,
        )
    )
    if marked:
        conv.mark(len(conv.messages) - 1)
    return {c.id: c.name for c in calls if c.id is not None}


def _tool_use(block: dict[str, Any], where: str) -> ToolCall:
    for key in ("id", "name"):
        if not isinstance(block.get(key), str) or not block[key]:
            raise InvalidRequest(
                f"{where}.{key} must be a non-empty string", param=f"{where}.{key}"
            )
    arguments = block.get("input", {})
    if not isinstance(arguments, dict):
        raise InvalidRequest(f"{where}.input must be an object", param=f"{where}.input")
    return ToolCall(block["name"], arguments, block["id"])


def _user(
    conv: Converted,
    blocks: list[Any],
    param: str,
    tool_uses: dict[str, str],
    deferred_tools: dict[str, dict[str, Any]],
) -> None:
    pending: list[tuple[int, dict[str, Any]]] = []  # text blocks not yet emitted

    def flush() -> None:
        if pending:
            _texts_message(conv, "user", [b for _, b in pending], param, [j for j, _ in pending])
            pending.clear()

    for j, block in enumerate(blocks):
        where = f"{param}.content[{j}]"
        kind = _kind(block, where)
        if kind in ("text", "image"):
            pending.append((j, block))
        elif kind == "tool_result":
            flush()
            conv.messages.append(_tool_result(block, where, tool_uses, deferred_tools, conv.limits))
            if block.get("cache_control") is not None:
                conv.mark(len(conv.messages) - 1)
        else:
            raise _unsupported(kind, where)
    flush()


def _tool_result(
    block: dict[str, Any],
    where: str,
    tool_uses: dict[str, str],
    deferred_tools: dict[str, dict[str, Any]],
    limits: ImageLimits,
) -> Message:
    """A tool_result as a `tool` message: its text blocks joined, its image blocks (Claude
    Code's Read tool returns a screenshot so) where they stand."""
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str):
        raise InvalidRequest(f"{where}.tool_use_id must be a string", param=f"{where}.tool_use_id")
    if call_id not in tool_uses:
        raise InvalidRequest(
            f"{where}: tool_result for tool_use_id {call_id!r}, which no tool_use block of the "
            "previous assistant message has",
            param=f"{where}.tool_use_id",
        )
    content = block.get("content", "")
    images: list[ImageAt] = []
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        text = ""
        for k, part in enumerate(content):
            at = f"{where}.content[{k}]"
            kind = _kind(part, at)
            if kind == "text":
                text += _text(part, at)
            elif kind == "image":
                images.append(ImageAt(len(text), anthropic_image_block(part, limits, at), at))
            elif kind == "tool_reference" and part.get("tool_name") in deferred_tools:
                text += json.dumps(deferred_tools[part["tool_name"]], sort_keys=True)
            else:
                raise _unsupported(kind, at)
    else:
        raise InvalidRequest(
            f"{where}.content must be a string or an array of blocks", param=f"{where}.content"
        )
    is_error = block.get("is_error", False)
    if not isinstance(is_error, bool):
        raise InvalidRequest(f"{where}.is_error must be a boolean", param=f"{where}.is_error")
    if is_error:
        text = f"Error: {text}"
        images = [ImageAt(i.offset + len("Error: "), i.image, i.param) for i in images]
    return Message(
        "tool", text, tool_call_id=call_id, name=tool_uses[call_id], images=tuple(images)
    )


def _kind(block: Any, where: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise InvalidRequest(f"{where} must be a content block with a 'type'", param=where)
    return block["type"]


def _unsupported(kind: str, where: str) -> InvalidRequest:
    return InvalidRequest(
        f"{where}: content blocks of type {kind!r} are not supported here (text, image, "
        "tool_use, tool_result, thinking and redacted_thinking are)",
        param=where,
    )
