"""POST /v1/cache/warm bodies: a chat (messages, tools) or a raw prompt to prefill and
cache without generating; GET /v1/cache/requests's query (`limit`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mlx_prefix.errors import InvalidRequest
from mlx_prefix.records import CachePreference, PromptInput
from mlx_prefix.vision.intake import ImageLimits

from .chat import parse_messages, read_tools
from .completions import prompt_text
from .fields import field
from .request import cache_preference


@dataclass(frozen=True)
class WarmRequest:
    prompt: PromptInput
    pin: bool
    cache: CachePreference  # its cache_salt (the namespace is the sender's)


def parse_warm(body: dict[str, Any], images: ImageLimits | None = None) -> WarmRequest:
    if ("messages" in body) == ("prompt" in body):
        raise InvalidRequest("give exactly one of 'messages' or 'prompt'")
    if "messages" in body:
        prompt = PromptInput(
            messages=parse_messages(body["messages"], images),
            tools=read_tools(body),
            chat_template_kwargs=field(body, "chat_template_kwargs", dict, None) or {},
        )
    else:
        prompt = PromptInput(text=prompt_text(body["prompt"]))
    pin = bool(field(body, "pin", bool, False))
    cache = cache_preference(body)  # its scope says what goes to disk (pinned: "full")
    if not cache.enabled:
        raise InvalidRequest(
            "prefix_cache.enabled: false on a warm-up, whose only work is to cache",
            param="prefix_cache.enabled",
        )
    return WarmRequest(prompt=prompt, pin=pin, cache=cache)


REQUESTS_LIMIT = 50  # records listed when the query names no limit


def parse_requests_query(query: Mapping[str, str]) -> int:
    """GET /v1/cache/requests's `?limit=N` (a positive integer; the explainer keeps at
    most its own bound); any other parameter refused, naming it."""
    unknown = sorted(set(query) - {"limit"})
    if unknown:
        name = unknown[0]
        raise InvalidRequest(f"unknown query parameter {name!r} (known: limit)", param=name)
    raw = query.get("limit", str(REQUESTS_LIMIT))
    if not raw.isdigit() or int(raw) < 1:
        raise InvalidRequest(f"limit must be a positive integer, not {raw!r}", param="limit")
    return int(raw)
