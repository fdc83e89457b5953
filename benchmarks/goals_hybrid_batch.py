"""Issues 14 and 15's benchmark goals, computed from one run's JSON document.

- issue 14 (hybrid reuse): after an edit, the cached tokens at least 0.9 of the common
  prefix on 4K+ token documents and 0.6 on shorter ones (pooled over the edit points
  of each document length); one request, a restart, the same request: TTFT at most
  0.1x its cold TTFT; under a small budget, value eviction saves more prefill than the
  kind order.
- issue 15 (batched prefill): against mlx_lm.server in the same run, the cold burst
  whose requests each add ~150 unique tokens in at most 0.4x its wall time, the warm
  burst in at most 0.8x, requests/s at 4, 8 and 16 clients at least 1.3x, and the p99
  inter-token latency during the bursts no worse.
"""

from __future__ import annotations

from typing import Any

from .goals_common import Goal, burst_wall, missing, ratio, runs, tokens, ttft
from .names import OURS, PEER

RPS_CLIENTS = (4, 8, 16)


def evaluate(doc: dict[str, Any]) -> list[Goal]:
    return [
        *_edits(doc),
        *_restart_once(doc),
        *_mixed(doc),
        *burst_wall(doc, 15, "unique", "cold burst, ~150 unique tokens each, wall / mlx_lm", 0.4),
        *burst_wall(doc, 15, "warm", "warm burst wall time, mlx-prefix / mlx_lm.server", 0.8),
        *_rps(doc),
        *_itl(doc),
    ]


def _skipped(issue: int, what: str, w: dict[str, Any], target: str) -> Goal:
    return Goal(issue, what, w["model"], None, f"skipped: {w['skipped']}", target, None)


def edit_reuse(rows: list[dict[str, Any]], doc_tokens: int) -> float | None:
    """Cached tokens over the common prefix, pooled over one length's edit points."""
    mine = [r for r in rows if r["doc_tokens"] == doc_tokens]
    if not mine or any(r["cached"] is None for r in mine):
        return None
    common = sum(r["common"] for r in mine)
    return sum(r["cached"] for r in mine) / common if common else None


def _edits(doc: dict[str, Any]) -> list[Goal]:
    what = "tokens reused after an edit / common prefix"
    out = []
    for w in runs(doc, "edits"):
        if w["skipped"]:
            out.append(_skipped(14, what, w, ">= 0.90 (4K+), >= 0.60"))
            continue
        ours = w["servers"].get(OURS, {}).get("extra", {}).get("rows") or []
        peer = w["servers"].get(PEER, {}).get("extra", {}).get("rows") or []
        for n in sorted({r["doc_tokens"] for r in ours}):
            limit = 0.9 if n >= 4096 else 0.6
            target = f">= {limit:.2f}"
            what_n = f"{what}, {tokens(n)}-token document"
            x = edit_reuse(ours, n)
            if x is None:
                out.append(Goal(14, what_n, w["model"], None, "not reported", target, None))
                continue
            mine = [r for r in ours if r["doc_tokens"] == n]
            cached, common = sum(r["cached"] for r in mine), sum(r["common"] for r in mine)
            shown = f"{x:.2f} ({cached} / {common} tokens over {len(mine)} edits)"
            y = edit_reuse(peer, n)
            shown += "" if y is None else f"; mlx_lm.server {y:.2f}"
            out.append(Goal(14, what_n, w["model"], x, shown, target, x >= limit))
    return out or [missing(14, what, ">= 0.90 (4K+), >= 0.60")]


def _restart_once(doc: dict[str, Any]) -> list[Goal]:
    from .workloads.restart import ONCE, ONCE_AFTER

    what, target = "one request, restart, same request: TTFT / cold TTFT", "<= 0.10x"
    out = []
    for w in runs(doc, "restart"):
        if w["skipped"]:
            out.append(_skipped(14, what, w, target))
            continue
        ours, peer = w["servers"].get(OURS), w["servers"].get(PEER)
        after, cold = ttft(ours, ONCE_AFTER), ttft(ours, ONCE)
        r = ratio(after, cold)
        shown = "not measured" if r is None else f"{r:.3f}x ({after:.2f} s / {cold:.2f} s)"
        peer_after = ttft(peer, ONCE_AFTER)
        if r is not None and peer_after:
            shown += f"; mlx_lm.server after its restart {peer_after:.2f} s"
        out.append(Goal(14, what, w["model"], r, shown, target, None if r is None else r <= 0.1))
    return out or [missing(14, what, target)]


