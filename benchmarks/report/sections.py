"""RESULTS.md's sections for the parallel burst, requests per second, resident memory,
the cache restore cost and the prefill with and without the fast BLAS."""

from __future__ import annotations

from typing import Any

from ..names import OURS, SERVERS
from . import claims
from .format import _s


def burst_lines(doc: dict[str, Any]) -> list[str]:
    rows = []
    for w in doc["workloads"]:
        if w["workload"] != "burst" or w["skipped"]:
            continue
        for name in SERVERS:
            e = w["servers"].get(name, {}).get("extra", {})
            if "cold_wall_s" in e:
                phases = ("cold", "warm", "unique")
                walls = " | ".join(_s(e.get(f"{p}_wall_s"), 1) for p in phases)
                tokens = [e.get(f"{p}_completion_tokens") for p in phases]
                rows.append(
                    f"| {w['model']} | {name} | {walls} | "
                    + " / ".join("-" if t is None else str(t) for t in tokens)
                    + " |"
                )
    if not rows:
        return []
    return [
        "",
        "## Parallel burst",
        "",
        "Wall times compare only where both servers generated as many tokens (the goals "
        "are not judged otherwise). *unique*: a cold burst on a new instruction whose "
        "requests each add their own snippet (~150 tokens in the quick and full profiles).",
        "",
        "| model | server | cold burst wall s | warm burst wall s | unique burst wall s "
        "| completion tokens cold / warm / unique |",
        "|---|---|---:|---:|---:|---:|",
        *rows,
    ]


def concurrency_lines(doc: dict[str, Any]) -> list[str]:
    rows, levels = [], []
    for w in doc["workloads"]:
        if w["workload"] != "concurrency" or w["skipped"]:
            continue
        for name in SERVERS:
            e = w["servers"].get(name, {}).get("extra", {})
            found = sorted(int(k[4:]) for k in e if k.startswith("rps_"))
            levels = levels or found
            if found:
                cells = " | ".join(_s(e.get(f"rps_{n}"), 2) for n in levels)
                rows.append(f"| {w['model']} | {name} | {cells} |")
    if not rows:
        return []
    head = " | ".join(f"{n} client{'s' if n > 1 else ''}" for n in levels)
    return [
        "",
        "## Requests per second",
        "",
        f"| model | server | {head} |",
        "|---|---|" + "---:|" * len(levels),
        *rows,
    ]


def memory_lines(doc: dict[str, Any]) -> list[str]:
    rows = []
    for w in doc["workloads"]:
        if w["workload"] != "memory" or w["skipped"]:
            continue
        for name in SERVERS:
            e = w["servers"].get(name, {}).get("extra", {})
            rss = [r for r in e.get("rss_mib", []) if r is not None]
            if rss:
                cache = _s(e.get("cache_bytes_mib"), 1)
                evictions = "-" if e.get("evictions") is None else str(e["evictions"])
                rows.append(
                    f"| {w['model']} | {name} | {e['cap']} | {len(rss) - 1} | "
                    f"{rss[0]:.0f} | {rss[-1]:.0f} | {max(rss):.0f} | {cache} | {evictions} |"
                )
    if not rows:
        return []
    return [
        "",
        "## Resident memory",
        "",
        "*cache MiB* and *evictions*: the prompt cache's own count at the end (mlx-prefix's "
        "`GET /v1/cache`; mlx_lm.server reports none).",
        "",
        "| model | server | cache cap | requests | RSS start MiB | RSS end MiB | RSS max MiB "
        "| cache MiB | evictions |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
        *rows,
    ]


def restore_lines(doc: dict[str, Any]) -> list[str]:
    w = next((w for w in doc["workloads"] if w["workload"] == "restore"), None)
    if w is None or w["skipped"]:
        return []
    extra = w["servers"][OURS]["extra"]
    rows, shape = extra.get("rows") or [], extra.get("shape", {})
    if not rows:
        return []
    mlx = doc["versions"].get("mlx", "?")
    lines = [
        "",
        "## Cache restore cost",
        "",
        f"A KV cache shaped like the dense model ({shape.get('layers')} layers, "
        f"{shape.get('heads')} KV heads, head dim {shape.get('dim')}, float32), in-process "
        "(`benchmarks/workloads/restore.py`), medians. *restore* = `snapshot.restore` alone "
        "(fresh cache objects sharing the snapshot's arrays); *lookup + restore* = what a "
        "request pays: trie match, acquire, restore, release; *mlx_lm fetch* = "
        "`LRUPromptCache.fetch_nearest_cache`, its trie walk and a `copy.deepcopy` of the "
        f"cache objects, which in MLX {mlx} {claims.deepcopy_shares(rows)}. *+MiB* = active "
        f"MLX memory the restored cache adds: {claims.restore_copies(rows)}.",
        "",
        "| tokens | prefix MiB | restore ms | lookup + restore ms | mlx_lm fetch ms "
        "| mlx-prefix +MiB | mlx_lm +MiB |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['tokens']} | {r['prefix_mib']:.1f} | {r['restore_ms']:.2f} | "
            f"{r['lookup_restore_ms']:.2f} | {r['mlx_lm_fetch_ms']:.2f} | "
            f"{r['restore_extra_mib']:.1f} | {r['mlx_lm_extra_mib']:.1f} |"
        )
    lines += [
        "",
        "The copy happens at the first write, for both: one decode token into every layer "
        "of the restored cache. mlx-prefix's restored KV arrays end exactly at the prefix, "
        "so the first `update_and_fetch` allocates a larger buffer and copies into it; "
        "mlx_lm's fetched cache writes into a step-padded buffer its stored entry still "
        "references, so MLX copies that buffer before writing. Either way the stored "
        f"entry is never changed. {claims.first_write(rows)}",
        "",
        "| tokens | mlx-prefix 1st write ms | mlx_lm 1st write ms | mlx-prefix 1st write +MiB "
        "| mlx_lm 1st write +MiB |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['tokens']} | {r['first_write_ms']:.1f} | {r['mlx_lm_first_write_ms']:.1f} | "
            f"{r['first_write_extra_mib']:.1f} | {r['mlx_lm_first_write_extra_mib']:.1f} |"
        )
    return lines


def blas_lines(doc: dict[str, Any]) -> list[str]:
    w = next((w for w in doc["workloads"] if w["workload"] == "blas"), None)
    if w is None or w["skipped"]:
        return []
    res = w["servers"].get(OURS, {})
    rows = res.get("extra", {}).get("rows") or []
    if not rows:
        return []
    base = rows[0]["tokens_per_s"]
    lines = [
        "",
        "## Prefill with and without the fast BLAS",
        "",
        f"One cold prefill on {res['extra'].get('model', w['model'])} "
        "(`benchmarks/workloads/blas.py`), each in a fresh process: first with the BLAS MLX "
        "brings (on Linux, the mlx[cpu] wheel's reference BLAS), then with the one the "
        f"`mlx-prefix` launcher preloads ({rows[-1]['blas']}): "
        f"{claims.fast_blas_used(doc, rows[-1]['blas'])}.",
        "",
        "| BLAS | tokens | seconds | tokens/s | speed-up |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['blas']} | {r['tokens']} | {r['seconds']:.2f} | {r['tokens_per_s']:.1f} | "
            f"{r['tokens_per_s'] / base:.1f}x |"
        )
    lines += [f"\n{n}" for n in res.get("notes", [])]
    return lines
