"""benchmarks/studies/budget.py and bench_cancel.py's tables, without a server: each peer's
budget flag says the budget it was given, a peer run later joins the earlier run's table,
and the tables show each server's per-turn reuse, the main agent's next turn and every
retry try. The runs themselves are measurements (benchmarks/RESULTS.md), not tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.names import OURS, PEER, VLLM
from benchmarks.studies import budget as bench_budget
from benchmarks.studies import cancel as bench_cancel
from benchmarks.studies.budgets import MiB, budget_args


def test_each_server_gets_the_budget_in_its_own_flag() -> None:
    assert budget_args(OURS, 5_000_000) == ("--cache-budget", "5000000")
    assert budget_args(PEER, 5_000_000) == ("--prompt-cache-bytes", "5000000")
    assert budget_args(VLLM, int(7.6 * MiB)) == ("--cache-memory-mb", "8")
    assert budget_args(VLLM, 1000) == ("--cache-memory-mb", "1")  # never 0: no cache


def _row(turn: int, cached: int | None, reachable: int, **tags: object) -> dict[str, object]:
    return {"turn": turn, "cached_tokens": cached, "reachable": reachable,
            "prompt_tokens": reachable + 50, "ttft_s": 1.0, **tags}  # fmt: skip


def _sweep(servers: tuple[str, ...], machine: str) -> dict[str, object]:
    rows = [_row(1, 0, 0), _row(2, 290, 300), _row(3, 0, 400)]
    return {
        "part": "sweep", "model": "dense", "final_tokens": 500, "kv_bytes": 500 * 46080,
        "kv_per_token": 46080, "kv_fixed": 0, "machine": machine, "left_out": {},
        "runs": [{"server": s, "factor": 1.25, "budget": 30 * MiB, "rows": rows,
                  "machine": machine} for s in servers],
    }  # fmt: skip


def test_a_peer_run_later_joins_the_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(bench_budget, "OUT", tmp_path)
    path = tmp_path / "budget-sweep-dense.json"
    first = dict(_sweep((OURS, PEER), "day 1"), left_out={VLLM: "not installed"})
    doc = bench_budget._merged(first, _sweep((VLLM,), "day 2"))
    assert [r["server"] for r in doc["runs"]] == [OURS, PEER, VLLM]
    assert doc["left_out"] == {}
    path.write_text(json.dumps(doc))
    text = bench_budget.render()
    assert "| 1.25x (30.0 MiB) | vllm-mlx | 290 / 300 (0.97) | 0 / 400 (0.00) | - |" in text
    assert "mlx-prefix, mlx_lm.server: day 1; vllm-mlx: day 2" in text


def test_the_subagent_table_shows_the_main_agents_next_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bench_budget, "OUT", tmp_path)
    rows = [_row(1, 0, 0, agent="main"), _row(2, 300, 310, agent="main")]
    rows += [_row(t, 100, 120, agent=f"sub{i}") for i in range(1, 6) for t in (1, 2)]
    rows.append(_row(3, 12, 400, agent="main"))
    doc = {
        "part": "subagents", "model": "hybrid", "main_tokens": 450, "sub_tokens": [200, 210],
        "held_bytes": 10 * MiB, "budget": 12 * MiB, "factor": 1.25, "machine": "m",
        "left_out": {}, "runs": [{"server": OURS, "rows": rows, "held_bytes": 11 * MiB,
                                  "evictions": 7}],
    }  # fmt: skip
    (tmp_path / "budget-subagents-hybrid.json").write_text(json.dumps(doc))
    text = bench_budget.render()
    assert "| mlx-prefix | 12 / 400 (**0.03**) | 12 / 450 | 0.83, 0.83, 0.83, 0.83, 0.83 |" in text
    assert "11.0 MiB / 7 |" in text


def test_the_cancel_table_shows_every_retry_try(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bench_cancel, "OUT", tmp_path)
    retry = {"timeout_s": 4.0, "finished": True, "total_s": 9.5, "prompt_tokens": 520,
             "tries": [{"s": 4.0, "done": False, "cached_tokens": None},
                       {"s": 4.0, "done": False, "cached_tokens": 260},
                       {"s": 1.0, "done": True, "cached_tokens": 518}]}  # fmt: skip
    doc = {
        "model": "dense", "description": "SmolLM2", "tokens": 500, "machine": "m, load 1.0",
        "machine_end": "m, load 2.0", "left_out": {PEER: "why"},
        "servers": {VLLM: {"prompt_tokens": 520, "cold_ttft_s": 10.0,
                           "cancelled_after_s": 5.0, "resend_cached_tokens": 256,
                           "resend_ttft_s": 6.0, "resend_total_s": 6.5, "retry": retry}},
    }  # fmt: skip
    (tmp_path / "cancel-dense.json").write_text(json.dumps(doc))
    text = bench_cancel.render()
    assert (
        "| vllm-mlx | 10.0 | 5.0 | 256 of 520 | 6.0 | 4.0 | 3 | yes | 9.5 | -, 260, 518 |" in text
    )
    assert "- mlx_lm.server left out: why." in text
