"""Sentences RESULTS.md states about a run, each derived from what the run measured or
recorded (never a fixed claim): which BLAS each server loaded, whether a restore
copies the prefix, what the first write after a restore costs."""

from __future__ import annotations

from typing import Any

from ..names import OURS, PEER

COPY_SHARE = 0.01  # more memory than this share of the prefix is a copy


def _blas_name(blas: str) -> str:
    return "the slow reference BLAS" if blas == "reference" else blas


def _servers_blas(doc: dict[str, Any]) -> dict[str, str]:
    """Server -> the BLAS it loaded (several models: every one seen), as recorded."""
    seen: dict[str, set[str]] = {}
    for info in doc.get("models", {}).values():
        for server, blas in (info.get("blas") or {}).items():
            seen.setdefault(server, set()).add(blas or "unknown")
    return {s: " / ".join(sorted(b)) for s, b in seen.items()}


def servers_blas(doc: dict[str, Any]) -> str:
    """'both with openblas' ('all 3 with'), or each server's, or that it was not recorded."""
    per = _servers_blas(doc)
    if not per:
        return "the BLAS each server loaded was not recorded"
    if len(per) > 1 and len(set(per.values())) == 1:
        every = "both" if len(per) == 2 else f"all {len(per)}"
        return f"{every} with {_blas_name(next(iter(per.values())))}"
    return ", ".join(f"{s} with {_blas_name(b)}" for s, b in per.items())


def fast_blas_used(doc: dict[str, Any], fast: str) -> str:
    """Whether the servers of this run loaded the BLAS the launcher preloads (`fast`)."""
    per = _servers_blas(doc)
    if not per:
        return "the servers' BLAS was not recorded"
    if all(b == fast for b in per.values()):
        every = "both servers" if len(per) == 2 else "every server"
        return f"which {every} ran with here" if len(per) > 1 else "which the server ran with"
    return "the servers ran with " + ", ".join(f"{_blas_name(b)} ({s})" for s, b in per.items())


def _copies(rows: list[dict[str, Any]], key: str) -> dict[str, Any] | None:
    """The row where the restore added the most memory, if that was a copy."""
    worst = max(
        rows, key=lambda r: (r[key] / r["prefix_mib"] if r["prefix_mib"] else 0, r["tokens"])
    )
    return worst if worst[key] >= COPY_SHARE * worst["prefix_mib"] else None


def restore_copies(rows: list[dict[str, Any]]) -> str:
    """What the restores' added memory shows: no copy, or who copied how much."""
    found = {OURS: _copies(rows, "restore_extra_mib"), PEER: _copies(rows, "mlx_lm_extra_mib")}
    if not any(found.values()):
        return f"neither side copied the prefix at restore (under {COPY_SHARE:.0%} of it added)"
    keys = {OURS: "restore_extra_mib", PEER: "mlx_lm_extra_mib"}
    parts = [
        f"{name} added {r[keys[name]]:.1f} MiB for a {r['prefix_mib']:.1f} MiB prefix at "
        f"{r['tokens']} tokens (a copy)"
        if r is not None
        else f"{name} copied nothing"
        for name, r in found.items()
    ]
    return "; ".join(parts)


def deepcopy_shares(rows: list[dict[str, Any]]) -> str:
    """How mlx-lm's deepcopy of the cache treated the arrays, from its added memory."""
    if _copies(rows, "mlx_lm_extra_mib"):
        return "copies the arrays"
    return "shares each array's buffer rather than copying it"


def first_write(rows: list[dict[str, Any]]) -> str:
    """The first write's cost at the longest prefix, as a share of the prefix's memory."""
    r = rows[-1]
    share = {
        name: r[key] / r["prefix_mib"] if r["prefix_mib"] else 0.0
        for name, key in (
            (OURS, "first_write_extra_mib"),
            (PEER, "mlx_lm_first_write_extra_mib"),
        )
    }
    return (
        f"At {r['tokens']} tokens the first write took {r['first_write_ms']:.0f} ms and added "
        f"{share[OURS]:.0%} of the prefix's memory for mlx-prefix, "
        f"{r['mlx_lm_first_write_ms']:.0f} ms and {share[PEER]:.0%} for mlx_lm."
    )
