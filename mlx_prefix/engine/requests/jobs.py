"""A request's record as every stage of the engine sees it: the Job, from the caller's
queue to its one final event, and what it reports (WarmResult, usage). The floor of the
engine: the stages' own records build on it (prefill/task.py's PrefillTask,
decode/running.py's Running), and it imports no stage. Engine thread only, except where
a field says otherwise."""

from __future__ import annotations

import itertools
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from mlx_prefix.engine.requests.handle import RequestHandle
from mlx_prefix.records import CachePreference, DoneEvent, PromptInput, SamplingParams, Usage

if TYPE_CHECKING:
    import mlx.core as mx

    from mlx_prefix.prompt.request.plan import RenderedPrompt


class Constraint(Protocol):
    """One request's grammar state (response_format; engine/decode/constraints.py builds
    it). Engine thread only, once created."""

    def allowed(self, vocab_size: int) -> mx.array:
        """The tokens that may come next: bool [vocab_size]. EOS is among them only when
        the reply so far is complete. Does not change the state."""
        ...

    def advance(self, token: int) -> bool:
        """Consume a sampled token; False if the grammar did not allow it (`error` says
        why; the constraint is broken for good)."""
        ...

    @property
    def finished(self) -> bool:
        """The reply is complete and nothing but EOS may follow."""
        ...

    @property
    def error(self) -> str: ...


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
    no_room: int = 0  # not started: the budget held neither it beside its entry nor in its place
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
    # Cancelled, its prefill running on as a background job for what it stores (issue
    # 55: engine/loop.py); its final event is sent.
    orphaned: bool = False
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
