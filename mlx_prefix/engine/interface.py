"""What the server may call on an engine: the typed face of HTTP -> engine.

`Engine` (engine.py) provides it, a sharded rank's too (built by sharded/distributed.py);
the server's tests use fakes with the same methods. The cache's reads and actions are
a part of the engine, `engine.views` (CacheViewsAPI). Every method is safe
from any thread: submissions go through the engine's inbox, cache views through the
thread-safe store and disk tier; none touches an MLX array.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from mlx_prefix.cache.disk.index import DiskEntryInfo
    from mlx_prefix.cache.types import EntryInfo, EvictOutcome, StoredTokens
    from mlx_prefix.engine.activity import Activity
    from mlx_prefix.engine.requests.handle import RequestHandle
    from mlx_prefix.engine.requests.jobs import WarmResult
    from mlx_prefix.models.load import LoadedModel
    from mlx_prefix.prompt.reply.reader import ReplyFormat
    from mlx_prefix.records import CachePreference, PromptInput, SamplingParams


class EngineAPI(Protocol):
    model: LoadedModel
    model_key: str  # the model part of every cache entry's key (engine/keys.py)
    reply_format: ReplyFormat  # how the model writes replies: tool calls, reasoning

    def submit(
        self,
        prompt: PromptInput,
        sampling: SamplingParams,
        cache: CachePreference = ...,
        request_id: str | None = None,
        *,
        fit_reply: bool = False,
        progress: bool = False,
    ) -> RequestHandle:
        """Render, validate and queue a request; its events come through the handle
        (`progress`: ProgressEvents too while the prompt is prefilled).
        Raises InvalidRequest, ContextLengthExceeded or EngineBusy in the caller's thread."""
        ...

    def start_warm(
        self, prompt: PromptInput, pin: bool = False, cache: CachePreference = ...
    ) -> tuple[RequestHandle, Future[WarmResult]]:
        """Queue a prefill without generation (optionally pinned)."""
        ...

    def count_tokens(self, prompt: PromptInput) -> int: ...

    def shutdown(self, timeout: float = 10.0, save_timeout: float = ...) -> None: ...

    @property
    def views(self) -> CacheViewsAPI:
        """The engine's cache: what the server reads of it and the actions it takes."""
        ...


class CacheViewsAPI(Protocol):
    """An engine's cache views (engine/cache_views.py CacheViews; the server's tests'
    fakes have their own): reads from any thread, actions where the turns say."""

    def cache_stats(self) -> dict: ...

    def cache_entries(self) -> list[dict]: ...

    def cache_sequences(self) -> list[StoredTokens[EntryInfo]]: ...

    def disk_sequences(self) -> list[StoredTokens[DiskEntryInfo]]: ...

    def flush_cache(self, namespace: str | None = None) -> int:
        """Remove the entries of `namespace` (None: every namespace); returns how many."""
        ...

    def set_pinned(self, entry_id: int, pinned: bool) -> bool: ...

    def evict_entry(self, entry_id: int) -> EvictOutcome: ...

    def activity(self) -> Activity: ...
