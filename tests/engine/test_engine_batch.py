"""Batched serving (issue 5) under --deterministic (batch invariance): concurrent requests
decode together, each output equal to the same request served alone, each request
checkpointing at its own offsets. The default mode's guarantees (the cache exact, what
batching may move) are tests/engine/test_engine_exact_cache.py's."""

from __future__ import annotations

import random
import threading

import pytest
from support.engine_helpers import PacedHandle, chat, paced, run, submit_together

from mlx_prefix.config import CacheConfig
from mlx_prefix.prompt.request.render import common_prefix_length
from mlx_prefix.records import (
    CachePreference,
    DoneEvent,
    ErrorEvent,
    PromptInput,
    SamplingParams,
    TokenEvent,
)

WORDS = (
    "river",
    "lamp",
    "orchard",
    "copper",
    "signal",
    "meadow",
    "ledger",
    "harbor",
    "velvet",
    "quarry",
    "tunnel",
    "pepper",
)
INSTRUCTION = (
    "Rewrite the text below in simple English, keeping every name and number. "
    + " ".join(WORDS[i % len(WORDS)] for i in range(300))
)
TEXTS = [
    f"Passage {i}: " + " ".join(WORDS[(i * 5 + k) % len(WORDS)] for k in range(4 + 9 * i))
    for i in range(6)
]
SAMPLING = SamplingParams(max_tokens=10)
NO_PERIODIC = CacheConfig(budget_bytes=1 << 30, prefill_chunk=64, checkpoint_interval=1 << 16)


def collect(handle):
    tokens, done = [], None
    for event in handle.events(timeout=300):
        if isinstance(event, TokenEvent) and event.token is not None:
            tokens.append(event.token)
        elif isinstance(event, ErrorEvent):
            raise AssertionError(event.message)
        elif isinstance(event, DoneEvent):
            done = event
    return tokens, done


