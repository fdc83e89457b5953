"""The runs RESULTS.md is generated from: every run's JSON document is kept in
`benchmarks/results/runs/`, and RESULTS.md shows, per workload and model, the newest run
that measured it. A rerun of a few workloads replaces those rows and leaves the others
as the run that measured them; the runs table says which run gave which rows, and a run
with no row left is dropped. History
(what earlier code measured) is benchmarks/HISTORY.md, written by hand."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..profiles import ALL_WORKLOADS

RUNS = "results/runs"  # under the report dir


def runs_dir(report_dir: Path) -> Path:
    return report_dir / RUNS


def keep(doc: dict[str, Any], report_dir: Path) -> Path:
    """Store a run's document beside the ones RESULTS.md is generated from, and drop the
    kept runs none of whose rows is shown any more (newer runs measured all of them:
    what mattered in them belongs in HISTORY.md)."""
    folder = runs_dir(report_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{doc['timestamp']}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    shown = {r["timestamp"] for r in merge(kept(report_dir))["runs"]}
    for old in folder.glob("*.json"):
        if old.stem not in shown:
            old.unlink()
    return path


def load(paths: list[Path]) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in paths]


def kept(report_dir: Path) -> list[dict[str, Any]]:
    return load(sorted(runs_dir(report_dir).glob("*.json")))


def merge(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """One document: the newest run's header, and per (workload, model) the newest run's
    result, marked with its run's timestamp. Goals are left to the caller."""
    assert docs, "no run to merge"
    docs = sorted(docs, key=lambda d: d["timestamp"])
    latest = docs[-1]
    results: dict[tuple[str, str], dict[str, Any]] = {}
    models: dict[str, Any] = {}
    plans: dict[str, Any] = {}
    for d in docs:
        models.update(d.get("models", {}))
        plans.update({p["model"]: dict(p, profile=d["profile"]) for p in d.get("plans", [])})
        for w in d["workloads"]:
            results[w["workload"], w["model"]] = dict(w, run=d["timestamp"])
    used = {w["run"] for w in results.values()}
    model_order = list(models)

    def order(key: tuple[str, str]) -> tuple[int, int]:
        name, model = key
        m = model_order.index(model) if model in model_order else len(model_order)
        return m, ALL_WORKLOADS.index(name) if name in ALL_WORKLOADS else len(ALL_WORKLOADS)

    servers: list[str] = []
    for d in docs:
        servers += [s for s in d.get("servers", []) if s not in servers]
    out = dict(latest)
    out.pop("goals", None)
    out.update(
        workloads=[results[k] for k in sorted(results, key=order)],
        models=models,
        plans=list(plans.values()),
        servers=servers,
        runs=[
            {
                "timestamp": d["timestamp"],
                "profile": d["profile"],
                "elapsed_s": d["elapsed_s"],
                "machine": d["machine"],
                "versions": d["versions"],
                "left_out": d.get("left_out", {}),
                "supplied": sorted(
                    {
                        f"{w['workload']} ({w['model']})"
                        for w in results.values()
                        if w["run"] == d["timestamp"]
                    }
                ),  # fmt: skip
            }
            for d in docs
            if d["timestamp"] in used
        ],
    )
    return out
