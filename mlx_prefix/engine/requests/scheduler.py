"""Admission: which waiting job starts next (pure Python, engine thread only)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Generic, Protocol, TypeVar


class Waiting(Protocol):
    passovers: int  # times a later request was started before this one


J = TypeVar("J", bound=Waiting)


def pick_next(waiting: Sequence[J], reuse_of: Callable[[J], int], max_passovers: int) -> J:
    """Longest cached prefix first (it costs the least prefill), ties by arrival.

    Bounded waiting: a request passed over `max_passovers` times goes next, the oldest
    such first, so a stream of well-cached requests cannot starve a cold one. Mutates
    the passover counts of the requests the chosen one overtakes.
    """
    assert waiting, "pick_next needs a waiting request"
    starved = [job for job in waiting if job.passovers >= max_passovers]
    if starved:
        chosen = starved[0]
    else:
        best = -1
        chosen = waiting[0]
        for job in waiting:
            reuse = reuse_of(job)
            if reuse > best:
                best, chosen = reuse, job
    for job in waiting:
        if job is chosen:
            break
        job.passovers += 1
    return chosen


def extends(tokens: Sequence[int], prefix: Sequence[int]) -> bool:
    """Whether `tokens` starts with `prefix` (a request that can restore from it)."""
    return len(tokens) >= len(prefix) and tuple(tokens[: len(prefix)]) == tuple(prefix)


class WaitingJob(Protocol):
    passovers: int
    background: bool  # a next-turn prefetch: runs only when nothing else would
    not_before: float  # monotonic time a background job may start
    cache_key: str  # a job restores only from entries of its own key (namespace)

    @property
    def tokens(self) -> Sequence[int]: ...


W = TypeVar("W", bound=WaitingJob)


class WaitingList(Generic[W]):
    """The jobs waiting to start, requests and background prefetches (engine thread
    only). Requests always go first; a background job starts only on an idle engine,
    after its delay, and gives way to any request that cannot restore from it."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.jobs: list[W] = []
        # When background jobs may start: this process's clock, or a sharded group's
        # (rank 0's, from the turn's plan: engine/sharded/lockstep.py).
        self.clock = clock

    def __len__(self) -> int:
        return len(self.jobs)

    def __iter__(self) -> Iterator[W]:
        return iter(self.jobs)

    def add(self, jobs: Iterable[W]) -> None:
        self.jobs.extend(jobs)

    def remove(self, job: W) -> None:
        self.jobs.remove(job)

    def take_if(self, drop: Callable[[W], bool]) -> list[W]:
        """Remove and return the jobs `drop` selects (mutates)."""
        gone = [j for j in self.jobs if drop(j)]
        for job in gone:
            self.jobs.remove(job)
        return gone

    def has_requests(self) -> bool:
        return any(not j.background for j in self.jobs)

    def background_wait(self) -> float | None:
        """Seconds until the next background job may start (None: none waits)."""
        times = [j.not_before for j in self.jobs if j.background]
        return max(0.0, min(times) - self.clock()) if times else None

    def next_request(
        self,
        reuse_of: Callable[[W], int],
        max_passovers: int,
        startable: Callable[[W], bool] = lambda j: True,
    ) -> W | None:
        """The request to start next (pick_next among the `startable` ones), removed from
        the list; None if no such request waits."""
        requests = [j for j in self.jobs if not j.background and startable(j)]
        if not requests:
            return None
        job = pick_next(requests, reuse_of, max_passovers)
        self.jobs.remove(job)
        return job

    def superseded_by(self, job: W) -> list[W]:
        """Remove and return the background jobs `job` extends (mutates): they would only
        recompute what it computes."""
        return self.take_if(lambda bg: bg.background and restores_from(job, bg))

    def ready_background(self, decoding: bool) -> W | None:
        """The oldest background job allowed to start, removed from the list: only on an
        engine with nothing to decode, after its delay (a client that sends its next
        request at once gets the engine to itself)."""
        if decoding:
            return None
        now = self.clock()
        job = next((j for j in self.jobs if j.background and j.not_before <= now), None)
        if job is not None:
            self.jobs.remove(job)
        return job

    def preempts(self, prefetch: W) -> bool:
        """Whether a waiting request cannot restore from the background prefill
        `prefetch` (so that prefill should give way)."""
        return any(not j.background and not restores_from(j, prefetch) for j in self.jobs)


def restores_from(job: WaitingJob, earlier: WaitingJob) -> bool:
    """Whether `job` can restore what `earlier` computes: the same entry key (one
    namespace never restores another's prefill) and a prompt extending its prompt."""
    return job.cache_key == earlier.cache_key and extends(job.tokens, earlier.tokens)
