from __future__ import annotations

import pytest
from support.models import TEST_CACHE, loaded_test_model

from mlx_prefix.config import EngineConfig
from mlx_prefix.engine.engine import Engine


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
