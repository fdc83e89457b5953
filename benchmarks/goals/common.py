"""What every goal module shares: the Goal record and how a goal reads one run's JSON
document (which runs of a workload, ratios, TTFTs, a burst phase's wall time against a
peer's). A leaf below the other goal modules."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..names import OURS, PEER


@dataclass(frozen=True)
class Goal:
    workload: str  # the workload measured (profiles.ALL_WORKLOADS)
    what: str  # the measure
    model: str  # "dense", "hybrid", "synthetic KV", or "-" when nothing ran
    value: float | None  # the measured ratio / efficiency / ms / MiB (None: not measured)
    shown: str  # the value with what it was computed from, for RESULTS.md
    target: str  # "<= 0.40x"; "" for a row given for information
    met: bool | None  # None: information only, or not measured

    @property
    def status(self) -> str:
        if self.met is not None:
            return "met" if self.met else "not met"
        if not self.target:
            return "(information)"
        return "not measured" if self.value is None else "not judged"  # `shown` says why


def ranks(doc: dict[str, Any], model: str) -> int:
    """How many ranks each server of `model` ran on (1 for a run that did not say)."""
    return int(doc.get("models", {}).get(model, {}).get("ranks", 1))


def runs(doc: dict[str, Any], name: str, sharded: bool = False) -> Iterator[dict[str, Any]]:
    """The runs of workload `name` on one rank (`sharded`: on several)."""
    for w in doc["workloads"]:
        if w["workload"] == name and (ranks(doc, w["model"]) > 1) == sharded:
            yield w


def missing(workload: str, what: str, target: str, why: str = "not measured") -> Goal:
    return Goal(workload, what, "-", None, why, target, None)


def skipped(what: str, w: dict[str, Any], target: str) -> Goal:
    """A goal row for a run of `w`'s workload that was skipped, with why."""
    return Goal(w["workload"], what, w["model"], None, f"skipped: {w['skipped']}", target, None)


def ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def burst_wall(doc: dict[str, Any], phase: str, what: str, limit: float) -> list[Goal]:
    """A burst phase's wall time against mlx_lm.server's, judged only where both servers
    generated as many tokens."""
    target = f"<= {limit:.2f}x"
    out = []
    for w in runs(doc, "burst"):
        if w["skipped"]:
            out.append(
                Goal(
                    w["workload"], what, w["model"], None, f"skipped: {w['skipped']}", target, None
                )
            )
            continue
        ours_x = w["servers"].get(OURS, {}).get("extra", {})
        peer_x = w["servers"].get(PEER, {}).get("extra", {})
        ours, peer = ours_x.get(f"{phase}_wall_s"), peer_x.get(f"{phase}_wall_s")
        r = ratio(ours, peer)
        if r is None:
            out.append(Goal(w["workload"], what, w["model"], None, "not measured", target, None))
            continue
        shown = f"{r:.2f}x ({ours:.1f} s / {peer:.1f} s)"
        key = f"{phase}_completion_tokens"
        n_ours, n_peer = ours_x.get(key), peer_x.get(key)
        if n_ours != n_peer or n_ours is None:
            shown += f"; not comparable: completion tokens {n_ours} vs {n_peer}"
            out.append(Goal(w["workload"], what, w["model"], r, shown, target, None))
            continue
        out.append(Goal(w["workload"], what, w["model"], r, shown, target, r <= limit))
    return out or [missing("burst", what, target)]


def ttft(res: dict[str, Any] | None, label: str) -> float | None:
    for s in (res or {}).get("samples", []):
        if s["label"] == label:
            return s["ttft_s"]
    return None


def tokens(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)
