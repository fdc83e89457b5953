"""The engine's records of one request: queued (Job), being prefilled (PrefillTask),
decoding (Running). Engine thread only, except where a field says otherwise."""

from __future__ import annotations

import itertools
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mlx_prefix.engine.decode.constraints import Constraint
from mlx_prefix.engine.decode.text import TextStream
from mlx_prefix.engine.forward.runner import PrefillCursor
from mlx_prefix.engine.requests.handle import RequestHandle
from mlx_prefix.prompt.boundaries import RenderedPrompt
from mlx_prefix.records import CachePreference, DoneEvent, PromptInput, SamplingParams, Usage

if TYPE_CHECKING:
    import mlx.core as mx

    from mlx_prefix.engine.decode.reasoning_budget import ReasoningBudget
    from mlx_prefix.engine.decode.speculative import DraftCache
    from mlx_prefix.engine.prefill.checkpoints import Checkpointer


@dataclass(frozen=True, slots=True)
class WarmResult:
    prompt_tokens: int
    cached_tokens: int
    pinned: bool


@dataclass(slots=True)
class PrefetchStats:
    """Next-turn prefetch (engine/requests/prefetch.py): background prefills and their tokens."""

    started: int = 0
    completed: int = 0
    cancelled: int = 0  # dropped for a request that could not use them
    tokens: int = 0  # prompt tokens computed in the background


@dataclass(slots=True)
class Job:
    handle: RequestHandle
    prompt: RenderedPrompt
    sampling: SamplingParams
    cache_pref: CachePreference
    cache_key: str  # its entries' key (engine/keys.entry_key): model and namespace
    submitted_at: float
    source: PromptInput | None = None  # what the caller sent (None: background job)
    warm: Future | None = None  # set for warm-only jobs (prefill, no decode)
    pin: bool = False
    background: bool = False  # a next-turn prefetch: prefill only, when nothing waits
    not_before: float = 0.0  # monotonic time a background job may start
    passovers: int = 0
    ended: bool = False  # its last event was sent; nothing more may follow
    # The reply's grammar state (response_format); built by the caller, then engine only.
    constraint: Constraint | None = None
    stored_to: int = 0  # furthest prompt position its prefill stored in the cache
    # Unique in this process, never reused (unlike id()): names the job to in-flight
    # sharing, and across ranks to a sharded engine (engine/sharded/distributed.py).
    serial: int = field(default_factory=itertools.count(1).__next__)

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.prompt.tokens


@dataclass(slots=True)
class PrefillTask:
    """A request being prefilled (several may be at once, each on its own grid)."""

    job: Job
    cache: list  # updated in place chunk by chunk (the Checkpointer holds the same list)
    reuse: int  # prompt tokens restored from the cache
    lease: int | None  # store entry locked while its arrays may still be shared
    cursor: PrefillCursor
    started_at: float
    bytes_key: str  # its cache's bytes in the store's budget
    checkpointer: Checkpointer | None = None  # what this prefill stores (None: no cache)
    draft: DraftCache | None = None  # --draft-model: the draft's cache of the same prefix
    # The prompt is computed: its last logits [1, V], held until the request joins the
    # decode batch with the rest of its burst (engine/requests/pace.py `gathers`).
    logits: mx.array | None = None

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.job.prompt.tokens

    @property
    def position(self) -> int:
        """Prompt tokens in `cache` so far."""
        return self.cursor.position

    @property
    def computed(self) -> int:
        """Prompt tokens this prefill has computed so far (not restored)."""
        return self.position - self.reuse


@dataclass(slots=True)
class Running:
    """A request in the decode batch."""

    job: Job
    stream: TextStream
    limit: int  # completion tokens allowed
    reuse: int
    prefill_tps: float
    first_at: float
    count: int = 0
    emitted: list[int] = field(default_factory=list)  # its reply's token ids so far
    reasoning: ReasoningBudget | None = None  # its reasoning budget, if it has one


def usage(
    job: Job,
    reuse: int = 0,
    count: int = 0,
    ttft: float = 0.0,
    prefill_tps: float = 0.0,
    decode_tps: float = 0.0,
) -> Usage:
    return Usage(
        prompt_tokens=len(job.prompt.tokens),
        completion_tokens=count,
        cached_tokens=reuse,
        ttft_s=ttft,
        prefill_tokens_per_s=prefill_tps,
        decode_tokens_per_s=decode_tps,
        cache_written_tokens=max(0, job.stored_to - reuse),
        images=len(vision.spans) if (vision := job.prompt.vision) is not None else 0,
        image_tokens=vision.image_tokens if vision is not None else 0,
    )


def cancelled(job: Job, reuse: int = 0) -> DoneEvent:
    """The final event of a job stopped before it produced a token."""
    return DoneEvent("cancelled", usage(job, reuse))
