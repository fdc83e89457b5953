"""The tiny random-weight test models, loaded once per process, and the cache settings
the engine tests run with."""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, make_prompt_cache

from mlx_prefix.config import CacheConfig
from mlx_prefix.models.load import load_model
from mlx_prefix.models.testing import cached_test_model

# Small chunks and checkpoint intervals so that short test prompts cross many grid points.
TEST_CACHE = CacheConfig(budget_bytes=1 << 30, prefill_chunk=32, checkpoint_interval=64)

_loaded: dict = {}


def loaded_test_model(kind: str, think_template: bool = False):
    key = (kind, think_template)
    if key not in _loaded:
        _loaded[key] = load_model(str(cached_test_model(kind, think_template)))
    return _loaded[key]


def kv_of(model, tokens: int) -> int:
    """What one prefill of `tokens` tokens leaves: KV per token of the attention layers,
    plus the state of the others (recurrent; a sliding window's ring, full by then),
    measured after a forward of that many tokens through the model."""
    cache = make_prompt_cache(model.model)
    mx.eval(model.model(mx.array([[1] * tokens]), cache=cache))
    total = 0
    for c in cache:
        if type(c) is KVCache:
            total += 2 * c.keys.shape[1] * c.keys.shape[3] * c.keys.dtype.size * tokens
        else:
            total += sum(a.nbytes for _, a in tree_flatten(c.state) if isinstance(a, mx.array))
    return total
