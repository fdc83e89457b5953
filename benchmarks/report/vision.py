"""RESULTS.md's section for the image study (studies/vision.py, `make bench-vision`): the
image conversation, side by side, from the newest run kept in benchmarks/results/vision/,
and its goals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..names import MLX_VLM, OURS, VLLM

RUNS = "results/vision"  # under the report dir
ORDER = (OURS, MLX_VLM, VLLM)


def keep(doc: dict[str, Any], report_dir: Path) -> Path:
    """Store a run's document; only the newest is shown (older ones stay for HISTORY.md)."""
    folder = report_dir / RUNS
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{doc['timestamp']}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def newest(report_dir: Path) -> dict[str, Any] | None:
    runs = sorted((report_dir / RUNS).glob("*.json"))
    return json.loads(runs[-1].read_text()) if runs else None


def _share(cached: int | None, shared: int) -> float | None:
    return None if cached is None else cached / shared


def goals(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per server: each goal's measured value and whether it is met (None: not measured)."""
    k = doc["keys"]
    out: dict[str, dict[str, Any]] = {}
    for name, s in doc["servers"].items():
        t2, t3, swap = s["turn2"], s["turn3"], s["swap"]
        r2 = _share(t2["cached_tokens"], k["shared"]["turn2"])
        r3 = _share(t3["cached_tokens"], k["shared"]["turn3"])
        ttft = t2["ttft_s"] / s["cold_turn2"]["ttft_s"]
        past = None if swap["cached_tokens"] is None else swap["cached_tokens"] > k["image_start"]
        # The swap's answer tells only where the images change the answer at all.
        telling = s["turn1"]["text"] != s["swap_fresh"]["text"]
        same = swap["text"] == s["swap_fresh"]["text"]
        out[name] = {
            "turn2_reuse": (r2, None if r2 is None else r2 >= 0.95),
            "turn3_reuse": (r3, None if r3 is None else r3 >= 0.95),
            "swap_reused_past_image": (past, None if past is None else not past),
            "swap_answers_as_fresh": (same if telling else None, same if telling else None),
            "ttft_turn2_over_cold": (ttft, ttft <= 0.3),
        }
    return out


def _ratio(value: float | None) -> str:
    return "not reported" if value is None else f"{value:.2f}"


def _status(met: bool | None) -> str:
    return "-" if met is None else ("met" if met else "**not met**")


def lines(doc: dict[str, Any] | None) -> list[str]:
    if doc is None:
        return []
    k, g = doc["keys"], goals(doc)
    names = [n for n in ORDER if n in doc["servers"]]
    m = doc["machine"]
    out = [
        "",
        "## Images in an agent conversation",
        "",
        f"`benchmarks/studies/vision.py`, run {doc['timestamp']} on {m['cpu']} "
        f"({m['cores']} cores; load average {doc['load'][0]} / {doc['load'][1]} at start / "
        f"end), {doc['model']}. A system prompt of ~{doc['system_tokens']} tokens, "
        "then turn 1 with a 256x256 screenshot, turn 2 a follow-up question, turn 3 a new "
        "screenshot of the same size; *cold turn 2*: turn 2 behind a system prompt that "
        "starts with one more word; *swap*: turn 1 with another image of the same size, "
        "sent after the conversation, and first on a fresh process for its reference "
        "answer. Shared prefixes counted on mlx-prefix's key (turn 2 shares "
        f"{k['shared']['turn2']} tokens with turn 1, turn 3 {k['shared']['turn3']} with "
        f"turn 2; the swap shares {k['shared']['swap']} with turn 1, its image starts at "
        f"{k['image_start']}). Each server its own process, one after another, greedy, "
        f"{_peer_notes(doc)}",
        "",
        "| measure | goal | " + " | ".join(names) + " |",
        "|---|---|" + "---|" * len(names),
    ]
    rows = (
        ("turn 2: cached / shared with turn 1", "turn2_reuse", ">= 0.95", _ratio),
        ("turn 3: cached / shared with turns 1-2", "turn3_reuse", ">= 0.95", _ratio),
        ("swap: reused past the image's start", "swap_reused_past_image", "no", _yes_no),
        ("swap: answers as on a fresh server", "swap_answers_as_fresh", "yes", _yes_no),
        ("TTFT turn 2 / cold turn 2", "ttft_turn2_over_cold", "<= 0.30x", _ratio),
    )
    for label, key, goal, fmt in rows:
        cells = [f"{fmt(g[n][key][0])} ({_status(g[n][key][1])})" for n in names]
        out.append(f"| {label} | {goal} | " + " | ".join(cells) + " |")
    out += ["", "| request | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    lengths = {**k["lengths"], "cold_turn2": k["lengths"]["turn2"] + 1}
    lengths["swap_fresh"] = k["lengths"]["swap"]
    for req in ("turn1", "turn2", "cold_turn2", "turn3", "swap_fresh", "swap"):
        cells = [_request_cell(doc["servers"][n][req]) for n in names]
        out.append(f"| {req} (~{lengths[req]} tokens) | " + " | ".join(cells) + " |")
    for name, why in doc.get("left_out", {}).items():
        out.append(f"\n{name} left out of this run: {why}")
    return out


def _yes_no(value: bool | None) -> str:
    return "not told" if value is None else ("yes" if value else "no")


def _request_cell(r: dict[str, Any]) -> str:
    cached = "-" if r["cached_tokens"] is None else r["cached_tokens"]
    ttft = "-" if r["ttft_s"] is None else f"{r['ttft_s'] * 1000:.0f} ms"
    return f"{ttft}, {cached} of {r['prompt_tokens']} cached"


def _peer_notes(doc: dict[str, Any]) -> str:
    v = doc.get("versions", {})
    return (
        f"max {doc['max_tokens']} tokens. mlx-vlm {v.get('mlx-vlm', '?')}'s server runs from "
        "vllm-mlx's venv (it has mlx-vlm's full dependencies) with its automatic prefix cache on "
        "(`APC_ENABLED=1`, memory only); vllm-mlx with `--mllm`. *Not reported*: the server "
        "sends no `cached_tokens`; *not told*: the two images give the same answer there, "
        "so the answer cannot tell. What the peers do with images (read from their "
        "source, the versions above): vllm-mlx takes only text-only requests into its "
        "prefix cache (`is_text_only_prefix_cache_request`: how it closed its issue #718, "
        "a same-size image reusing another's state), so a conversation with an image "
        "reuses nothing, right or wrong; mlx-vlm salts every cached block with one hash "
        "of all the request's images, so turn 3's new image and the swap share nothing, "
        "not even the text before the first image."
    )
