"""POST /v1/responses bodies (the OpenAI Responses API, as the `openai` SDK's
`responses.create` and Codex CLI send it) -> a ResponsesRequest.

Stricter than the other families: a field this server cannot honour (built-in tools,
`reasoning.summary` beyond auto, `background`, `truncation: auto`, a field it does not
know) is
refused with a 400 naming it, unless its value is empty (null, false, "", [], {}):
clients often send defaults. Bookkeeping that changes no output (`metadata`, `user`,
`prompt_cache_key`, ...) is accepted and echoed. `text.format` may ask for JSON
(server/protocol/formats.py). `reasoning.effort` bounds the reasoning or turns it off
(protocol/effort.py). SGLang's fields, which its router adds to every body it forwards:
`top_k`, `min_p`, `repetition_penalty` honoured as in chat completions, `priority` only 0.
`previous_response_id` is only read here; the route resolves it against its store.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mlx_prefix.conversation import Conversation, Message
from mlx_prefix.errors import InvalidRequest
from mlx_prefix.records import CachePreference, PromptInput, SamplingParams, ToolCallIds

from ..effort import effort_bound
from ..fields import field as read
from ..fields import integer, number
from ..formats import responses_text_format
from ..request import SEED_LIMIT, GenerationRequest, Limits, ToolChoice, cache_preference
from ..sampling_fields import MAX_REPETITION_PENALTY
from .items import chat_tools, input_messages, is_empty

LOGPROBS = "message.output_text.logprobs"
# Asks for a field of reasoning items; this server's always carry it (their text, sealed:
# protocol/sealed.py), so there is nothing more to include. Codex always sends it.
ENCRYPTED_REASONING = "reasoning.encrypted_content"

# Accepted as sent and echoed in the response; they change nothing generated.
_ECHOED = ("metadata", "user", "safety_identifier", "prompt_cache_key")
# Accepted, never echoed: a client's own bookkeeping, or a bound on built-in tools
# (none run here), or options read below.
_ACCEPTED = {
    *_ECHOED,
    "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls",
    "max_output_tokens", "temperature", "top_p", "stream", "store", "previous_response_id",
    "include", "text", "reasoning", "truncation", "service_tier", "stream_options",
    "top_logprobs", "max_tool_calls", "client_metadata", "prompt_cache_retention",
    # this server's extensions, as in chat completions
    "prefix_cache", "seed", "chat_template_kwargs", "cache_salt",
    # SGLang's, which its router (sglang-router 0.3.2) writes into every Responses body
    # it forwards: sampling extensions (read below) and `priority` (_check_options)
    "top_k", "min_p", "repetition_penalty", "priority",
}  # fmt: skip
# Refused when not empty, with why (fields not listed here or above get a generic reason).
_REFUSED = {
    "background": "background responses are not supported; send the request and wait",
    "conversation": "conversations are not stored here; chain with previous_response_id",
    "prompt": "stored prompt templates are not supported; send input and instructions",
    "context_management": "server-side context compaction is not supported",
    "prompt_cache_options": "cache options are not supported: every prefix is cached",
}


@dataclass(frozen=True)
class ResponsesRequest:
    model: str | None
    input: Conversation  # this request's own messages
    instructions: str | None  # a system message before everything (not carried over)
    tools: tuple[dict[str, Any], ...] | None  # chat shape, for the template; None: none offered
    sampling: SamplingParams
    cache: CachePreference
    stream: bool
    store: bool
    previous_response_id: str | None
    max_output_tokens: int | None  # as sent; None: the server's default (clamped)
    parallel_tool_calls: bool  # False: the reply ends after its first tool call
    chat_template_kwargs: dict[str, Any]
    # What the response object repeats back: tools (flat), tool_choice, metadata, ...
    echo: dict[str, Any] = field(default_factory=dict)

    @property
    def adapter(self) -> None:
        """No LoRA adapter: `adapters` (mlx_lm.server's chat field) is refused here."""
        return None

    def prompt(self, history: Conversation, ids: ToolCallIds) -> PromptInput:
        """The engine's prompt: instructions, the previous responses' conversation, this
        input; the reply's tool calls named by `ids`."""
        system = (Message("system", self.instructions),) if self.instructions else ()
        return PromptInput(
            messages=(*system, *history, *self.input),
            tools=self.tools,
            chat_template_kwargs=self.chat_template_kwargs,
            reply_tool_call_ids=ids,
        )

    def generation(self, history: Conversation, ids: ToolCallIds) -> GenerationRequest:
        """This request as every family's generation flow takes it (routes/flow.py)."""
        explicit = self.max_output_tokens is not None
        return GenerationRequest(
            kind="chat",
            model=self.model,
            prompt=self.prompt(history, ids),
            sampling=self.sampling,
            cache=self.cache,
            stream=self.stream,
            max_tokens_param="max_output_tokens" if explicit else None,
            include_usage=False,
            parse_tools=bool(self.tools),
            tool_choice=ToolChoice(parallel=self.parallel_tool_calls),
        )


def parse_responses(body: dict[str, Any], limits: Limits) -> ResponsesRequest:
    _refuse_unknown(body)
    _check_options(body)
    tool_choice = read(body, "tool_choice", (str, dict), "auto")
    if tool_choice not in ("auto", "none"):
        raise InvalidRequest(
            "tool_choice: only 'auto' and 'none' are supported (forcing a call needs "
            "constrained decoding, which this server does not do)",
            param="tool_choice",
        )
    found = chat_tools(body.get("tools"))
    tools, flat_tools = found if found is not None else (None, [])
    text_format = read(body, "text", dict, {}).get("format")
    response_format = None if is_empty(text_format) else responses_text_format(text_format)
    if response_format is not None and tools is not None and tool_choice != "none":
        raise InvalidRequest(
            "text.format cannot be combined with tools: a reply held to the format could "
            "never call one (send tool_choice: 'none', or no tools)",
            param="text.format",
        )
    stream = bool(read(body, "stream", bool, False))
    if not stream and not is_empty(body.get("stream_options")):
        raise InvalidRequest("stream_options needs stream: true", param="stream_options")
    max_output_tokens = integer(body, "max_output_tokens", None, lo=1, hi=None)
    if max_output_tokens is not None and max_output_tokens > limits.max_tokens:
        raise InvalidRequest(
            f"max_output_tokens is {max_output_tokens}, more than this model allows "
            f"({limits.max_tokens})",
            param="max_output_tokens",
        )
    effort = read(body, "reasoning", dict, {}).get("effort")
    bound = effort_bound(effort, "reasoning.effort")
    sampling = SamplingParams(
        max_tokens=max_output_tokens or min(limits.default_max_tokens, limits.max_tokens),
        temperature=number(
            body, "temperature", limits.sampling.get("temperature", 0.0), lo=0.0, hi=2.0
        ),
        top_p=number(body, "top_p", limits.sampling.get("top_p", 1.0), lo=0.0, hi=1.0),
        # SGLang's extensions, as chat completions reads them; the router sends top_k -1
        # (SGLang's "off", mlx_lm's 0), min_p 0 and repetition_penalty 1 (both off).
        top_k=max(integer(body, "top_k", limits.sampling.get("top_k", 0), lo=-1, hi=None), 0),
        min_p=number(body, "min_p", limits.sampling.get("min_p", 0.0), lo=0.0, hi=1.0),
        repetition_penalty=number(
            body, "repetition_penalty", 0.0, lo=0.0, hi=MAX_REPETITION_PENALTY
        ),
        seed=integer(body, "seed", None, lo=0, hi=SEED_LIMIT - 1),
        logprobs=LOGPROBS in _include(body),
        response_format=response_format,
        reasoning_budget=bound.budget,
    )
    if "input" not in body or body["input"] is None:
        raise InvalidRequest("'input' is required", param="input")
    echo = {
        "tools": flat_tools,
        "tool_choice": tool_choice,
        "parallel_tool_calls": read(body, "parallel_tool_calls", bool, True),
        "metadata": read(body, "metadata", dict, {}),
        "truncation": "disabled",
        "text": {"format": text_format if response_format is not None else {"type": "text"}},
        "reasoning": {"effort": effort, "summary": None},
        **{k: body[k] for k in _ECHOED[1:] if isinstance(body.get(k), str)},
    }
    return ResponsesRequest(
        model=read(body, "model", str, None),
        input=tuple(input_messages(body["input"], images=limits.images)),
        instructions=read(body, "instructions", str, None) or None,
        tools=tools if tool_choice != "none" else None,
        sampling=sampling,
        cache=cache_preference(body),
        stream=stream,
        store=bool(read(body, "store", bool, True)),
        previous_response_id=read(body, "previous_response_id", str, None) or None,
        max_output_tokens=max_output_tokens,
        parallel_tool_calls=echo["parallel_tool_calls"],
        chat_template_kwargs=bound.kwargs_under(
            read(body, "chat_template_kwargs", dict, None) or {}
        ),
        echo=echo,
    )


def _refuse_unknown(body: dict[str, Any]) -> None:
    for name, value in body.items():
        if name in _ACCEPTED or is_empty(value):
            continue
        reason = _REFUSED.get(name, "this server does not know this field")
        raise InvalidRequest(f"'{name}' is not supported: {reason}", param=name)


def _check_options(body: dict[str, Any]) -> None:
    """Option objects whose defaults are what this server does; anything else is refused."""
    reasoning = read(body, "reasoning", dict, {})
    for key, value in reasoning.items():
        # "auto" leaves whether to summarize to the server: the reasoning items carry the
        # reasoning itself, no summary. The effort: parse_responses reads it.
        if key == "effort" or is_empty(value) or (key == "summary" and value in ("auto", "none")):
            continue
        raise InvalidRequest(
            f"reasoning.{key} is not supported: reasoning items carry the model's reasoning "
            "itself, never a summary of it",
            param=f"reasoning.{key}",
        )
    text = read(body, "text", dict, {})
    for key, value in text.items():
        if key != "format" and not is_empty(value):  # format: parse_responses reads it
            raise InvalidRequest(f"text.{key}: this option is not supported", param=f"text.{key}")
    for name, allowed in (
        ("truncation", ("disabled",)),
        ("service_tier", ("auto", "default")),
        ("prompt_cache_retention", ("in_memory",)),
    ):
        value = read(body, name, str, allowed[0])
        if value not in allowed:
            raise InvalidRequest(
                f"{name} {value!r} is not supported (only {', '.join(map(repr, allowed))})",
                param=name,
            )
    options = read(body, "stream_options", dict, {})
    for key, value in options.items():
        if not is_empty(value):
            raise InvalidRequest(
                f"stream_options.{key} is not supported", param=f"stream_options.{key}"
            )
    if integer(body, "top_logprobs", 0, lo=0, hi=20):
        raise InvalidRequest(
            "top_logprobs is not supported: only the sampled tokens' logprobs are returned "
            f"(include {LOGPROBS!r})",
            param="top_logprobs",
        )
    integer(body, "max_tool_calls", None, lo=0, hi=None)
    # SGLang's router sends `priority: 0` on every Responses body (its default: none).
    # Nothing here schedules by priority, so only that passes.
    if integer(body, "priority", 0, lo=None, hi=None) != 0:
        raise InvalidRequest(
            "priority is not supported: requests are not scheduled by priority here "
            "(only 0, no priority, is accepted)",
            param="priority",
        )
    read(body, "client_metadata", dict, None)
    for name in _ECHOED:
        read(body, name, dict if name == "metadata" else str, None)


def _include(body: dict[str, Any]) -> list[str]:
    include = read(body, "include", list, [])
    for i, item in enumerate(include):
        if item not in (LOGPROBS, ENCRYPTED_REASONING):
            raise InvalidRequest(
                f"include[{i}] {item!r} is not supported (only {LOGPROBS!r})",
                param=f"include[{i}]",
            )
    return include
