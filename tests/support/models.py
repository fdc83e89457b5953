"""The tiny random-weight test models, loaded once per process, and the cache settings
the engine tests run with."""

from __future__ import annotations

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
