from __future__ import annotations

import openai
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


# A module whose `live` fixture is a live server (support.live.live_server: a base URL and
# the engine it serves) gets these two; a module defines its own to differ.
@pytest.fixture
def client(live):
    """An OpenAI client of the module's live server."""
    with openai.OpenAI(base_url=f"{live[0]}/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture
def engine(live):
    """The engine the module's live server serves."""
    return live[1]
