"""Admission: which waiting request starts next (pure Python, engine thread only)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar


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
