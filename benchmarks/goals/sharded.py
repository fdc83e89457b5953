"""The rows of the chat and burst workloads on the models served on 2 ranks (both servers
under mlx.launch, ring backend, same model), side by side. No number is set for them,
so every row is information: reuse
efficiency, TTFT and wall time of mlx-prefix against mlx_lm.server, and whether the
warm answers equal their cold runs."""

from __future__ import annotations

import statistics
from typing import Any

from ..names import OURS, PEER
from .common import Goal, missing, ranks, ratio, runs

WHAT = {"chat": "multi-turn chat", "burst": "parallel burst"}


def evaluate(doc: dict[str, Any]) -> list[Goal]:
    out: list[Goal] = []
    for name in WHAT:
        for w in runs(doc, name, sharded=True):
            out += _rows(w, ranks(doc, w["model"]))
    return out or [missing("chat, burst", "both servers on 2 ranks", "")]


def median_ttft(res: dict[str, Any], skip_first: bool) -> float | None:
    """Median TTFT of a run's requests (`skip_first`: of those after the first)."""
    t = [s["ttft_s"] for s in res.get("samples", [])[int(skip_first) :]]
    return statistics.median(t) if t and all(x is not None for x in t) else None


def _eff(res: dict[str, Any]) -> str:
    reuse = res.get("reuse") or {}
    x = reuse.get("efficiency")
    if x is None:
        return "unknown (no cached tokens reported)"
    shown = f"{x:.3f}"
    if reuse.get("background"):
        shown += f" ({reuse['request_path_efficiency']:.3f} on the requests' path)"
    if reuse.get("over_reported"):
        shown += f", **over-reported** by {reuse['over_reported']} tokens"
    return shown


def _rows(w: dict[str, Any], n: int) -> list[Goal]:
    what = f"{WHAT[w['workload']]}, {n} ranks"
    if w["skipped"]:
        return [Goal(w["workload"], what, w["model"], None, f"skipped: {w['skipped']}", "", None)]
    ours, peer = w["servers"].get(OURS, {}), w["servers"].get(PEER, {})
    x = (ours.get("reuse") or {}).get("efficiency")
    out = [
        Goal(
            w["workload"],
            f"reuse efficiency, {what}, mlx-prefix; mlx_lm.server",
            w["model"],
            x,
            f"{_eff(ours)}; mlx_lm.server {_eff(peer)}",
            "",
            None,
        )
    ]
    # The chat's first turn is cold on both servers; the later ones are what reuse buys.
    skip = w["workload"] == "chat"
    a, b = median_ttft(ours, skip), median_ttft(peer, skip)
    r = ratio(a, b)
    which = "later turns" if skip else "all requests"
    shown = "not measured" if r is None else f"{r:.2f}x ({a:.2f} s / {b:.2f} s)"
    out.append(_info(w, f"median TTFT ({which}), {what}, mlx-prefix / mlx_lm.server", r, shown))
    r = ratio(ours.get("wall_s"), peer.get("wall_s"))
    if r is not None:
        shown = f"{r:.2f}x ({ours['wall_s']:.1f} s / {peer['wall_s']:.1f} s)"
        if w["workload"] == "burst":
            shown += "; " + _phases(ours, peer)
        out.append(_info(w, f"wall time, {what}, mlx-prefix / mlx_lm.server", r, shown))
    checks = [f"{_matched(res)} {name}" for name, res in ((OURS, ours), (PEER, peer)) if res]
    out.append(_info(w, f"warm answers equal to their cold runs, {what}", None, "; ".join(checks)))
    return out


def _info(w: dict[str, Any], what: str, value: float | None, shown: str) -> Goal:
    """A row given for information: no target, never judged."""
    return Goal(w["workload"], what, w["model"], value, shown, target="", met=None)


def _phases(ours: dict[str, Any], peer: dict[str, Any]) -> str:
    parts = []
    for phase in ("cold", "warm", "unique"):
        a = ours.get("extra", {}).get(f"{phase}_wall_s")
        b = peer.get("extra", {}).get(f"{phase}_wall_s")
        if a is not None and b is not None:
            parts.append(f"{phase} {a:.1f} / {b:.1f} s")
    return ", ".join(parts)


def _matched(res: dict[str, Any]) -> str:
    checks = res.get("checks") or []
    if not checks:
        return "-"
    return f"{sum(c['match'] for c in checks)}/{len(checks)}"
