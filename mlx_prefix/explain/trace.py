"""What the engine hands the explainer about one request: a CacheTrace, made at submit
(in the caller's thread), filled at admission (on the engine thread: a few assignments,
nothing computed there), read after the request's final event. The handle's event queue
orders the engine's writes before the reader's reads, as for `handle.cached_tokens`.

The ExplainContext is one per engine (its model): the tokenizer, the chunk grid, the
store's eviction record, and what identifies the model and its cache settings, for the
`model` and `settings` reasons. Plain Python values and references, no MLX arrays.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from mlx_prefix.cache.eviction.log import EvictionLog
    from mlx_prefix.prompt.request.grid import ChunkGrid
    from mlx_prefix.prompt.request.render import ChatRenderer
    from mlx_prefix.records import CachePreference, PromptInput

Source = Literal["memory", "disk", "none"]


@dataclass(eq=False)
class ExplainContext:
    model: str  # the model's name, as records show it
    identity: str  # its identity's key (weights, adapter, dtype, template): `model` reason
    cache_key: str  # identity + grid + kernels + KV bits: same identity, other key: `settings`
    tokenizer: Any
    grid: ChunkGrid
    evicted: EvictionLog  # the store's record of what it let go
    renderer: ChatRenderer | None = None  # finds the template's opening (`opening`)
    _opening: int | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def opening(self) -> int:
        """Tokens every chat prompt of this template starts with whatever its first
        message (`<|im_start|>system\\n`, a BOS): sharing no more than this is `new`.
        Found once from two probe renders; 0 without a template."""
        with self._lock:
            if self._opening is None:
                self._opening = _opening(self.renderer)
            return self._opening


def _opening(renderer: ChatRenderer | None) -> int:
    if renderer is None or not renderer.has_template:
        return 0
    from mlx_prefix.cache.token_ids import common_tokens, packed
    from mlx_prefix.conversation import Message
    from mlx_prefix.errors import InvalidRequest

    probes = (
        [Message("user", "zqopening one")],
        [Message("user", "zqopening two")],
        [Message("system", "zqopening three"), Message("user", "zqopening four")],
    )
    renders = []
    for messages in probes:
        try:
            renders.append(renderer.encode_chat(renderer.render_text(messages)))
        except InvalidRequest:
            continue  # a template without a system role
    if len(renders) < 2:
        return 0
    first = packed(renders[0])
    return min(common_tokens(first, 0, packed(other)) for other in renders[1:])


def kwargs_digest(kwargs: dict[str, Any]) -> str:
    """A request's chat_template_kwargs, comparable across requests."""
    return json.dumps(kwargs, sort_keys=True, default=str) if kwargs else ""


@dataclass(slots=True, eq=False)
class CacheTrace:
    context: ExplainContext
    tokens: tuple[int, ...]  # the rendered prompt (a TokenIds: its packed bytes come free)
    prompt: PromptInput | None  # what the caller sent: the messages' roles
    entry_key: str  # the key its entries live under (model, namespace, salt)
    namespace: str  # who sent it (server/guards/namespaces.py), before any salt
    salt: str | None
    template_kwargs: str  # kwargs_digest of its chat_template_kwargs
    enabled: bool  # it could read the cache (the server's cache and its prefix_cache)
    off: str = ""  # why not, in words
    # At admission (engine thread):
    admitted: bool = False
    source: Source = "none"
    cached: int = 0  # prompt tokens restored
    # The longest common prefix with any entry stored under its key: the store's trie
    # walk computes it for the match anyway.
    stored_match: int = 0
    # What it restored is where a cancelled prefill stopped (a CANCELLED entry: issue 55).
    resumed_cancelled: bool = False
    # The reply's token ids (the decode phase's own list, complete at the final event).
    reply: list[int] = field(default_factory=list)

    @classmethod
    def of(
        cls,
        context: ExplainContext,
        tokens: tuple[int, ...],
        prompt: PromptInput,
        cache: CachePreference,
        entry_key: str,
        cache_on: bool,
    ) -> CacheTrace:
        """A submitted request's trace (`cache_on`: the server has a prefix cache)."""
        off = (
            "the server runs without a prefix cache"
            if not cache_on
            else "the request turned prefix_cache off"
        )
        return cls(
            context=context,
            tokens=tokens,
            prompt=prompt,
            entry_key=entry_key,
            namespace=cache.namespace,
            salt=cache.salt,
            template_kwargs=kwargs_digest(prompt.chat_template_kwargs),
            enabled=cache_on and cache.enabled,
            off=off,
        )
