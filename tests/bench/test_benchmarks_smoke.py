"""The benchmark harness end to end on a tiny model: mlx-prefix and mlx_lm.server start
(vllm-mlx, the optional peer, is left out here: tests/bench/test_bench_peers.py covers it),
every selected workload runs against both, and the JSON, RESULTS.md and plots are written. No timing
assertions: this machine's speed is not the point. Plus the goals table and the sizes
table, rendered from a made-up run so that every status shows."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from benchmarks import goals, profiles
from benchmarks.goals.reuse import edit_reuse
from benchmarks.names import GENERATE, OURS_DETERMINISTIC, VLLM
from benchmarks.report import claims, edits, markdown, sections
from benchmarks.run import main
from benchmarks.servers import DETERMINISTIC, OURS, PEER, has_flag
from benchmarks.workloads import WORKLOADS
from benchmarks.workloads.mixed import OURS_KIND
from benchmarks.workloads.restart import ONCE, ONCE_AFTER
from mlx_prefix.browsers import NO_CHROMIUM, find_chromium
from mlx_prefix.models.testing import cached_test_model

# Every workload, restart (the disk tier) and the in-process ones included.
SELECTED = tuple(WORKLOADS)
SERVERS = (OURS, PEER)


def test_harness_runs_every_workload_against_both_servers(tmp_path: Path) -> None:
    model = cached_test_model("dense")
    out, report_dir = tmp_path / "out", tmp_path / "report"
    argv = ["--profile", "smoke", "--model", str(model), "--out", str(out),
            "--report-dir", str(report_dir), "--workloads", ",".join(SELECTED),
            "--peers", PEER]  # fmt: skip
    assert main(argv) == 0

    (json_path,) = out.glob("*.json")
    doc = json.loads(json_path.read_text())
    assert doc["profile"] == "smoke"
    assert doc["servers"] == list(SERVERS)
    assert doc["left_out"] == {f"{VLLM} ({model.name})": "not asked for (--peers)"}
    # The run is kept beside the others RESULTS.md is generated from.
    (kept,) = (report_dir / "results" / "runs").glob("*.json")
    assert json.loads(kept.read_text())["timestamp"] == doc["timestamp"]
    by_name = {w["workload"]: w for w in doc["workloads"]}
    assert set(by_name) == set(SELECTED)
    for name, w in by_name.items():
        assert w["skipped"] is None, name
        assert w["elapsed_s"] > 0, name
        expected = {
            "blas": {OURS},
            "mixed": {OURS, OURS_KIND, PEER},
            "throughput": {*SERVERS, OURS_DETERMINISTIC, GENERATE},
        }.get(name, set(SERVERS))
        assert set(w["servers"]) == expected, name
        for server, res in w["servers"].items():
            assert not [n for n in res["notes"] if n.startswith("error")], (name, server)
            if name in ("restore", "blas") or server == GENERATE:
                continue
            if server == OURS_DETERMINISTIC and not has_flag(DETERMINISTIC):
                assert res["notes"][0].startswith("not run") and not res["samples"]
                continue
            assert res["samples"], (name, server)
            assert all(s["prompt_tokens"] for s in res["samples"]), (name, server)
            assert res["checks"], (name, server)  # a warm request was compared with a cold one
            if server != PEER:  # ours must match; mlx_lm.server's mismatches are findings
                assert all(c["match"] for c in res["checks"]), (name, res["checks"])
    # Our server reports cached tokens, and the shared prefix was actually reused.
    ours = by_name["shared_system"]["servers"][OURS]["samples"]
    assert ours[-1]["cached_tokens"] > 0
    # A billing header that changes every request costs ours nothing: it is left out.
    session = by_name["messages_agent_cch"]["servers"][OURS]["samples"]
    assert all(2 * s["cached_tokens"] > s["prompt_tokens"] for s in session[1:])
    assert by_name["memory"]["servers"][OURS]["extra"]["rss_mib"][-1] > 0
    assert len(by_name["memory"]["servers"][OURS]["samples"]) == 3
    # The restart checks are free: each request's first run before the restart is the
    # cold twin, that of the request seen once (issue 14) included.
    restart = by_name["restart"]["servers"][OURS]
    checks = {c["label"]: c for c in restart["checks"]}
    assert set(checks) == {"after restart", ONCE_AFTER}
    assert "before the restart" in checks["after restart"]["how"]
    assert all(c["match"] is True and c["warm"] == c["cold"] for c in checks.values())
    labels = [s["label"] for s in restart["samples"]]
    assert labels.index(ONCE) < labels.index("after restart") < labels.index(ONCE_AFTER)
    # The cold bursts (in-flight sharing) are checked against cold twins too, and the
    # completion lengths that make their wall times comparable are recorded; every
    # output chunk's arrival is, so the inter-token latency is pooled per burst.
    for server, res in by_name["burst"]["servers"].items():
        labels = {c["label"].split()[0] for c in res["checks"]}
        assert labels == {"cold", "warm", "unique"}, server
        for phase in ("cold", "warm", "unique"):
            assert res["extra"][f"{phase}_completion_tokens"] > 0, (server, phase)
        itl = res["extra"]["itl"]
        assert set(itl) == {"cold", "warm", "unique", "all"}
        gaps = [g for s in res["samples"] for g in s["gaps_s"]]
        assert itl["all"]["gaps"] == len(gaps) > 0 and all(g >= 0 for g in gaps)
        assert itl["all"]["p50_ms"] <= itl["all"]["p99_ms"] <= itl["all"]["max_ms"]
        assert sum(itl[p]["gaps"] for p in ("cold", "warm", "unique")) == len(gaps)
    # Issue 33's throughput: requests/s per client count with and without a shared
    # prompt, the warm burst and its inter-token latency, decode beside mlx_lm.generate.
    thr = by_name["throughput"]["servers"]
    for server in SERVERS:
        e = thr[server]["extra"]
        for variant in ("shared", "unique"):
            for n in (4, 8, 16):
                assert e[f"{variant}_rps_{n}"] > 0 and e[f"{variant}_completion_tokens_{n}"] > 0
        assert e["warm_burst_wall_s"] > 0 and e["itl"]["burst"]["gaps"] > 0
        assert e["decode_tps"] > 0 and e["decode_tokens"] > 1
        groups = [s["group"] for s in thr[server]["samples"]]
        assert groups.count("shared 16") == groups.count("unique 16") == 16
    assert thr[GENERATE]["extra"]["decode_tps"] > 0
    # The shared prompt is reused; a request with its own text is not.
    ours = {s["group"]: s for s in thr[OURS]["samples"]}
    assert ours["shared 16"]["cached_tokens"] > ours["unique 16"]["cached_tokens"]
    for server, res in by_name["concurrency"]["servers"].items():
        assert set(res["extra"]["itl"]) == {"1", "2"}, server
        assert res["extra"]["completion_tokens_2"] > 0
    # The edit sweep: one row per edit point, the common prefix measured, and mlx-prefix
    # (a dense model: it trims) reuses a share of it without over-reporting.
    for server, res in by_name["edits"]["servers"].items():
        rows = res["extra"]["rows"]
        assert [(r["doc_tokens"], r["position"]) for r in rows] == [
            (400, f) for f in (0.1, 0.5, 0.7, 0.95)
        ], server
        assert all(0 < r["common"] < r["prompt"] for r in rows)
    ours_rows = by_name["edits"]["servers"][OURS]["extra"]["rows"]
    assert all(r["cached"] <= r["common"] for r in ours_rows)
    assert ours_rows[-1]["cached"] > ours_rows[0]["cached"] and edit_reuse(ours_rows, 400) > 0
    # Mixed traffic under a budget: both eviction orders and the peer, what each saved.
    for key, res in by_name["mixed"]["servers"].items():
        e = res["extra"]
        kinds = {s["group"] for s in res["samples"]}
        assert kinds == {"document", "chat", "agent", "one-shot"}, key
        assert 0 < e["savable"] < e["prompt"] and e["saved"] == sum(
            s["cached_tokens"] for s in res["samples"]
        )
        assert e["net_saved"] == e["saved"] - res["background_tokens"]
        if key != PEER:
            # The budget bites: entries evicted, or handed to the request extending them.
            assert e["evictions"] is not None and e["handed_over"] is not None, key
            assert e["evictions"] + e["handed_over"] > 0, key
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
    measured = {g["workload"] for g in doc["goals"] if g["value"] is not None}
    goals_of = ["restore", "chat agent", "burst", "restart", "edits restart mixed", "throughput"]
    for one_of in goals_of:
        assert set(one_of.split()) & measured, one_of
    # The sizes actually used are recorded, with the other profiles' for comparison.
    (plan,) = doc["plans"]
    assert plan["sizes"]["document_tokens"] == 150
    assert "150-token document" in plan["described"]["document"]
    assert {"quick", "full"} <= set(doc["other_profiles"])

    md = (report_dir / "RESULTS.md").read_text()
    assert claims.servers_blas(doc) in md and claims.restore_copies([row]) in md
    for name in SELECTED:
        assert WORKLOADS[name].TITLE in md or name in md
    for section in (
        "## Goals",
        "## Sizes",
        "## Cache restore cost",
        "## Prefill with and",
        "## Inter-token latency",
        "## Document edited",
        "## Mixed traffic under a small budget",
        "## Throughput",
        "## Runs",
    ):
        assert section in md
    assert "mlx-prefix" in md and "mlx_lm.server" in md and OURS_KIND in md
    pngs = ("ttft_per_request", "wall_time", "reuse_efficiency", "memory_rss", "restore_cost")
    for png in (*pngs, "document_edits"):
        assert (report_dir / "results" / f"{png}.png").stat().st_size > 0
        assert f"results/{png}.png" in md


def _sample(label: str, ttft: float) -> dict:
    return {"label": label, "ttft_s": ttft}


def _server(efficiency: float | None = None, over: int = 0, **extra: object) -> dict:
    reuse = {"efficiency": efficiency, "over_reported": over}
    return {"reuse": reuse, "extra": extra, "samples": []}


def _itl(p99: float) -> dict:
    return {"gaps": 40, "p50_ms": p99 / 2, "p99_ms": p99, "max_ms": p99 + 1}


def _burst(cold_s: float, warm_s: float, unique_s: float, itl_ms: float) -> dict:
    """A burst run's figures: wall times of its cold, warm and unique rounds (96 tokens
    each) and one inter-token latency."""
    walls = {"cold": cold_s, "warm": warm_s, "unique": unique_s}
    figures = {f"{k}_wall_s": v for k, v in walls.items()}
    figures |= {f"{k}_completion_tokens": 96 for k in walls}
    return _server(**figures, itl={"cold": _itl(itl_ms), "all": _itl(itl_ms)})


def _concurrency(rps: tuple, tokens: tuple, itl_ms: float) -> dict:
    """A concurrency run's figures at 4, 8 and 16 clients."""
    figures = {f"rps_{n}": r for n, r in zip((4, 8, 16), rps, strict=True)}
    figures |= {f"completion_tokens_{n}": t for n, t in zip((4, 8, 16), tokens, strict=True)}
    return _server(**figures, itl={"4": _itl(itl_ms)})


