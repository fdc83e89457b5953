"""Stacked tails: the short rest of several prompts in one forward (default mode).

A burst of requests sharing a cached prefix (a browser extension's instruction, a
server's system prompt) leaves each a short rest to compute: its own question or
snippet and the generation prompt. Alone, each rest is a forward of a few tokens, which
costs about as much as reading the weights once, on any backend; stacked, the burst's
rests cost one forward, as mlx_lm.server prefills a batch of prompts. Histories of
different lengths are left-padded by the merge; rests of different lengths are
right-padded where every layer's batch cache can mask padding (cache/layers/
`tail_stacking`), else only rests of one length stack.

A stacked forward is not a prefill alone on the canonical grid, so nothing it computes
is stored (invariant 12): like a decode state, it serves only the request that computed
it, and a hit still computes exactly what a miss computes. So a request computes alone
on the grid up to its stack point (checkpoints.py `stack_point`: its last planned
checkpoint before its end, ChatML's cut after the generation prompt's `<|im_start|>`),
stores the state there (`keep_stack_start`), and only the few tokens after it stack:
the next turn of a chat (this prompt, the reply, a new message) restores nearly all of
this prompt, however many conversations arrived together (issue 55; measured by a
study now retired, its figures in benchmarks/HISTORY.md, 2026-11-28). A request at its
stack point computes nothing while another, still computing alone, will reach its own
within a stackable rest (`waits_to_stack`): they stack then. The request's answer may move
with what it was stacked with, as a decode step's may (batching, not the cache);
`--deterministic` never stacks tails. A request stacks only when its rest owes nothing
to others (checkpoints.py `owes_after`: a client's breakpoint, a system prompt, a
chosen disk save, a prefix a waiting request will restore) and it is not a warm-up or a
prefetch, whose whole purpose is what they store.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from mlx_prefix.cache.layers import EQUAL_TAILS, NO_STACKING, PADDED_TAILS, kind_of
from mlx_prefix.engine.forward.runner import ChunkWork, compute_tails
from mlx_prefix.engine.prefill.task import PrefillTask
from mlx_prefix.engine.requests.jobs import Job

log = logging.getLogger("mlx_prefix.engine")


@dataclass(frozen=True, slots=True)
class TailGroup:
    """Requests whose rests prefill in one forward."""

    tasks: tuple[PrefillTask, ...]
    padded: bool  # rests of different lengths, right-padded

    @property
    def tokens(self) -> int:
        return sum(len(t.tokens) - t.position for t in self.tasks)


def stacking(task: PrefillTask) -> int:
    """How this request's cache may stack (the least any of its layers allows)."""
    return min((kind_of(c).tail_stacking(c) for c in task.cache), default=NO_STACKING)


def stackable(task: PrefillTask, limit: int, *, at_point: bool = True) -> bool:
    """Whether `task`'s rest may compute stacked with others' and store nothing; with
    `at_point=False`, whether it will once it computed alone up to its stack point (it
    may wait for that where it is ready: `waits_to_stack`)."""
    job = task.job
    rest = len(task.tokens) - task.position
    if task.cursor.done or not 0 < rest <= limit:
        return False
    if job.background or job.warm is not None or task.draft is not None:
        return False  # they exist for what they store, or follow a draft step by step
    if task.checkpointer is not None:
        if task.checkpointer.owes_after(task.position):
            return False
        if at_point and task.position < task.checkpointer.stack_point():
            return False  # it computes alone up to there, stored for the next turn
    return stacking(task) != NO_STACKING


def awaited(task: PrefillTask, waiting: Iterable[Job], min_tokens: int) -> bool:
    """Whether a waiting request of the same key would restore at least `min_tokens` of
    `task`'s rest from what its prefill stores (an all-KV cache's end serves every
    prefix: in-flight sharing)."""
    key, need = task.job.cache_key, task.position + min_tokens
    head = tuple(task.tokens[:need])  # a slice compare: prompts can be long
    return len(head) == need and any(
        j.cache_pref.enabled and j.cache_key == key and tuple(j.prompt.tokens[:need]) == head
        for j in waiting
    )


def may_stack(task: PrefillTask, limit: int, waiting: Iterable[Job], min_tokens: int) -> bool:
    """Whether `task`'s rest may stack now: `stackable`, and not `awaited`."""
    # A prompt with images computes its chunks alone (vision/forward.py).
    if task.job.prompt.vision is not None:
        return False
    return stackable(task, limit) and not awaited(task, waiting, min_tokens)


