"""The issues' benchmark goals, computed from one run's JSON document.

- issue 3: restore at 32K cached tokens under 1 ms, what a request pays (trie lookup +
  restore) flat in prefix length, no copy of the prefix in memory;
- issue 4: reuse efficiency 1.00 on the multi-turn chat, >= 0.95 on the agent loop
  (tools + thinking), dense and hybrid;
- issue 5: a cold burst of 6 requests sharing a ~500-token instruction in at most 0.4x
  mlx_lm.server's wall time;
- issue 7: TTFT after a restart at most 0.1x the cold TTFT (and, for information,
  against mlx_lm.server after its restart);
- issue 13: the agent session over /v1/messages (8 tool turns, long system prompt and
  tools): reuse efficiency on the requests' path 1.00 (next-turn prefetch on), warm-turn
  TTFT at most 0.3x mlx_lm.server's on the same conversation, every warm answer equal
  to its cold run; dense and hybrid.

Issues 14 and 15's goals are in goals_hybrid_batch.py, issue 16's (information only, for
the models served on 2 ranks) in goals_sharded.py, issue 33's (throughput against the
faster of mlx_lm.server and vllm-mlx) in goals_throughput.py; what they share in
goals_common.py. The other issues' goals are computed
on the models served on one rank.
"""

from __future__ import annotations

from typing import Any

from . import goals_hybrid_batch, goals_sharded, goals_throughput
from .goals_common import Goal, burst_wall, missing, ratio, runs, tokens, ttft
from .names import OURS, PEER

__all__ = ["Goal", "evaluate"]


def evaluate(doc: dict[str, Any]) -> list[Goal]:
    return [
        *_restore(doc),
        *_reuse(doc, "chat", "reuse efficiency, multi-turn chat", 1.0),
        *_reuse(doc, "agent", "reuse efficiency, agent loop (tools + thinking)", 0.95),
        *_burst(doc),
        *_restart(doc),
        *_messages_agent(doc),
        *goals_hybrid_batch.evaluate(doc),
        *goals_sharded.evaluate(doc),
        *goals_throughput.evaluate(doc),
    ]


def _burst(doc: dict[str, Any]) -> list[Goal]:
    what = "cold burst wall time, mlx-prefix / mlx_lm.server"
    return burst_wall(doc, 5, "cold", what, 0.4)


def _restart(doc: dict[str, Any]) -> list[Goal]:
    cold_what, cold_target = "TTFT after restart / cold TTFT (mlx-prefix)", "<= 0.10x"
    peer_what = "TTFT after restart, mlx-prefix / mlx_lm.server"
    out = []
    for w in runs(doc, "restart"):
        if w["skipped"]:
            why = f"skipped: {w['skipped']}"
            out.append(Goal(7, cold_what, w["model"], None, why, cold_target, None))
            continue
        ours, peer = w["servers"].get(OURS), w["servers"].get(PEER)
        after, cold = ttft(ours, "after restart"), ttft(ours, "before restart #1")
        peer_after = ttft(peer, "after restart")
        r = ratio(after, cold)
        shown = "not measured" if r is None else f"{r:.3f}x ({after:.2f} s / {cold:.2f} s)"
        out.append(
            Goal(7, cold_what, w["model"], r, shown, cold_target, None if r is None else r <= 0.1)
        )
        rp = ratio(after, peer_after)
        if rp is not None:
            shown = f"{rp:.3f}x ({after:.2f} s / {peer_after:.2f} s)"
            out.append(Goal(7, peer_what, w["model"], rp, shown, "", None))
    return out or [missing(7, cold_what, cold_target)]


def _reuse(doc: dict[str, Any], name: str, what: str, goal: float) -> list[Goal]:
    target = "1.00" if goal == 1.0 else f">= {goal:.2f}"
    out = []
    for w in runs(doc, name):
        if w["skipped"]:
            out.append(Goal(4, what, w["model"], None, f"skipped: {w['skipped']}", target, None))
            continue
        eff = w["servers"].get(OURS, {}).get("reuse", {}).get("efficiency")
        peer = w["servers"].get(PEER, {}).get("reuse", {}).get("efficiency")
        if eff is None:
            out.append(Goal(4, what, w["model"], None, "not measured", target, None))
            continue
        reuse = w["servers"][OURS]["reuse"]
        over = reuse.get("over_reported") or 0
        shown = _efficiency(eff)
        if reuse.get("background"):
            path = _efficiency(reuse["request_path_efficiency"])
            shown += f" ({path} on the requests' path, {reuse['background']} tokens prefetched)"
        if over:
            shown += f"; **over-reported**: {over} more cached tokens than it computed"
        shown += "" if peer is None else f"; mlx_lm.server {_efficiency(peer)}"
        # Judged on the raw value, all prefill work included (the background prefetch):
        # 0.996 is not 1.00, and above 1.0 the server's cached-token count is wrong.
        met = goal <= eff and not over
        out.append(Goal(4, what, w["model"], eff, shown, target, met))
    return out or [missing(4, what, target)]


