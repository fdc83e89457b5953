from __future__ import annotations

import pytest

from mlx_prefix.config import CacheConfig, EngineConfig
from mlx_prefix.engine.engine import Engine
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


@pytest.fixture
def make_engine():
    engines: list[Engine] = []

    def make(
        kind: str = "dense",
        think_template: bool = False,
        cache_config=TEST_CACHE,
        deterministic: bool = False,
    ):
        """An engine on a tiny test model; `deterministic`: batch-invariant decode."""
        config = EngineConfig(deterministic=deterministic)
        engine = Engine(loaded_test_model(kind, think_template), cache_config, config)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()
