"""A verify of several rows (engine/forward/verify_positions.py): the padding after a
shorter row is not computed at all (a row without a draft costs a decode row, not the
longest row's width); with --deterministic each row's own positions compute as that row
alone would, by default as the model's own forward of the padded rows does."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from support.models import loaded_test_model

from mlx_prefix.engine.decode.batch import DecodeBatch
from mlx_prefix.engine.decode.sampling import TokenSampler
from mlx_prefix.engine.forward import rowwise
from mlx_prefix.engine.forward.runner import ChunkWork, compute_chunks
from mlx_prefix.records import SamplingParams


def _batch(model, rows: int | None, prompts: list[list[int]]) -> DecodeBatch:
    batch = DecodeBatch(model, rows)
    for i, prompt in enumerate(prompts):
        cache = make_prompt_cache(model)
        compute_chunks(model, [ChunkWork(cache, prompt, 0, len(prompt))], group=False)
        batch.add(i, cache, TokenSampler(SamplingParams(temperature=0.0)), prompt[-1], steps=8)
    return batch


# Prompts of different lengths (left padding in the batch), drafts of 4, 0 and 2.
PROMPTS = [[3 + (5 * i) % 90 for i in range(n)] for n in (37, 20, 29)]
DRAFTS = [[11, 12, 13, 14], [], [21, 22]]


def test_a_shorter_rows_padding_is_not_computed_and_each_row_is_its_alone_verify():
    model = loaded_test_model("dense").model
    rowwise.install(model)
    rows = rowwise.consistent_rows(model)
    prompts = PROMPTS
    inputs = [[p[-1], *d] for p, d in zip(prompts, DRAFTS, strict=True)]
    together = _batch(model, rows, prompts).verify_rows(inputs)
    assert together.shape[1] == 5
    for row, (prompt, tokens) in enumerate(zip(prompts, inputs, strict=True)):
        alone = _batch(model, rows, [prompt]).verify(tokens)
        n = len(tokens)
        assert mx.array_equal(together[row, :n], alone).item()
        # Its padding: dropped after the verify, never read, never computed.
        assert not mx.any(together[row, n:]).item()


def test_by_default_the_padding_is_not_computed_and_each_row_is_the_padded_forwards():
    model = loaded_test_model("dense").model
    rowwise.install(model)  # as verify_rows.py does before a verify of several rows
    inputs = [[p[-1], *d] for p, d in zip(PROMPTS, DRAFTS, strict=True)]
    together = _batch(model, None, PROMPTS).verify_rows(inputs)
    # The same rows padded with their last token: the model's own forward of them all.
    width = together.shape[1]
    full = [[*row, *[row[-1]] * (width - len(row))] for row in inputs]
    padded = _batch(model, None, PROMPTS).verify_rows(full)
    for row, tokens in enumerate(inputs):
        n = len(tokens)
        # Another call shape than the padded forward's: the last bits may differ.
        assert mx.allclose(together[row, :n], padded[row, :n], rtol=1e-4, atol=1e-4).item()
        assert not mx.any(together[row, n:]).item()  # never computed
        assert mx.all(mx.any(padded[row, n:] != 0, axis=-1)).item()  # computed, padded
