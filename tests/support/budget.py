"""Budget tests' shared pieces: a watch on the store's stored + running bytes after every
change, and a conversation's cold replies to compare the cached turns with."""

from __future__ import annotations

from dataclasses import dataclass, field

from mlx_prefix.cache.store import PromptCache
from mlx_prefix.config import EngineConfig
from mlx_prefix.records import SamplingParams
from support.engine_helpers import EXACT, chat, open_engine, run
from support.models import TEST_CACHE

STORE_CALLS = ("insert", "set_active_bytes", "acquire", "release", "hand_over")
SYSTEM = ("system", "You are a careful assistant. " * 40)


@dataclass
class StoreWatch:
    """Stored + running bytes after each store change, and each change that left them
    over the budget, named. Recorded, not raised: an assertion on the engine thread
    would end the request or prefetch instead of failing the test."""

    totals: list[int] = field(default_factory=list)
    over: list[str] = field(default_factory=list)

    def assert_capped(self, budget: int) -> None:
        assert self.totals and not self.over, self.over[:5]
        assert max(self.totals) <= budget


def watch_store(monkeypatch) -> StoreWatch:
    watch = StoreWatch()

    def wrap(name: str) -> None:
        method = getattr(PromptCache, name)

        def call(self, *args, **kwargs):
            out = method(self, *args, **kwargs)
            s = self.stats()
            watch.totals.append(s.bytes + s.active_bytes)
            if s.bytes + s.active_bytes > s.budget_bytes:
                watch.over.append(f"{name}: {s.bytes} stored + {s.active_bytes} running")
            return out

        monkeypatch.setattr(PromptCache, name, call)

    for name in STORE_CALLS:
        wrap(name)
    return watch


def questions(n: int) -> list[str]:
    """`n` long user turns (each some hundred tokens)."""
    return [f"Question {i}: " + "tell me about the topic please " * 30 for i in range(n)]


def cold_conversation(model, users: list[str], sampling: SamplingParams = EXACT):
    """Each turn's messages (SYSTEM, then each user turn after the cold replies before
    it) and its cold reply, computed without the cache."""
    turns, cold = [], []
    with open_engine(model, TEST_CACHE, EngineConfig(prefetch_next_turn=False)) as engine:
        messages = [SYSTEM]
        for user in users:
            messages.append(("user", user))
            turns.append(list(messages))
            cold.append(run(engine, chat(*messages), cache=False, sampling=sampling))
            messages.append(("assistant", cold[-1].text))
    return turns, cold
