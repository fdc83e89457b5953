"""The request explainer's pure parts (explain/, cache/eviction/log.py): the namespace history
and its bounds, the reason table, the texts and locations, the store's eviction record."""

from __future__ import annotations

from dataclasses import replace

from mlx_prefix.cache.eviction.log import EvictedPrefix
from mlx_prefix.cache.store import PromptCache
from mlx_prefix.cache.token_ids import TokenIds, packed
from mlx_prefix.conversation import Message
from mlx_prefix.explain.history import Closest, Divergence, PromptHistory, Seen
from mlx_prefix.explain.reasons import NO_DIVERGENCE, EvictedHit, Evidence, decide
from mlx_prefix.explain.texts import TEXT_CHARS, around, location, reply_came_back
from mlx_prefix.prompt.request.grid import ChunkGrid


def seen(tokens, prompt_len=None, key="m/ns", **kw) -> Seen:
    fields = dict(identity="id", cache_key="m", salt=None, kwargs="")
    fields.update(kw)
    n = len(tokens) if prompt_len is None else prompt_len
    return Seen(packed(tuple(tokens)), n, key, **fields)


def test_the_closest_shares_the_longest_prefix_newest_first_and_never_another_namespace():
    h = PromptHistory()
    h.add("a", seen([1, 2, 3, 4]), None)
    h.add("a", seen([1, 2, 9, 9]), None)
    h.add("b", seen([1, 2, 3, 4, 5, 6]), None)
    found = h.closest("a", "m/ns", packed((1, 2, 3, 4, 5)))
    assert found.shared == 4 and found.seen.raw == packed((1, 2, 3, 4))
    assert h.closest("a", "m/ns", packed((1, 2, 7))).seen.raw == packed((1, 2, 9, 9))  # tie
    assert h.closest("c", "m/ns", packed((1, 2, 3))) is None
    assert h.elsewhere("a", "m/ns", packed((1, 2))) is None
    h.add("a", seen([1, 2, 3, 4, 5], key="other/ns"), None)
    assert h.elsewhere("a", "m/ns", packed((1, 2, 3, 4, 5))).shared == 5
    h.check_integrity()


def test_the_history_stays_within_its_bounds():
    h = PromptHistory(per_key=2, max_keys=2, max_tokens=20)
    h.add("a", seen([1, 2]), None)
    h.add("a", seen([1, 2, 3]), None)  # extends the first: replaces it
    assert h.tokens == 3
    h.add("a", seen([5, 6, 7]), None)
    h.add("a", seen([8, 9, 10]), None)  # a third sequence of one key: the oldest goes
    assert h.closest("a", "m/ns", packed((1, 2, 3))).shared == 0
    for i in range(10):
        h.add(f"ns{i}", seen(list(range(100 + i, 108 + i))), Divergence(3, 0))
    assert h.tokens <= 20
    h.check_integrity()
    assert h.closest("ns9", "m/ns", packed(tuple(range(109, 117)))).shared == 8
    h.forget("ns9")
    assert h.closest("ns9", "m/ns", packed((109,))) is None
    h.check_integrity()


def test_the_store_records_what_it_evicts_and_refuses_with_the_bytes_it_lacked():
    class Payload:
        trimmable = True

        def __init__(self, n: int, nbytes: int):
            self.length, self.nbytes = n, nbytes

    store = PromptCache(budget_bytes=100)
    store.insert("k", (1, 2, 3), Payload(3, 60), kind=1)
    store.insert("k2", (4, 5, 6), Payload(3, 60), kind=1)  # evicts the first
    assert not store.insert("k", (7, 8), Payload(2, 500), kind=1)  # never fits
    (evicted,) = store.evicted.of("k2") or [None]
    assert evicted is None
    refused, gone = store.evicted.of("k")
    assert refused.refused and refused.length == 2 and refused.short == 500 - 100
    assert not gone.refused and gone.length == 3 and gone.nbytes == 60 and gone.short == 20
    assert gone.digest == hash(packed((1, 2, 3)))


def evidence(**kw) -> Evidence:
    base = dict(
        length=100, cached=0, enabled=True, off="", opening=3, stored_match=0, closest=None,
        elsewhere=None, identity="id", cache_key="m", salt=None, kwargs="",
        align=lambda n: n // 10 * 10, divergence=NO_DIVERGENCE, evicted=lambda cached: None,
    )  # fmt: skip
    base.update(kw)
    return Evidence(**base)