@pytest.mark.parametrize("kind", ["dense", "qwen3_5", "sliding"])
def test_six_concurrent_requests_sharing_an_instruction_sent_twice(make_engine, kind):
    engine = make_engine(kind, cache_config=NO_PERIODIC, deterministic=True)
    prompts = [chat(("user", INSTRUCTION + "\n\n" + text)) for text in TEXTS]
    alone = [run(engine, p, cache=False, sampling=SAMPLING).tokens for p in prompts]
    first_tokens = engine.plan(prompts[0]).tokens
    for burst in range(2):
        handles = submit_together(engine, prompts, SAMPLING)
        results = [collect(h) for h in handles]
        for (tokens, _done), expected in zip(results, alone, strict=True):
            assert tokens == expected, "batching changed an answer"
        cached = [done.usage.cached_tokens for _, done in results]
        if burst == 0:
            # The instruction is computed once: every other request restores it.
            computed_it = sum(1 for c in cached if c == 0)
            assert computed_it == 1
            for prompt, c in zip(prompts, cached, strict=True):
                if c:
                    mine = engine.plan(prompt).tokens
                    shared = engine.planner.grid.align(
                        mine, common_prefix_length(first_tokens, mine)
                    )
                    assert c >= shared > 300
        else:
            assert all(c >= len(first_tokens) // 2 for c in cached)
    assert engine.loop.decode.peak_batch >= 4  # rotating caches too (TemporalBatchRotatingKVCache)
    engine.store.check_integrity()


@pytest.mark.parametrize("kind", ["dense", "qwen3_5", "nemotron_h", "sliding"])
def test_batched_prefill_and_decode_give_alone_logprobs_bit_for_bit(make_engine, kind):
    """Requests prefilled side by side (equal-shape chunks stacked) and decoded together
    give every token's logprob of the same request run alone and cold: batching never
    changes the numbers, and neither does a cache hit under batching."""
    engine = make_engine(kind, cache_config=NO_PERIODIC, deterministic=True)
    # Equal-length user messages: after the shared instruction their chunks match in
    # shape, so they are computed in stacked forwards.
    candidates = [
        chat(("user", INSTRUCTION + "\n\n" + " ".join(WORDS[(i + k) % 12] for k in range(40))))
        for i in range(12)
    ]
    by_length: dict[int, list] = {}
    for p in candidates:
        by_length.setdefault(len(engine.plan(p).tokens), []).append(p)
    prompts = max(by_length.values(), key=len)[:5]
    assert len(prompts) >= 3
    exact = SamplingParams(max_tokens=8, logprobs=True)
    alone = [run(engine, p, cache=False, sampling=exact) for p in prompts]
    for burst in range(2):
        handles = submit_together(engine, prompts, exact)
        for handle, expected in zip(handles, alone, strict=True):
            tokens, logprobs, done = [], [], None
            for event in handle.events(timeout=300):
                if isinstance(event, TokenEvent) and event.token is not None:
                    tokens.append(event.token)
                    logprobs.append(event.logprob)
                elif isinstance(event, ErrorEvent):
                    raise AssertionError(event.message)
                elif isinstance(event, DoneEvent):
                    done = event
            assert tokens == expected.tokens, "batching changed an answer"
            assert logprobs == expected.logprobs, "batching changed the numbers"
            assert burst == 0 or done.usage.cached_tokens > 300  # the second burst hits
    assert engine.loop.prefill.peak_tasks >= 2 and engine.loop.decode.peak_batch >= 2
    assert engine.loop.prefill.stacked > 0  # chunks were stacked
    engine.store.check_integrity()


@pytest.mark.parametrize(("kind", "budget"), [("dense", 1_500_000), ("nemotron_h", 1_000_000)])
def test_soak_of_mixed_requests_with_cancellations(make_engine, kind, budget):
    # A budget small enough that entries are evicted while requests run (each token's KV
    # is held once: the hybrid's 3 MB held every entry then).
    engine = make_engine(
        kind,
        cache_config=CacheConfig(budget_bytes=budget, prefill_chunk=32, checkpoint_interval=64),
        deterministic=True,
    )
    rng = random.Random(7)
    systems = ["You are a librarian. " * 6, "You are a chef who answers briefly. " * 9]
    prompts: list[PromptInput] = []
    for i in range(50):
        if i % 5 == 4:
            prompts.append(PromptInput(text="Once upon a time " * rng.randint(2, 30)))
        else:
            question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))
            prompts.append(chat(("system", rng.choice(systems)), ("user", question)))
    samplings = [SamplingParams(max_tokens=rng.randint(1, 14)) for _ in prompts]
    chosen = rng.sample(range(50), 12)
    cancel_after = {i: rng.randint(1, 3) for i in chosen[:8]}  # midway through decoding
    cancel_at_once = set(chosen[8:])  # before any token: queued or prefilling
    serial = {
        i: run(engine, p, cache=False, sampling=s).tokens
        for i, (p, s) in enumerate(zip(prompts, samplings, strict=True))
        if i not in cancel_after and i not in cancel_at_once
    }
    engine.views.flush_cache()

    outcomes: dict[int, tuple] = {}

    # A cancellation lands where its client sends it, whatever the threads' speed: "at
    # once" before the engine sees the request, midway before the engine goes on past
    # the token the client cancels at (engine_helpers.PacedHandle).
    engine.handle_type = PacedHandle

    def client(i: int) -> None:
        with paced(at_once=i in cancel_at_once, after=cancel_after.get(i)):
            handle = engine.submit(prompts[i], samplings[i], CachePreference())
        tokens, done = [], None
        for event in handle.events(timeout=300):
            if isinstance(event, TokenEvent) and event.token is not None:
                tokens.append(event.token)
                if i in cancel_after and len(tokens) >= cancel_after[i]:
                    handle.cancel()
            elif isinstance(event, ErrorEvent):
                outcomes[i] = ("error", event.message)
                return
            elif isinstance(event, DoneEvent):
                done = event
        outcomes[i] = (tokens, done)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert len(outcomes) == 50
    cancelled = 0
    for i, (tokens, done) in outcomes.items():
        assert tokens != "error", done
        if i in cancel_after or i in cancel_at_once:
            assert done.finish_reason in ("cancelled", "stop", "length")
            cancelled += done.finish_reason == "cancelled"
            if i in cancel_at_once:
                assert done.finish_reason == "cancelled" and tokens == []
        else:
            assert tokens == serial[i], f"request {i} differs from its serial run"
    assert cancelled >= len(cancel_at_once) + 2  # some cancellations landed midway too
    stats = engine.store.stats()
    assert stats.bytes <= budget and stats.active_bytes == 0 and stats.active_requests == 0
    assert stats.hits > 10 and stats.evictions > 0
    assert engine.loop.decode.peak_batch > 1
    assert engine.lifecycle.pending == 0
    engine.store.check_integrity()


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(make_engine):
    engine = make_engine("dense", deterministic=True)
    prompt = chat(("user", "Tell me a story about a lighthouse."))
    seeded = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234)
    alone = run(engine, prompt, sampling=seeded).tokens
    assert run(engine, prompt, sampling=seeded).tokens == alone
    prompts = [chat(("user", f"Other {i}")) for i in range(3)] + [prompt]
    *others, batched = submit_together(engine, prompts, [SamplingParams(12)] * 3 + [seeded])
    assert collect(batched)[0] == alone
    for handle in others:
        collect(handle)
    assert engine.loop.decode.peak_batch > 1
    other_seed = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=99)
    assert run(engine, prompt, sampling=other_seed).tokens != alone