def _edit_rows(cached: dict[tuple[int, float], int | None]) -> list[dict]:
    rows = []
    for (n, f), c in cached.items():
        common = int(n * f) + 20
        reuse = None if c is None else c / common
        rows.append({"doc_tokens": n, "position": f, "prompt": n + 40, "common": common,
                     "cached": c, "reuse": reuse})  # fmt: skip
    return rows


def _mixed(net: int, evictions: int | None) -> dict:
    by_kind = {"document": {"requests": 6, "prompt": 6000, "savable": 4000, "saved": net}}
    return _server(budget_mib=16.0, prompt=9000, savable=5000, saved=net + 10,
                   net_saved=net, evictions=evictions, by_kind=by_kind,
                   reports_cached=True) | {"background_tokens": 10}  # fmt: skip


def _made_up_run() -> dict:
    restart = {OURS: _server(), PEER: _server()}
    restart[OURS]["samples"] = [
        _sample("before restart #1", 10.0),
        _sample(ONCE, 6.0),
        _sample("after restart", 0.5),
        _sample(ONCE_AFTER, 0.9),  # 0.15x: the request seen once was not kept
    ]
    restart[PEER]["samples"] = [_sample("before restart #1", 9.0), _sample("after restart", 9.5)]
    dense_edits = {(1024, f): int(1024 * f) + 20 for f in (0.1, 0.5, 0.7, 0.95)}
    hybrid_edits = {(1024, 0.1): 0, (1024, 0.5): 512, (1024, 0.7): 512, (1024, 0.95): 0}
    hybrid_edits |= {(4096, f): int(4096 * f) for f in (0.1, 0.5, 0.7, 0.95)}
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
                    OURS: _burst(cold_s=9.0, warm_s=2.0, unique_s=3.0, itl_ms=300.0),
                    PEER: _burst(cold_s=20.0, warm_s=2.8, unique_s=10.0, itl_ms=250.0),
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
            run(
                "concurrency",
                "dense",
                {
                    OURS: _concurrency(rps=(3.0, 4.0, 4.0), tokens=(32, 64, 100), itl_ms=90.0),
                    PEER: _concurrency(rps=(2.0, 4.0, 2.0), tokens=(32, 64, 128), itl_ms=80.0),
                },
            ),
            run(
                "edits",
                "dense",
                {
                    OURS: _server(rows=_edit_rows(dense_edits)),
                    PEER: _server(rows=_edit_rows(dense_edits)),
                },  # fmt: skip
            ),
            run(
                "edits",
                "hybrid",
                {
                    OURS: _server(rows=_edit_rows(hybrid_edits)),
                    PEER: _server(rows=_edit_rows(dict.fromkeys(hybrid_edits, 0))),
                },  # fmt: skip
            ),
            run(
                "mixed",
                "dense",
                {OURS: _mixed(3000, 12), OURS_KIND: _mixed(2500, 15), PEER: _mixed(2000, None)},
            ),
            run(
                "mixed",
                "hybrid",  # the kind order saved nothing: value saving anything is more
                {OURS: _mixed(800, 40), OURS_KIND: _mixed(0, 44), PEER: _mixed(0, None)},
            ),
            run("restart", "dense", restart),
            run("restart", "hybrid", {}, skipped="no disk tier"),
            run("restore", "synthetic KV", {OURS: _server(rows=restore_rows)}),
        ]
    }


