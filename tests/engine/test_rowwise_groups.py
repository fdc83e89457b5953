"""Decode row groups per layer shape (engine/forward/rowwise.py): each linear layer projects a
decode batch's rows in groups no larger than its own shape computes like one row, so the
wide projections and the output head (nearly all the weight bytes a step reads) take
many rows at once while narrow ones split finer, and every row still gets its alone
numbers bit for bit."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import make_prompt_cache
from support.models import loaded_test_model

from mlx_prefix.engine.decode.batch import DecodeBatch
from mlx_prefix.engine.decode.sampling import TokenSampler
from mlx_prefix.engine.forward import rowwise
from mlx_prefix.engine.forward.rowwise import Grouping
from mlx_prefix.engine.forward.runner import ChunkWork, compute_chunks
from mlx_prefix.engine.sharded.lockstep import RankAgreement
from mlx_prefix.records import SamplingParams


def test_rows_split_into_as_few_even_groups_as_fit():
    assert rowwise._even(16, 12) == 8  # 8 + 8, not 12 + 4
    assert rowwise._even(13, 12) == 7
    assert rowwise._even(12, 12) == 12
    assert rowwise._even(5, 3) == 3
    assert rowwise._even(7, 1) == 1


def test_every_batch_invariant_layer_gets_its_measured_group():
    model = loaded_test_model("qwen3_5").model
    rowwise.install(model)
    found = rowwise.measure_rows(model)
    cap = rowwise.assign_rows(model, found)
    assert cap == max(g.most for g in found)
    layers = [m for _, m in model.named_modules() if hasattr(m, "_grouping")]
    # Every projection and the embedding's output head, each with its shape's figure.
    assert {nn.Linear, nn.Embedding} <= {type(m).__mro__[1] for m in layers}
    by_shape = dict(zip(rowwise.layer_shapes(model), found, strict=True))
    assert all(m._grouping == by_shape[rowwise._shape_key(m)] for m in layers)
    # Each shape measured on its own (what it finds is this machine's BLAS's business).
    assert len(found) == len(by_shape) > 1


@pytest.mark.parametrize("bias", [False, True])
def test_a_layers_rows_in_its_measured_groups_compute_as_alone(bias):
    """Whatever this machine's BLAS keeps apart (as the matmul's rows, or past that as
    its columns), a batch of more rows than the layer's group gives each row the layer
    called on that row alone: the groups only ever hold what was measured to."""
    layer = nn.Linear(256, 768, bias=bias)
    model = nn.Sequential(layer)
    rowwise.install(model)
    (grouping,) = rowwise.measure_rows(model, most=24)
    cap = rowwise.assign_rows(model, [grouping])
    assert cap == grouping.most >= 1
    rows = 2 * cap + 1  # past the group: the layer splits them
    x = mx.random.normal((rows, 1, 256), key=mx.random.key(3))
    alone = [layer(x[i : i + 1]) for i in range(rows)]  # outside `batched`: plain rows
    with rowwise.batched(rows, lengths=[1] * rows):
        together = layer(x)
    assert all(mx.array_equal(together[i : i + 1], alone[i]).item() for i in range(rows))


def _decode(model, prompts, rows, steps=4):
    batch = DecodeBatch(model, rows)
    for i, prompt in enumerate(prompts):
        cache = make_prompt_cache(model)
        compute_chunks(model, [ChunkWork(cache, prompt, 0, len(prompt))], group=False)
        batch.add(i, cache, TokenSampler(SamplingParams(temperature=0.0)), prompt[-1])
    out = [[] for _ in prompts]
    for _ in range(steps):
        for i, (_, row) in enumerate(batch.step(want_logprobs=True)):
            out[i].append((row.token, row.logprob))
    return out


@pytest.mark.parametrize("kind", ["dense", "qwen3_5", "nemotron_h", "sliding"])
def test_a_decode_batch_wider_than_every_group_gives_alone_logprobs(kind):
    """More rows than any layer's group holds: every layer splits its rows (unevenly
    across layers), and each row's tokens and logprobs are still its alone run's."""
    model = loaded_test_model(kind).model
    rowwise.install(model)
    rows = rowwise.consistent_rows(model)
    prompts = [[10 + (7 * i + 13 * k) % 180 for k in range(20 + 3 * i)] for i in range(rows + 2)]
    together = _decode(model, prompts, rows)
    alone = [_decode(model, [p], rows)[0] for p in prompts]
    assert together == alone


class _Channel:
    """Two ranks: this one's figures and the other's."""

    def __init__(self, other: list[int]):
        self.other = list(other)

    def gather(self, value: int) -> list[int]:
        return [value, self.other.pop(0)]


def test_sharded_ranks_take_each_shapes_smallest_group():
    # Gathered per shape: the length, then each shape's rows and columns.
    mine = [Grouping(12, 30), Grouping(3, 14), Grouping(8, 0)]
    other = [3, 12, 20, 2, 14, 8, 0]
    agreed = RankAgreement(_Channel(other)).rows(mine)
    assert agreed == [Grouping(12, 20), Grouping(2, 14), Grouping(8, 0)]
    # Ranks that measured different shapes (never with an even shard): the least for all.
    assert RankAgreement(_Channel([2, 5])).rows(mine) == [Grouping(3)] * 3
