"""Issue 33's benchmark goals and table, from made-up throughput runs: each measure is
judged against the faster peer on that measure, only where the token counts match;
`--deterministic` rows are information. And RESULTS.md generated from several kept runs:
per workload and model, the newest."""

from __future__ import annotations

from pathlib import Path

from benchmarks import goals
from benchmarks.goals.throughput import WORKLOAD
from benchmarks.names import GENERATE, OURS, OURS_DETERMINISTIC, PEER, VLLM
from benchmarks.report import kept as kept_runs
from benchmarks.report import markdown
from benchmarks.report import throughput as report_throughput


def _rates(shared: float, unique: float, burst: float, p99: float, tps: float, **tokens) -> dict:
    extra = {"warm_burst_wall_s": burst, "warm_burst_completion_tokens": tokens.get("burst", 48)}
    for n in (4, 8, 16):
        extra |= {
            f"shared_rps_{n}": shared,
            f"unique_rps_{n}": unique,
            f"shared_completion_tokens_{n}": tokens.get(f"shared_{n}", 16 * n),
            f"unique_completion_tokens_{n}": 16 * n,
        }
    extra["itl"] = {"burst": {"gaps": 90, "p50_ms": p99 / 2, "p99_ms": p99, "max_ms": p99}}
    extra |= {"decode_tps": tps, "decode_tokens": 64}
    return {"extra": extra, "notes": [], "samples": []}


def _run(servers: dict, model: str = "dense", timestamp: str = "20261126T090000Z") -> dict:
    w = {"workload": "throughput", "model": model, "skipped": None, "servers": servers}
    return {"timestamp": timestamp, "workloads": [w]}


def _servers() -> dict:
    return {
        # 16 clients: ours generated fewer tokens than the faster peer there.
        OURS: _rates(3.0, 2.0, 1.5, 100.0, 30.0, shared_16=200),
        PEER: _rates(2.0, 2.2, 2.0, 90.0, 28.0),
        VLLM: _rates(2.5, 1.0, 2.4, 300.0, 25.0),  # faster than mlx_lm at the shared prompt
        OURS_DETERMINISTIC: _rates(1.5, 1.0, 3.0, 150.0, 20.0, shared_16=200),
        GENERATE: {"extra": {"decode_tps": 32.0, "decode_tokens": 64}, "notes": []},
    }


def test_each_measure_is_judged_against_the_faster_peer() -> None:
    rows = [g for g in goals.evaluate(_run(_servers())) if g.workload == WORKLOAD]
    by = {g.what: g for g in rows}
    shared = by[f"requests/s at 4 clients with a shared system prompt, {OURS} / the faster peer"]
    assert shared.value == 3.0 / 2.5 and shared.met is False  # 1.2x < 1.3x vllm-mlx
    assert shared.target == ">= 1.30x" and "vllm-mlx" in shared.shown
    assert f"{PEER} 2.00 req/s" in shared.shown  # the slower peer is shown too
    unique = by[f"requests/s at 8 clients without one, {OURS} / the faster peer"]
    assert unique.value == 2.0 / 2.2 and unique.met is False and unique.target == ">= 1.00x"
    sixteen = by[f"requests/s at 16 clients with a shared system prompt, {OURS} / the faster peer"]
    assert sixteen.met is None and "completion tokens 200 vs 256" in sixteen.shown
    burst = by[f"warm burst wall time, {OURS} / the faster peer"]
    assert burst.value == 1.5 / 2.0 and burst.met is True  # mlx_lm.server was faster here
    itl = by[f"p99 inter-token latency during the warm burst, {OURS} / the faster peer"]
    assert itl.value == 100.0 / 90.0 and itl.met is False
    decode = by[f"single-stream decode tokens/s, {OURS} / {GENERATE}"]
    assert decode.value == 30.0 / 32.0 and decode.met is False and decode.target == ">= 1.00x"
    # What batch invariance costs: information, beside the default mode and the peers.
    cost = by[f"requests/s at 4 clients with a shared system prompt, {OURS_DETERMINISTIC} / {OURS}"]
    assert cost.value == 0.5 and cost.met is None and cost.target == ""
    det = by[f"single-stream decode tokens/s, {OURS_DETERMINISTIC} / {GENERATE}"]
    assert det.value == 20.0 / 32.0 and det.met is None and det.status == "(information)"