def test_top_k_sampling_is_seeded_batch_independent_and_top_1_is_greedy(make_engine):
    engine = make_engine("dense", deterministic=True)
    prompt = chat(("user", "Name three rivers."))
    greedy = run(engine, prompt, sampling=SamplingParams(max_tokens=10)).tokens
    top1 = SamplingParams(max_tokens=10, temperature=1.0, seed=7, top_k=1)
    assert run(engine, prompt, sampling=top1).tokens == greedy
    top5 = SamplingParams(max_tokens=10, temperature=1.5, seed=7, top_k=5)
    alone = run(engine, prompt, sampling=top5).tokens
    prompts = [chat(("user", f"x {i}")) for i in range(2)] + [prompt]
    *others, batched = submit_together(engine, prompts, [SamplingParams(10)] * 2 + [top5])
    assert collect(batched)[0] == alone
    for handle in others:
        collect(handle)
    wide = SamplingParams(max_tokens=10, temperature=1.5, seed=7)
    assert run(engine, prompt, sampling=wide).tokens != alone  # the limit changed the draw


def _mass_above(model, tokens: list[int], token: int) -> float:
    """Probability of the tokens strictly more likely than `token` after `tokens`, from
    a direct forward pass."""
    import mlx.core as mx

    logits = model.model(mx.array([tokens]))[0, -1].astype(mx.float32)  # [V]
    probs = mx.softmax(logits)
    return mx.sum(mx.where(probs > probs[token], probs, 0.0)).item()


def test_top_p_below_one_changes_seeded_sampling(make_engine):
    # Same seed, same temperature: top_p < 1 samples only from the nucleus, which a
    # top_p of 1 does not (an ignored top_p would give identical tokens).
    engine = make_engine("dense")
    prompt = chat(("user", "Tell me a story about a lighthouse."))
    ids = list(engine.plan(prompt).tokens)

    def sample(top_p: float) -> list[int]:
        params = SamplingParams(max_tokens=12, temperature=1.0, top_p=top_p, seed=7)
        return run(engine, prompt, sampling=params, cache=False).tokens

    full, nucleus = sample(1.0), sample(0.3)
    assert sample(0.3) == nucleus  # seeded: the difference is top_p's, not chance
    assert nucleus != full
    model = engine.model

    def outside(tokens: list[int]) -> list[bool]:
        return [_mass_above(model, ids + tokens[:i], t) >= 0.3 + 1e-4 for i, t in enumerate(tokens)]

    assert not any(outside(nucleus))  # every token from the 0.3 nucleus
    assert any(outside(full))  # top_p = 1 reached beyond it


def _reference_top(model, tokens: list[int], n: int) -> tuple[list[int], list[float]]:
    """The `n` most likely next tokens after `tokens`: log_softmax of a direct forward
    pass, sorted."""
    import mlx.core as mx
    import numpy as np

    logits = model.model(mx.array([tokens]))[0, -1].astype(mx.float32)  # [V]
    logprobs = np.array(logits - mx.logsumexp(logits))
    order = np.argsort(-logprobs, kind="stable")[:n]
    return order.tolist(), logprobs[order].tolist(), logprobs


def test_top_logprobs_match_a_direct_forward_pass_alone_and_in_a_batch(make_engine):
    engine = make_engine("dense", deterministic=True)
    prompts = [chat(("user", f"Name {i + 2} rivers of Europe.")) for i in range(3)]
    asks = [
        SamplingParams(max_tokens=6, logprobs=True, top_logprobs=5),
        SamplingParams(max_tokens=6, logprobs=True, top_logprobs=2),
        SamplingParams(max_tokens=6),  # no logprobs: none computed for it
    ]
    alone = [collect_events(engine.submit(p, s)) for p, s in zip(prompts, asks, strict=True)]
    handles = submit_together(engine, prompts, asks)
    batched = [collect_events(h) for h in handles]
    assert engine.loop.decode.peak_batch > 1
    for prompt, params, solo, together in zip(prompts, asks, alone, batched, strict=True):
        assert [(e.token, e.logprob, e.top_logprobs) for e in solo] == [
            (e.token, e.logprob, e.top_logprobs) for e in together
        ]  # batched decode changes nothing, alternatives included
        ids = list(engine.plan(prompt).tokens)
        for event in solo:
            if not params.logprobs:
                assert event.logprob is None and event.top_logprobs == ()
                continue
            want_ids, want_values, full = _reference_top(engine.model, ids, params.top_logprobs)
            assert [t.token for t in event.top_logprobs] == want_ids
            for got, want in zip(event.top_logprobs, want_values, strict=True):
                assert abs(got.logprob - want) < 1e-4
            assert abs(event.logprob - full[event.token]) < 1e-4
            ids.append(event.token)


def collect_events(handle) -> list[TokenEvent]:
    events = [e for e in handle.events(timeout=120) if isinstance(e, TokenEvent)]
    return [e for e in events if e.token is not None]
