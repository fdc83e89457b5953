"""Cell formatting RESULTS.md's tables share (a leaf below the other report modules)."""

from __future__ import annotations

import statistics
from typing import Any

ONCE = ("restore", "blas")  # in-process, once per run: not in the per-server tables


def _s(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _reuse(reuse: dict[str, Any]) -> str:
    """Efficiency to a tenth of a percent (99.6% is not 100%); above 100% the server
    reported more cached tokens than it computed, which is flagged, not rounded away."""
    x = reuse.get("efficiency")
    if x is None:
        return "unknown"
    if reuse.get("over_reported"):
        return f"**{100 * x:.1f}% (over-reported by {reuse['over_reported']} tokens)**"
    return f"{100 * x:.1f}%"


def _ttfts(res: dict[str, Any]) -> tuple[float | None, float | None]:
    """TTFT of the first request, median TTFT of the rest."""
    t = [s["ttft_s"] for s in res["samples"] if s["ttft_s"] is not None]
    if not t:
        return None, None
    return t[0], (statistics.median(t[1:]) if len(t) > 1 else None)


def _checks(res: dict[str, Any]) -> str:
    n = len(res["checks"])
    if not n:
        return "-"
    m = res["checks_matched"]
    return f"{m}/{n} match" if m == n else f"**{m}/{n} match**"


def _cached(res: dict[str, Any]) -> str:
    samples = res["samples"]
    if not samples:
        return "-"
    prompt = sum(s["prompt_tokens"] or 0 for s in samples)
    if any(s["cached_tokens"] is None for s in samples):
        return f"? / {prompt}"
    return f"{sum(s['cached_tokens'] for s in samples)} / {prompt}"


def _label(w: dict[str, Any]) -> str:
    return f"{w['title']} ({w['model']})"


def _short(label: str) -> str:
    return label if len(label) <= 18 else label[:17] + "…"
