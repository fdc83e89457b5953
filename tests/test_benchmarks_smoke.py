"""The benchmark harness end to end on a tiny model: both servers start, every selected
workload runs against both, and the JSON, RESULTS.md and plots are written. No timing
assertions: this machine's speed is not the point. Plus the goals table and the sizes
table, rendered from a made-up run so that every status shows."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from benchmarks import claims, goals, profiles, report
from benchmarks.run import main
from benchmarks.servers import OURS, PEER, SERVERS
from benchmarks.workloads import WORKLOADS
from mlx_prefix.models.testing import cached_test_model

# Every workload, restart (the disk tier) and the in-process ones included.
SELECTED = tuple(WORKLOADS)


def test_harness_runs_every_workload_against_both_servers(tmp_path: Path) -> None:
    model = cached_test_model("dense")
    out, report_dir = tmp_path / "out", tmp_path / "report"
    argv = ["--profile", "smoke", "--model", str(model), "--out", str(out),
            "--report-dir", str(report_dir), "--workloads", ",".join(SELECTED)]  # fmt: skip
    assert main(argv) == 0

    (json_path,) = out.glob("*.json")
    doc = json.loads(json_path.read_text())
    assert doc["profile"] == "smoke"
    by_name = {w["workload"]: w for w in doc["workloads"]}
    assert set(by_name) == set(SELECTED)
    for name, w in by_name.items():
        assert w["skipped"] is None, name
        assert w["elapsed_s"] > 0, name
        expected = {OURS} if name == "blas" else set(SERVERS)
        assert set(w["servers"]) == expected, name
        for server, res in w["servers"].items():
            assert not [n for n in res["notes"] if n.startswith("error")], (name, server)
            if name in ("restore", "blas"):
                continue
            assert res["samples"], (name, server)
            assert all(s["prompt_tokens"] for s in res["samples"]), (name, server)
            assert res["checks"], (name, server)  # a warm request was compared with a cold one
            if server == OURS:  # ours must match; mlx_lm.server's mismatches are findings
                assert all(c["match"] for c in res["checks"]), (name, res["checks"])
    # Our server reports cached tokens, and the shared prefix was actually reused.
    ours = by_name["shared_system"]["servers"][OURS]["samples"]
    assert ours[-1]["cached_tokens"] > 0
    assert by_name["memory"]["servers"][OURS]["extra"]["rss_mib"][-1] > 0
    assert len(by_name["memory"]["servers"][OURS]["samples"]) == 3
    # The restart check is free: the first request before the restart is the cold twin.
    (check,) = by_name["restart"]["servers"][OURS]["checks"]
    assert check["label"] == "after restart" and "before the restart" in check["how"]
    assert check["match"] is True and check["warm"] == check["cold"]
    # The cold burst (in-flight sharing) is checked against cold twins too, and the
    # completion lengths that make its wall times comparable are recorded.
    for server, res in by_name["burst"]["servers"].items():
        assert {c["label"].split()[0] for c in res["checks"]} == {"cold", "warm"}, server
        assert res["extra"]["cold_completion_tokens"] > 0
    # Reuse efficiency is the raw ratio, never clamped, and over-reporting is counted.
    for w in doc["workloads"]:
        for res in w["servers"].values():
            reuse = res["reuse"]
            if reuse.get("efficiency") is not None:
                assert reuse["efficiency"] == reuse["novel"] / reuse["prefilled"]
                assert reuse["over_reported"] == max(0, reuse["novel"] - reuse["prefilled"])
    # Claims in RESULTS.md come from the run: the BLAS each server process loaded.
    for info in doc["models"].values():
        assert set(info["blas"]) == set(SERVERS) and all(info["blas"].values())
    (row,) = by_name["restore"]["servers"][OURS]["extra"]["rows"]
    assert row["tokens"] == 256 and row["restore_ms"] > 0
    blas_rows = by_name["blas"]["servers"][OURS]["extra"]["rows"]
    assert blas_rows and all(r["tokens"] == 16 and r["tokens_per_s"] > 0 for r in blas_rows)
    # Goals were computed from this run (whatever they say on this machine).
    measured = {(g["issue"], g["what"]) for g in doc["goals"] if g["value"] is not None}
    assert {3, 4, 5, 7} <= {issue for issue, _ in measured}
    # The sizes actually used are recorded, with the other profiles' for comparison.
    (plan,) = doc["plans"]
    assert plan["sizes"]["document_tokens"] == 150
    assert "150-token document" in plan["described"]["document"]
    assert {"quick", "full"} <= set(doc["other_profiles"])

    md = (report_dir / "RESULTS.md").read_text()
    assert claims.servers_blas(doc) in md and claims.restore_copies([row]) in md
    for name in SELECTED:
        assert WORKLOADS[name].TITLE in md or name in md
    for section in ("## Goals", "## Sizes", "## Cache restore cost", "## Prefill with and"):
        assert section in md
    assert "mlx-prefix" in md and "mlx_lm.server" in md
    for png in ("ttft_per_request", "wall_time", "reuse_efficiency", "memory_rss", "restore_cost"):
        assert (report_dir / "results" / f"{png}.png").stat().st_size > 0
        assert f"results/{png}.png" in md


def _sample(label: str, ttft: float) -> dict:
    return {"label": label, "ttft_s": ttft}


def _server(efficiency: float | None = None, over: int = 0, **extra: object) -> dict:
    reuse = {"efficiency": efficiency, "over_reported": over}
    return {"reuse": reuse, "extra": extra, "samples": []}


def _made_up_run() -> dict:
    restart = {OURS: _server(), PEER: _server()}
    restart[OURS]["samples"] = [_sample("before restart #1", 10.0), _sample("after restart", 0.5)]
    restart[PEER]["samples"] = [_sample("before restart #1", 9.0), _sample("after restart", 9.5)]
    restore_rows = [
        {"tokens": n, "prefix_mib": n / 1024 * 45, "restore_ms": ms, "lookup_restore_ms": lk,
         "mlx_lm_fetch_ms": 3.0, "restore_extra_mib": 0.0, "mlx_lm_extra_mib": 0.0,
         "first_write_ms": 20.0, "mlx_lm_first_write_ms": 20.0,
         "first_write_extra_mib": n / 1024 * 45, "mlx_lm_first_write_extra_mib": n / 1024 * 45}
        for n, ms, lk in ((1024, 0.15, 0.2), (32768, 0.2, 1.4))
    ]  # fmt: skip

    def run(name: str, model: str, servers: dict, skipped: str | None = None) -> dict:
        return {"workload": name, "model": model, "skipped": skipped, "servers": servers}

    return {
        "workloads": [
            run("chat", "dense", {OURS: _server(0.996), PEER: _server(1.0)}),
            run("chat", "tiny", {OURS: _server(1.02, over=20), PEER: _server(1.0)}),
            run("chat", "hybrid", {OURS: _server(0.96), PEER: _server(0.97)}),
            run("agent", "dense", {OURS: _server(0.97), PEER: _server(1.0)}),
            run(
                "burst",
                "dense",
                {
                    OURS: _server(cold_wall_s=9.0, cold_completion_tokens=96),
                    PEER: _server(cold_wall_s=20.0, cold_completion_tokens=96),
                },
            ),
            run(
                "burst",
                "hybrid",
                {  # the peer stopped early: its wall time says little
                    OURS: _server(cold_wall_s=9.0, cold_completion_tokens=96),
                    PEER: _server(cold_wall_s=30.0, cold_completion_tokens=40),
                },
            ),
            run("restart", "dense", restart),
            run("restart", "hybrid", {}, skipped="no disk tier"),
            run("restore", "synthetic KV", {OURS: _server(rows=restore_rows)}),
        ]
    }


def test_goals_are_computed_against_the_issues_targets() -> None:
    by = {(g.what, g.model): g for g in goals.evaluate(_made_up_run())}
    dense = by["reuse efficiency, multi-turn chat", "dense"]
    assert dense.met is False and dense.shown.startswith("0.996")  # not rounded to 1.00
    assert by["reuse efficiency, multi-turn chat", "hybrid"].met is False
    over = by["reuse efficiency, multi-turn chat", "tiny"]  # above 1.0: a counting error
    assert over.met is False and "over-reported" in over.shown and over.value == 1.02
    assert by["reuse efficiency, agent loop (tools + thinking)", "dense"].met is True
    burst = by["cold burst wall time, mlx-prefix / mlx_lm.server", "dense"]
    assert burst.value == 9.0 / 20.0 and burst.met is False
    unequal = by["cold burst wall time, mlx-prefix / mlx_lm.server", "hybrid"]
    assert unequal.met is None and unequal.status == "not judged"
    assert "completion tokens 96 vs 40" in unequal.shown
    cold = by["TTFT after restart / cold TTFT (mlx-prefix)", "dense"]
    assert cold.value == 0.05 and cold.met is True
    vs_peer = by["TTFT after restart, mlx-prefix / mlx_lm.server", "dense"]
    assert vs_peer.met is None and vs_peer.status == "(information)"
    skipped = by["TTFT after restart / cold TTFT (mlx-prefix)", "hybrid"]
    assert skipped.status == "not measured" and "no disk tier" in skipped.shown
    assert by["restore time (restore alone)", "synthetic KV"].met is True
    assert by["restore time (trie lookup + restore)", "synthetic KV"].met is False
    assert by["memory added by a restore", "synthetic KV"].met is True
    # Flat is judged on lookup + restore (0.2 -> 1.4 ms: 7x), not on restore alone.
    flat = by["lookup + restore time, flat in prefix length", "synthetic KV"]
    assert flat.met is False and flat.value == 1.4 / 0.2


def test_goals_and_sizes_tables_render() -> None:
    doc = _made_up_run()
    doc.update(
        profile="quick",
        versions={"mlx": "0.32.4"},
        plans=[
            {
                "model": p.model,
                "sizes": {"max_tokens": p.sizes.max_tokens, "check_last": 1},
                "described": {w: WORKLOADS[w].describe(p.sizes) for w in p.workloads},
            }
            for p in profiles.PROFILES["quick"].plans
        ],  # fmt: skip
        other_profiles={},
        asked={w: m.ASKED for w, m in WORKLOADS.items()},
    )
    lines = report._goal_lines(doc) + report._size_lines(doc)
    md = "\n".join(lines)
    assert "| #5 | cold burst wall time, mlx-prefix / mlx_lm.server | dense | 0.45x" in md
    assert "**not met**" in md and "| met |" in md and "not measured" in md
    # Every workload runs on both models in the quick profile, at the sizes stated.
    quick = {p.model: p for p in profiles.PROFILES["quick"].plans}
    assert set(profiles.MODEL_WORKLOADS) <= set(quick["hybrid"].workloads)
    assert set(profiles.ALL_WORKLOADS) == set(quick["dense"].workloads)
    row = next(line for line in lines if line.startswith("| document |"))
    assert f"{quick['hybrid'].sizes.document_tokens}-token document" in row
    assert "4K+ tokens" in row


def test_dashboard_png_after_the_chat_workload(tmp_path: Path) -> None:
    pytest.importorskip("playwright")
    if not Path("/usr/bin/chromium").exists():
        pytest.skip("no /usr/bin/chromium")
    model = cached_test_model("dense")
    report_dir = tmp_path / "report"
    argv = ["--profile", "smoke", "--model", str(model), "--out", str(tmp_path / "out"),
            "--report-dir", str(report_dir), "--workloads", "chat", "--dashboard-png"]  # fmt: skip
    assert main(argv) == 0
    png = (report_dir / "results" / "dashboard.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])  # the IHDR chunk
    assert width == 1400 and height > 900  # the whole page, not just the viewport


def test_results_state_what_was_measured_not_fixed_claims() -> None:
    # mlx_lm's fetch copied the prefix here and its server ran on the reference BLAS:
    # RESULTS.md must say so, not "neither side copies" / "both with the fast BLAS".
    doc = _made_up_run()
    rows = doc["workloads"][-1]["servers"][OURS]["extra"]["rows"]
    for r in rows:
        r["mlx_lm_extra_mib"] = r["prefix_mib"]
    doc["workloads"].append(
        {"workload": "blas", "model": "dense", "skipped": None, "servers": {OURS: {
            "extra": {"rows": [
                {"blas": "reference", "tokens": 16, "seconds": 8.0, "tokens_per_s": 2.0},
                {"blas": "openblas", "tokens": 16, "seconds": 0.1, "tokens_per_s": 160.0},
            ]}, "notes": []}}}
    )  # fmt: skip
    doc.update(versions={"mlx": "0.32.4"}, models={"dense": {"blas": {OURS: "openblas",
               PEER: "reference"}}})  # fmt: skip
    text = "\n".join(report._restore_lines(doc) + report._blas_lines(doc))
    assert "neither side" not in text and "both servers ran with" not in text
    assert "mlx_lm.server added 1440.0 MiB for a 1440.0 MiB prefix at 32768 tokens" in text
    assert "mlx-prefix copied nothing" in text and "copies the arrays" in text
    assert "the slow reference BLAS (mlx_lm.server)" in text
    assert claims.servers_blas(doc) == (
        "mlx-prefix with openblas, mlx_lm.server with the slow reference BLAS"
    )
    doc["models"]["dense"]["blas"][PEER] = "openblas"
    assert claims.servers_blas(doc) == "both with openblas"
    for r in rows:
        r["mlx_lm_extra_mib"] = 0.0
    text = "\n".join(report._restore_lines(doc) + report._blas_lines(doc))
    assert "neither side copied the prefix" in text and "which both servers ran with" in text
