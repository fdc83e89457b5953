"""Running: a request in the decode batch, the decode phase's record. Engine thread only."""

from __future__ import annotations

from dataclasses import dataclass, field

from mlx_prefix.engine.decode.reasoning_budget import ReasoningBudget
from mlx_prefix.engine.decode.text import TextStream
from mlx_prefix.engine.requests.jobs import Job


@dataclass(slots=True)
class Running:
    job: Job
    stream: TextStream
    limit: int  # completion tokens allowed
    reuse: int
    prefill_tps: float
    first_at: float
    count: int = 0
    emitted: list[int] = field(default_factory=list)  # its reply's token ids so far
    reasoning: ReasoningBudget | None = None  # its reasoning budget, if it has one
