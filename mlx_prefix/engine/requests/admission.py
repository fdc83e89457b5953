"""What a request must satisfy before it is queued (checked in the caller's thread, so
a bad request is refused with a 4xx before it reaches the engine)."""

from __future__ import annotations

from mlx_prefix.errors import ContextLengthExceeded, InvalidRequest
from mlx_prefix.prompt.request.plan import PromptPlanner, RenderedPrompt
from mlx_prefix.records import PromptInput, SamplingParams

MAX_TOP_LOGPROBS = 20  # alternatives per position (OpenAI's chat limit)


def plan_prompt(
    planner: PromptPlanner, context_length: int | None, prompt: PromptInput
) -> RenderedPrompt:
    """Render and plan `prompt`; ContextLengthExceeded if it leaves no room to reply."""
    rendered = planner.plan(prompt)
    if context_length is not None and len(rendered.tokens) >= context_length:
        raise ContextLengthExceeded(
            f"the prompt has {len(rendered.tokens)} tokens; this model's context is "
            f"{context_length} tokens, including the reply",
            param=_prompt_param(prompt),
        )
    return rendered


def check_sampling(sampling: SamplingParams, vocab_size: int) -> None:
    """Raise InvalidRequest for sampling settings the engine cannot honour (a request's
    disk scope was parsed where it entered: records.CachePreference)."""
    if sampling.max_tokens < 1:
        raise InvalidRequest("max_tokens must be at least 1", param="max_tokens")
    if sampling.seed is not None and not 0 <= sampling.seed < 2**64:
        raise InvalidRequest("seed must be between 0 and 2**64 - 1", param="seed")
    if not 0 <= sampling.top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(
            f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}", param="top_logprobs"
        )
    if sampling.top_logprobs and not sampling.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs", param="top_logprobs")
    _check_filters(sampling)
    for token, _ in sampling.logit_bias:
        if not 0 <= token < vocab_size:
            raise InvalidRequest(
                f"logit_bias: token id {token} is not in this model's vocabulary "
                f"(0 to {vocab_size - 1})",
                param="logit_bias",
            )


def check_images(rendered: RenderedPrompt, sampling: SamplingParams) -> None:
    """What a prompt with images cannot have: draft tokens asked for (the draft model
    sees no images; the server's default drafting just skips such a request)."""
    if rendered.vision is not None and sampling.num_draft_tokens:
        raise InvalidRequest(
            "num_draft_tokens: a prompt with images is not drafted (the draft model sees "
            "no images); leave it out or 0 for plain decoding",
            param="num_draft_tokens",
        )


def _check_filters(s: SamplingParams) -> None:
    # mlx_lm.sample_utils raises ValueError past these bounds (a 500 mid-decode).
    checks = (
        ("top_k", s.top_k >= 0),
        ("min_p", 0 <= s.min_p <= 1),
        ("xtc_probability", 0 <= s.xtc_probability <= 1),
        ("xtc_threshold", 0 <= s.xtc_threshold <= 0.5),
        ("repetition_penalty", s.repetition_penalty >= 0),
        ("repetition_context_size", s.repetition_context_size >= 1),
        ("presence_context_size", s.presence_context_size >= 1),
        ("frequency_context_size", s.frequency_context_size >= 1),
    )
    for name, ok in checks:
        if not ok:
            raise InvalidRequest(f"{name} is out of range", param=name)


def check_reply_fits(
    rendered: RenderedPrompt, prompt: PromptInput, max_tokens: int, context_length: int | None
) -> None:
    """OpenAI's rule for an explicit max_tokens: the prompt and the whole reply must fit
    in the context (ContextLengthExceeded otherwise). Without it a reply is cut at the
    context's end instead."""
    wanted = len(rendered.tokens) + max_tokens
    if context_length is not None and wanted > context_length:
        raise ContextLengthExceeded(
            f"this model's context is {context_length} tokens, but {wanted} were requested "
            f"({len(rendered.tokens)} in the prompt, {max_tokens} for the "
            "completion); shorten the prompt or lower max_tokens",
            param=_prompt_param(prompt),
        )


def _prompt_param(prompt: PromptInput) -> str:
    return "messages" if prompt.messages is not None else "prompt"
