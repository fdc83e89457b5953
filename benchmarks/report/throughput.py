"""RESULTS.md's section for the throughput workload: requests/s at each client
count with and without a shared system prompt, the warm burst and its p99 inter-token
latency, single-stream decode; every server of the run, mlx-prefix `--deterministic`
and `mlx_lm.generate` on one table."""

from __future__ import annotations

from typing import Any

from ..names import GENERATE, OURS_DETERMINISTIC, SERVERS
from .format import _s

ROWS = (*SERVERS, OURS_DETERMINISTIC, GENERATE)


def _clients(runs: list[dict[str, Any]]) -> list[int]:
    found = {
        int(k.rsplit("_", 1)[1])
        for w in runs
        for res in w["servers"].values()
        for k in res.get("extra", {})
        if k.startswith("shared_rps_")
    }
    return sorted(found)


def lines(doc: dict[str, Any]) -> list[str]:
    runs = [w for w in doc["workloads"] if w["workload"] == "throughput" and not w["skipped"]]
    if not runs:
        return []
    levels = _clients(runs)
    head = " | ".join(f"{v} {n}" for v in ("shared", "unique") for n in levels)
    rows, notes = [], []
    for w in runs:
        for name in ROWS:
            res = w["servers"].get(name)
            if res is None:
                continue
            e = res.get("extra", {})
            why = "; ".join(n for n in res.get("notes", []) if n.startswith(("error", "not run")))
            if why:
                rows.append(f"| {w['model']} | {name} | {why} |" + " |" * (len(levels) * 2 + 2))
                continue
            rps = [_s(e.get(f"{v}_rps_{n}")) for v in ("shared", "unique") for n in levels]
            p99 = (e.get("itl", {}).get("burst") or {}).get("p99_ms")
            cells = [*rps, _s(e.get("warm_burst_wall_s")), _s(p99, 0), _s(e.get("decode_tps"), 1)]
            rows.append(f"| {w['model']} | {name} | " + " | ".join(cells) + " |")
            notes += [f"- {w['model']}, {name}: {n}" for n in res.get("notes", [])]
    return [
        "",
        "## Throughput",
        "",
        "Requests/s with N concurrent clients, each sending its requests one after another: "
        "*shared* = every request starts with the same system prompt, *unique* = each "
        "brings its own text of the same length and no system prompt (no cache helps). "
        "*Warm burst*: the requests of a burst sharing an instruction one request read "
        "before, sent at once; its wall time and the p99 of the gaps between output chunks "
        "of its requests. *Decode*: one request alone, tokens/s from its first output chunk "
        f"to its last; {GENERATE}'s row is the rate it prints for the same prompt and length. "
        f"{OURS_DETERMINISTIC}: batch-invariant mode, its own process, where the flag exists.",
        "",
        f"| model | server | {head} | warm burst s | burst p99 ITL ms | decode tok/s |",
        "|---|---|" + "---:|" * (len(levels) * 2 + 3),
        *rows,
        *(["", *notes] if notes else []),
    ]
