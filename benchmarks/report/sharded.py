"""RESULTS.md's section for the models served on 2 ranks: the multi-turn chat and the
parallel burst with both servers on 2 ranks under the same launcher, side by side, next
to the same workloads on one rank where the run served the same model folder that way
(the hybrid model)."""

from __future__ import annotations

from typing import Any

from ..goals.common import ranks
from ..names import SERVERS
from ..servers_sharded import BACKEND
from .format import _cached, _checks, _reuse, _s, _ttfts

NAMES = ("chat", "burst")


def lines(doc: dict[str, Any]) -> list[str]:
    sharded = [w for w in doc["workloads"] if w["workload"] in NAMES and ranks(doc, w["model"]) > 1]
    if not sharded:
        return []
    paths = {k: m.get("path") for k, m in doc.get("models", {}).items()}
    rows = []
    for w in sharded:
        twins = [
            t
            for t in doc["workloads"]
            if t["workload"] == w["workload"]
            and ranks(doc, t["model"]) == 1
            and paths.get(t["model"]) == paths.get(w["model"])
        ]
        for run in (w, *twins):
            if run["skipped"]:
                rows.append(f"| {run['title']} | {run['model']} | - | - | skipped: "
                            f"{run['skipped']} | | | | | |")  # fmt: skip
                continue
            n = ranks(doc, run["model"])
            for name in SERVERS:
                res = run["servers"].get(name)
                if res is None:
                    continue
                first, rest = _ttfts(res)
                rows.append(
                    f"| {run['title']} | {run['model']} | {name} | {n} | {_s(res['wall_s'], 1)}"
                    f" | {_s(first)} | {_s(rest)} | {_cached(res)} | {_reuse(res['reuse'])} | "
                    f"{_checks(res)} |"
                )
    return [
        "",
        "## Sharded serving (2 ranks)",
        "",
        "Both servers started the same way, `mlx.launch -n 2 --backend "
        f"{BACKEND} -p PORT --python PYTHON -m mlx_prefix.blas_exec PYTHON -m <server> "
        "--model M`, over loopback on this machine, each splitting every layer's heads "
        "over its 2 ranks (mlx-lm's `shard`, tensor parallel); rank 0 serves HTTP. Both "
        "groups run at once, as the 1-rank servers do, and mlx.launch's own polling "
        "costs each group a fraction of a core while it runs: on 2 cores the times are "
        "noisy, the token counts exact. Warm = cold: mlx-prefix against `prefix_cache` "
        "off in the same group, mlx_lm.server against a fresh 2-rank group with no "
        "prompt cache. Rows on 1 rank: the same model folder in this run, for scale.",
        "",
        "| workload | model | server | ranks | wall s | TTFT 1st s | TTFT rest s "
        "| cached / prompt | reuse | warm = cold |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|",
        *rows,
    ]
