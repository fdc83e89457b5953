"""Tool-call ids in the form the chat template accepts.

Clients name calls their own way (`call_...` from the OpenAI SDK and Codex, `toolu_...`
from Claude Code, the server's own `ToolCallIds`), and some templates will not render
those: Mistral Small 3.x and Devstral refuse any id that is not 9 alphanumerics (the
whole conversation is a 400), and Kimi K2 names a call itself (`functions.<name>:<i>`,
i its index in the message) while printing the result's `tool_call_id` as sent, so the
model would see a result answer an id it never wrote.

Each conversation's ids are mapped before the template sees them, in order of first
appearance: an id the template accepts stays as it is, another becomes a digest of it,
redrawn while it would collide with an id mapped before it. The mapping of an id
depends only on the ids before it, so a conversation renders the same tokens every turn
(the prefix cache depends on it) and the next-turn prefetch, which renders the reply
with the ids the client will get, renders what the next request will. Only the prompt
changes: replies carry the ids the client knows.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Sequence
from dataclasses import replace
from enum import Enum

from mlx_prefix.conversation import Message, ToolCall

_ALPHABET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_NINE = re.compile(r"[A-Za-z0-9]{9}")


class CallIdForm(Enum):
    AS_SENT = "as sent"  # the template takes any id
    NINE_ALNUM = "9 alphanumerics"  # Mistral Small 3.x, Devstral, Magistral
    TEMPLATE_NAMED = "functions.<name>:<index>"  # Kimi K2 names calls itself


Render = Callable[[Sequence[Message]], str]

_PROBE_NAME = "zqprobe_tool"


def _probe(call_id: str) -> list[Message]:
    return [
        Message("user", "zqask"),
        Message("assistant", tool_calls=(ToolCall(_PROBE_NAME, {}, call_id),)),
        Message("tool", "zqresult", tool_call_id=call_id),
    ]


def detect(render: Render) -> CallIdForm:
    """The form of id the template behind `render` (messages -> text, raising on a
    template's refusal) accepts, from renders of one call and its result."""
    try:
        text = render(_probe("call_zqprobe0"))
    except Exception:  # noqa: BLE001 -- any refusal: try the strict form
        try:
            render(_probe("zqProbe09"))
        except Exception:  # noqa: BLE001 -- no tool calls at all: nothing to map
            return CallIdForm.AS_SENT
        return CallIdForm.NINE_ALNUM
    if f"functions.{_PROBE_NAME}:0" in text and "call_zqprobe0" in text:
        return CallIdForm.TEMPLATE_NAMED
    return CallIdForm.AS_SENT


def map_call_ids(messages: Sequence[Message], form: CallIdForm) -> list[Message]:
    """`messages` with their tool-call ids in `form`: the calls' `id` and the results'
    `tool_call_id` alike."""
    if form is CallIdForm.AS_SENT:
        return list(messages)
    mapped = _template_names(messages) if form is CallIdForm.TEMPLATE_NAMED else _nine(messages)
    out = []
    for message in messages:
        if message.tool_calls:
            calls = tuple(
                replace(c, id=mapped[c.id]) if c.id is not None else c for c in message.tool_calls
            )
            message = replace(message, tool_calls=calls)
        if message.tool_call_id is not None:
            message = replace(message, tool_call_id=mapped[message.tool_call_id])
        out.append(message)
    return out


def _ids_in_order(messages: Sequence[Message]) -> list[str]:
    seen: dict[str, None] = {}
    for message in messages:
        for call in message.tool_calls:
            if call.id is not None:
                seen.setdefault(call.id)
        if message.tool_call_id is not None:
            seen.setdefault(message.tool_call_id)
    return list(seen)


def _nine(messages: Sequence[Message]) -> dict[str, str]:
    mapped: dict[str, str] = {}
    taken: set[str] = set()
    for call_id in _ids_in_order(messages):
        candidate, attempt = call_id, 0
        while not _NINE.fullmatch(candidate) or candidate in taken:
            candidate = nine_alnum(call_id, attempt)
            attempt += 1
        mapped[call_id] = candidate
        taken.add(candidate)
    return mapped


def nine_alnum(call_id: str, attempt: int = 0) -> str:
    """9 alphanumerics from a digest of `call_id` (and the attempt, after a collision)."""
    value = int.from_bytes(hashlib.sha256(f"{attempt}#{call_id}".encode()).digest()[:8], "big")
    chars = []
    for _ in range(9):
        value, digit = divmod(value, len(_ALPHABET))
        chars.append(_ALPHABET[digit])
    return "".join(chars)


def _template_names(messages: Sequence[Message]) -> dict[str, str]:
    """Kimi K2: each call as the template names it; a result then answers that name."""
    mapped: dict[str, str] = {}
    for message in messages:
        for index, call in enumerate(message.tool_calls):
            if call.id is not None:
                mapped.setdefault(call.id, f"functions.{call.name}:{index}")
    for call_id in _ids_in_order(messages):
        mapped.setdefault(call_id, call_id)  # a result of no call in the conversation
    return mapped
