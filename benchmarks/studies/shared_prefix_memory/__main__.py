"""`python -m benchmarks.studies.shared_prefix_memory`: one part's run, or the table of
the runs kept in benchmarks/out/ (see __init__.py)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from ..memory import machine
from . import __doc__ as DOC
from .serve import OUT, MiB, measure_memory
from .sessions import measure_restore, measure_sessions


def _load(part: str, label: str) -> dict[str, Any] | None:
    path = OUT / f"shared_prefix_memory-{part}-{label}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / MiB:,.0f} MiB"


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _ms(v: float | None) -> str:
    return "-" if v is None else (f"{v:,.0f}" if v >= 10 else f"{v:.1f}")


def table(labels: tuple[str, str] = ("before", "after")) -> str:
    """The markdown section of the runs found in benchmarks/out/."""
    lines = ["## Each cached token stored once (issue 48)", ""]
    first = _load("memory", labels[0]) or {}
    lines += [
        f"`benchmarks/studies/shared_prefix_memory`, {first.get('date', '?')}, on "
        f"{first.get('machine', '?')} (shared with other work: load average ~20 on 2 "
        "cores, so times are noisy; bytes and tokens are exact). *before* = main's code, "
        "*after* = the chained entries, same machine, same day.",
        "",
        "Bytes held per distinct token's KV: SmolLM2-135M-Instruct float32 (46,080 B/token), "
        "three interleaved five-turn conversations, two sharing a system prompt, "
        "`--disk-cache off` (the disk row: `--disk-cache full`, bytes of the files).",
        "",
        "| code | entries | distinct tokens | their KV | held | held / KV | disk files / KV "
        "| regenerate / edit / turn before: cached of prompt | warm-turn TTFT, median s |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for label in labels:
        mem, disk = _load("memory", label), _load("memory-disk", label)
        if mem is None:
            continue
        h = mem["held"]
        d = (disk or {}).get("disk")
        on_disk = f"{d['bytes'] / h['kv_bytes']:.2f}x" if d and h["kv_bytes"] else "-"
        f = mem["follow_ups"]
        again = " / ".join(
            f"{f[k]['cached_tokens']} of {f[k]['prompt_tokens']}"
            for k in ("regenerate", "edit", "turn_before")
        )
        warm = _median([t["ttft_s"] for t in mem["turns"] if t["turn"] > 1])
        lines.append(
            f"| {label} | {h['entries']} | {h['distinct_tokens']:,} | {_mib(h['kv_bytes'])} "
            f"| {_mib(h['held_bytes'])} | **{h['ratio']:.2f}x** | {on_disk} | {again} "
            f"| {warm:.1f} |"
        )
    lines += [
        "",
        "Restore and warm-turn TTFT by prefix length: in process, a random llama with "
        "SmolLM2's tokenizer and a 128K context, 4 layers, 2 KV heads of 64 (4,096 B of KV "
        "per token; SmolLM2's context is 8K and it prefills 16K-64K far too slowly here). "
        "Turn 2 and 3 add ~100 tokens each to a cold turn 1; *regenerate* is turn 3 again "
        "(restored from its own entry: after the change a chain of three pieces), median "
        "of 5. *restore* = `restore_longest` with the restored state evaluated (after: the "
        "pieces assembled into one buffer; before: views), *first step* = the prefill step "
        "after it (before: where the first append copies the prefix), milliseconds.",
        "",
        "| tokens | code | turn 2: restore / first step / TTFT | turn 3: restore / first "
        "step / TTFT | regenerate: restore / first step / TTFT |",
        "|---:|---|---|---|---|",
    ]
    for n in sorted(
        {r["tokens"] for lb in labels for r in (_load("restore", lb) or {}).get("rows", [])}
    ):
        for label in labels:
            rows = [r for r in (_load("restore", label) or {}).get("rows", []) if r["tokens"] == n]
            if not rows:
                continue
            cells = []
            for turn in (2, 3, 4):
                rs = [r for r in rows if r["turn"] == turn]
                cells.append(
                    " / ".join(
                        _ms(_median([r[k] for r in rs]))
                        for k in ("restore_ms", "first_step_ms", "ttft_ms")
                    )
                )
            lines.append(f"| {n:,} | {label} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "What it buys: eight interleaved agent sessions (a shared 600-token system prompt, "
        "11 steps of ~330-token tool results and 16-token replies: ~4.2K tokens each), "
        "round robin, under one byte budget for every server (mlx-prefix `--cache-budget`, "
        "mlx_lm.server `--prompt-cache-bytes`, vllm-mlx `--cache-memory-mb`), the tiny "
        "llama above. Tokens reused per turn: cached tokens reported, steps 2-11.",
        "",
        "| server | code | budget | reused per turn | of prompt | held at the end | entries "
        "| evictions |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label in labels:
        sess = _load("sessions", label)
        if sess is None:
            continue
        for name, r in sess["servers"].items():
            if "error" in r:
                lines.append(f"| {name} | {label} | - | failed: {r['error'][:80]} | | | | |")
                continue
            lines.append(
                f"| {name} | {label} | {_mib(sess['budget_bytes'])} "
                f"| {r['reused_per_turn']:,.0f} | {r['reused_share']:.0%} "
                f"| {_mib(r.get('held_bytes'))} | {r.get('entries', '-')} "
                f"| {r.get('evictions', '-')} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=DOC, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--part", choices=("memory", "sessions", "restore", "table"), required=True)
    p.add_argument("--label", default="", help="before | after (names the output file)")
    p.add_argument("--disk", action="store_true", help="memory: with the disk tier on")
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--system-tokens", type=int, default=460)
    p.add_argument("--user-tokens", type=int, default=250)
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--steps", type=int, default=11)
    p.add_argument("--session-system-tokens", type=int, default=600)
    p.add_argument("--result-tokens", type=int, default=330)
    p.add_argument("--reply-tokens", type=int, default=16)
    p.add_argument("--budget", type=int, default=112 * MiB)
    p.add_argument(
        "--servers", type=lambda x: x.split(","), default=None,
        help="sessions: labels to run (ours, peer, vllm-mlx; default: all)",
    )  # fmt: skip
    p.add_argument("--repeat", type=int, default=5, help="restore: regenerates of turn 3")
    p.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")],
                   default=[2048, 16384, 65536])  # fmt: skip
    args = p.parse_args()
    log_dir = OUT / "logs"
    if args.part == "table":  # from the runs in benchmarks/out/
        print(table(), end="")
        return
    if not args.label:
        p.error("--label is required to run a part")
    if args.part == "memory":
        result = measure_memory(args, log_dir)
    elif args.part == "sessions":
        result = measure_sessions(args, log_dir)
    else:
        result = measure_restore(args)
    import mlx_prefix

    result.update(
        label=args.label,
        machine=machine(),
        python=platform.python_version(),
        mlx_prefix=str(Path(mlx_prefix.__file__).resolve().parent),
        date=time.strftime("%Y-%m-%d %H:%M"),
        blas=os.environ.get("LD_PRELOAD", ""),
    )
    suffix = "-disk" if args.part == "memory" and args.disk else ""
    out = OUT / f"shared_prefix_memory-{args.part}{suffix}-{args.label}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
