"""ReasoningBudget: which tokens count as reasoning and when the close is forced."""

from __future__ import annotations

import mlx.core as mx

from mlx_prefix.engine.decode.reasoning_budget import ReasoningBudget
from mlx_prefix.engine.decode.sampling import TokenSampler
from mlx_prefix.prompt.reply.reasoning import ReasoningMarkers
from mlx_prefix.records import SamplingParams

START, END, NL, NL2, WORD = 10, 11, 1, 2, 5
MARKERS = ReasoningMarkers(
    "<think>", "</think>", (START,), (END,), "\n</think>\n\n", (NL, END, NL2)
)
SPLIT = ReasoningMarkers("<|a|>go", "<|b|>", (20, 21), (22,), "<|b|>", (22,))  # multi-token start


def sampled(sampler: TokenSampler) -> int:
    logits = mx.zeros((1, 30))
    return int(sampler(logits).item())


def run(bound: ReasoningBudget, sampler: TokenSampler, reply: list[int]) -> list[int]:
    """The reply's tokens, each replaced by a forced one while the sampler forces."""
    out = []
    for token in reply:
        if sampler.forcing:
            token = sampled(sampler)
        bound.after(token)
        out.append(token)
    return out


def test_the_close_follows_the_budgets_last_reasoning_token():
    sampler = TokenSampler(SamplingParams())
    bound = ReasoningBudget.of(3, MARKERS, True, sampler)
    assert bound is not None
    out = run(bound, sampler, [WORD] * 10)
    assert out[:6] == [WORD, WORD, WORD, NL, END, NL2] and out[6:] == [WORD] * 4
    assert bound.spent == 3 and not bound.bounding


def test_a_budget_of_zero_closes_before_the_first_token():
    sampler = TokenSampler(SamplingParams())
    assert ReasoningBudget.of(0, MARKERS, True, sampler) is not None
    assert [sampled(sampler) for _ in range(3)] == [NL, END, NL2]


def test_a_reply_that_opens_its_own_block_is_bounded_one_that_does_not_is_not():
    sampler = TokenSampler(SamplingParams())
    bound = ReasoningBudget.of(2, SPLIT, False, sampler)
    assert bound is not None
    assert run(bound, sampler, [20, 21, WORD, WORD, WORD, WORD]) == [20, 21, WORD, WORD, 22, WORD]
    plain = TokenSampler(SamplingParams())
    free = ReasoningBudget.of(2, SPLIT, False, plain)
    assert free is not None
    assert run(free, plain, [WORD, 20, 21, WORD, WORD, WORD]) == [WORD, 20, 21, WORD, WORD, WORD]


def test_a_block_the_model_closes_in_time_is_left_alone():
    sampler = TokenSampler(SamplingParams())
    bound = ReasoningBudget.of(3, MARKERS, True, sampler)
    assert bound is not None
    assert run(bound, sampler, [WORD, END, WORD, WORD, WORD]) == [WORD, END, WORD, WORD, WORD]
    assert ReasoningBudget.of(None, MARKERS, True, sampler) is None
    assert ReasoningBudget.of(3, None, True, sampler) is None
