"""Running: a request in the decode batch, the decode phase's record. Engine thread only."""

from __future__ import annotations

from dataclasses import dataclass, field

from mlx_prefix.cache.handover import EndState
from mlx_prefix.cache.types import CheckpointKind
from mlx_prefix.engine.decode.reasoning_budget import ReasoningBudget
from mlx_prefix.engine.decode.text import TextStream
from mlx_prefix.engine.requests.jobs import Job


@dataclass(frozen=True, slots=True)
class HandBack:
    """The end of a prompt whose restored entry was handed to it (cache/handover.py):
    stored from its decode row when it finishes, in that entry's place."""

    key: str  # the request's entry key
    tokens: tuple[int, ...]  # its prompt
    kind: CheckpointKind
    # A hybrid cache's other layers at its checkpoints, its end last (its row went on
    # past them; their KV comes from the row: cache/handover.py `from_row`).
    states: tuple[EndState, ...] = ()


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
    hand_back: HandBack | None = None  # its prompt's entry, stored when it finishes
