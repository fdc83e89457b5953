"""A decode step's results: lazy until read, then one RowSample per row.

DecodeBatch (engine/decode/batch.py) builds a step's arrays without evaluating them, so
that with overlap the next step can launch before this one is read; rows that leave the
batch meanwhile are dropped from the step too (`Step.keep`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx

from mlx_prefix.engine.decode.sampling import float_list, int_list


@dataclass(frozen=True, slots=True)
class RowSample:
    """One row's result of a decode step."""

    token: int
    logprob: float | None  # of `token`, when the step was asked for logprobs
    top_ids: list[int]  # the step's `top_n` most likely tokens, most likely first
    top_values: list[float]  # their logprobs


@dataclass(slots=True)
class Step:
    """A decode step's lazy results for the rows it computed, `members` in row order."""

    members: list[Any]
    tokens: mx.array  # [B]
    chosen: mx.array | None = None  # [B] logprob of each token, when asked
    top_ids: mx.array | None = None  # [B, n]
    top_values: mx.array | None = None  # [B, n]

    @property
    def arrays(self) -> list[mx.array]:
        found = (self.tokens, self.chosen, self.top_ids, self.top_values)
        return [a for a in found if a is not None]

    def keep(self, rows: list[int]) -> None:
        """Only these rows (indices into `members`) stay."""
        index = mx.array(rows)
        self.members = [self.members[i] for i in rows]
        self.tokens = self.tokens[index]
        if self.chosen is not None:
            self.chosen = self.chosen[index]
        if self.top_ids is not None and self.top_values is not None:
            self.top_ids, self.top_values = self.top_ids[index], self.top_values[index]


def read(step: Step) -> tuple[list[int], list[RowSample]]:
    """Wait for `step`: its tokens and each row's sample, in row order."""
    mx.eval(*step.arrays)
    token_list = int_list(step.tokens)
    rows = len(token_list)
    chosen: list[float | None] = [None] * rows
    if step.chosen is not None:
        chosen = list(float_list(step.chosen))
    ids = (
        cast("list[list[int]]", step.top_ids.tolist()) if step.top_ids is not None else [[]] * rows
    )
    values = (
        cast("list[list[float]]", step.top_values.tolist())
        if step.top_values is not None
        else [[]] * rows
    )
    samples = [RowSample(*row) for row in zip(token_list, chosen, ids, values, strict=True)]
    return token_list, samples
