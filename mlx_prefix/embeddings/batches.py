"""Which sequences share a forward. Pure: no MLX.

A padded batch computes rows x longest tokens, so sequences are sorted by length and cut
into groups whose padded size stays under a budget, and a sequence less than half as long
as its group's longest starts a new group: on a CPU padding is computed like any token
(a verse of 11 tokens beside one of 71 cost 6x its own work), while on a GPU a few more
forwards cost little. A sequence longer than the budget goes alone (chunked by the
model)."""

from __future__ import annotations

from collections.abc import Sequence

MAX_BATCH_TOKENS = 8192  # padded tokens per forward
MAX_BATCH_ROWS = 64


def plan_batches(
    lengths: Sequence[int], max_tokens: int = MAX_BATCH_TOKENS, max_rows: int = MAX_BATCH_ROWS
) -> list[list[int]]:
    """Indices into `lengths` grouped into forwards, longest first; every index once."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in order:
        group = batches[-1] if batches else []
        width = lengths[group[0]] if group else 0  # longest first: its first row sets it
        fits = len(group) < max_rows and (len(group) + 1) * width <= max_tokens
        if group and fits and 2 * lengths[i] >= width:
            group.append(i)
        else:
            batches.append([i])
    return batches