def _mixed(doc: dict[str, Any]) -> list[Goal]:
    from .workloads.mixed import OURS_KIND

    what, target = "prefill saved under a small budget, value / kind eviction", "> 1.00x"
    out = []
    for w in runs(doc, "mixed"):
        if w["skipped"]:
            out.append(_skipped(14, what, w, target))
            continue
        value = w["servers"].get(OURS, {}).get("extra", {})
        kind = w["servers"].get(OURS_KIND, {}).get("extra", {})
        a, b = value.get("net_saved"), kind.get("net_saved")
        if a is None or b is None:
            out.append(Goal(14, what, w["model"], None, "not measured", target, None))
            continue
        r = ratio(a, b)
        shown = f"{a} / {b} tokens (of {value.get('savable')} savable)"
        shown = (f"{r:.2f}x " if r is not None else "") + f"({shown})"
        shown += f"; evictions {value.get('evictions')} / {kind.get('evictions')}"
        # Saving more than a kind order that saved nothing still counts as more.
        out.append(Goal(14, what, w["model"], r, shown, target, a > b))
    return out or [missing(14, what, target)]


def _rps(doc: dict[str, Any]) -> list[Goal]:
    target = ">= 1.30x"
    out = []
    for w in runs(doc, "concurrency"):
        ours = w["servers"].get(OURS, {}).get("extra", {})
        peer = w["servers"].get(PEER, {}).get("extra", {})
        for n in RPS_CLIENTS:
            what = f"requests/s at {n} clients, mlx-prefix / mlx_lm.server"
            if w["skipped"]:
                out.append(_skipped(15, what, w, target))
                continue
            a, b = ours.get(f"rps_{n}"), peer.get(f"rps_{n}")
            r = ratio(a, b)
            if r is None:
                out.append(Goal(15, what, w["model"], None, "not measured", target, None))
                continue
            shown = f"{r:.2f}x ({a:.2f} / {b:.2f} req/s)"
            key = f"completion_tokens_{n}"
            if ours.get(key) != peer.get(key):
                shown += f"; not comparable: completion tokens {ours.get(key)} vs {peer.get(key)}"
                out.append(Goal(15, what, w["model"], r, shown, target, None))
                continue
            out.append(Goal(15, what, w["model"], r, shown, target, r >= 1.3))
    return out or [missing(15, f"requests/s at {RPS_CLIENTS} clients", target)]


def _itl(doc: dict[str, Any]) -> list[Goal]:
    what = "p99 inter-token latency during the bursts, mlx-prefix / mlx_lm.server"
    target = "<= 1.00x"
    out = []
    for w in runs(doc, "burst"):
        if w["skipped"]:
            out.append(_skipped(15, what, w, target))
            continue
        ours = w["servers"].get(OURS, {}).get("extra", {}).get("itl", {}).get("all", {})
        peer = w["servers"].get(PEER, {}).get("extra", {}).get("itl", {}).get("all", {})
        a, b = ours.get("p99_ms"), peer.get("p99_ms")
        r = ratio(a, b)
        if r is None:
            out.append(Goal(15, what, w["model"], None, "not measured", target, None))
            continue
        shown = (
            f"{r:.2f}x ({a:.0f} ms / {b:.0f} ms; p50 {ours['p50_ms']:.0f} / "
            f"{peer['p50_ms']:.0f} ms; {ours['gaps']} / {peer['gaps']} gaps)"
        )
        out.append(Goal(15, what, w["model"], r, shown, target, r <= 1.0))
    return out or [missing(15, what, target)]
