"""RESULTS.md and its PNG plots from a run's JSON document (or several runs' merged:
kept.py). The goals (benchmarks/goals/) come first, keyed by workload, then each
workload's figures beside its peers', then what they were measured on.

- markdown.py: the page; sections.py, throughput.py, edits.py, sharded.py, vision.py:
  the sections of single workloads; claims.py: sentences derived from the figures;
- plots.py: the PNGs; format.py: cell formats;
- kept.py: the runs RESULTS.md is generated from (results/runs/);
- machine.py: what a run records about its machine and versions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..device import table as device_table
from . import markdown, plots, vision


def write(doc: dict[str, Any], report_dir: Path) -> Path:
    report_dir.mkdir(parents=True, exist_ok=True)
    pngs = plots.plots(doc, report_dir / "results")
    rel = [str(p.relative_to(report_dir)) for p in pngs]
    path = report_dir / "RESULTS.md"
    page = markdown.markdown(doc, rel, vision.newest(report_dir))
    path.write_text(page + device_table.kept_section(report_dir))
    return path
