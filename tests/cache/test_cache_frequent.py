"""The value policy's frequent segment (issue 55 item 4): a conversation restored turn
after turn outlasts newer one-off entries and their protected system prompts, within a
share of the budget (cache/eviction/policy.py, cache/eviction/uses.py)."""

from __future__ import annotations

from dataclasses import dataclass

from support.cache_sim import FakeSnapshot

from mlx_prefix.cache.eviction import policy as policy_module
from mlx_prefix.cache.eviction.policy import ValueLRU
from mlx_prefix.cache.store import CheckpointKind, PromptCache
from mlx_prefix.cache.types import Buffer, new_buffer_key

K = CheckpointKind
M = "model-a"


def snap(tokens) -> FakeSnapshot:
    return FakeSnapshot(len(tokens), nbytes=len(tokens))  # one byte a token


def ident(x: int) -> int:
    return x


def _conversation(base: int, system: int, turns: int) -> list[list[int]]:
    """Each turn's prompt: a system prompt of `system` tokens, then 10 tokens a turn."""
    tokens, out = list(range(base, base + system)), []
    for t in range(turns):
        tokens = tokens + list(range(base + 1000 + 10 * t, base + 1010 + 10 * t))
        out.append(tokens)
    return out


def _turn(cache: PromptCache, tokens: list[int], system: int) -> int:
    """A request as the engine makes it: restore, then store the system prompt and the
    prompt's end. Returns the tokens it reused."""
    reused = cache.match(M, tokens, ident).reuse_tokens
    cache.insert(M, tokens[:system], snap(tokens[:system]), K.SYSTEM)
    cache.insert(M, tokens, snap(tokens), K.LAST_MESSAGE)
    return reused


def test_a_main_agent_outlasts_five_newer_subagents_and_their_system_prompts():
    main = _conversation(0, system=100, turns=5)
    subagents = [_conversation(10_000 * (k + 1), system=40, turns=2) for k in range(5)]
    # The main agent's whole conversation and two subagents' (system prompt, end).
    cache = PromptCache(len(main[-1]) + 2 * (40 + 60), policy=ValueLRU())
    for tokens in main[:-1]:
        _turn(cache, tokens, 100)
    for turns in subagents:
        for tokens in turns:
            _turn(cache, tokens, 40)
    assert _turn(cache, main[-1], 100) == len(main[-2])  # the whole previous turn
    cache.check_integrity()


@dataclass(slots=True)
class FakeEntry:
    entry_id: int
    kind: CheckpointKind
    saved_work: float
    uses: int
    nbytes: int
    share_bytes: float = 1.0
    children: int = 0
    tokens: tuple[int, ...] = ()
    last_access: float = 0.0
    buffers: tuple[Buffer, ...] = ()

    def __post_init__(self) -> None:
        self.buffers = (Buffer(new_buffer_key(), self.nbytes),)


def test_the_frequent_segment_is_capped_its_least_valuable_entry_demoted():
    uses = policy_module.FREQUENT_USES
    policy: ValueLRU = ValueLRU()
    policy.bind(lambda: 100)  # frequent entries hold at most 80 bytes
    entries = [
        FakeEntry(0, K.HISTORY, saved_work=1e3, uses=uses, nbytes=45),  # the least valuable
        FakeEntry(1, K.HISTORY, saved_work=1e6, uses=uses, nbytes=45),
        FakeEntry(2, K.SYSTEM, saved_work=1e6, uses=0, nbytes=5),  # probationary
        FakeEntry(3, K.LAST_MESSAGE, saved_work=1e3, uses=0, nbytes=5),  # probationary
    ]
    for e in entries:
        policy.add(e)
    # 0 is demoted: it ranks with the probationary entries (by value, then the protected
    # kind), before 1, which is kept.
    assert [e.entry_id for e in policy.order()] == [0, 3, 2, 1]
    policy.bind(lambda: 1000)  # room for both: 0 and 1 go after every probationary one
    assert [e.entry_id for e in policy.order()] == [3, 2, 0, 1]
