"""A conversation (or raw text) to token ids, deterministically.

The same conversation must always render to the same tokens, whoever sends it: the
conversation arrives in one form (mlx_prefix/conversation.py: parts joined, arguments
decoded with sorted keys, validated by whoever built it), and tool definitions are
serialized with a stable key order.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from mlx_prefix.conversation import Message, canonical_json, template_messages
from mlx_prefix.errors import InvalidRequest
from mlx_prefix.prompt.request.bounded import Timeout, call_bounded
from mlx_prefix.prompt.request.call_ids import CallIdForm, detect, map_call_ids
from mlx_prefix.records import PromptInput

# The planner's sentinel (plan.py, breakpoints.py): an invisible separator, short, and
# never merging across a message start; a probe render with it in place of some content
# shares its tokens with the real render up to where that content begins.
SENTINEL = "\u2063"

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
    params: Iterable[inspect.Parameter]
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
        # The server's apply_chat_template arguments (--chat-template-args); a request's
        # own chat_template_kwargs win over them, as in mlx_lm.server.
        self.defaults = dict(defaults or {})
        for key in sorted(self.defaults.keys() & self.reserved.keys()):
            raise InvalidRequest(
                f"--chat-template-args may not set {key!r}: {self.reserved[key]}",
                param="chat_template_args",
            )
        # The tool-call ids this template accepts (prompt/request/call_ids.py): found once.
        self.call_ids = CallIdForm.AS_SENT
        if self.has_template:
            self.call_ids = detect(
                lambda messages: tokenizer.apply_chat_template(
                    template_messages(messages),
                    tokenize=False,
                    add_generation_prompt=False,
                    **self.defaults,
                )
            )

    def render_text(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
        contents: Mapping[int, str] | None = None,
    ) -> str:
        """The template's text for `messages`; `contents` replaces some messages' content
        (conversation.template_messages: a planner's probe)."""
        if not self.has_template:
            raise InvalidRequest("this model has no chat template: use /v1/completions")
        for key in sorted((template_kwargs or {}).keys() & self.reserved.keys()):
            raise InvalidRequest(
                f"chat_template_kwargs may not set {key!r}: {self.reserved[key]}",
                param=f"chat_template_kwargs.{key}",
            )
        kwargs = {**self.defaults, **(template_kwargs or {})}
        if tools:
            kwargs["tools"] = [canonical_json(t) for t in tools]
        dicts = template_messages(map_call_ids(messages, self.call_ids), contents)

        def render() -> str:
            return self.tokenizer.apply_chat_template(
                dicts,
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

    def messages_text(self, prompt: PromptInput, contents: Mapping[int, str] | None = None) -> str:
        """The template's text for `prompt`'s conversation, with `contents` replacing some
        messages' content (a planner's probe); without its assistant prefix."""
        if not prompt.messages:
            raise InvalidRequest("'messages' must not be empty", param="messages")
        return self.render_text(
            prompt.messages,
            tools=prompt.tools,
            template_kwargs=prompt.chat_template_kwargs,
            contents=contents,
        )


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
