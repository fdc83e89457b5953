"""What the engine is doing, for any thread to read: requests waiting, prefilling and
decoding, warm-ups and background prefetches.

The waiting list, the prefill tasks and the decode batch belong to the engine thread
(invariant 1). Once per turn of its loop the engine thread publishes an immutable
`Activity` built from them; readers (the dashboard, in HTTP threads) only ever read the
last one published, so they never touch the engine's own records nor wait for it. A
reader sees the engine as it was at the end of its last turn (a turn prefills at most
`prefill_tokens_per_step` tokens, then decodes one token per request).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from mlx_prefix.engine.decode.running import Running
from mlx_prefix.engine.keys import namespace_of
from mlx_prefix.engine.prefill.task import PrefillTask
from mlx_prefix.engine.requests.jobs import Job

State = Literal["queued", "prefilling", "decoding"]
Role = Literal["request", "warm", "prefetch"]


@dataclass(frozen=True, slots=True)
class JobView:
    request_id: str
    role: Role  # a client's request, a warm-up (POST /v1/cache/warm) or a next-turn prefetch
    state: State
    prompt_tokens: int
    cached_tokens: int  # restored from the cache (known once its prefill started)
    computed_tokens: int  # prompt tokens prefilled so far (cached ones not counted)
    generated_tokens: int
    max_tokens: int
    submitted_at: float  # time.perf_counter() when it was queued
    namespace: str | None = None  # its cache namespace's id (engine/keys.py): who sees it


@dataclass(frozen=True, slots=True)
class Activity:
    jobs: tuple[JobView, ...]  # prefilling first, then decoding, then waiting in queue order
    capacity: int  # requests that may decode together
    published_at: float  # time.perf_counter()


class ActivityBoard:
    """The last published Activity. `publish` on the engine thread; `current` anywhere
    (one reference assignment: a reader gets one whole Activity, old or new)."""

    def __init__(self, capacity: int) -> None:
        self._current = Activity((), capacity, time.perf_counter())

    @property
    def current(self) -> Activity:
        return self._current

    def publish(
        self,
        waiting: Iterable[Job],
        prefilling: Iterable[PrefillTask],
        decoding: Iterable[Running],
        capacity: int,
    ) -> None:
        jobs = [_view(t.job, "prefilling", t.reuse, t.computed, 0) for t in prefilling]
        jobs += [
            _view(r.job, "decoding", r.reuse, len(r.job.tokens) - r.reuse, r.count)
            for r in decoding
        ]
        jobs += [_view(j, "queued", 0, 0, 0) for j in waiting if not j.ended]
        self._current = Activity(tuple(jobs), capacity, time.perf_counter())


def _view(job: Job, state: State, cached: int, computed: int, generated: int) -> JobView:
    role: Role = "prefetch" if job.background else "warm" if job.warm is not None else "request"
    return JobView(
        request_id=job.handle.request_id,
        role=role,
        state=state,
        prompt_tokens=len(job.tokens),
        cached_tokens=cached,
        computed_tokens=computed,
        generated_tokens=generated,
        max_tokens=job.sampling.max_tokens if role == "request" else 0,
        submitted_at=job.submitted_at,
        namespace=namespace_of(job.cache_key),
    )
