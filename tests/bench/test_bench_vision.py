"""The image benchmark's goals and its RESULTS.md section (benchmarks/report/vision.py)
read from a run's document, and how mlx-vlm's server is started: no server runs here."""

from __future__ import annotations

import copy
from pathlib import Path

from benchmarks import peers
from benchmarks.names import MLX_VLM, OURS, VLLM
from benchmarks.report import vision as report_vision
from benchmarks.server_process import ServerSpec


def reply(ttft: float, cached: int | None, prompt: int, text: str = "a b c") -> dict:
    return {"ttft_s": ttft, "prompt_tokens": prompt, "cached_tokens": cached, "text": text}


def server(turn3_cached: int | None, swap_cached: int | None, swap_text: str) -> dict:
    return {
        "swap_fresh": reply(5.0, 0, 1000, "fresh answer"),
        "turn1": reply(5.0, 0, 1000, "first image's answer"),
        "turn2": reply(0.1, None if turn3_cached is None else 990, 1040),
        "turn3": reply(0.3, turn3_cached, 1100),
        "cold_turn2": reply(5.0, None if turn3_cached is None else 0, 1041),
        "swap": reply(0.2, swap_cached, 1000, swap_text),
        "blas": "openblas",
    }


DOC = {
    "timestamp": "20261127T000000Z",
    "machine": {"cpu": "test cpu", "cores": 2},
    "load": [0.5, 0.7],
    "model": "a test model",
    "system_tokens": 900,
    "max_tokens": 16,
    "versions": {"mlx-vlm": "0.7.10"},
    "keys": {
        "lengths": {"turn1": 1000, "turn2": 1040, "turn3": 1100, "swap": 1000},
        "shared": {"turn2": 998, "turn3": 1038, "swap": 930},
        "image_start": 930,
    },
    "servers": {
        OURS: server(1030, 930, "fresh answer"),
        MLX_VLM: server(0, 0, "fresh answer"),
        VLLM: server(None, None, "first image's answer"),  # reuses the wrong state
    },
    "left_out": {},
}


def test_goals_read_reuse_the_swap_and_ttft_from_a_run():
    g = report_vision.goals(DOC)
    assert g[OURS]["turn2_reuse"] == (990 / 998, True)
    assert g[OURS]["turn3_reuse"][1] is True
    assert g[OURS]["swap_reused_past_image"] == (False, True)  # up to the image, no further
    assert g[OURS]["swap_answers_as_fresh"] == (True, True)
    assert g[OURS]["ttft_turn2_over_cold"] == (0.1 / 5.0, True)
    assert g[MLX_VLM]["turn3_reuse"] == (0.0, False)
    # No cached_tokens reported: not measured; a swap answered with the first image's
    # answer reused its state.
    assert g[VLLM]["turn2_reuse"] == (None, None)
    assert g[VLLM]["swap_answers_as_fresh"] == (False, False)


def test_a_swap_past_the_image_start_fails_and_an_answer_that_cannot_tell_is_not_counted():
    doc = copy.deepcopy(DOC)
    doc["servers"][OURS]["swap"]["cached_tokens"] = 931
    doc["servers"][OURS]["turn1"]["text"] = "fresh answer"  # both images answer alike
    g = report_vision.goals(doc)[OURS]
    assert g["swap_reused_past_image"] == (True, False)
    assert g["swap_answers_as_fresh"] == (None, None)


def test_the_section_has_one_column_per_server_and_says_who_was_left_out(tmp_path: Path):
    doc = copy.deepcopy(DOC)
    del doc["servers"][VLLM]
    doc["left_out"][VLLM] = "not installed"
    report_vision.keep(doc, tmp_path)
    text = "\n".join(report_vision.lines(report_vision.newest(tmp_path)))
    assert "| measure | goal | mlx-prefix | mlx-vlm |" in text
    row = "| turn 3: cached / shared with turns 1-2 | >= 0.95 | 0.99 (met) | 0.00 (**not met**) |"
    assert row in text
    assert "vllm-mlx left out of this run: not installed" in text
    assert report_vision.lines(None) == []


def test_mlx_vlm_serves_from_vllm_mlx_venv_with_its_prefix_cache_asked_for(tmp_path: Path):
    spec = ServerSpec(MLX_VLM, Path("/models/tiny"), env=(("APC_ENABLED", "1"),))
    argv = spec.argv(8123)
    at = argv.index("-m", argv.index("mlx_prefix.blas_exec") + 1)
    assert argv[at - 1] == str(peers.VENV / "bin" / "python") and argv[at + 1] == "mlx_vlm.server"
    assert argv[argv.index("--model") + 1] == "/models/tiny" and "8123" in argv
    assert spec.request_model == "/models/tiny" and spec.own_home
    why = peers.mlx_vlm_problem(tmp_path / "absent")
    assert why is not None and "vllm-mlx" in why
