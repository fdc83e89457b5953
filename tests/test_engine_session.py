from __future__ import annotations

from conftest import TEST_CACHE, loaded_test_model

from mlx_prefix.engine.session import PrefixCacheSession

SYSTEM = "You summarize shipping notices for a warehouse team, in one line each. " * 5


def test_library_session_reuses_the_system_prompt_and_matches_a_cold_run():
    with PrefixCacheSession(loaded_test_model("nemotron_h"), cache_config=TEST_CACHE) as session:
        first = session.generate("Parcel 1 delayed.", system=SYSTEM, max_tokens=8)
        second = session.generate("Parcel 2 arrived.", system=SYSTEM, max_tokens=8)
        cold = session.generate("Parcel 2 arrived.", system=SYSTEM, max_tokens=8, cache=False)
    assert first.usage.cached_tokens == 0
    assert second.usage.cached_tokens > 50
    assert cold.usage.cached_tokens == 0 and second.tokens == cold.tokens
