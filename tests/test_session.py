from __future__ import annotations

from support.engine_helpers import PacedHandle, paced, wait_for
from support.models import TEST_CACHE, loaded_test_model

from mlx_prefix.records import SamplingParams, TokenEvent
from mlx_prefix.session import PrefixCacheSession, chat_prompt

long_reply = SamplingParams(max_tokens=400)
SYSTEM = "You summarize shipping notices for a warehouse team, in one line each. " * 5


def test_library_session_reuses_the_system_prompt_and_matches_a_cold_run():
    with PrefixCacheSession(loaded_test_model("nemotron_h"), cache_config=TEST_CACHE) as session:
        first = session.generate("Parcel 1 delayed.", system=SYSTEM, max_tokens=8)
        second = session.generate("Parcel 2 arrived.", system=SYSTEM, max_tokens=8)
        cold = session.generate("Parcel 2 arrived.", system=SYSTEM, max_tokens=8, cache=False)
    assert first.usage.cached_tokens == 0
    assert second.usage.cached_tokens > 50
    assert cold.usage.cached_tokens == 0 and second.tokens == cold.tokens


def test_a_consumer_that_stops_early_cancels_its_request():
    with PrefixCacheSession(loaded_test_model("dense"), cache_config=TEST_CACHE) as session:
        engine = session.engine
        engine.handle_type = PacedHandle  # the engine goes on once the first token is read
        with paced(after=1):
            for event in session.stream(chat_prompt("Count to a thousand."), long_reply):
                if isinstance(event, TokenEvent):
                    break  # the caller loses interest after one token
        assert wait_for(lambda: engine.lifecycle.pending == 0)
        # Cancelled within a few steps, not run to its 400 tokens.
        assert engine.loop.decode.steps < 50
        assert engine.store.stats().active_bytes == 0