def test_without_vllm_mlx_the_goals_compare_with_mlx_lm_and_say_why_a_row_is_missing() -> None:
    servers = _servers()
    del servers[VLLM]
    servers[OURS_DETERMINISTIC] = {"extra": {}, "notes": ["not run: no --deterministic"]}
    by = {g.what: g for g in goals.evaluate(_run(servers)) if g.workload == WORKLOAD}
    shared = by[f"requests/s at 4 clients with a shared system prompt, {OURS} / the faster peer"]
    assert shared.value == 1.5 and shared.met is True and PEER in shared.shown
    cost = by[f"warm burst wall time, {OURS_DETERMINISTIC} / {OURS}"]
    assert cost.value is None and cost.shown == "not run: no --deterministic"
    servers[PEER]["notes"] = ["2 connections dropped before an answer, sent again"]
    md = "\n".join(report_throughput.lines(_run(servers)))
    assert f"- dense, {PEER}: 2 connections dropped before an answer, sent again" in md
    assert f"| dense | {OURS_DETERMINISTIC} | not run: no --deterministic |" in md
    assert f"| dense | {OURS} | 3.00 | 3.00 | 3.00 | 2.00 | 2.00 | 2.00 | 1.50 | 100 | 30.0 |" in md
    assert f"| dense | {GENERATE} | - | - | - | - | - | - | - | - | 32.0 |" in md


def _doc(timestamp: str, workloads: list[tuple[str, str, float]]) -> dict:
    return {
        "timestamp": timestamp,
        "profile": "quick",
        "elapsed_s": 60.0,
        "machine": {"cpu": "cpu", "cores": 2, "ram_gib": 8, "python": "3.11", "blas": None},
        "versions": {"mlx": "0.32.4"},
        "models": {m: {"description": m, "blas": {OURS: "openblas"}} for _, m, _ in workloads},
        "servers": [OURS, PEER],
        "plans": [],
        "workloads": [
            {
                "workload": name,
                "title": name,
                "model": model,
                "skipped": None,
                "elapsed_s": 1.0,
                "servers": {OURS: {"extra": {"cold_wall_s": wall}}},
            }
            for name, model, wall in workloads
        ],  # fmt: skip
    }


def test_results_show_the_newest_run_of_each_workload(tmp_path: Path) -> None:
    old = _doc("20261120T100000Z", [("burst", "dense", 9.0), ("chat", "dense", 1.0)])
    new = _doc("20261126T100000Z", [("burst", "dense", 5.0), ("burst", "hybrid", 2.0)])
    for d in (new, old):
        kept_runs.keep(d, tmp_path)
    doc = kept_runs.merge(kept_runs.kept(tmp_path))
    got = {(w["workload"], w["model"]): w for w in doc["workloads"]}
    assert set(got) == {("burst", "dense"), ("chat", "dense"), ("burst", "hybrid")}
    assert got["burst", "dense"]["servers"][OURS]["extra"]["cold_wall_s"] == 5.0
    assert got["burst", "dense"]["run"] == new["timestamp"]
    assert got["chat", "dense"]["run"] == old["timestamp"]
    assert doc["timestamp"] == new["timestamp"]
    # Model by model, in the workloads' order.
    assert [(w["workload"], w["model"]) for w in doc["workloads"]][:2] == [
        ("chat", "dense"),
        ("burst", "dense"),
    ]
    lines = "\n".join(markdown._runs_lines(doc))
    assert "| 20261120T100000Z | `quick` |" in lines and "| chat (dense) |" in lines
    assert "burst (dense), burst (hybrid)" in lines
    # A run on a busy machine says so before its figures.
    assert not markdown._caveat_lines(doc)
    doc["runs"][-1]["machine"]["load"] = [9.5, 1.0]
    (caveat,) = [line for line in markdown._caveat_lines(doc) if line]
    assert "20261126T100000Z shared its machine** (load average 9.5 / 1 " in caveat
    # A run whose every row a newer one replaced is no longer listed, nor kept.
    newest = _doc("20261127T100000Z", [("chat", "dense", 1.0)])
    kept_runs.keep(newest, tmp_path)
    doc = kept_runs.merge(kept_runs.kept(tmp_path))
    assert [r["timestamp"] for r in doc["runs"]] == [new["timestamp"], newest["timestamp"]]
    kept = sorted(p.stem for p in kept_runs.runs_dir(tmp_path).glob("*.json"))
    assert kept == [new["timestamp"], newest["timestamp"]]