def test_each_reason_from_its_evidence():
    prior = Closest(seen(range(80), prompt_len=60), 70)  # shares 70: inside its reply
    edited = Closest(seen(range(80), prompt_len=60), 45)
    assert decide(evidence()).reason == "new"
    assert decide(evidence(enabled=False, closest=edited)).reason == "disabled"
    assert decide(evidence(closest=Closest(seen(range(50)), 50), cached=50)).reason == "hit"
    # The same prompt again: all of it inside the closest (which goes on with its reply).
    again = evidence(length=60, cached=50, closest=Closest(seen(range(80), 60), 60))
    assert (
        decide(replace(again, divergence=replace(NO_DIVERGENCE, reply_changed=True))).reason
        == "hit"
    )
    # Inside the reply, its text came back unchanged: the tokenizer split it otherwise.
    assert decide(evidence(closest=prior, cached=60)).reason == "hit"
    changed = replace(NO_DIVERGENCE, reply_changed=True)
    assert decide(evidence(closest=prior, cached=60, divergence=changed)).reason == "re_rendered"
    earlier = replace(NO_DIVERGENCE, earlier_message=True)
    assert decide(evidence(closest=edited, cached=40, divergence=earlier)).reason == "edited"
    v = decide(evidence(closest=edited, cached=40, divergence=replace(earlier, volatile=True)))
    assert v.reason == "volatile" and v.lost == 60 - 40 and v.diverged_at == 45
    # A stored entry (the next-turn prefetch) sharing more than the history: no edit.
    assert (
        decide(evidence(closest=edited, stored_match=90, cached=90, divergence=earlier)).reason
        == "hit"
    )
    # Less than the grid allows: an evicted entry that served more, else the checkpoints.
    short = evidence(closest=Closest(seen(range(50)), 50), cached=20)
    assert decide(short).reason == "grid" and decide(short).lost == 30
    hit = EvictedHit(EvictedPrefix("m/ns", 50, 0, True, 3 << 20, 2 << 20, 0.0), 50)
    verdict = decide(replace(short, evicted=lambda c: hit))
    assert verdict.reason == "evicted" and verdict.lost == 30 and "2.0 MiB more" in verdict.detail
    # Another model or salt shares more than anything under this key.
    other = Closest(seen(range(50), identity="other"), 50)
    assert decide(evidence(elsewhere=other)).reason == "model"
    salted = Closest(seen(range(50), salt="x"), 50)
    assert decide(evidence(elsewhere=salted)).reason == "settings"


class Words:
    """A tokenizer of one word a token."""

    def __init__(self):
        self.vocab: list[str] = []

    def encode(self, text: str) -> tuple[int, ...]:
        out = []
        for word in text.split(" "):
            if word not in self.vocab:
                self.vocab.append(word)
            out.append(self.vocab.index(word))
        return TokenIds(out)

    def decode(self, ids) -> str:
        return " ".join(self.vocab[i] for i in ids)


def test_the_texts_hold_the_divergence_and_stay_short():
    t = Words()
    a = t.encode(" ".join(["filler"] * 50 + ["blue", "maps"] + ["more"] * 100))
    b = t.encode(" ".join(["filler"] * 50 + ["green", "maps"] + ["more"] * 100))
    before, after = around(t, a, 50), around(t, b, 50)
    assert "blue" in before and "green" in after and "blue" not in after
    assert len(before) <= TEXT_CHARS and len(after) <= TEXT_CHARS
    reply = t.encode("fine thanks")
    assert reply_came_back(t, reply, t.encode("fine thanks <end> next"))
    assert not reply_came_back(t, reply, t.encode("thanks <end> next"))


def test_the_location_counts_message_starts_past_the_templates_own():
    start = 7
    grid = ChunkGrid(32, segment_tokens=frozenset({start}))
    messages = [Message("user", "a"), Message("assistant", "b"), Message("user", "c")]
    # A default system turn, then the three messages and the generation prompt.
    tokens = TokenIds([start, 1, 1, start, 2, 2, start, 3, 3, start, 4, 4, start, 5])
    assert location(grid, tokens, messages, 4).message == 0
    assert location(grid, tokens, messages, 6) == location(grid, tokens, messages, 7)
    assert location(grid, tokens, messages, 7).role == "assistant"
    assert location(grid, tokens, messages, 13).message == 3  # the generation prompt
    assert location(grid, tokens, None, 4) is None