def test_goals_are_computed_against_their_targets() -> None:
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


def test_edit_restart_mixed_burst_and_rps_goals_are_judged() -> None:
    rows = [
        g
        for g in goals.evaluate(_made_up_run())
        if g.workload in ("edits", "restart", "mixed", "burst", "concurrency")
    ]
    by = {(g.what, g.model): g for g in rows}
    # Edits: dense trims to the whole common prefix; the hybrid 1K document reuses the
    # 512-token checkpoint at two edits of four (under 0.6), the 4K one all but the
    # template's 20 tokens (over 0.9).
    edit = "tokens reused after an edit / common prefix, "
    assert by[edit + "1K-token document", "dense"].met is True
    assert by[edit + "1K-token document", "dense"].value == 1.0
    hybrid_1k = by[edit + "1K-token document", "hybrid"]
    common_1k = sum(int(1024 * f) + 20 for f in (0.1, 0.5, 0.7, 0.95))
    assert hybrid_1k.value == 1024 / common_1k and hybrid_1k.met is False
    assert hybrid_1k.target == ">= 0.60" and "mlx_lm.server 0.00" in hybrid_1k.shown
    hybrid_4k = by[edit + "4K-token document", "hybrid"]
    assert hybrid_4k.target == ">= 0.90" and hybrid_4k.met is True and hybrid_4k.value < 1
    # Restart after one request: 0.9 s / 6.0 s is 0.15x, over the 0.1x goal.
    once = by["one request, restart, same request: TTFT / cold TTFT", "dense"]
    assert once.value == 0.9 / 6.0 and once.met is False
    # Value eviction saves more than kind: judged on net saved tokens; more than a kind
    # order that saved nothing counts (the ratio is undefined there).
    mixed = "prefill saved under a small budget, value / kind eviction"
    assert by[mixed, "dense"].value == 3000 / 2500 and by[mixed, "dense"].met is True
    assert by[mixed, "hybrid"].value is None and by[mixed, "hybrid"].met is True
    # Bursts: warm 2.0 / 2.8 s met (<= 0.8x), unique 3 / 10 s met; p99 inter-token
    # latency 300 ms against 250 ms is worse than mlx_lm.server: not met.
    warm = by["warm burst wall time, mlx-prefix / mlx_lm.server", "dense"]
    assert warm.value == 2.0 / 2.8 and warm.met is True
    unique = by["cold burst, ~150 unique tokens each, wall / mlx_lm", "dense"]
    assert unique.value == 0.3 and unique.met is True
    itl = by["p99 inter-token latency during the bursts, mlx-prefix / mlx_lm.server", "dense"]
    assert itl.value == 300.0 / 250.0 and itl.met is False
    # Requests/s: 1.5x at 4 clients met, 1.0x at 8 not met, 16 not comparable (the
    # servers generated different numbers of tokens).
    rps = "requests/s at {} clients, mlx-prefix / mlx_lm.server"
    assert by[rps.format(4), "dense"].met is True and by[rps.format(4), "dense"].value == 1.5
    assert by[rps.format(8), "dense"].met is False
    sixteen = by[rps.format(16), "dense"]
    assert sixteen.met is None and "completion tokens 100 vs 128" in sixteen.shown


