"""The throughput workload's goals, from one run's JSON document.

Against the faster peer, mlx_lm.server or vllm-mlx, whichever did better on that very
measure in the same run (a peer that did not run is not a candidate):
- requests/s at 4, 8 and 16 clients at least 1.30x with a shared system prompt and at
  least 1.00x without one;
- a warm 6-way burst in at most 0.80x its wall time;
- the p99 inter-token latency during that burst no worse (at most 1.00x);
and single-stream decode at least as fast as `mlx_lm.generate` (tokens/s, at least 1.00x).
A ratio is judged only where both sides generated as many tokens. The same measures for
mlx-prefix `--deterministic` are information: what batch invariance costs, next to the
default mode.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..names import GENERATE, OURS, OURS_DETERMINISTIC, PEERS
from .common import Goal, missing, ratio, runs

WORKLOAD = "throughput"
RPS_TARGETS = {"shared": 1.3, "unique": 1.0}  # variant -> at least this x the faster peer
BURST_WALL = 0.8
ITL_P99 = 1.0
DECODE = 1.0
VARIANT_WHAT = {"shared": "with a shared system prompt", "unique": "without one"}


@dataclass(frozen=True)
class Measure:
    what: str
    value: Callable[[dict[str, Any]], float | None]  # from a result's `extra`
    tokens: Callable[[dict[str, Any]], int | None]  # what makes two values comparable
    higher_is_better: bool
    limit: float
    unit: str


def measures(doc: dict[str, Any]) -> list[Measure]:
    """The measures compared with a peer, at the client counts this run used."""
    out = []
    for variant, limit in RPS_TARGETS.items():
        for n in _clients(doc):
            out.append(
                Measure(
                    f"requests/s at {n} clients {VARIANT_WHAT[variant]}",
                    lambda e, k=f"{variant}_rps_{n}": e.get(k),
                    lambda e, k=f"{variant}_completion_tokens_{n}": e.get(k),
                    True,
                    limit,
                    "req/s",
                )
            )
    out.append(
        Measure(
            "warm burst wall time",
            lambda e: e.get("warm_burst_wall_s"),
            lambda e: e.get("warm_burst_completion_tokens"),
            False,
            BURST_WALL,
            "s",
        )
    )
    out.append(
        Measure(
            "p99 inter-token latency during the warm burst",
            lambda e: (e.get("itl", {}).get("burst") or {}).get("p99_ms"),
            lambda e: e.get("warm_burst_completion_tokens"),
            False,
            ITL_P99,
            "ms",
        )
    )
    return out


def _clients(doc: dict[str, Any]) -> list[int]:
    found: set[int] = set()
    for w in runs(doc, WORKLOAD):
        for res in w["servers"].values():
            found |= {int(k.rsplit("_", 1)[1]) for k in res.get("extra", {}) if "_rps_" in k}
    return sorted(found) or [4, 8, 16]


def _extra(w: dict[str, Any], name: str) -> dict[str, Any] | None:
    """A server's measures, None where it did not run or failed."""
    res = w["servers"].get(name)
    if res is None or any(n.startswith(("error", "not run")) for n in res.get("notes", [])):
        return None
    return res.get("extra") or None


def faster_peer(w: dict[str, Any], m: Measure) -> tuple[str, float] | None:
    """The peer that did best on `m` in this run, and its value."""
    found = [(p, m.value(e)) for p in PEERS if (e := _extra(w, p)) is not None]
    found = [(p, v) for p, v in found if v is not None]
    if not found:
        return None
    pick = max if m.higher_is_better else min
    return pick(found, key=lambda pv: pv[1])


def _fmt(x: float, unit: str) -> str:
    return f"{x:.0f} {unit}" if unit == "ms" else f"{x:.2f} {unit}"


