"""How many prefill tokens share an engine step with decoding, from measured cost.

Every engine step prefills some grid chunks, then advances every running request by one
token, so a running request waits one step between two tokens. While requests decode,
the prefill share of a step is sized so that step stays within `decode_latency_s`: the
budget is (target - measured decode step) / measured seconds per prefill token, both
running averages. A grid chunk cannot be split (DESIGN 4), so at least one chunk runs:
the time between tokens is then bounded by the larger of the target and one chunk.
"""

from __future__ import annotations

from mlx_prefix.config import EngineConfig

_WEIGHT = 0.3  # of the newest measurement in the running averages


class Pace:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.per_token: float | None = None  # seconds per prefill token
        self.decode_step: float | None = None  # seconds per decode step

    def prefilled(self, tokens: int, seconds: float) -> None:
        if tokens > 0:
            self.per_token = _average(self.per_token, seconds / tokens)

    def decoded(self, seconds: float) -> None:
        self.decode_step = _average(self.decode_step, seconds)

    def prefill_budget(self, decoding: int) -> int:
        """Prefill tokens for the next step while `decoding` requests wait on it."""
        cap = self.config.prefill_tokens_per_step
        if not decoding or self.per_token is None:
            return cap
        room = self.config.decode_latency_s - (self.decode_step or 0.0)
        return max(1, min(cap, int(room / self.per_token)))


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - _WEIGHT) * old + _WEIGHT * new