def _messages_agent(doc: dict[str, Any]) -> list[Goal]:
    out: list[Goal] = []
    for name, header in (
        ("messages_agent", "constant billing header"),
        ("messages_agent_cch", "billing header with a new `cch=` per request"),
    ):
        out += _agent_session(doc, name, header)
    return out or [missing(13, "agent session over /v1/messages", "1.00")]


def _agent_session(doc: dict[str, Any], name: str, header: str) -> list[Goal]:
    reuse_what = (
        f"reuse efficiency on the requests' path, agent session over /v1/messages ({header})"
    )
    ttft_what = f"warm-turn TTFT, mlx-prefix / mlx_lm.server (agent session, {header})"
    same_what = f"warm answers equal to their cold runs (agent session, {header})"
    out = []
    for w in runs(doc, name):
        if w["skipped"]:
            why = f"skipped: {w['skipped']}"
            out.append(Goal(13, reuse_what, w["model"], None, why, "1.00", None))
            continue
        ours, peer = w["servers"].get(OURS, {}), w["servers"].get(PEER, {})
        reuse = ours.get("reuse") or {}
        path, over = reuse.get("request_path_efficiency"), reuse.get("over_reported") or 0
        shown = "not measured" if path is None else _efficiency(path)
        if over:
            shown += f"; **over-reported**: {over} more cached tokens than it computed"
        # Judged on the raw value, as _reuse does: 0.996 is not 1.00.
        met = None if path is None else path >= 1.0 and not over
        out.append(Goal(13, reuse_what, w["model"], path, shown, "1.00", met))
        ours_ttft, peer_ttft = _warm_ttft(ours), _warm_ttft(peer)
        r = ratio(ours_ttft, peer_ttft)
        shown = (
            "not measured"
            if r is None
            else f"{r:.2f}x ({ours_ttft:.2f} s / {peer_ttft:.2f} s over the warm turns)"
        )
        out.append(
            Goal(13, ttft_what, w["model"], r, shown, "<= 0.30x", None if r is None else r <= 0.3)
        )
        checks = ours.get("checks") or []
        matched = sum(c["match"] for c in checks)
        shown = f"{matched}/{len(checks)}" if checks else "not measured"
        met = bool(checks) and matched == len(checks) if checks else None
        out.append(Goal(13, same_what, w["model"], matched if checks else None, shown, "all", met))
    return out


def _warm_ttft(result: dict[str, Any]) -> float | None:
    """Summed TTFT of the turns after the first (the first prefills everything cold)."""
    ttfts = [s["ttft_s"] for s in result.get("samples", [])[1:]]
    return sum(ttfts) if ttfts and all(t is not None for t in ttfts) else None


def _efficiency(x: float) -> str:
    return f"{x:.3f}"  # three places: 0.996 is not 1.00


def _restore(doc: dict[str, Any]) -> list[Goal]:
    w = next(runs(doc, "restore"), None)
    rows = (w or {}).get("servers", {}).get(OURS, {}).get("extra", {}).get("rows") or []
    what_ms = "restore time (restore alone)"
    if not rows:
        return [missing(3, what_ms, "< 1 ms")]
    big, small = rows[-1], rows[0]
    at = tokens(big["tokens"])
    model = w["model"]
    fetch = f"mlx_lm fetch {big['mlx_lm_fetch_ms']:.2f} ms"
    out = []
    for key, what in (
        ("restore_ms", what_ms),
        ("lookup_restore_ms", "restore time (trie lookup + restore)"),
    ):
        ms = big[key]
        shown = f"{ms:.2f} ms at {at} tokens ({fetch})"
        out.append(Goal(3, what, model, ms, shown, "< 1 ms", ms < 1.0))
    if len(rows) > 1:
        # Judged on what a request pays: the trie lookup grows with the prefix, restore
        # alone does not.
        key = "lookup_restore_ms"
        flat = ratio(big[key], small[key])
        shown = (
            f"{flat:.1f}x ({big[key]:.2f} ms at {at} / {small[key]:.2f} ms "
            f"at {tokens(small['tokens'])}; prefix {big['tokens'] // small['tokens']}x longer)"
        )
        what = "lookup + restore time, flat in prefix length"
        out.append(Goal(3, what, model, flat, shown, "<= 2x", flat <= 2))
    extra, prefix = big["restore_extra_mib"], big["prefix_mib"]
    shown = (
        f"{extra:.1f} MiB for a {prefix:.0f} MiB prefix at {at} "
        f"(mlx_lm fetch {big['mlx_lm_extra_mib']:.1f} MiB)"
    )
    out.append(
        Goal(
            3,
            "memory added by a restore",
            model,
            extra,
            shown,
            "no copy (< 1% of the prefix)",
            extra < 0.01 * prefix,
        )
    )
    return out