def _against_peer(w: dict[str, Any], m: Measure, key: str, judged: bool) -> Goal:
    op = ">=" if m.higher_is_better else "<="
    target = f"{op} {m.limit:.2f}x" if judged else ""
    what = f"{m.what}, {key} / the faster peer"
    ours = _extra(w, key)
    best = faster_peer(w, m)
    a = None if ours is None else m.value(ours)
    if best is None or a is None:
        return Goal(w["workload"], what, w["model"], None, "not measured", target, None)
    peer, b = best
    r = ratio(a, b)
    assert r is not None
    shown = f"{r:.2f}x ({_fmt(a, m.unit)} / {_fmt(b, m.unit)}, {peer})"
    others = [
        f"{p} {_fmt(v, m.unit)}"
        for p in PEERS
        if p != peer and (e := _extra(w, p)) is not None and (v := m.value(e)) is not None
    ]
    shown += "".join(f"; {o}" for o in others)
    n_ours, n_peer = m.tokens(ours), m.tokens(_extra(w, peer) or {})
    if n_ours != n_peer or n_ours is None:
        shown += f"; not comparable: completion tokens {n_ours} vs {n_peer}"
        return Goal(w["workload"], what, w["model"], r, shown, target, None)
    met = (r >= m.limit if m.higher_is_better else r <= m.limit) if judged else None
    return Goal(w["workload"], what, w["model"], r, shown, target, met)


def _decode(w: dict[str, Any], key: str, judged: bool) -> Goal:
    target = f">= {DECODE:.2f}x" if judged else ""
    what = f"single-stream decode tokens/s, {key} / mlx_lm.generate"
    ours, ref = _extra(w, key), _extra(w, GENERATE)
    a = None if ours is None else ours.get("decode_tps")
    b = None if ref is None else ref.get("decode_tps")
    r = ratio(a, b)
    if r is None:
        return Goal(w["workload"], what, w["model"], None, "not measured", target, None)
    tokens = f"{ours['decode_tokens']} / {ref['decode_tokens']} tokens"
    shown = f"{r:.2f}x ({a:.1f} / {b:.1f} tok/s over {tokens})"
    peers = [
        f"{p} {e['decode_tps']:.1f}"
        for p in PEERS
        if (e := _extra(w, p)) is not None and e.get("decode_tps") is not None
    ]
    shown += "".join(f"; {p}" for p in peers)
    return Goal(w["workload"], what, w["model"], r, shown, target, r >= DECODE if judged else None)


def _cost(w: dict[str, Any], m: Measure) -> Goal:
    """`--deterministic` against the default mode on one measure (information)."""
    what = f"{m.what}, {OURS_DETERMINISTIC} / {OURS}"
    det, ours = _extra(w, OURS_DETERMINISTIC), _extra(w, OURS)
    a = None if det is None else m.value(det)
    b = None if ours is None else m.value(ours)
    r = ratio(a, b)
    if r is None:
        res = w["servers"].get(OURS_DETERMINISTIC) or {}
        why = next(iter(res.get("notes") or []), "not measured")
        return Goal(w["workload"], what, w["model"], None, why, "", None)
    return Goal(
        w["workload"],
        what,
        w["model"],
        r,
        f"{r:.2f}x ({_fmt(a, m.unit)} / {_fmt(b, m.unit)})",
        "",
        None,
    )


def evaluate(doc: dict[str, Any]) -> list[Goal]:
    out: list[Goal] = []
    for w in runs(doc, WORKLOAD):
        if w["skipped"]:
            why = f"skipped: {w['skipped']}"
            what = "throughput against the faster peer"
            out.append(Goal(WORKLOAD, what, w["model"], None, why, target="", met=None))
            continue
        ms = measures(doc)
        out += [_against_peer(w, m, OURS, judged=True) for m in ms]
        out.append(_decode(w, OURS, judged=True))
        out += [_cost(w, m) for m in ms]  # its figures beside the peers': the section's table
        out.append(_decode(w, OURS_DETERMINISTIC, judged=False))
    return out or [missing(WORKLOAD, "throughput against the faster peer", ">= 1.30x")]
