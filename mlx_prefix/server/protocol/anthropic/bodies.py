"""POST /v1/messages and /v1/messages/count_tokens bodies (Anthropic's Messages API) ->
the engine's records.

Every field is honoured or refused with a 400 naming it:
- `model`, `max_tokens` (required; it bounds the reply, which is cut at the context's
  end, so an agent asking for 32000 on a small model still gets an answer), `stream`,
  `stop_sequences`, `temperature` (Anthropic's default 1.0), `top_p`, `top_k`;
- `system`, `messages` (blocks.py), top-level and block
  `cache_control` (breakpoints: checkpoints of their own kind);
- `tools` (tools.py: custom tools with `input_schema`; `defer_loading` tools stay out of the prompt
  until a `tool_reference` loads them; server tools and `strict` are refused),
  `tool_choice` auto / any / tool / none and `disable_parallel_tool_use`;
- `thinking` (thinking.py) enabled / disabled / adaptive -> the template's `enable_thinking` switch
  (adaptive: the template's default); `budget_tokens` (any non-negative count below
  max_tokens: Anthropic's 1024 floor is a billing rule) bounds the reasoning: once
  spent, the server closes the think block as the template does and the model answers
  (engine/decode/reasoning_budget.py); disabled also closes at once a block the prompt opens
  anyway (a budget of 0); `display: "omitted"` sends thinking blocks without their text
  (the signature carries it back, server/replies/anthropic.py);
- `output_config.format` (the beta's `output_format`): `json_schema` structured output,
  held to the schema as chat's `response_format` is (not with `stop_sequences` or tools);
- `output_config.effort`: a local model has one knob for how hard it works, whether it
  reasons before answering, so "low" turns the template's thinking off (unless
  `thinking` enables it) and the other levels leave it as `thinking` says;
- `context_management` edits `clear_thinking_20251015` (keep all, or the last N turns);
  `metadata` is ignored (it names the caller, nothing about the reply); `service_tier`
  has one tier here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlx_prefix.errors import InvalidRequest
from mlx_prefix.records import Breakpoint, PromptInput, SamplingParams
from mlx_prefix.vision.intake import ImageLimits

from ..fields import MISSING, field, integer
from ..formats import anthropic_output_format
from ..request import GenerationRequest, Limits, cache_preference
from ..spec import (
    MESSAGES_SAMPLING,
    read_sampling,
    refuse_format_with_tools,
    refuse_stop_with_format,
    refuse_unknown,
)
from .blocks import convert
from .thinking import keep_thinking_turns, read_thinking
from .tools import Tools, read_tool_choice, read_tools


@dataclass(frozen=True)
class MessagesRequest:
    generation: GenerationRequest
    show_thinking: bool  # the reply's reasoning goes out as thinking blocks

    @property
    def model(self) -> str | None:
        return self.generation.model

    @property
    def adapter(self) -> str | None:
        return self.generation.adapter


def parse_messages_request(
    body: dict[str, Any], limits: Limits, *, keep_billing_header: bool = False
) -> MessagesRequest:
    model = _model(body)
    max_tokens = integer(body, "max_tokens", MISSING, lo=1, hi=None)
    if max_tokens is MISSING:
        raise InvalidRequest("max_tokens: Field required", param="max_tokens")
    thinking = read_thinking(body, max_tokens)
    prompt, tools = _prompt(body, keep_billing_header, thinking.enable, limits.images)
    choice = read_tool_choice(body, tools, thinking.enable)
    sampling = SamplingParams(
        max_tokens=min(max_tokens, limits.max_tokens),
        **read_sampling(body, MESSAGES_SAMPLING, limits.sampling),
        reasoning_budget=thinking.budget,
        response_format=anthropic_output_format(body),
    )
    offer = prompt.tools is not None
    refuse_stop_with_format(sampling, "stop_sequences")
    refuse_format_with_tools(sampling.response_format, offer)
    generation = GenerationRequest(
        kind="chat",
        model=model,
        prompt=prompt,
        sampling=sampling,
        cache=cache_preference(body),
        stream=bool(field(body, "stream", bool, False)),
        max_tokens_param="max_tokens",
        include_usage=False,
        parse_tools=offer,
        tool_choice=choice,
        fit_reply=False,
        adapter=field(body, "adapters", str, None) or None,  # as mlx_lm.server's chat field
    )
    return MessagesRequest(generation, show_thinking=thinking.show)


def parse_count_tokens(
    body: dict[str, Any], *, keep_billing_header: bool = False, images: ImageLimits | None = None
) -> tuple[str, PromptInput]:
    """The model name and the prompt whose tokens /v1/messages/count_tokens counts (its
    images under the server's limits, as /v1/messages reads them)."""
    model = _model(body)
    thinking = read_thinking(body, None).enable
    prompt, tools = _prompt(body, keep_billing_header, thinking, images)
    read_tool_choice(body, tools, thinking)
    return model, prompt


def _model(body: dict[str, Any]) -> str:
    model = field(body, "model", str, None)
    if model is None:
        raise InvalidRequest("model: Field required", param="model")
    return model


def _prompt(
    body: dict[str, Any],
    keep_billing_header: bool,
    thinking: bool | None,
    images: ImageLimits | None = None,
) -> tuple[PromptInput, Tools]:
    tools = read_tools(body)
    choice = body.get("tool_choice")
    offer = tools.rendered is not None and not (
        isinstance(choice, dict) and choice.get("type") == "none"
    )
    conv = convert(
        body.get("system"),
        body.get("messages"),
        deferred_tools=tools.deferred,
        keep_billing_header=keep_billing_header,
        keep_thinking_turns=keep_thinking_turns(body),
        images=images,
    )
    breakpoints = [*tools.breakpoints] if offer else []
    breakpoints += conv.breakpoints
    if field(body, "cache_control", dict, None) is not None:  # automatic caching
        breakpoints.append(Breakpoint(message=len(conv.messages) - 1))
    _refuse_unsupported(body)
    prompt = PromptInput(
        messages=tuple(conv.messages),
        tools=tools.rendered if offer else None,
        chat_template_kwargs={} if thinking is None else {"enable_thinking": thinking},
        breakpoints=tuple(breakpoints),
    )
    return prompt, tools


# Every top-level field this module reads (or refuses by name); anything else is a 400.
KNOWN_FIELDS = frozenset(
    {
        *("model", "messages", "max_tokens", "system", "stop_sequences", "stream"),
        *("temperature", "top_p", "top_k", "tools", "tool_choice", "thinking"),
        *("metadata", "service_tier", "output_config", "output_format"),
        *("context_management", "cache_control", "mcp_servers", "container"),
        # mlx-prefix's and mlx_lm.server's extensions
        *("seed", "prefix_cache", "cache_salt", "adapters"),
    }
)
_OUTPUT_CONFIG_KEYS = frozenset({"effort", "format"})


def _refuse_unsupported(body: dict[str, Any]) -> None:
    refuse_unknown(body, KNOWN_FIELDS, what="the Messages API here")
    field(body, "metadata", dict, None)  # ignored, but it must be an object
    output = field(body, "output_config", dict, None) or {}
    refuse_unknown(output, _OUTPUT_CONFIG_KEYS, what="output_config", where="output_config.")
    for name in ("mcp_servers", "container"):
        if body.get(name):
            raise InvalidRequest(f"{name} is not supported", param=name)
