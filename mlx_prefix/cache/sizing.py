"""How big the cache's byte budget is by default, and what a budget holds (issue 55).

A conversation of N tokens holds N x (KV bytes per token) in its stored entry; its next
turn's request takes that entry over and grows it (cache/handover.py), so a budget of
about `CONVERSATION_FACTOR` x its KV keeps it hitting every turn: the KV once, plus the
step a KV buffer grows by and the room of a turn's new tokens.

Without --cache-budget the budget is a share of the memory the device says is free once
the weights are loaded (Metal: MLX's recommended working set less what MLX holds; CUDA:
the GPU's free memory; elsewhere the host's available memory: platform.available_memory),
as Ollama and oMLX size their KV caches from what the weights leave: activations, MLX's
buffer cache and the rest of the system need the remainder.

Pure Python (no MLX).
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30
MiB = 1 << 20
FREE_SHARE = 0.5  # of the memory free after the weights
MIN_BUDGET = 256 * MiB  # below this a budget keeps too little to be worth having
FALLBACK_BUDGET = 4 * GiB  # when the device does not say what is free
CONVERSATION_FACTOR = 1.25  # budget / KV of the longest conversation it keeps


@dataclass(frozen=True, slots=True)
class DefaultBudget:
    nbytes: int
    free: int | None  # bytes free after the weights (None: unknown: the fallback)

    def describe(self, kv_per_token: int) -> str:
        """The startup line: the budget, where it comes from, what it keeps."""
        where = (
            f"{FREE_SHARE:.0%} of {self.free / GiB:.1f} GiB free after the weights"
            if self.free is not None
            else "free memory unknown"
        )
        text = f"cache budget {self.nbytes / GiB:.2f} GiB ({where}; --cache-budget sets it)"
        if kv_per_token > 0:
            tokens = longest_conversation(self.nbytes, kv_per_token)
            text += f": keeps a conversation of up to {tokens:,} tokens "
            text += f"({kv_per_token / 1024:.0f} KiB of KV per token)"
        return text


def default_budget(free: int | None) -> DefaultBudget:
    """The budget for a machine with `free` bytes left after the weights (None: unknown)."""
    if free is None:
        return DefaultBudget(FALLBACK_BUDGET, None)
    return DefaultBudget(max(int(free * FREE_SHARE), min(MIN_BUDGET, free)), free)


def longest_conversation(budget: int, kv_per_token: int) -> int:
    """Tokens of the longest conversation `budget` keeps hitting every turn."""
    return int(budget / (kv_per_token * CONVERSATION_FACTOR)) if kv_per_token > 0 else 0


def budget_for(tokens: int, kv_per_token: int) -> int:
    """The budget a conversation of `tokens` tokens needs to hit every turn."""
    return int(tokens * kv_per_token * CONVERSATION_FACTOR)
