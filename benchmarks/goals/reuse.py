"""The goals of the workloads that measure what the cache reuses, keyed by workload:

- restore: at 32K cached tokens under 1 ms, what a request pays (trie lookup + restore)
  flat in prefix length, no copy of the prefix in memory;
- chat, agent: reuse efficiency 1.00 on the multi-turn chat, >= 0.95 on the agent loop
  (tools + thinking);
- restart: TTFT after a restart at most 0.1x the cold TTFT (and, for information, against
  mlx_lm.server after its restart); a request seen once, a restart, the same request: at
  most 0.1x its cold TTFT;
- messages_agent, messages_agent_cch: the agent session over /v1/messages (8 tool turns,
  long system prompt and tools): reuse on the requests' path 1.00 (next-turn prefetch
  on), warm-turn TTFT at most 0.3x mlx_lm.server's on the same conversation, every warm
  answer equal to its cold run;
- edits: after an edit, the cached tokens at least 0.9 of the common prefix on 4K+ token
  documents and 0.6 on shorter ones (pooled over the edit points of each length);
- mixed: under a small budget, value eviction saves more prefill than the kind order.

Each is held on the models served on one rank (dense and hybrid).
"""

from __future__ import annotations

from typing import Any

from ..names import OURS, PEER
from .common import Goal, missing, ratio, runs, skipped, tokens, ttft


def evaluate(doc: dict[str, Any]) -> list[Goal]:
    return [
        *_restore(doc),
        *_reuse(doc, "chat", "reuse efficiency, multi-turn chat", 1.0),
        *_reuse(doc, "agent", "reuse efficiency, agent loop (tools + thinking)", 0.95),
        *_restart(doc),
        *_messages_agent(doc),
        *_edits(doc),
        *_restart_once(doc),
        *_mixed(doc),
    ]


def _restart(doc: dict[str, Any]) -> list[Goal]:
    cold_what, cold_target = "TTFT after restart / cold TTFT (mlx-prefix)", "<= 0.10x"
    peer_what = "TTFT after restart, mlx-prefix / mlx_lm.server"
    out = []
    for w in runs(doc, "restart"):
        if w["skipped"]:
            why = f"skipped: {w['skipped']}"
            out.append(Goal(w["workload"], cold_what, w["model"], None, why, cold_target, None))
            continue
        ours, peer = w["servers"].get(OURS), w["servers"].get(PEER)
        after, cold = ttft(ours, "after restart"), ttft(ours, "before restart #1")
        peer_after = ttft(peer, "after restart")
        r = ratio(after, cold)
        shown = "not measured" if r is None else f"{r:.3f}x ({after:.2f} s / {cold:.2f} s)"
        out.append(
            Goal(
                w["workload"],
                cold_what,
                w["model"],
                r,
                shown,
                cold_target,
                None if r is None else r <= 0.1,
            )
        )
        rp = ratio(after, peer_after)
        if rp is not None:
            shown = f"{rp:.3f}x ({after:.2f} s / {peer_after:.2f} s)"
            out.append(Goal(w["workload"], peer_what, w["model"], rp, shown, "", None))
    return out or [missing("restart", cold_what, cold_target)]


def _reuse(doc: dict[str, Any], name: str, what: str, goal: float) -> list[Goal]:
    target = "1.00" if goal == 1.0 else f">= {goal:.2f}"
    out = []
    for w in runs(doc, name):
        if w["skipped"]:
            out.append(
                Goal(
                    w["workload"], what, w["model"], None, f"skipped: {w['skipped']}", target, None
                )
            )
            continue
        eff = w["servers"].get(OURS, {}).get("reuse", {}).get("efficiency")
        peer = w["servers"].get(PEER, {}).get("reuse", {}).get("efficiency")
        if eff is None:
            out.append(Goal(w["workload"], what, w["model"], None, "not measured", target, None))
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
        out.append(Goal(w["workload"], what, w["model"], eff, shown, target, met))
    return out or [missing(name, what, target)]


