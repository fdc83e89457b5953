"""DecodeBatch: the running requests' caches merged into one batched cache (MLX).

mlx-lm's batch caches (BatchKVCache, ArraysCache, CacheList, ...) left-pad shorter
sequences and mask the padding. Measured here, a batched decode step then gives
bit-identical logits to the same sequence decoding alone for attention and recurrent
layers; a rotating (sliding-window) cache's padding does not (differences ~4e-6), so
models with one decode alone to keep "a hit never changes the answer" - and
"batched never changes the answer" - true.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import CacheList, RotatingKVCache

from mlx_prefix.cache.snapshot import cache_nbytes
from mlx_prefix.engine.sampling import TokenSampler, normalize, top_logprobs


def batchable(cache: list) -> bool:
    """Whether this cache may decode batched without changing its numbers."""

    def ok(c: Any) -> bool:
        if isinstance(c, CacheList):
            return all(ok(child) for child in c.caches)
        return not isinstance(c, RotatingKVCache) and hasattr(c, "merge")

    return all(ok(c) for c in cache)


@dataclass(frozen=True, slots=True)
class RowSample:
    """One row's result of a decode step."""

    token: int
    logprob: float | None  # of `token`, when the step was asked for logprobs
    top_ids: list[int]  # the step's `top_n` most likely tokens, most likely first
    top_values: list[float]  # their logprobs


class DecodeBatch:
    """Rows in insertion order; row i belongs to `members[i]`. Engine thread only."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.cache: list = []
        self.members: list[Any] = []
        self._samplers: list[TokenSampler] = []
        self._inputs: list[int] = []  # next input token per row

    def __len__(self) -> int:
        return len(self.members)

    def add(self, member: Any, cache: list, sampler: TokenSampler, first_token: int) -> None:
        """Join a sequence whose prompt is fully in `cache`; its next input is first_token."""
        single = [type(c).merge([c]) for c in cache]
        if not self.cache:
            self.cache = single
        else:
            for batched, new in zip(self.cache, single, strict=True):
                batched.extend(new)
        self.members.append(member)
        self._samplers.append(sampler)
        self._inputs.append(first_token)

    def remove(self, members: Sequence[Any]) -> None:
        gone = {id(m) for m in members}
        keep = [i for i, m in enumerate(self.members) if id(m) not in gone]
        if len(keep) == len(self.members):
            return
        if not keep:
            self.cache, self.members, self._samplers, self._inputs = [], [], [], []
            return
        for c in self.cache:
            c.filter(keep)
        self.members = [self.members[i] for i in keep]
        self._samplers = [self._samplers[i] for i in keep]
        self._inputs = [self._inputs[i] for i in keep]

    def step(self, want_logprobs: bool = False, top_n: int = 0) -> list[RowSample]:
        """One decode step for every row. Logprobs (and the `top_n` most likely tokens)
        only when asked: computed with the tokens, in the same evaluation."""
        inputs = mx.array(self._inputs)[:, None]  # [B, 1]
        logprobs = normalize(self.model(inputs, cache=self.cache)[:, -1, :])  # [B, V]
        tokens = mx.concatenate(
            [s(logprobs[i : i + 1]) for i, s in enumerate(self._samplers)]
        )  # [B]
        out = [tokens]
        if want_logprobs:
            out.append(mx.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0])  # [B]
            if top_n:
                out.extend(top_logprobs(logprobs, top_n))  # [B, n] ids, [B, n] values
        mx.eval(*out)
        token_list = tokens.tolist()
        self._inputs = list(token_list)
        rows = len(token_list)
        chosen = out[1].tolist() if want_logprobs else [None] * rows
        ids = out[2].tolist() if len(out) > 2 else [[]] * rows
        values = out[3].tolist() if len(out) > 2 else [[]] * rows
        return [RowSample(*row) for row in zip(token_list, chosen, ids, values, strict=True)]

    def nbytes(self) -> int:
        return cache_nbytes(self.cache) if self.cache else 0
