from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from support.engine_helpers import chat
from support.models import TEST_CACHE, loaded_test_model

from mlx_prefix.cache.disk.policy import DiskPolicy
from mlx_prefix.cache.disk.tier import DiskCache
from mlx_prefix.cache.snapshot import capture, restore
from mlx_prefix.cache.store import CheckpointKind
from mlx_prefix.config import DEFAULT_AUTO_WINDOW, MAX_AUTO_WINDOW, DiskScope, ScopeMode
from mlx_prefix.engine.forward.runner import always_trimmable, greedy_continue, prefill
from mlx_prefix.prompt.request.plan import PromptPlanner

# -- parsing ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, mode, n",
    [
        ("off", ScopeMode.OFF, 0),
        ("full", ScopeMode.FULL, 0),
        ("auto", ScopeMode.AUTO, DEFAULT_AUTO_WINDOW),
        (" AUTO:4 ", ScopeMode.AUTO, 4),
        (f"auto:{MAX_AUTO_WINDOW}", ScopeMode.AUTO, MAX_AUTO_WINDOW),
        ("1000", ScopeMode.FIXED, 1000),
        ("1", ScopeMode.FIXED, 1),
    ],
)
def test_parse(text: str, mode: ScopeMode, n: int):
    scope = DiskScope.parse(text)
    assert (scope.mode, scope.n) == (mode, n)
    assert DiskScope.parse(str(scope)) == scope


@pytest.mark.parametrize(
    "text",
    [
        "",
        "on",
        "auto:",
        "auto:0",
        "auto:-3",
        f"auto:{MAX_AUTO_WINDOW + 1}",
        "auto:x",
        "0",
        "-5",
        "12.5",
        "full:3",
        "1e3",
        "auto:4:5",
    ],
)
def test_parse_rejects_with_a_clear_message(text: str):
    with pytest.raises(ValueError, match="off, full, auto, auto:N"):
        DiskScope.parse(text)


def test_default_scope_is_auto_16():
    assert str(DiskPolicy().default) == "auto:16"


# -- selection on fake prompts ------------------------------------------------------------


@dataclass(frozen=True)
class _Cp:
    position: int
    kind: CheckpointKind = CheckpointKind.PERIODIC
    marked: bool = False


@dataclass(frozen=True)
class _Prompt:
    tokens: tuple[int, ...]
    checkpoints: tuple[_Cp, ...]


def _prompt(tokens, checkpoints) -> _Prompt:
    return _Prompt(tuple(tokens), tuple(_Cp(p) for p in checkpoints))


def align8(n: int) -> int:
    return n - n % 8


SYSTEM = list(range(100, 140))  # 40 tokens shared by every request below


def _req(tail_first: int, tail: int = 30) -> _Prompt:
    tokens = SYSTEM + [tail_first] + list(range(500, 500 + tail - 1))
    return _prompt(tokens, [16, 40, 64])  # 40: the end of the system prompt


def test_off_selects_nothing():
    assert DiskPolicy("off").select("m", _req(1), align8) == []


def test_full_selects_every_checkpoint_and_the_end_of_prefill():
    policy = DiskPolicy("full")
    p = _req(1, tail=32)  # 72 tokens: the end is a grid point
    assert policy.select("m", p, align8) == [16, 40, 64, 72]
    odd = _req(1, tail=30)  # 70 tokens: not a grid point, useless unless trimmable
    assert policy.select("m", odd, align8) == [16, 40, 64]
    assert policy.select("m", odd, align8, trimmable=True) == [70]


def test_fixed_selects_the_largest_grid_point_at_or_below_n():
    policy = DiskPolicy("50")
    assert policy.select("m", _req(1), align8) == [48]
    assert policy.select("m", _req(1, tail=32), align8, "1000") == [72]  # the whole prompt
    assert policy.select("m", _req(1), align8, "5") == []


def test_auto_caches_the_prefix_shared_with_recent_requests():
    policy = DiskPolicy("auto:3")
    assert policy.select("m", _req(1), align8) == [], "nothing shared yet"
    # Shares the system prompt and one more token (41): down to the checkpoint at 40.
    assert policy.select("m", _prompt(SYSTEM + [1, 2, 3], [16, 40, 43]), align8) == [40]
    assert policy.select("m", _req(2), align8) == [40]
    # An identical request shares everything: its largest checkpoint.
    assert policy.select("m", _req(2), align8) == [64]


def test_auto_persists_protected_checkpoints_the_first_time_it_sees_them():
    policy = DiskPolicy("auto")
    protected = [k for k in CheckpointKind if k > CheckpointKind.LAST_MESSAGE]
    checkpoints = [
        _Cp(16, CheckpointKind.PERIODIC),
        _Cp(40, CheckpointKind.SYSTEM),
        _Cp(48, CheckpointKind.LAST_MESSAGE),
        *(_Cp(56 + 8 * i, k) for i, k in enumerate(protected)),
    ]
    prompt = _Prompt(tuple(range(100, 200)), tuple(checkpoints))
    chosen = policy.select("m", prompt, align8)
    assert chosen == [40] + [56 + 8 * i for i in range(len(protected))]
    # A trimmable cache keeps the longest only: one file serves the shorter ones.
    assert DiskPolicy("auto").select("m", prompt, align8, trimmable=True) == chosen[-1:]


