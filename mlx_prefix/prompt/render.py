"""Chat messages (or raw text) to token ids, deterministically.

The same conversation must always render to the same tokens, whoever sends it:
content as a string or as an array of text parts renders identically, and tool
definitions and tool-call arguments are serialized with a stable key order.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from mlx_prefix.errors import InvalidRequest
from mlx_prefix.prompt.call_ids import CallIdForm, detect, map_call_ids
from mlx_prefix.records import PromptInput

from .bounded import Timeout, call_bounded

if TYPE_CHECKING:
    from mlx_prefix.prompt.reasoning import ReasoningMarkers

ROLES = ("system", "developer", "user", "assistant", "tool")

# apply_chat_template's own arguments: in chat_template_kwargs they would replace the
# template, change how it is rendered or tokenized, or collide with what the renderer
# sets itself. Only template variables (enable_thinking, ...) may come from a request.
# Any other named parameter of the tokenizer's apply_chat_template is refused too.
_RESERVED_KWARGS = {
    "chat_template": "the server renders with the model's own template only",
    "tools": "give tools in the request's 'tools' field",
    "documents": "not supported; put documents in the messages",
    "add_generation_prompt": "the server always adds the generation prompt",
    "continue_final_message": "the server always adds the generation prompt",
    "tokenize": "the server tokenizes the rendered prompt itself",
    "tokenizer_kwargs": "the server tokenizes the rendered prompt itself",
    "padding": "the server tokenizes the rendered prompt itself",
    "truncation": "the server tokenizes the rendered prompt itself",
    "max_length": "the server tokenizes the rendered prompt itself",
    "return_tensors": "the server tokenizes the rendered prompt itself",
    "return_dict": "the server tokenizes the rendered prompt itself",
    "return_assistant_tokens_mask": "the server tokenizes the rendered prompt itself",
    "conversation": "give the conversation in 'messages'",
    "messages": "give the conversation in 'messages'",
}
# Rendering runs user-influenced template code: it ends with an error past this.
RENDER_TIMEOUT_S = 10.0


def reserved_template_kwargs(tokenizer: Any) -> dict[str, str]:
    """The keys a chat_template_kwargs may not set for this tokenizer, with the reason."""
    reserved = dict(_RESERVED_KWARGS)
    try:
        params = inspect.signature(tokenizer.apply_chat_template).parameters.values()
    except (AttributeError, TypeError, ValueError):
        params = ()
    for p in params:
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            reserved.setdefault(
                p.name, "an argument of apply_chat_template, not a template variable"
            )
    return reserved


def content_text(content: Any, *, param: str = "messages") -> str:
    """A message's content as one string; an array of text parts is concatenated."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type") in ("text", "input_text"):
                if not isinstance(part.get("text"), str):
                    raise InvalidRequest("a text content part needs a string 'text'", param=param)
                parts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise InvalidRequest(f"unsupported content part type: {kind!r}", param=param)
        return "".join(parts)
    raise InvalidRequest("message content must be a string or an array of parts", param=param)


