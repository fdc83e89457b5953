"""What callers hand the engine and what they get back: requests, sampling, events.

Records every layer may import (prompt, engine, server, CLI) without an arrow running
back up the tree. They cross the thread boundary between HTTP handlers / the CLI and
the engine thread: they hold plain Python values, never MLX arrays.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Literal

from mlx_prefix.config import DiskScope
from mlx_prefix.conversation import Conversation, Message


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """Structured output: the reply must be JSON (engine/decode/constraints.py enforces it)."""

    kind: Literal["json_object", "json_schema"]
    schema: str | None = None  # the JSON schema as JSON text; None: any JSON object
    name: str | None = None  # json_schema.name, echoed only
    # The request field to blame when the schema cannot be compiled ("response_format",
    # "text.format"): the engine compiles it, the API family names it.
    param: str = field(default="response_format", compare=False)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False  # report each sampled token's logprob
    top_logprobs: int = 0  # and this many most likely tokens at each position (with logprobs)
    response_format: ResponseFormat | None = None  # None: free text
    # mlx_lm.server's sampling fields, with its defaults and meanings (mlx_lm.sample_utils;
    # engine/decode/sampling.py and engine/decode/logits.py apply them per request).
    top_k: int = 0  # sample among the k most likely tokens; 0 = no limit
    min_p: float = 0.0  # drop tokens less likely than min_p x the top token's; 0 = off
    xtc_probability: float = 0.0  # XTC: the chance, each step, of excluding top choices
    xtc_threshold: float = 0.1  # ... all tokens above this probability but the least likely
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    repetition_penalty: float = 0.0  # sign-aware multiplicative; 0 (or 1) = off
    repetition_context_size: int = 20  # over the last N tokens of prompt + reply
    presence_penalty: float = 0.0  # subtracted once per token seen; 0 = off
    presence_context_size: int = 20
    frequency_penalty: float = 0.0  # subtracted per occurrence; 0 = off
    frequency_context_size: int = 20
    # Speculative decoding with the server's --draft-model: draft tokens per verify step;
    # None: the server's --num-draft-tokens, 0: plain decoding (engine/decode/speculative.py).
    num_draft_tokens: int | None = None
    # Prompt lookup (engine/decode/lookup.py): draft tokens at most per verify, drafted from
    # the request's own sequence; None: the server's --prompt-lookup, 0: plain decoding.
    prompt_lookup: int | None = None
    # Reasoning tokens the reply may write in its think block before the server closes
    # it as the template does (engine/decode/reasoning_budget.py); None: unbounded.
    reasoning_budget: int | None = None


@dataclass(frozen=True, slots=True)
class CachePreference:
    """The per-request `prefix_cache` body object, and whose cache it is (issue 19)."""

    enabled: bool = True  # False: neither read nor write the prefix cache
    scope: DiskScope | None = None  # disk policy override (None: the server's)
    # The cache namespace (invariant 10): a request matches only entries of its own. The
    # server derives it from who sent the request (server/guards/namespaces.py); "" is the one
    # of clients without an Origin, the CLI and library callers.
    namespace: str = ""
    salt: str | None = None  # the body's `cache_salt`: splits the namespace further


@dataclass(frozen=True, slots=True)
class Breakpoint:
    """Where a client marked its stable prefix (Anthropic's `cache_control`): the end of
    `messages[message]`, or of its first `chars` characters of content; with `tool` set
    (and `message` None), the end of `tools[tool]`. It becomes a checkpoint of its own
    kind (prompt/request/breakpoints.py), aligned onto the chunk grid."""

    message: int | None = None
    chars: int | None = None  # None: the whole message
    tool: int | None = None


@dataclass(frozen=True, slots=True)
class ToolCallIds:
    """How the API layer names the tool calls of one request's reply: the i-th call is
    `prefix` + a digest of (`seed`, i). Deterministic, so the engine's next-turn prefetch
    renders the ids the client will send back (Mistral and Kimi templates print them,
    in their own form: prompt/request/call_ids.py maps them at render time, never in
    replies)."""

    seed: str  # the request's id
    prefix: str = "call_"  # OpenAI's; Anthropic's tool_use ids start "toolu_"

    def id(self, index: int) -> str:
        return self.prefix + hashlib.sha256(f"{self.seed}#{index}".encode()).hexdigest()[:24]


@dataclass(frozen=True)
class PromptInput:
    """Exactly one of `messages` (chat) or `text` (raw completion)."""

    # Built once by the protocol layer (or conversation_from_dicts) and rendered as is.
    messages: Conversation | None = None
    text: str | None = None
    tools: tuple[dict[str, Any], ...] | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # The client's cache breakpoints; they change only which prefixes are kept.
    breakpoints: tuple[Breakpoint, ...] = ()
    # Text the assistant's turn opens with, after the generation prompt (a forced tool
    # call's opening, server/routes/tool_choice.py); the reply continues it.
    assistant_prefix: str = ""
    # How the reply's tool calls will be named (None: after the engine's request id).
    # Not part of the prompt's identity: it changes nothing rendered.
    reply_tool_call_ids: ToolCallIds | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.messages is None:
            return
        messages = tuple(self.messages)
        if not all(isinstance(m, Message) for m in messages):
            raise TypeError(
                "PromptInput.messages takes conversation.Message records: build them from "
                "chat dicts with conversation_from_dicts()"
            )
        object.__setattr__(self, "messages", messages)


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens restored from the prefix cache, not computed
    ttft_s: float  # submit -> first token
    prefill_tokens_per_s: float  # over the tokens actually computed
    decode_tokens_per_s: float
    # Prompt tokens this request computed and left in the cache: the furthest position
    # it stored (a checkpoint, or the prompt's end) less cached_tokens; 0 if none.
    cache_written_tokens: int = 0
    images: int = 0  # images in the prompt
    image_tokens: int = 0  # prompt tokens they take (counted in prompt_tokens too)


@dataclass(frozen=True, slots=True)
class TopLogprob:
    """One of the most likely tokens at a position, and its log-probability."""

    token: int
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenEvent:
    text: str  # detokenized text delta (may be "" while a multi-byte char is incomplete)
    token: int | None  # None for a final flush of held-back text
    logprob: float | None = None
    top_logprobs: tuple[TopLogprob, ...] = ()  # most likely first; when the request asked


@dataclass(frozen=True, slots=True)
class DoneEvent:
    finish_reason: Literal["stop", "length", "cancelled"]
    usage: Usage
    stop_sequence: str | None = None  # the stop string that ended it (finish "stop")


@dataclass(frozen=True, slots=True)
class ErrorEvent:
    message: str
    type: str = "server_error"


@dataclass(frozen=True, slots=True)
class ProgressEvent:
    """How far a request's prefill has come; sent only to a request that asked for it
    (`generate`'s progress bar, a stream's `return_progress`), once per engine turn
    while its prompt is prefilled, never after its first token."""

    total: int  # prompt tokens
    cached: int  # restored from the cache
    processed: int  # in the request's cache so far, the cached ones included
    elapsed_s: float  # since the request was submitted


Event = TokenEvent | DoneEvent | ErrorEvent | ProgressEvent
