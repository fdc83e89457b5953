"""The benchmark harness end to end on a tiny model: both servers start, every selected
workload runs against both, and the JSON, RESULTS.md and plots are written. No timing
assertions: this machine's speed is not the point."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.run import main
from benchmarks.servers import SERVERS
from benchmarks.workloads import WORKLOADS
from mlx_prefix.models.testing import cached_test_model

# Every workload, restart (the disk tier) included, must produce results for both servers.
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
        assert set(w["servers"]) == set(SERVERS), name
        for server, res in w["servers"].items():
            assert not [n for n in res["notes"] if n.startswith("error")], (name, server)
            if name == "restore":
                assert [r["tokens"] for r in res["extra"]["series"]] == [256]
                continue
            assert res["samples"], (name, server)
            assert all(s["prompt_tokens"] for s in res["samples"]), (name, server)
            assert res["checks"], (name, server)  # a warm request was compared with a cold one
    # Our server reports cached tokens, and the shared prefix was actually reused.
    ours = by_name["shared_system"]["servers"]["mlx-prefix"]["samples"]
    assert ours[-1]["cached_tokens"] > 0
    assert by_name["memory"]["servers"]["mlx-prefix"]["extra"]["rss_mib"][-1] > 0

    md = (report_dir / "RESULTS.md").read_text()
    for name in SELECTED:
        assert WORKLOADS[name].TITLE in md
    assert "mlx-prefix" in md and "mlx_lm.server" in md
    for png in ("ttft_per_request", "wall_time", "reuse_efficiency", "memory_rss"):
        assert (report_dir / "results" / f"{png}.png").stat().st_size > 0
        assert f"results/{png}.png" in md