def _sorted_json(value: Any) -> Any:
    """Recursively rebuild dicts with sorted keys so templates' tojson is order-stable."""
    if isinstance(value, dict):
        return {k: _sorted_json(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_sorted_json(v) for v in value]
    return value


def _normalize_tool_call(call: Any) -> dict[str, Any]:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise InvalidRequest("tool_calls entries need a 'function' object", param="messages")
    function = dict(call["function"])
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            pass  # keep the client's string as sent
    # Templates differ (some print a dict, some a string); a dict with sorted keys is the
    # canonical form both kinds render deterministically.
    function["arguments"] = _sorted_json(arguments)
    out = {"type": call.get("type", "function"), "function": function}
    if "id" in call:
        out["id"] = call["id"]
    return out


def normalize_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Validate messages and bring them to the one form the chat template sees."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidRequest("'messages' must be a non-empty array", param="messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequest(f"messages[{i}] must be an object", param="messages")
        role = message.get("role")
        if role not in ROLES:
            raise InvalidRequest(
                f"messages[{i}].role must be one of {', '.join(ROLES)}; got {role!r}",
                param="messages",
            )
        normalized: dict[str, Any] = {
            "role": role,
            "content": content_text(message.get("content"), param=f"messages[{i}].content"),
        }
        if message.get("tool_calls"):
            normalized["tool_calls"] = [_normalize_tool_call(c) for c in message["tool_calls"]]
        for key in ("name", "tool_call_id", "reasoning_content"):
            if isinstance(message.get(key), str):
                normalized[key] = message[key]
        # `reasoning`: mlx_lm.server's and newer vLLM's name for the same field.
        if role == "assistant" and "reasoning_content" not in normalized:
            if isinstance(message.get("reasoning"), str):
                normalized["reasoning_content"] = message["reasoning"]
        reasoning = normalized.get("reasoning_content")
        if reasoning and not (normalized["content"] and normalized.get("tool_calls")):
            # gpt-oss's template reads an assistant turn's analysis from `thinking` (and
            # refuses it beside both text and a tool call, where it renders the text).
            normalized["thinking"] = reasoning
        if role != "assistant" and "content" not in message:
            raise InvalidRequest(f"messages[{i}] has no content", param="messages")
        out.append(normalized)
    return out


class ChatRenderer:
    """Renders prompts with one tokenizer's chat template. Holds no MLX state."""

    def __init__(
        self,
        tokenizer: Any,
        defaults: dict[str, Any] | None = None,
        timeout_s: float | None = None,
    ):
        self.tokenizer = tokenizer
        self.has_template = bool(getattr(tokenizer, "chat_template", None))
        self._timeout_s = timeout_s  # None: RENDER_TIMEOUT_S, read at each render
        self.reserved = reserved_template_kwargs(tokenizer)
        # The model's think markers, once known (prompt/reasoning.py; set by the planner).
        self.reasoning: ReasoningMarkers | None = None
        # The server's apply_chat_template arguments (--chat-template-args); a request's
        # own chat_template_kwargs win over them, as in mlx_lm.server.
        self.defaults = dict(defaults or {})
        for key in sorted(self.defaults.keys() & self.reserved.keys()):
            raise InvalidRequest(
                f"--chat-template-args may not set {key!r}: {self.reserved[key]}",
                param="chat_template_args",
            )
        # The tool-call ids this template accepts (prompt/call_ids.py): found once.
        self.call_ids = CallIdForm.AS_SENT
        if self.has_template:
            self.call_ids = detect(
                lambda messages: tokenizer.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=False, **self.defaults
                )
            )

    def render_text(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        if not self.has_template:
            raise InvalidRequest("this model has no chat template: use /v1/completions")
        for key in sorted((template_kwargs or {}).keys() & self.reserved.keys()):
            raise InvalidRequest(
                f"chat_template_kwargs may not set {key!r}: {self.reserved[key]}",
                param=f"chat_template_kwargs.{key}",
            )
        kwargs = {**self.defaults, **(template_kwargs or {})}
        if tools:
            kwargs["tools"] = [_sorted_json(t) for t in tools]

        def render() -> str:
            return self.tokenizer.apply_chat_template(
                map_call_ids(messages, self.call_ids),
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **kwargs,
            )

        timeout_s = RENDER_TIMEOUT_S if self._timeout_s is None else self._timeout_s
        try:
            return call_bounded(render, timeout_s, name="chat-template")
        except InvalidRequest:
            raise
        except Timeout:
            raise InvalidRequest(
                f"the chat template did not finish rendering within {timeout_s:g}s "
                "(a loop too long for these messages or chat_template_kwargs?)",
                param="messages",
                code="template_timeout",
            ) from None
        except Exception as e:  # jinja raise_exception() and template errors
            raise InvalidRequest(f"chat template failed: {e}", param="messages") from None

    def encode_chat(self, text: str) -> list[int]:
        # The template already wrote any BOS it wants; don't let the tokenizer add another.
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_completion(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def prompt_tokens(self, prompt: PromptInput) -> list[int]:
        """The tokens `prompt` renders to (no checkpoint planning, no context check)."""
        if prompt.text is not None:
            return self.encode_completion(prompt.text)
        return self.messages_tokens(prompt, normalize_messages(prompt.messages or ()))

    def messages_tokens(self, prompt: PromptInput, messages: Sequence[dict[str, Any]]) -> list[int]:
        text = self.render_text(
            messages, tools=prompt.tools, template_kwargs=prompt.chat_template_kwargs
        )
        prefix = prompt.assistant_prefix
        if prefix and self.reasoning is not None and self.reasoning.opens_text(text):
            # A forced tool call is never reasoning: the think block the generation
            # prompt opened is closed first, as the template closes one.
            prefix = self.reasoning.close_text + prefix
        return self.encode_chat(text + prefix)
