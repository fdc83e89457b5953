"""RESULTS.md sections and plots for the edits, mixed, burst and concurrency workloads:
inter-token latency in the bursts and at each client count, the document-edit sweep, and
the mixed traffic under a small cache budget."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..goals.reuse import edit_reuse
from ..names import OURS, PEER, SERVERS


def _s(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _done(doc: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return [w for w in doc["workloads"] if w["workload"] == name and not w["skipped"]]


_BURSTS = {
    "cold": "cold burst",
    "warm": "warm burst",
    "unique": "cold burst, unique snippets",
    "all": "all bursts",
}


def itl_lines(doc: dict[str, Any]) -> list[str]:
    rows = []
    for name in ("burst", "concurrency"):
        for w in _done(doc, name):
            for server in SERVERS:
                by = w["servers"].get(server, {}).get("extra", {}).get("itl", {})
                for key, st in by.items():
                    part = _BURSTS.get(key, key)
                    if name == "concurrency":
                        part = f"{key} client{'' if key == '1' else 's'}"
                    rows.append(
                        f"| {w['model']} | {part} | {server} | {st['gaps']} | "
                        f"{_s(st['p50_ms'])} | {_s(st['p99_ms'])} | {_s(st['max_ms'])} |"
                    )
    if not rows:
        return []
    return [
        "",
        "## Inter-token latency",
        "",
        "Time between two consecutive chunks carrying output of the same streamed request "
        "(both servers send one chunk per token), pooled over the requests of a burst or "
        "of a client count; *all bursts* pools every burst of the workload (the goal's "
        "measure). With short replies the p99 is close to the largest gap.",
        "",
        "| model | requests | server | gaps | p50 ms | p99 ms | max ms |",
        "|---|---|---|---:|---:|---:|---:|",
        *rows,
    ]


def _pct(fraction: float) -> str:
    return f"{round(100 * fraction)}%"


def edit_lines(doc: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    for w in _done(doc, "edits"):
        ours = w["servers"].get(OURS, {}).get("extra", {}).get("rows") or []
        peer = w["servers"].get(PEER, {}).get("extra", {}).get("rows") or []
        peer_at = {(r["doc_tokens"], r["position"]): r for r in peer}
        for r in ours:
            p = peer_at.get((r["doc_tokens"], r["position"]), {})
            lines.append(
                f"| {w['model']} | {r['doc_tokens']} | {_pct(r['position'])} | {r['prompt']} | "
                f"{r['common']} | {_cached(r)} | {_cached(p)} |"
            )
        for n in sorted({r["doc_tokens"] for r in ours}):
            a, b = edit_reuse(ours, n), edit_reuse(peer, n)
            lines.append(
                f"| {w['model']} | {n} | **all edits** | | | **{_s(a, 2)}** | **{_s(b, 2)}** |"
            )
    if not lines:
        return []
    return [
        "",
        "## Document edited",
        "",
        "A document asked about once, then with one sentence inserted at each point in "
        "turn (every edit of the original). *common* = the prompt's longest prefix any "
        "earlier request to that server computed (the most a cache can reuse); cached "
        "tokens as the server reported them, with their share of *common*; *all edits* "
        "pools a length's edits (the goal's measure). mlx-prefix resumes on its "
        "256-token prefill grid, dense models included; mlx_lm.server trims a dense "
        "model's cache to the exact edit and reuses a hybrid's only on an exact match.",
        "",
        "| model | document tokens | edit at | prompt | common | mlx-prefix cached "
        "| mlx_lm.server cached |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *lines,
    ]


def _cached(r: dict[str, Any]) -> str:
    if r.get("cached") is None:
        return "-"
    share = f" ({r['reuse']:.2f})" if r.get("reuse") is not None else ""
    return f"{r['cached']}{share}"


def mixed_lines(doc: dict[str, Any]) -> list[str]:
    rows = []
    for w in _done(doc, "mixed"):
        for key, res in w["servers"].items():
            e = res.get("extra", {})
            if "saved" not in e:
                continue
            saved = str(e["saved"]) if e.get("reports_cached") else "not reported"
            kinds = ", ".join(
                f"{k} {v['saved']}/{v['savable']}" for k, v in e.get("by_kind", {}).items()
            )
            evictions = "-" if e.get("evictions") is None else str(e["evictions"])
            rows.append(
                f"| {w['model']} | {key} | {e['budget_mib']:g} | {len(res['samples'])} | "
                f"{e['prompt']} | {e['savable']} | {saved} | {res['background_tokens']} | "
                f"{e['net_saved']} | {evictions} | {kinds} |"
            )
    if not rows:
        return []
    return [
        "",
        "## Mixed traffic under a small budget",
        "",
        "Documents asked again and again, chats, an agent session and one-shots, "
        "interleaved, each server on its own under the same byte budget "
        "(`--cache-budget` / `--prompt-cache-bytes`); mlx-prefix once with value eviction "
        "(the default) and once with `--cache-eviction kind`. *savable* = tokens of each "
        "prompt's common prefix with what that server computed before; *saved* = cached "
        "tokens reported; *net* = saved less the tokens prefilled in the background; "
        "*by kind* = saved / savable per kind of client. The same bytes are not the "
        "same rule: mlx-prefix's budget covers its stored and running caches; "
        "mlx_lm.server trims its cache to the bytes less the running batch's "
        "when it admits a request, and keeps at most `--prompt-cache-size` (10) entries.",
        "",
        "| model | server | budget MiB | requests | prompt | savable | saved | background "
        "| net saved | evictions | by kind |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        *rows,
    ]


def edit_plot(doc: dict[str, Any], folder: Path, plt: Any, colors: dict[str, str]) -> Path | None:
    """Tokens reused per edit position, one panel per model and document length."""
    panels = []
    for w in _done(doc, "edits"):
        ours = w["servers"].get(OURS, {}).get("extra", {}).get("rows") or []
        for n in sorted({r["doc_tokens"] for r in ours}):
            panels.append((w, n))
    if not panels:
        return None
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    for ax, (w, n) in zip(axes.flat, panels, strict=False):
        drawn = False
        for server in SERVERS:
            pts = [
                r
                for r in w["servers"].get(server, {}).get("extra", {}).get("rows") or []
                if r["doc_tokens"] == n
            ]
            if not drawn and pts:
                xs = [100 * r["position"] for r in pts]
                common = [r["common"] for r in pts]
                # On top, so it shows where a server reused all of it.
                ax.plot(xs, common, "--", color="0.2", lw=1.6, zorder=3, label="common prefix")
                drawn = True
            pts = [r for r in pts if r["cached"] is not None]
            if pts:
                xs = [100 * r["position"] for r in pts]
                ys = [r["cached"] for r in pts]
                # Hollow squares for the peer: where both reuse as much, both show.
                style = {"marker": "o"} if server == OURS else {"marker": "s", "mfc": "none"}
                ax.plot(xs, ys, label=server, color=colors[server], **style)
        ax.set_title(f"{n}-token document ({w['model']})", fontsize=10)
        ax.set_xlabel("edit position (% of the document)")
        ax.set_ylabel("tokens reused (cached)")
        ax.set_xlim(0, 100)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle("Tokens reused after an edit, per edit position", fontsize=11)
    fig.tight_layout()
    path = folder / "document_edits.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
