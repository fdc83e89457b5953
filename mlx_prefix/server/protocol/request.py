"""GenerationRequest, and the body fields chat and completions share: n, stream,
max_tokens, sampling (with mlx_lm.server's fields), stop, response_format, model, the
prefix_cache extension and cache_salt."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from mlx_prefix.config import DiskScope
from mlx_prefix.errors import InvalidRequest
from mlx_prefix.records import CachePreference, PromptInput, SamplingParams
from mlx_prefix.vision.intake import ImageLimits

from .fields import field, integer
from .formats import chat_response_format
from .sampling_fields import mlx_lm_sampling
from .spec import (
    CHAT_SAMPLING,
    SamplingDefaults,
    read_sampling,
    refuse_format_with_tools,
    refuse_stop_with_format,
    refuse_unknown,
)

_PREFIX_CACHE_KEYS = frozenset({"enabled", "scope"})


@dataclass(frozen=True)
class Limits:
    default_max_tokens: int
    # Largest max_tokens accepted: the served model's context length or the server's cap
    # (parsing uses the cap; `fit_to_model` then the model's own).
    max_tokens: int
    sampling: SamplingDefaults = SamplingDefaults()
    # The server's --draft-model as a request may name it (its id, its path); empty: none.
    draft_names: tuple[str, ...] = ()
    images: ImageLimits = ImageLimits()  # what a request's images may be


@dataclass(frozen=True)
class ToolChoice:
    """Whether the reply may, must or must not call a tool (server/routes/tool_choice.py
    honours the forced modes)."""

    mode: Literal["auto", "none", "required", "named"] = "auto"
    name: str | None = None  # mode "named": the tool to call
    parallel: bool = True  # False: at most one call (the reply ends after the first)


@dataclass(frozen=True)
class GenerationRequest:
    kind: Literal["chat", "completion"]
    model: str | None  # as the client named it; None when absent
    prompt: PromptInput
    sampling: SamplingParams
    cache: CachePreference
    stream: bool
    # The body field that set sampling.max_tokens; None: the server's default, which the
    # engine clamps to the context left after the prompt (never an error).
    max_tokens_param: str | None
    include_usage: bool  # stream_options.include_usage: a final chunk carrying usage
    parse_tools: bool  # tools were offered and tool_choice is not "none"
    tool_choice: ToolChoice = ToolChoice()
    # An explicit max_tokens must fit in the context with the prompt (OpenAI's rule, a
    # 400 otherwise); False: it only bounds the reply, cut at the context's end.
    fit_reply: bool = True
    # mlx_lm.server's `adapters`: a LoRA adapter folder; its engine is the model's with
    # the adapter applied (server/served/pool.py), its cache apart from the base model's.
    adapter: str | None = None
    # The body used the deprecated `functions`: a call comes back as `function_call`.
    legacy_functions: bool = False
    # llama.cpp's `return_progress`: the stream carries the prompt's prefill progress.
    return_progress: bool = False


def generation_request(
    kind: Literal["chat", "completion"],
    body: dict[str, Any],
    prompt: PromptInput,
    limits: Limits,
    logprobs: bool,
    *,
    top_logprobs: int = 0,
    parse_tools: bool,
    tool_choice: ToolChoice = ToolChoice(),
) -> GenerationRequest:
    n = integer(body, "n", 1, lo=1, hi=None)
    if n != 1:
        raise InvalidRequest("only n=1 is supported", param="n")
    stream = bool(field(body, "stream", bool, False))
    stream_options = field(body, "stream_options", dict, None) or {}
    include_usage = stream_options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise InvalidRequest(
            "stream_options.include_usage must be a boolean", param="stream_options.include_usage"
        )
    _refuse_unsupported(body)
    return_progress = bool(field(body, "return_progress", bool, False))
    if return_progress and not stream:
        raise InvalidRequest(
            "return_progress needs stream: true (the progress comes as stream chunks)",
            param="return_progress",
        )
    max_tokens, max_tokens_param = _max_tokens(body, limits)
    sampling = SamplingParams(
        max_tokens=max_tokens,
        **read_sampling(body, CHAT_SAMPLING, limits.sampling),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        response_format=chat_response_format(body),
        **mlx_lm_sampling(body),
        num_draft_tokens=_num_draft_tokens(body, limits),
        # Prompt lookup's most draft tokens (engine/decode/lookup.py); 0: plain decoding.
        prompt_lookup=integer(body, "prompt_lookup", None, lo=0, hi=32),
    )
    refuse_stop_with_format(sampling, "stop")
    refuse_format_with_tools(sampling.response_format, parse_tools)
    return GenerationRequest(
        kind=kind,
        model=field(body, "model", str, None),
        prompt=prompt,
        sampling=sampling,
        cache=cache_preference(body),
        stream=stream,
        max_tokens_param=max_tokens_param,
        include_usage=stream and include_usage,
        parse_tools=parse_tools,
        tool_choice=tool_choice,
        adapter=field(body, "adapters", str, None) or None,
        return_progress=return_progress,
    )


# mlx_lm.server's per-request fields this server does not honour: a 400 naming the field
# rather than a reply computed without it.
_UNSUPPORTED = {
    "role_mapping": "role_mapping is not supported: the chat template renders the messages "
    "(--chat-template, or --use-default-chat-template for a model without one)",
}


def _refuse_unsupported(body: dict[str, Any]) -> None:
    for name, why in _UNSUPPORTED.items():
        if body.get(name) not in (None, "", [], {}):
            raise InvalidRequest(why, param=name)


def _num_draft_tokens(body: dict[str, Any], limits: Limits) -> int | None:
    """mlx_lm.server's speculative decoding fields: honoured with the server's own draft
    model (the engine bounds the count), refused otherwise."""
    needs = "speculative decoding needs a server started with --draft-model"
    draft = field(body, "draft_model", str, None)
    if draft:
        if not limits.draft_names:
            raise InvalidRequest(f"{needs} (draft_model)", param="draft_model")
        if draft not in limits.draft_names:
            raise InvalidRequest(
                f"draft_model {draft!r} is not this server's draft model "
                f"({limits.draft_names[0]}); one draft model per server (--draft-model)",
                param="draft_model",
            )
    count = integer(body, "num_draft_tokens", None, lo=0, hi=None)
    if count is not None and not limits.draft_names:
        raise InvalidRequest(f"{needs} (num_draft_tokens)", param="num_draft_tokens")
    return count


def fit_to_model(req: GenerationRequest, limits: Limits) -> GenerationRequest:
    """Bound the reply by the served model's own limit. A body is parsed before its model
    is known (loading one waits for the body's checks), under the server's cap only."""
    limit, asked = limits.max_tokens, req.sampling.max_tokens
    if req.max_tokens_param is None:
        n = min(limits.default_max_tokens, limit)
    elif asked <= limit:
        return req
    elif req.fit_reply:
        raise InvalidRequest(
            f"{req.max_tokens_param} is {asked}, more than this model allows ({limit})",
            param=req.max_tokens_param,
        )
    else:
        n = limit
    return replace(req, sampling=replace(req.sampling, max_tokens=n))


def _max_tokens(body: dict[str, Any], limits: Limits) -> tuple[int, str | None]:
    # max_completion_tokens is the newer name; when both are sent it wins.
    for name in ("max_completion_tokens", "max_tokens"):
        value = integer(body, name, None, lo=1, hi=None)
        if value is None:
            continue
        if value > limits.max_tokens:
            raise InvalidRequest(
                f"{name} is {value}, more than this model allows ({limits.max_tokens})", param=name
            )
        return value, name
    return min(limits.default_max_tokens, limits.max_tokens), None


def cache_preference(body: dict[str, Any]) -> CachePreference:
    """The `prefix_cache` object and `cache_salt` (vLLM's name: a request matches only
    cache entries made with the same salt, inside its namespace)."""
    salt = field(body, "cache_salt", str, None)
    if salt == "":
        raise InvalidRequest("cache_salt must be a non-empty string", param="cache_salt")
    pref = field(body, "prefix_cache", dict, None)
    if pref is None:
        return CachePreference(salt=salt)
    refuse_unknown(pref, _PREFIX_CACHE_KEYS, what="prefix_cache", where="prefix_cache.")
    enabled = pref.get("enabled", True)
    if not isinstance(enabled, bool):
        raise InvalidRequest("prefix_cache.enabled must be a boolean", param="prefix_cache.enabled")
    scope = pref.get("scope")
    return CachePreference(enabled=enabled, scope=disk_scope(scope), salt=salt)


def disk_scope(text: Any) -> DiskScope | None:
    """`prefix_cache.scope`, parsed once here: the engine reads the typed value."""
    if text is None:
        return None
    if isinstance(text, str) and text == text.strip().lower():  # as written, no case games
        try:
            return DiskScope.parse(text)
        except ValueError as e:
            raise InvalidRequest(str(e), param="prefix_cache.scope") from None
    raise InvalidRequest(
        "prefix_cache.scope must be one of off, full, auto, auto:N or N",
        param="prefix_cache.scope",
    )
