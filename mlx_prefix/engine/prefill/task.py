"""PrefillTask: a request being prefilled, from its cache match to its logits (several
may be at once, each on its own grid). The prefill phase's record; the loop hands what
decode needs of a finished one on as an Arrival (engine/decode/running.py). Engine
thread only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from mlx_prefix.engine.decode.speculative import DraftCache
from mlx_prefix.engine.forward.runner import PrefillCursor
from mlx_prefix.engine.prefill.checkpoints import Checkpointer
from mlx_prefix.engine.requests.jobs import Job

if TYPE_CHECKING:
    import mlx.core as mx


@dataclass(slots=True)
class PrefillTask:
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
    progress_sent: int = -1  # the position its last ProgressEvent reported (loop.py)
    stop_at: int = -1  # a cancelled prefill running on stops at this position (loop.py)

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
