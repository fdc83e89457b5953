"""RESULTS.md's PNG plots: TTFT per request, wall time and reuse per workload, the
document edits, resident memory and the restore cost."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..names import OURS, PEER, SERVERS, VLLM
from .edits import edit_plot
from .format import ONCE, _label, _short

_COLORS = {OURS: "#1f77b4", PEER: "#ff7f0e", VLLM: "#2ca02c"}


def plots(doc: dict[str, Any], folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    folder.mkdir(parents=True, exist_ok=True)
    out = []
    title = f"{doc['profile']} profile, {doc['machine']['cpu']}"
    workloads = [w for w in doc["workloads"] if not w["skipped"]]

    seq = [
        w
        for w in workloads
        if w["workload"] in ("chat", "agent", "shared_system", "document", "burst", "restart")
    ]
    if seq:
        cols = min(3, len(seq))
        rows = -(-len(seq) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.6 * rows), squeeze=False)
        for ax, w in zip(axes.flat, seq, strict=False):
            labels: list[str] = []
            for name in SERVERS:
                samples = w["servers"].get(name, {}).get("samples", [])
                labels = labels or [s["label"] for s in samples]
                pts = [(i, s["ttft_s"]) for i, s in enumerate(samples) if s["ttft_s"]]
                if pts:
                    ax.plot(*zip(*pts, strict=True), marker="o", label=name, color=_COLORS[name])
            ax.set_title(f"{w['title']} ({w['model']})", fontsize=10)
            step = max(1, -(-len(labels) // 8))
            ticks = list(range(0, len(labels), step))
            ax.set_xticks(
                ticks, [_short(labels[i]) for i in ticks], fontsize=7, rotation=30, ha="right"
            )
            ax.set_ylabel("TTFT (s)")
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        for ax in list(axes.flat)[len(seq) :]:
            ax.axis("off")
        fig.suptitle(f"Time to first token per request ({title})", fontsize=11)
        fig.tight_layout()
        out.append(_save(fig, folder / "ttft_per_request.png"))

    bars = [w for w in workloads if w["workload"] not in ONCE]
    if bars:
        out.append(
            _bar_chart(
                plt,
                bars,
                lambda r: r["wall_s"] or None,
                "wall time (s)",
                f"Wall time per workload ({title})",
                folder / "wall_time.png",
            )
        )
        out.append(
            _bar_chart(
                plt,
                bars,
                lambda r: r["reuse"]["efficiency"],
                "reuse efficiency (novel / prefilled)",
                f"Reuse efficiency (1.0 = nothing recomputed; {title})",
                folder / "reuse_efficiency.png",
                unit_max=1.0,
            )
        )

    edits = edit_plot(doc, folder, plt, _COLORS)
    out += [edits] if edits is not None else []

    mem = [w for w in workloads if w["workload"] == "memory"]
    if mem:
        fig, axes = plt.subplots(1, len(mem), figsize=(6 * len(mem), 3.8), squeeze=False)
        for ax, w in zip(axes.flat, mem, strict=True):
            for name in SERVERS:
                rss = w["servers"].get(name, {}).get("extra", {}).get("rss_mib", [])
                if rss:
                    ax.plot(range(len(rss)), rss, label=name, color=_COLORS[name])
            cap = w["servers"].get(OURS, {}).get("extra", {}).get("cap", "?")
            ax.set_title(f"{_label(w)}, cache cap {cap}", fontsize=10)
            ax.set_xlabel("requests served")
            ax.set_ylabel("RSS (MiB)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle("Server resident memory", fontsize=11)
        fig.tight_layout()
        out.append(_save(fig, folder / "memory_rss.png"))

    restore = next((w for w in workloads if w["workload"] == "restore"), None)
    rows = restore["servers"][OURS]["extra"].get("rows") if restore else None
    if rows:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
        panels = (
            (
                "restore (ms)",
                (
                    ("restore_ms", "mlx-prefix restore", _COLORS[OURS], "-"),
                    ("lookup_restore_ms", "mlx-prefix lookup + restore", _COLORS[OURS], "--"),
                    ("mlx_lm_fetch_ms", "mlx-lm LRUPromptCache fetch", _COLORS[PEER], "-"),
                ),
            ),
            (
                "first decode write after restore (ms)",
                (
                    ("first_write_ms", "mlx-prefix", _COLORS[OURS], "-"),
                    ("mlx_lm_first_write_ms", "mlx-lm", _COLORS[PEER], "-"),
                ),
            ),
        )
        xs = [r["tokens"] for r in rows]
        for ax, (ylabel, series) in zip(axes, panels, strict=True):
            ys = []
            for key, label, color, style in series:
                ax.plot(xs, [r[key] for r in rows], style, marker="o", label=label, color=color)
                ys += [r[key] for r in rows]
            ax.set_xscale("log", base=2)
            if min(ys) > 0 and max(ys) / min(ys) > 20:
                ax.set_yscale("log")
            else:
                ax.set_ylim(bottom=0)
            ax.set_xticks(xs, [f"{x // 1024}K" if x >= 1024 else str(x) for x in xs])
            ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
            ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.set_xlabel("cached prefix (tokens)")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=8)
        fig.suptitle("Cache restore cost (KV shaped like the dense model, float32)", fontsize=11)
        fig.tight_layout()
        out.append(_save(fig, folder / "restore_cost.png"))
    return out


def _bar_chart(plt, workloads, value, xlabel, title, path, unit_max=None):
    import numpy as np

    labels = [_label(w) for w in workloads]
    y = np.arange(len(labels))
    shown = [s for s in SERVERS if any(s in w["servers"] for w in workloads)]
    h = 0.76 / len(shown)
    fig, ax = plt.subplots(figsize=(8, 0.3 * len(shown) * len(labels) + 1.4))
    for k, name in enumerate(shown):
        vals = [value(w["servers"][name]) if name in w["servers"] else None for w in workloads]
        pos = y + (k - (len(shown) - 1) / 2) * h
        ax.barh(pos, [v or 0 for v in vals], h, label=name, color=_COLORS[name])
        for p, v in zip(pos, vals, strict=True):
            text = "n/a" if v is None else (f"{v:.0%}" if unit_max else f"{v:.1f}")
            ax.text((v or 0), p, " " + text, va="center", fontsize=7)
    ax.set_yticks(y, labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    if unit_max:  # an over-reporting server's bar runs past 100%: show all of it
        top = max([unit_max] + [v for w in workloads for v in _values(w, value)])
        ax.set_xlim(0, top * 1.15)
    else:
        ax.set_xlim(0, ax.get_xlim()[1] * 1.12)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return _save(fig, path)


def _values(w: dict[str, Any], value: Any) -> list[float]:
    return [v for name in SERVERS if name in w["servers"] for v in [value(w["servers"][name])] if v]


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
