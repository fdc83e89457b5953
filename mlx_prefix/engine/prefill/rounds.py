"""Which chunks a prefill step takes: the order its rounds visit the tasks in, and each
round's chunks within the step's token budget (a chunk is never split: invariant 4).

Pure Python (no MLX). Engine thread only.
"""

from __future__ import annotations

from collections.abc import Iterable

from mlx_prefix.engine.prefill.task import PrefillTask


def in_order(tasks: list[PrefillTask], grouped: bool) -> list[PrefillTask]:
    """The order a step takes chunks in. Stacked forwards (`grouped`) want the
    oldest-first rounds (equal shapes meet there). Alone, the request with the fewest
    tokens left goes first (background prefetches last): the burst's total prefill is the
    same in any order, and this one gets each request into the decode batch soonest."""
    if grouped:
        return tasks
    return sorted(tasks, key=lambda t: (t.job.background, len(t.tokens) - t.position))


def choose_chunks(tasks: Iterable[PrefillTask], budget: int, spent: int) -> tuple[list, int]:
    """One round of a step: the next chunk of each task in order, while the step's
    tokens (`spent` in earlier rounds) stay within `budget`. The step's first chunk goes
    whatever its size (a chunk cannot be split: invariant 4); no later one overruns the
    budget, or a running request would wait for several chunks where one fits."""
    chosen: list[PrefillTask] = []
    tokens = 0
    for task in tasks:
        if task.cursor.done:
            continue
        begin, end = task.cursor.next_chunk()
        if (chosen or spent) and spent + tokens + end - begin > budget:
            break
        chosen.append(task)
        tokens += end - begin
    return chosen, tokens
