"""How many prefill tokens share an engine step with decoding, from measured cost.

Every engine step prefills some grid chunks, then advances every running request by one
token, so a running request waits one step between two tokens. While requests decode,
the prefill share of a step is sized so that step stays within `decode_latency_s`: the
budget is (target - measured decode step) / measured seconds per prefill token, both
running averages. A grid chunk cannot be split (invariant 4), so at least one chunk runs:
the time between tokens is then bounded by the larger of the target and one chunk.

A burst decodes together. Requests arriving together (a browser extension's parallel
calls) would otherwise each start decoding as soon as their own prompt is in, and every
prefill step of the others would then sit between two of their tokens. So a request
whose prefill ends while nothing decodes waits for the others still prefilling, when
they have at most `gather_tokens` prompt tokens left: no prefill runs between the
burst's tokens, and the prefill steps run without decode steps between them. The wait
adds at most that many tokens of prefill to its first token, and depends only on
tokens, never on timings (every rank of a sharded group decides the same).
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


def gathers(config: EngineConfig, decoding: int, left: int) -> bool:
    """Whether requests whose prompt is computed wait for the `left` prompt tokens the
    others still prefill before they join the decode batch, `decoding` requests running."""
    return not decoding and 0 < left <= config.gather_tokens


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - _WEIGHT) * old + _WEIGHT * new
