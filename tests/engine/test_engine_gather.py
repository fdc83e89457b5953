"""Inter-token latency in a burst (issue 15): requests arriving together decode together,
with no prefill step between their tokens, and each answer stays its alone run's."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from support.engine_helpers import chat, collect, run, submit_together
from support.models import loaded_test_model

from mlx_prefix.config import CacheConfig, EngineConfig
from mlx_prefix.engine.decode.batch import DecodeBatch
from mlx_prefix.engine.decode.sampling import TokenSampler
from mlx_prefix.engine.engine import Engine
from mlx_prefix.engine.forward import rowwise
from mlx_prefix.engine.prefill.rounds import choose_chunks
from mlx_prefix.engine.requests.handle import RequestHandle
from mlx_prefix.engine.requests.pace import gathers
from mlx_prefix.records import SamplingParams, TokenEvent

WORDS = ("river", "lamp", "orchard", "copper", "signal", "meadow", "ledger", "harbor")
CACHE = CacheConfig(budget_bytes=1 << 30, prefill_chunk=64, checkpoint_interval=1 << 16)
SAMPLING = SamplingParams(max_tokens=5, temperature=0.0, logprobs=True)


def test_gathers_only_while_nothing_decodes_and_the_rest_is_short():
    config = EngineConfig(gather_tokens=100)
    assert gathers(config, decoding=0, left=100)
    assert not gathers(config, decoding=0, left=101)  # the burst's rest is too long
    assert not gathers(config, decoding=0, left=0)  # nobody else prefills
    assert not gathers(config, decoding=1, left=10)  # prefill steps already interleave
    assert not gathers(EngineConfig(gather_tokens=0), decoding=0, left=10)


@pytest.mark.parametrize(
    ("kind", "gather", "deterministic"),
    [("dense", 1024, True), ("qwen3_5", 1024, True), ("dense", 0, True), ("dense", 1024, False)],
)
def test_a_burst_decodes_together_and_answers_as_alone(kind, gather, deterministic):
    """Four requests of different lengths arrive together. With gathering, every first
    token goes out before any second one (no prefill between two tokens of a request),
    and after the batch cache is merged; without it the shortest starts decoding while
    the others still prefill. Batch-invariant (--deterministic), every answer is its
    alone run's, bit for bit."""
    emitted: list[tuple[str, int]] = []  # (request id, token number), in emission order
    merged_before: list[bool] = []  # the batch cache was merged when a token went out
    engine: Engine | None = None

    class Recording(RequestHandle):
        count = 0

        def emit(self, event):
            if isinstance(event, TokenEvent) and event.token is not None:
                self.count += 1
                emitted.append((self.request_id, self.count))
                merged_before.append(not engine.loop.decode.batch._joining)
            super().emit(event)

    config = EngineConfig(gather_tokens=gather, deterministic=deterministic)
    engine = Engine(loaded_test_model(kind), CACHE, config)
    engine.handle_type = Recording
    try:
        prompts = [
            chat(("user", " ".join(WORDS[(i + k) % len(WORDS)] for k in range(30 + 60 * i))))
            for i in range(4)
        ]
        handles = submit_together(engine, prompts, SAMPLING)
        results = [collect(handle, timeout=300) for handle in handles]
        assert all(r.finish_reason == "length" for r in results)
        engine.handle_type = RequestHandle
        for prompt, together in zip(prompts, results, strict=True):
            if not deterministic:
                break  # by default a row may move with its neighbours (batching, not the cache)
            alone = run(engine, prompt, cache=False, sampling=SAMPLING)
            assert together.tokens == alone.tokens, "decoding together changed an answer"
            assert together.logprobs == alone.logprobs, "decoding together changed the numbers"
        last_first = max(i for i, (_, n) in enumerate(emitted) if n == 1)
        first_second = min(i for i, (_, n) in enumerate(emitted) if n == 2)
        if gather:
            assert last_first < first_second, emitted
            assert engine.loop.decode.peak_batch == 4
        else:
            assert first_second < last_first, emitted  # the shortest went ahead
        assert all(merged_before)
    finally:
        engine.shutdown()


def test_joining_sequences_merge_once_into_a_buffer_with_room():
    """Sequences joining the decode batch are merged together into a KV buffer with room
    for the steps they may take (no more: it counts as resident memory): those steps
    copy nothing more, and every row decodes as it would alone."""
    model = loaded_test_model("dense").model
    rowwise.install(model)
    prompts = [[(7 * i + j) % 200 + 10 for j in range(40 + 9 * i)] for i in range(3)]

    def prefilled(tokens):
        cache = make_prompt_cache(model)
        logits = model(mx.array(tokens)[None], cache=cache)[:, -1, :]
        return cache, int(mx.argmax(logits, axis=-1).item())

    def greedy():
        return TokenSampler(SamplingParams(temperature=0.0), None, [1], [])

    alone = []
    for tokens in prompts:
        cache, first = prefilled(tokens)
        one = DecodeBatch(model, rowwise.consistent_rows(model))
        one.add(0, cache, greedy(), first)
        alone.append([one.step()[0][1].token for _ in range(4)])
    batch = DecodeBatch(model, rowwise.consistent_rows(model))
    for i, tokens in enumerate(prompts):
        cache, first = prefilled(tokens)
        batch.add(i, cache, greedy(), first, steps=4)
    batch.join()
    kv = batch.cache[0]
    buffer = kv.keys.shape[2]
    assert buffer == kv._idx + 4 and kv._idx == max(len(p) for p in prompts)
    rows = [[s.token for _, s in batch.step()] for _ in range(4)]
    assert kv.keys.shape[2] == buffer  # no growth copy in the first steps
    assert [list(r) for r in zip(*rows, strict=True)] == alone


class _Cursor:
    def __init__(self, *ends: int):
        self.ends, self.position = list(ends), 0

    @property
    def done(self) -> bool:
        return not self.ends

    def next_chunk(self) -> tuple[int, int]:
        return self.position, self.ends[0]


class _Task:
    def __init__(self, *ends: int):
        self.cursor = _Cursor(*ends)


def test_a_step_takes_one_chunk_over_budget_and_never_a_later_one():
    """The step's first chunk goes whatever its size; a later round does not add a
    chunk past the budget (it did: each round's first chunk went unconditionally, so a
    step meant for 100 tokens ran 58 + 3 + 62 + 256)."""
    a, b = _Task(58, 61), _Task(62, 318)
    assert choose_chunks([a, b], budget=100, spent=0) == ([a], 58)
    a.cursor.position = 58
    a.cursor.ends.pop(0)
    assert choose_chunks([a, b], budget=100, spent=58) == ([a], 3)  # 58 + 3 fits
    a.cursor.ends.clear()
    assert choose_chunks([a, b], budget=100, spent=61) == ([], 0)  # 61 + 62 does not
    assert choose_chunks([a, b], budget=1, spent=0) == ([b], 62)  # at least one chunk
    big = _Task(300)
    assert choose_chunks([big], budget=256, spent=0) == ([big], 300)
