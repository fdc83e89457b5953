"""What rank 0 sends the other ranks of a sharded engine at the start of every turn
(engine/sharded/lockstep.py), and the request handles on either side.

A turn's plan carries every input that is not a pure function of what the ranks
already share: the jobs that arrived (token ids, checkpoint plan, sampling with its
seed resolved), the cancels rank 0 latched, its clock (when background prefetches may
start) and prefill budget (engine/requests/pace.py, from its own timings), the cache actions
callers asked for (flush, pin, evict), whether a queued disk save is written this turn,
and the shutdown flags. Given the same plans in the same order, every rank's engine
takes the same steps, so every rank's cache holds the same entries for its shard.
"""

from __future__ import annotations

import pickle
import threading
from array import array
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from mlx_prefix.cache.token_ids import TokenIds, packed
from mlx_prefix.engine.cache_views import CacheAction
from mlx_prefix.engine.decode.constraints import ConstraintFactory
from mlx_prefix.engine.requests.handle import RequestHandle
from mlx_prefix.engine.requests.jobs import Job
from mlx_prefix.prompt.request.plan import Checkpoint, RenderedPrompt
from mlx_prefix.records import CachePreference, Event, SamplingParams


@dataclass(frozen=True, slots=True)
class JobSpec:
    """A job as the other ranks rebuild it (no caller: they have no HTTP)."""

    serial: int  # rank 0's Job.serial: names the job in later plans (cancels)
    request_id: str
    tokens: bytes  # int64 token ids (TokenIds.packed)
    checkpoints: tuple[Checkpoint, ...]
    is_chat: bool
    sampling: SamplingParams  # seed resolved on rank 0
    cache_pref: CachePreference
    cache_key: str  # its entries' key (model and namespace)
    warm: bool
    pin: bool
    background: bool
    not_before: float  # on rank 0's clock (TurnPlan.now)

    @classmethod
    def of(cls, job: Job) -> JobSpec:
        prompt = job.prompt
        return cls(
            job.serial,
            job.handle.request_id,
            packed(prompt.tokens),
            prompt.checkpoints,
            prompt.is_chat,
            job.sampling,
            job.cache_pref,
            job.cache_key,
            job.warm is not None,
            job.pin,
            job.background,
            job.not_before,
        )

    def job(self, submitted_at: float, constraints: ConstraintFactory) -> Job:
        """This rank's copy; its grammar state (response_format) built here like rank 0's."""
        fmt = self.sampling.response_format
        ids = array("q")
        ids.frombytes(self.tokens)
        prompt = RenderedPrompt(TokenIds(ids), self.checkpoints, self.is_chat)
        handle = SilentHandle(self.request_id, len(prompt.tokens))
        return Job(
            handle,
            prompt,
            self.sampling,
            self.cache_pref,
            self.cache_key,
            submitted_at,
            warm=Future() if self.warm else None,
            constraint=constraints.create(fmt) if fmt is not None else None,
            pin=self.pin,
            background=self.background,
            not_before=self.not_before,
            serial=self.serial,
        )


@dataclass(frozen=True, slots=True)
class TurnPlan:
    now: float  # rank 0's monotonic clock: which background jobs may start
    budget: int  # prefill tokens this turn (rank 0's engine/requests/pace.py)
    jobs: tuple[JobSpec, ...] = ()  # arrived since the last turn, in order
    cancels: tuple[int, ...] = ()  # serials of jobs whose cancel rank 0 latched
    actions: tuple[CacheAction, ...] = ()
    write_save: bool = False  # write the oldest queued disk save now
    drop_saves: bool = False  # the shutdown's time for disk saves is over
    closing: bool = False  # shutting down: cancel what waits, take nothing new
    stopping: bool = False  # the grace period is over: cancel running requests too
    stop: bool = False  # rank 0's loop is over: every rank's engine ends

    def encode(self) -> bytes:
        # Between ranks of one program (mlx_lm.server pickles its requests likewise).
        return pickle.dumps(self, protocol=pickle.HIGHEST_PROTOCOL)

    @staticmethod
    def decode(raw: bytes) -> TurnPlan:
        plan = pickle.loads(raw)
        assert isinstance(plan, TurnPlan)
        return plan


class LatchedHandle(RequestHandle):
    """Rank 0's handle: a caller's `cancel` only asks; the engine latches the ask at the
    next turn's start and sends it in the plan, so every rank cancels at the same point."""

    def __init__(self, request_id: str, prompt_tokens: int, **prompt: Any):
        super().__init__(request_id, prompt_tokens, **prompt)
        self.asked = threading.Event()

    def cancel(self) -> None:
        self.asked.set()

    def latch(self) -> bool:
        """Engine thread: True if a cancel was asked and not latched before (mutates)."""
        if self.asked.is_set() and not self.cancelled.is_set():
            self.cancelled.set()
            return True
        return False


class SilentHandle(RequestHandle):
    """Another rank's handle: nobody reads its events, so none are kept."""

    def emit(self, event: Event) -> None:
        pass
