"""Ollama's /api/chat and /api/generate bodies -> an OllamaRequest (a GenerationRequest
and what only Ollama says: keep_alive, think, num_ctx, whether it only loads the model).
Pure: no model, no MLX.

Every field Ollama's API documents is honoured or refused with a 400 naming it
(invariant 9): `messages` (roles, `thinking` sent back as reasoning, `tool_calls` with
their arguments as objects, `tool_name`), `tools`, `format`, `options`
(options.py), `think`, `keep_alive`, `stream` (true by default, as in
Ollama), `logprobs` / `top_logprobs`; /api/generate's `system` and `raw` (the prompt as
is, no template); `images` (base64, on a message or beside /api/generate's prompt) stand
before the message's text, where Ollama puts them, their headers read under the server's
image limits (decoded only once the whole request passed them, and a text-only model
refuses them naming the field: routes/flow.py). Refused: `suffix`
(fill-in-the-middle needs a template this server does not have), `template` (a request
never chooses the template, invariant 13), a non-empty `context` (Ollama's deprecated
token memory: send the conversation to /api/chat instead, whose history the prefix cache
reuses), `truncate: true` and `shift: true` (the server never cuts a prompt or shifts
the context), and any field Ollama does not define, except this server's own
`prefix_cache` and `cache_salt`. An empty prompt (or no messages) loads the model and
generates nothing, as in Ollama.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from mlx_prefix.conversation import Conversation, ImageAt, Message
from mlx_prefix.errors import InvalidRequest, json_type
from mlx_prefix.records import PromptInput, SamplingParams
from mlx_prefix.vision.intake import ImageInput, ImageLimits, decode_base64, read_image

from ..chat import read_tools
from ..effort import Thinking
from ..fields import field, integer
from ..messages import conversation_from_dicts
from ..request import GenerationRequest, Limits, cache_preference
from ..spec import refuse_format_with_tools, refuse_stop_with_format, refuse_unknown
from .options import (
    OptionValues,
    parse_format,
    parse_keep_alive,
    parse_options,
    parse_think,
)

COMMON_FIELDS = frozenset(
    {
        "model", "stream", "format", "options", "keep_alive", "think", "logprobs",
        "top_logprobs", "truncate", "shift", "prefix_cache", "cache_salt",
    }
)  # fmt: skip
CHAT_FIELDS = COMMON_FIELDS | {"messages", "tools"}
GENERATE_FIELDS = COMMON_FIELDS | {
    "prompt", "suffix", "system", "template", "context", "raw", "images",
}  # fmt: skip
MESSAGE_FIELDS = frozenset(
    {"role", "content", "thinking", "images", "tool_calls", "tool_name", "tool_call_id"}
)
ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class OllamaRequest:
    generation: GenerationRequest
    keep_alive: float | None  # seconds (config.FOREVER: for good); None: not sent
    think: Thinking | None  # None: not sent
    options: OptionValues
    load_only: bool  # nothing to generate: load (or, with keep_alive 0, unload) the model

    @property
    def model(self) -> str:
        assert self.generation.model is not None  # required by the parsers
        return self.generation.model

    @property
    def adapter(self) -> str | None:
        return None  # Ollama's API names no adapter


def parse_ollama_chat(body: dict[str, Any], limits: Limits) -> OllamaRequest:
    refuse_unknown(body, CHAT_FIELDS, what="/api/chat")
    raw_messages = field(body, "messages", list, None) or []
    think = parse_think(body.get("think"))
    tools = read_tools(body)
    if not raw_messages:
        return _request("chat", body, limits, None, think, tools=tools, load_only=True)
    messages = conversation_from_dicts(
        [_message(m, f"messages[{i}]") for i, m in enumerate(raw_messages)]
    )
    messages = tuple(
        _with_images(m, raw.get("images"), f"messages[{i}].images", limits.images)
        for i, (m, raw) in enumerate(zip(messages, raw_messages, strict=True))
    )
    return _request("chat", body, limits, messages, think, tools=tools)


def parse_ollama_generate(body: dict[str, Any], limits: Limits) -> OllamaRequest:
    refuse_unknown(body, GENERATE_FIELDS, what="/api/generate")
    prompt = field(body, "prompt", str, "")
    system = field(body, "system", str, "")
    raw = bool(field(body, "raw", bool, False))
    if field(body, "template", str, ""):
        raise InvalidRequest(
            "template is not supported: the served model's chat template renders the "
            "prompt (send raw: true with a prompt you rendered yourself)",
            param="template",
        )
    context = field(body, "context", list, None)
    if context:
        raise InvalidRequest(
            "context (Ollama's deprecated token memory) is not supported: send the "
            "conversation to /api/chat as messages; its shared history comes from the "
            "prefix cache",
            param="context",
        )
    if field(body, "suffix", str, ""):
        raise InvalidRequest(
            "suffix (fill-in-the-middle) is not supported: the served models have no "
            "fill-in-the-middle template here",
            param="suffix",
        )
    think = parse_think(body.get("think"))
    if raw:
        if system:
            raise InvalidRequest("raw mode does not support system", param="system")
        if body.get("images"):
            raise InvalidRequest(
                "raw mode does not support images: a raw prompt is not rendered by the "
                "template, which places them",
                param="images",
            )
        if think is not None:
            raise InvalidRequest(
                "raw mode does not support think: a raw prompt is not rendered by the "
                "template, whose switch think sets",
                param="think",
            )
        text = PromptInput(text=prompt) if prompt else None
        return _request("completion", body, limits, text, None, load_only=not prompt)
    if not prompt:
        return _request("chat", body, limits, None, think, load_only=True)
    turns = [{"role": "system", "content": system}] if system else []
    messages = conversation_from_dicts([*turns, {"role": "user", "content": prompt}])
    asked = _with_images(messages[-1], body.get("images"), "images", limits.images)
    return _request("chat", body, limits, (*messages[:-1], asked), think)


def _request(
    kind: Literal["chat", "completion"],
    body: dict[str, Any],
    limits: Limits,
    prompt: Conversation | PromptInput | None,
    think: Thinking | None,
    *,
    tools: tuple[dict[str, Any], ...] | None = None,
    load_only: bool = False,
) -> OllamaRequest:
    model = field(body, "model", str, None)
    if not model:
        raise InvalidRequest("model is required", param="model")
    for name in ("truncate", "shift"):
        if field(body, name, bool, False):
            raise InvalidRequest(
                f"{name}: true is not supported: this server never cuts a prompt nor "
                "shifts the context (a prompt over the context is a 400; a reply ends at "
                "the context's end with done_reason length); send false",
                param=name,
            )
    options = parse_options(body.get("options"), limits)
    logprobs = bool(field(body, "logprobs", bool, False))
    top = integer(body, "top_logprobs", 0, lo=0, hi=20)
    if top and not logprobs:
        raise InvalidRequest("top_logprobs requires logprobs: true", param="top_logprobs")
    fmt = parse_format(body.get("format"))
    refuse_format_with_tools(fmt, bool(tools), tool_choice=False)
    max_tokens = options.max_tokens
    sampling = SamplingParams(
        max_tokens=min(limits.default_max_tokens, limits.max_tokens)
        if max_tokens is None
        else min(max_tokens, limits.max_tokens),
        logprobs=logprobs,
        top_logprobs=top,
        response_format=fmt,
        reasoning_budget=think.budget if think is not None else None,
        **options.sampling,
    )
    refuse_stop_with_format(sampling, "options.stop")
    if isinstance(prompt, PromptInput):
        text = prompt
    else:
        kwargs = think.template_kwargs if think is not None else {}
        text = PromptInput(messages=prompt or (), tools=tools, chat_template_kwargs=kwargs)
    generation = GenerationRequest(
        kind=kind,
        model=model,
        prompt=text,
        sampling=sampling,
        cache=cache_preference(body),
        stream=bool(field(body, "stream", bool, True)),
        max_tokens_param=None if max_tokens is None else "options.num_predict",
        include_usage=False,
        parse_tools=bool(tools),
        fit_reply=False,  # num_predict bounds the reply; it never fails a request
    )
    return OllamaRequest(
        generation, parse_keep_alive(body.get("keep_alive")), think, options, load_only
    )


def _message(message: Any, param: str) -> dict[str, Any]:
    """One Ollama message as the chat-completions dict conversation.py reads: tool calls
    with their arguments as objects, `tool_name` as a tool result's name, `thinking` as
    an assistant turn's reasoning."""
    if not isinstance(message, dict):
        raise InvalidRequest(f"{param} must be an object, not {json_type(message)}", param=param)
    refuse_unknown(message, MESSAGE_FIELDS, what="Ollama's messages", where=f"{param}.")
    role = message.get("role")
    if isinstance(role, str):
        role = role.lower()  # Ollama lowercases roles
    if role not in ROLES:
        raise InvalidRequest(
            f"{param}.role must be one of {', '.join(ROLES)}, not {role!r}", param=f"{param}.role"
        )
    out: dict[str, Any] = {"role": role, "content": message.get("content") or ""}
    if not isinstance(out["content"], str):
        raise InvalidRequest(f"{param}.content must be a string", param=f"{param}.content")
    for key, to in (("thinking", "reasoning_content"), ("tool_name", "name")):
        value = message.get(key)
        if value:
            if not isinstance(value, str) or (key == "thinking" and role != "assistant"):
                raise InvalidRequest(
                    f"{param}.{key} must be a string"
                    + " on an assistant message" * (key == "thinking"),
                    param=f"{param}.{key}",
                )
            out[to] = value
    if message.get("tool_call_id"):
        out["tool_call_id"] = message["tool_call_id"]
    calls = message.get("tool_calls")
    if calls:
        if not isinstance(calls, list):
            raise InvalidRequest(
                f"{param}.tool_calls must be an array", param=f"{param}.tool_calls"
            )
        out["tool_calls"] = [_call(c, f"{param}.tool_calls[{j}]") for j, c in enumerate(calls)]
    return out


def _call(call: Any, param: str) -> dict[str, Any]:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise InvalidRequest(
            f'{param} must be {{"function": {{"name": ..., "arguments": {{...}}}}}}', param=param
        )
    function = call["function"]
    out: dict[str, Any] = {
        "type": "function",
        "function": {"name": function.get("name"), "arguments": function.get("arguments") or {}},
    }
    if call.get("id") is not None:
        out["id"] = call["id"]
    return out


def _with_images(message: Message, images: Any, param: str, limits: ImageLimits) -> Message:
    """`message` with Ollama's `images` (base64 strings, no data: prefix) before its
    text, where Ollama puts them."""
    if images is None or images == []:
        return message
    if not isinstance(images, list):
        raise InvalidRequest(f"{param} must be an array of base64 strings", param=param)
    decoded = []
    for j, text in enumerate(images):
        at = f"{param}[{j}]"
        image = ImageInput(read_image(decode_base64(text, limits, at), limits, at))
        decoded.append(ImageAt(0, image, at))
    return replace(message, images=tuple(decoded))