def test_auto_persists_client_breakpoints_at_first_sight():
    # The client marked 40 (cache_control): saved before any other request shares it,
    # and alongside the shared prefix afterwards.
    policy = DiskPolicy("auto")
    marked = (_Cp(16), _Cp(40, CheckpointKind.BREAKPOINT), _Cp(64))
    on_system = (_Cp(16), _Cp(40, CheckpointKind.SYSTEM, marked=True), _Cp(64))
    assert DiskPolicy("auto").select("m", _Prompt(tuple(range(70)), on_system), align8) == [40]
    first = _Prompt(tuple(SYSTEM + list(range(500, 530))), marked)
    assert policy.select("m", first, align8) == [40]
    again = _Prompt(first.tokens, marked)
    assert policy.select("m", again, align8) == [40, 64]
    assert policy.select("m", again, align8, trimmable=True) == [64]
    assert policy.select("m", again, align8, "off") == []


def test_auto_window_counts_requests():
    policy = DiskPolicy()
    policy.select("m", _req(1), align8)
    for i in range(3):
        policy.select("m", _prompt([9000 + i] * 50, [16, 32]), align8)  # unrelated
    assert policy.select("m", _req(1), align8, "auto:3") == [], "out of the window"
    assert policy.select("m", _req(1), align8, "auto:5") == [64]


def test_auto_history_is_per_model_key():
    policy = DiskPolicy()
    policy.select("a", _req(1), align8)
    assert policy.select("b", _req(1), align8) == []
    assert policy.select("a", _req(1), align8) == [64]
    policy.forget("a")
    assert policy.select("a", _req(2), align8) == []


def test_request_scope_overrides_the_default_and_min_tokens_applies():
    policy = DiskPolicy("off", min_tokens=20)
    assert policy.select("m", _req(1), align8, "full") == [40, 64]
    assert policy.select("m", _req(1), align8, DiskScope.parse("off")) == []
    with pytest.raises(ValueError):
        policy.select("m", _req(1), align8, "sometimes")


def test_trimmable_keeps_only_the_largest_position():
    assert DiskPolicy("full").select("m", _req(1, 32), align8, trimmable=True) == [72]


# -- with the engine's real prompt planner, prefill and a real cache ---------------------


@pytest.mark.parametrize("kind", ["qwen3_5", "dense"])
def test_the_end_of_prefill_checkpoint_is_really_saved(tmp_path: Path, kind: str):
    """Seed 004: a scoped save exactly at the end of prefill silently did nothing."""
    model = loaded_test_model(kind)
    key = model.identity.key()
    planner = PromptPlanner(model.tokenizer, TEST_CACHE)
    system = ("system", "You are a careful assistant who answers briefly. " * 6)
    first = planner.plan(chat(system, ("user", "Name three rivers in Europe.")))
    tokens = first.tokens
    n = len(tokens)

    def align(t):
        return lambda k: planner.grid.align(t, k)

    cache = make_prompt_cache(model.model)
    trimmable = always_trimmable(cache)
    positions = DiskPolicy("full").select(key, first, align(tokens), trimmable=trimmable)
    assert n in positions and planner.grid.is_point(tokens, n)
    snaps = {}

    def on_boundary(p: int) -> None:
        if p in positions:
            snaps[p] = capture(cache, p)

    prefill(model.model, cache, tokens, 0, planner.grid, on_boundary)
    assert n in snaps, "no snapshot at the end of prefill"
    disk = DiskCache(tmp_path)
    for p in positions:
        assert disk.save(key, tokens[:p], snaps[p], CheckpointKind.HISTORY)
    assert n in [e.tokens for e in DiskCache(tmp_path).entries(key)]

    # The next turn starts with the whole first prompt: it restores at exactly n.
    second = planner.plan(
        chat(
            system,
            ("user", "Name three rivers in Europe."),
            ("assistant", "Rhine, Danube, Seine."),
            ("user", "And in Asia?"),
        )
    )
    assert second.tokens[:n] == tokens
    fresh = DiskCache(tmp_path)
    match = fresh.match(key, second.tokens, align(second.tokens))
    assert match is not None and match.reuse_tokens == n
    loaded = fresh.load(match)
    assert loaded is not None
    warm_cache = restore(loaded, match.trim)
    warm = prefill(model.model, warm_cache, second.tokens, n, planner.grid, lambda p: None)
    cold_cache = make_prompt_cache(model.model)
    cold = prefill(model.model, cold_cache, second.tokens, 0, planner.grid, lambda p: None)
    assert np.array_equal(np.array(warm), np.array(cold))
    assert greedy_continue(model.model, warm_cache, warm, 6) == greedy_continue(
        model.model, cold_cache, cold, 6
    )


def test_auto_selects_a_chat_boundary_shared_by_two_requests():
    model = loaded_test_model("qwen3_5")
    planner = PromptPlanner(model.tokenizer, TEST_CACHE)
    system = ("system", "You summarize web pages for a browser extension. " * 5)
    a = planner.plan(chat(system, ("user", "Summarize: the cat sat on the mat.")))
    b = planner.plan(chat(system, ("user", "Summarize: dogs bark at night.")))
    policy = DiskPolicy("auto")

    def align(t):
        return lambda k: planner.grid.align(t, k)

    system_end = next(c.position for c in a.checkpoints if c.kind is CheckpointKind.SYSTEM)
    assert policy.select("m", a, align(a.tokens)) == [system_end], "first sight: the system"
    positions = policy.select("m", b, align(b.tokens))
    assert system_end in positions
    p = max(positions)
    shared = next(i for i, (x, y) in enumerate(zip(a.tokens, b.tokens, strict=False)) if x != y)
    kinds = {cp.position: cp.kind for cp in b.checkpoints}
    assert p <= shared and p in kinds
    assert kinds[p] in (CheckpointKind.SYSTEM, CheckpointKind.LAST_MESSAGE)
    assert not [q for q in kinds if p < q <= shared], "not the largest checkpoint below"
    assert a.tokens[:p] == b.tokens[:p]
