"""Quantized KV cache (--kv-bits, --kv-group-size, --quantized-kv-start), as mlx_lm does it.

mlx_lm.generate.maybe_quantize_kv_cache runs after every forward: each KVCache layer
whose offset has reached `start` becomes a QuantizedKVCache (its whole buffer quantized
at once; later tokens quantized as they are written). Here the same check runs after
every forward too: each prefill grid chunk and each decode step. Because the chunk grid
is a pure function of the prefix (invariant 4), a cold run and a run restored from any
checkpoint quantize at the same offset (the first grid point at or past `start`), so a
hit reproduces a cold run bit for bit:
- a checkpoint at p < start holds float KV (one bound after the switch would hold the
  quantized buffer: the Checkpointer settles its deferred checkpoints before it);
- a checkpoint at p >= start holds quantized KV, as a cold run has there;
- a quantized snapshot is restored only exactly, never trimmed (`snapshot.is_trimmable`):
  trimmed below `start` it would hold quantized positions a cold run holds in float.
So with quantization on, every prefill keeps its grid checkpoints, as a hybrid's does.

Only plain attention KVCache layers quantize (what mlx_lm converts): recurrent state
(ArraysCache) and sliding-window layers (RotatingKVCache, which mlx_lm cannot quantize)
stay float. Quantized caches have no batched form in mlx-lm (no merge, no batched
quantized attention), so a quantized server runs one request at a time, as
mlx_lm.server does with --kv-bits (engine/decode/batch.py decodes such a row unmerged).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START
from mlx_lm.models.cache import make_prompt_cache

from mlx_prefix.cache.layers import kind_of
from mlx_prefix.config import check_kv_quant

__all__ = ["DEFAULT_QUANTIZED_KV_START", "KvQuant", "check_model", "is_quantized"]

log = logging.getLogger("mlx_prefix.engine")


@dataclass(frozen=True, slots=True)
class KvQuant:
    bits: int
    group_size: int = 64
    start: int = DEFAULT_QUANTIZED_KV_START

    def __post_init__(self) -> None:
        check_kv_quant(self.bits, self.group_size, self.start)

    @classmethod
    def of(cls, bits: int | None, group_size: int, start: int) -> KvQuant | None:
        return None if bits is None else cls(bits, group_size, start)

    def signature(self) -> str:
        """Part of every cache key: a float entry never restores into a quantized
        engine, nor one quantized otherwise."""
        return f"kv={self.bits}/{self.group_size}@{self.start}"

    def apply(self, cache: list[Any]) -> bool:
        """Quantize, in place, every KVCache layer of `cache` whose offset reached
        `start` (mlx_lm's maybe_quantize_kv_cache). True if any layer changed."""
        changed = False
        for i, c in enumerate(cache):
            if self._due(c):
                cache[i] = c.to_quantized(group_size=self.group_size, bits=self.bits)
                changed = True
        return changed

    def due(self, cache: list[Any]) -> bool:
        """Whether `apply` would change `cache`. Does not mutate."""
        return any(self._due(c) for c in cache)

    def _due(self, c: Any) -> bool:
        # Plain KV only: sliding-window, chunked and recurrent layers stay float.
        return kind_of(c).quantizes(c, self.start)


def is_quantized(cache: list[Any]) -> bool:
    """Whether any layer of `cache` holds quantized KV. Does not mutate."""
    return any(kind_of(c).quantized for c in cache)


def check_model(model: nn.Module, kv: KvQuant) -> None:
    """Refuse, in one line (ValueError), a model whose attention head sizes the group
    size does not divide: mlx_lm would fail mid-request, at the first quantization.
    Logs which layers quantize. Runs one token through a fresh cache."""
    cache = make_prompt_cache(model)
    model(mx.array([[0]]), cache=cache)
    layers = [c for c in cache if kind_of(c).quantizes(c, 0)]
    sizes = sorted({n for c in layers for n in (c.keys.shape[-1], c.values.shape[-1])})
    bad = [n for n in sizes if n % kv.group_size]
    if bad:
        raise ValueError(
            f"--kv-group-size {kv.group_size} does not divide this model's attention head "
            f"size {bad[0]}; choose a group size that does"
        )
    log.info(
        "--kv-bits %d: %d of %d layers quantize from %d tokens (recurrent and "
        "sliding-window layers stay float)",
        kv.bits,
        len(layers),
        len(cache),
        kv.start,
    )