def waits_to_stack(
    task: PrefillTask,
    tasks: Iterable[PrefillTask],
    limit: int,
    *,
    ready: Callable[[PrefillTask], bool],
) -> bool:
    """Whether `task`, ready to stack (`ready`: `may_stack` with the phase's parts),
    computes nothing this round: another request, still computing alone up to its own
    stack point, has at most a stackable rest left and will stack with it (their stack
    points are stored, so they compute apart up to there). Ready tasks never wait on
    each other."""
    if not ready(task):
        return False
    return any(
        other is not task
        and not other.cursor.done
        and other.job.prompt.vision is None
        and stackable(other, limit, at_point=False)
        and not ready(other)
        for other in tasks
    )


def padding_allowance(device: mx.Device) -> float:
    """Padded tokens a stack may compute per token of its rests, on `device` (a fact of
    the device's kind, like its dtype: nothing is measured). On a GPU a short forward
    costs about one read of the weights whatever its length, so rests of different
    lengths stack freely (up to twice their tokens). On the CPU a forward costs in
    proportion to its tokens, padding included: on SmolLM2, five rests of 53-114 tokens
    padded to 570 for 399 took 1.5x their alone time (7.8 s against 5.2 s), while seven
    rests of one length took 0.94x. So there only rests of about one length stack."""
    return CPU_PADDING if device == mx.cpu else GPU_PADDING


CPU_PADDING = 1 / 16
GPU_PADDING = 1.0


def tail_group(
    tasks: Iterable[PrefillTask], limit: int, budget: int, padding: float
) -> TailGroup | None:
    """The largest group of at least two stackable requests, or None: rests close
    enough in length that the stack computes at most `padding` padded tokens per token
    of its rests (`padding_allowance`), and within the step's `budget` of prompt tokens
    (a group of two whatever its size). Caches of different layer kinds never share a
    forward."""
    groups: dict[tuple, list[PrefillTask]] = {}
    for task in tasks:
        if not stackable(task, limit):
            continue
        how = stacking(task)
        shape = tuple(type(c) for c in task.cache)
        rest = len(task.tokens) - task.position
        key = (shape, how) if how == PADDED_TAILS else (shape, how, rest)
        groups.setdefault(key, []).append(task)
    best: tuple[PrefillTask, ...] = ()
    padded = False
    for (_, how, *_), members in groups.items():
        assert how in (EQUAL_TAILS, PADDED_TAILS)
        found = closest_rests(members, padding, budget)
        if len(found) > len(best):
            best, padded = found, how == PADDED_TAILS
    return TailGroup(best, padded) if len(best) >= 2 else None


def closest_rests(tasks: list[PrefillTask], padding: float, budget: int) -> tuple[PrefillTask, ...]:
    """The most rests, of neighbouring lengths, that pad within `padding` and `budget`
    (on ties, the fewest padded tokens)."""
    ordered = sorted(tasks, key=lambda t: len(t.tokens) - t.position)
    rests = [len(t.tokens) - t.position for t in ordered]
    best: tuple[PrefillTask, ...] = ()
    best_cost = (0, 0)
    for i in range(len(ordered)):
        tokens = 0
        for j in range(i, len(ordered)):
            tokens += rests[j]
            size = j - i + 1
            if size > 2 and tokens > budget:
                break
            stacked = rests[j] * size  # sorted: the longest rest is the last
            if stacked > (1 + padding) * tokens:
                continue  # a longer window may pad less again (more rests of this length)
            if (size, -stacked) > best_cost:
                best, best_cost = tuple(ordered[i : j + 1]), (size, -stacked)
    return best


def compute_group(model: nn.Module, group: TailGroup) -> list[mx.array]:
    """The group's rests in one forward, after each task's deferred checkpoints are
    settled from the grid's KV: their last logits, in the group's order."""
    for task in group.tasks:
        if task.checkpointer is not None:
            task.checkpointer.settle()  # deferred checkpoints, from the grid's KV
            task.checkpointer.keep_stack_start(task.position)
    works = [ChunkWork(t.cache, t.tokens, t.position, len(t.tokens)) for t in group.tasks]
    started = time.perf_counter()
    outputs = compute_tails(model, works, group.padded)
    log.debug(
        "stacked %d rests, %d tokens (%s) in %.3f s",
        len(works),
        group.tokens,
        "padded" if group.padded else "one length",
        time.perf_counter() - started,
    )
    return outputs
