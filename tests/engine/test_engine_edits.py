"""A document edited anywhere is reused up to within 512 tokens of the edit, and within
half the tokens before it near its start (issue 14), on the models that can only resume
from exact checkpoints: both tiny hybrids and the sliding-window model, with the default
chunk grid and checkpoint placement (prompt/request/grid.py: 64, 128, 256, then every 512).

Each case prefills the original document once, then asks about versions edited at
10%, 50%, 70% and 95% of it: the restored position r must satisfy edit - r < 512 and
edit - r <= max(64, edit / 2), and the answer must equal a cold run's down to every
token's logprob. 16K
documents are checked against the checkpoint plan (what a hybrid's prefill stores) at
the same edit points: a cold 16K prefill takes minutes on a CPU box.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
from support.engine_helpers import chat, run
from support.models import loaded_test_model

from mlx_prefix.config import CacheConfig
from mlx_prefix.prompt.request.plan import PromptPlanner
from mlx_prefix.records import SamplingParams

KINDS = ["qwen3_5", "nemotron_h", "sliding"]
FRACTIONS = (0.10, 0.50, 0.70, 0.95)
RECOMPUTE = 512  # the most a divergence may recompute before it


def recompute_bound(edit: int) -> int:
    """The most a divergence at `edit` may recompute: a bounded share of what is before it."""
    return min(RECOMPUTE - 1, max(64, edit // 2))


CONFIG = CacheConfig(budget_bytes=1 << 30)  # the default chunk (256) and interval (512)
EXACT = SamplingParams(max_tokens=2, temperature=0.0, logprobs=True)
SYSTEM = "You answer questions about the document the user pastes. Be brief."
QUESTION = "Question: which river does the document mention first?"

_WORDS = {
    "adj": "quiet old bright narrow green heavy distant simple early careful".split(),
    "noun": "miller river bridge lantern orchard letter market harbour teacher road".split(),
    "verb": "crossed painted followed carried watched mended counted opened".split(),
    "place": "village hill station chapel meadow square wharf garden".split(),
}


def sentences(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        w = {k: rng.choice(v) for k, v in _WORDS.items()}
        out.append(
            f"In year {1700 + i} the {w['adj']} {w['noun']} {w['verb']} a "
            f"{rng.choice(_WORDS['noun'])} by the {w['place']}."
        )
    return out


def document(planner, target_tokens: int) -> list[str]:
    """Sentences making a chat prompt of about `target_tokens` tokens."""
    text = sentences(target_tokens // 10, seed=target_tokens)
    per = len(planner.plan(prompt(text)).tokens) / len(text)
    return text[: max(1, int(target_tokens / per))]


def prompt(text: list[str]):
    return chat(("system", SYSTEM), ("user", "Document:\n" + " ".join(text) + "\n\n" + QUESTION))


def edited(text: list[str], fraction: float) -> list[str]:
    i = int(len(text) * fraction)
    return [*text[:i], "Here a later hand wrote a different line entirely.", *text[i + 1 :]]


def divergence(planner, a, b) -> int:
    ta, tb = planner.plan(a).tokens, planner.plan(b).tokens
    return next(i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y)


def check_edits(engine, size: int, fractions: tuple[float, ...]) -> None:
    engine.model = dataclasses.replace(engine.model, context_length=32768)
    original = document(engine.planner, size)
    run(engine, prompt(original), sampling=EXACT)
    for fraction in fractions:
        version = prompt(edited(original, fraction))
        edit = divergence(engine.planner, prompt(original), version)
        assert abs(edit - fraction * size) < 0.1 * size  # the edit is where it should be
        warm = run(engine, version, sampling=EXACT)
        cached = warm.usage.cached_tokens
        assert edit - recompute_bound(edit) <= cached <= edit, (fraction, edit, cached)
        cold = run(engine, version, cache=False, sampling=EXACT)
        assert cold.usage.cached_tokens == 0
        assert (warm.tokens, warm.logprobs) == (cold.tokens, cold.logprobs), fraction
    engine.store.check_integrity()


@pytest.mark.parametrize("size", [1024, 4096])
@pytest.mark.parametrize("kind", KINDS)
def test_edited_document_restores_within_512_tokens_of_the_edit(make_engine, kind, size):
    check_edits(make_engine(kind, cache_config=CONFIG), size, FRACTIONS)


def test_edited_16k_document_restores_within_512_tokens_of_the_edit(make_engine):
    # One edit point on the fastest hybrid: a cold 16K prefill is the slow part.
    check_edits(make_engine("nemotron_h", cache_config=CONFIG), 16384, (0.95,))


@pytest.mark.parametrize("size", [1024, 4096, 16384])
def test_the_plan_puts_a_checkpoint_within_512_tokens_of_any_edit(size):
    planner = PromptPlanner(loaded_test_model("qwen3_5").tokenizer, CONFIG)
    original = document(planner, size)
    positions = sorted(c.position for c in planner.plan(prompt(original)).checkpoints)
    for fraction in FRACTIONS:
        edit = divergence(planner, prompt(original), prompt(edited(original, fraction)))
        below = max(p for p in positions if p <= edit)
        assert edit - recompute_bound(edit) <= below, (fraction, edit, below)
    # ... near the start too: any divergence restores within the bound.
    for edit in range(1, len(planner.plan(prompt(original)).tokens)):
        below = max((p for p in positions if p <= edit), default=0)
        assert edit - below <= recompute_bound(edit), (edit, below)
    # ... and between any two consecutive checkpoints there are at most 512 tokens.
    gaps = [b - a for a, b in zip([0, *positions], positions, strict=False)]
    assert max(gaps) <= RECOMPUTE


@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h"])
def test_the_early_checkpoints_cost_their_own_state_only(make_engine, kind):
    # The series near the start (64, 128, 256) adds checkpoints to every long prompt: on
    # a hybrid each holds its recurrent state (fixed-size), and views of the one KV
    # buffer of the prefill, which the budget counts once.
    engine = make_engine(kind, cache_config=CONFIG)
    original = prompt(document(engine.planner, 1024))
    run(engine, original, sampling=EXACT)
    stored = {e.tokens: e for e in engine.store.entries()}
    early = [stored[p] for p in (64, 128, 256)]
    own = {e.nbytes - e.shared_bytes for e in early}
    assert len(own) == 1 and own.pop() > 0  # the same fixed-size state each
    assert all(e.shared_bytes > 0 for e in early)
    assert engine.store.stats().bytes < sum(e.nbytes for e in engine.store.entries())
    for position in (64, 128, 256):
        p = engine.planner.plan(original)
        assert any(c.position == position for c in p.checkpoints)
