"""POST /v1/completions bodies: a raw text prompt, no chat template."""

from __future__ import annotations

from typing import Any

from mlx_prefix.errors import InvalidRequest
from mlx_prefix.records import PromptInput

from .fields import MISSING, field, integer
from .request import GenerationRequest, Limits, generation_request


def parse_completion(body: dict[str, Any], limits: Limits) -> GenerationRequest:
    prompt = PromptInput(text=prompt_text(body.get("prompt", MISSING)))
    if field(body, "echo", bool, False):
        raise InvalidRequest("echo is not supported", param="echo")
    if field(body, "suffix", str, ""):
        raise InvalidRequest("suffix is not supported", param="suffix")
    if integer(body, "best_of", 1, lo=1, hi=None) != 1:
        raise InvalidRequest("only best_of=1 is supported", param="best_of")
    # logprobs: N returns the sampled tokens' logprobs and, at each position, the N most
    # likely tokens (0: none); true is taken as 0, false and null as off.
    logprobs = field(body, "logprobs", (bool, int), None)
    if isinstance(logprobs, int) and not isinstance(logprobs, bool) and not 0 <= logprobs <= 5:
        raise InvalidRequest("logprobs must be between 0 and 5", param="logprobs")
    on = logprobs is not None and logprobs is not False
    top = 0 if isinstance(logprobs, bool) or logprobs is None else logprobs
    return generation_request(
        "completion", body, prompt, limits, on, top_logprobs=top, parse_tools=False
    )


def prompt_text(prompt: Any) -> str:
    if prompt is MISSING:
        raise InvalidRequest("'prompt' is required", param="prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    if isinstance(prompt, str):
        return prompt
    raise InvalidRequest("'prompt' must be a string or an array of one string", param="prompt")