def _messages_agent(doc: dict[str, Any]) -> list[Goal]:
    out: list[Goal] = []
    for name, header in (
        ("messages_agent", "constant billing header"),
        ("messages_agent_cch", "billing header with a new `cch=` per request"),
    ):
        out += _agent_session(doc, name, header)
    return out or [missing("messages_agent", "agent session over /v1/messages", "1.00")]


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
            out.append(Goal(w["workload"], reuse_what, w["model"], None, why, "1.00", None))
            continue
        ours, peer = w["servers"].get(OURS, {}), w["servers"].get(PEER, {})
        reuse = ours.get("reuse") or {}
        path, over = reuse.get("request_path_efficiency"), reuse.get("over_reported") or 0
        shown = "not measured" if path is None else _efficiency(path)
        if over:
            shown += f"; **over-reported**: {over} more cached tokens than it computed"
        # Judged on the raw value, as _reuse does: 0.996 is not 1.00.
        met = None if path is None else path >= 1.0 and not over
        out.append(Goal(w["workload"], reuse_what, w["model"], path, shown, "1.00", met))
        ours_ttft, peer_ttft = _warm_ttft(ours), _warm_ttft(peer)
        r = ratio(ours_ttft, peer_ttft)
        shown = (
            "not measured"
            if r is None
            else f"{r:.2f}x ({ours_ttft:.2f} s / {peer_ttft:.2f} s over the warm turns)"
        )
        out.append(
            Goal(
                w["workload"],
                ttft_what,
                w["model"],
                r,
                shown,
                "<= 0.30x",
                None if r is None else r <= 0.3,
            )
        )
        checks = ours.get("checks") or []
        matched = sum(c["match"] for c in checks)
        shown = f"{matched}/{len(checks)}" if checks else "not measured"
        met = bool(checks) and matched == len(checks) if checks else None
        out.append(
            Goal(
                w["workload"], same_what, w["model"], matched if checks else None, shown, "all", met
            )
        )
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
        return [missing("restore", what_ms, "< 1 ms")]
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
        out.append(Goal(w["workload"], what, model, ms, shown, "< 1 ms", ms < 1.0))
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
        out.append(Goal(w["workload"], what, model, flat, shown, "<= 2x", flat <= 2))
    extra, prefix = big["restore_extra_mib"], big["prefix_mib"]
    shown = (
        f"{extra:.1f} MiB for a {prefix:.0f} MiB prefix at {at} "
        f"(mlx_lm fetch {big['mlx_lm_extra_mib']:.1f} MiB)"
    )
    out.append(
        Goal(
            w["workload"],
            "memory added by a restore",
            model,
            extra,
            shown,
            "no copy (< 1% of the prefix)",
            extra < 0.01 * prefix,
        )
    )
    return out


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
            out.append(skipped(what, w, ">= 0.90 (4K+), >= 0.60"))
            continue
        ours = w["servers"].get(OURS, {}).get("extra", {}).get("rows") or []
        peer = w["servers"].get(PEER, {}).get("extra", {}).get("rows") or []
        for n in sorted({r["doc_tokens"] for r in ours}):
            limit = 0.9 if n >= 4096 else 0.6
            target = f">= {limit:.2f}"
            what_n = f"{what}, {tokens(n)}-token document"
            x = edit_reuse(ours, n)
            if x is None:
                out.append(
                    Goal(w["workload"], what_n, w["model"], None, "not reported", target, None)
                )
                continue
            mine = [r for r in ours if r["doc_tokens"] == n]
            cached, common = sum(r["cached"] for r in mine), sum(r["common"] for r in mine)
            shown = f"{x:.2f} ({cached} / {common} tokens over {len(mine)} edits)"
            y = edit_reuse(peer, n)
            shown += "" if y is None else f"; mlx_lm.server {y:.2f}"
            out.append(Goal(w["workload"], what_n, w["model"], x, shown, target, x >= limit))
    return out or [missing("edits", what, ">= 0.90 (4K+), >= 0.60")]


def _restart_once(doc: dict[str, Any]) -> list[Goal]:
    from ..workloads.restart import ONCE, ONCE_AFTER

    what, target = "one request, restart, same request: TTFT / cold TTFT", "<= 0.10x"
    out = []
    for w in runs(doc, "restart"):
        if w["skipped"]:
            out.append(skipped(what, w, target))
            continue
        ours, peer = w["servers"].get(OURS), w["servers"].get(PEER)
        after, cold = ttft(ours, ONCE_AFTER), ttft(ours, ONCE)
        r = ratio(after, cold)
        shown = "not measured" if r is None else f"{r:.3f}x ({after:.2f} s / {cold:.2f} s)"
        peer_after = ttft(peer, ONCE_AFTER)
        if r is not None and peer_after:
            shown += f"; mlx_lm.server after its restart {peer_after:.2f} s"
        out.append(
            Goal(w["workload"], what, w["model"], r, shown, target, None if r is None else r <= 0.1)
        )
    return out or [missing("restart", what, target)]


def _mixed(doc: dict[str, Any]) -> list[Goal]:
    from ..workloads.mixed import OURS_KIND

    what, target = "prefill saved under a small budget, value / kind eviction", "> 1.00x"
    out = []
    for w in runs(doc, "mixed"):
        if w["skipped"]:
            out.append(skipped(what, w, target))
            continue
        value = w["servers"].get(OURS, {}).get("extra", {})
        kind = w["servers"].get(OURS_KIND, {}).get("extra", {})
        a, b = value.get("net_saved"), kind.get("net_saved")
        if a is None or b is None:
            out.append(Goal(w["workload"], what, w["model"], None, "not measured", target, None))
            continue
        r = ratio(a, b)
        shown = f"{a} / {b} tokens (of {value.get('savable')} savable)"
        shown = (f"{r:.2f}x " if r is not None else "") + f"({shown})"
        shown += f"; evictions {value.get('evictions')} / {kind.get('evictions')}"
        # Saving more than a kind order that saved nothing still counts as more.
        out.append(Goal(w["workload"], what, w["model"], r, shown, target, a > b))
    return out or [missing("mixed", what, target)]