def test_edit_mixed_and_latency_sections_render() -> None:
    doc = _made_up_run()
    md = "\n".join(edits.itl_lines(doc) + edits.edit_lines(doc) + edits.mixed_lines(doc))
    assert "| dense | all bursts | mlx-prefix | 40 | 150 | 300 | 301 |" in md
    assert "| dense | 4 clients | mlx_lm.server | 40 | 40 | 80 | 81 |" in md
    # Per edit: the cached tokens and their share of the common prefix, both servers;
    # per length the pooled share the goal judges.
    assert "| hybrid | 1024 | 50% | 1064 | 532 | 512 (0.96) | 0 (0.00) |" in md
    assert "| hybrid | 1024 | **all edits** | | | **0.43** | **0.00** |" in md  # 1024 / 2382
    assert "| hybrid | 4096 | **all edits** | | | **0.99** | **0.00** |" in md
    assert f"| dense | {OURS_KIND} | 16 | 0 | 9000 | 5000 | 2510 | 10 | 2500 | 15 |" in md
    assert "| hybrid | mlx_lm.server | 16 | 0 | 9000 | 5000 | 10 | 10 | 0 | - |" in md


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
    lines = markdown._goal_lines(doc) + markdown._size_lines(doc)
    md = "\n".join(lines)
    assert "| burst | cold burst wall time, mlx-prefix / mlx_lm.server | dense | 0.45x" in md
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
    if find_chromium() is None:
        pytest.skip(NO_CHROMIUM)
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
    text = "\n".join(sections.restore_lines(doc) + sections.blas_lines(doc))
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
    text = "\n".join(sections.restore_lines(doc) + sections.blas_lines(doc))
    assert "neither side copied the prefix" in text and "which both servers ran with" in text
    doc["models"]["dense"]["blas"][VLLM] = "openblas"
    assert claims.servers_blas(doc) == "all 3 with openblas"
