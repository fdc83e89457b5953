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
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import CacheList, RotatingKVCache

from mlx_prefix.cache.snapshot import cache_nbytes
from mlx_prefix.engine.sampling import TokenSampler, normalize


def batchable(cache: list) -> bool:
    """Whether this cache may decode batched without changing its numbers."""

    def ok(c: Any) -> bool:
        if isinstance(c, CacheList):
            return all(ok(child) for child in c.caches)
        return not isinstance(c, RotatingKVCache) and hasattr(c, "merge")

    return all(ok(c) for c in cache)


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

    def step(self, want_logprobs: bool = False) -> list[tuple[int, float | None]]:
        """One decode step for every row: (token, logprob of it or None) per row."""
        inputs = mx.array(self._inputs)[:, None]  # [B, 1]
        logprobs = normalize(self.model(inputs, cache=self.cache)[:, -1, :])  # [B, V]
        tokens = mx.concatenate(
            [s(logprobs[i : i + 1]) for i, s in enumerate(self._samplers)]
        )  # [B]
        chosen = (
            mx.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0] if want_logprobs else None
        )
        mx.eval(tokens, *([chosen] if chosen is not None else []))
        token_list = tokens.tolist()
        lp_list = chosen.tolist() if chosen is not None else [None] * len(token_list)
        self._inputs = list(token_list)
        return list(zip(token_list, lp_list, strict=True))

    def nbytes(self) -> int:
        return cache_nbytes(self.cache) if self.cache else 0
