"""Memory under a small cache budget (issue 35, item 11): does the server stay near it?

`mlx-prefix serve` with the bundled SmolLM2-135M-Instruct (float32), `--cache-budget
64MiB --disk-cache off` (servers.py), fast BLAS preloaded. Ten warm-up chats, then 150
distinct chats of ~150 words each (consecutive KJV verses from distinct offsets, so no
two share more than the chat template), each asking for a 2-token reply, one at a time.
The server's RSS (/proc VmRSS) is read after the warm-ups and after every request; the
figure to watch is its growth over the 150, against the budget. The store's own count of
what it holds (GET /v1/cache) is reported beside it.

    python -m mlx_prefix.blas_exec python -m benchmarks.bench_memory [--budget 64MiB]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import httpx

from .corpus import verses
from .models import dense_model
from .servers import OURS, Server, ServerSpec

WARMUPS = 10
PROMPTS = 150
WORDS = 150
MiB = 1 << 20


def prompt_words(index: int, words: int = WORDS) -> str:
    """`words` words of consecutive verses, starting at a verse far from every other
    index's, so no two prompts share text."""
    vs = verses()
    out: list[str] = []
    i = (index * 97) % len(vs)
    while len(out) < words:
        out += vs[i].split()
        i = (i + 1) % len(vs)
    return " ".join(out[:words])


def chat(client: httpx.Client, index: int) -> dict[str, Any]:
    body = {
        "messages": [
            {"role": "user", "content": f"{prompt_words(index)}\n\nWho speaks here?"},
        ],
        "max_tokens": 2,
        "temperature": 0.0,
    }
    reply = client.post("/v1/chat/completions", json=body)
    reply.raise_for_status()
    return reply.json()


def machine() -> str:
    cpu = platform.processor()
    try:
        names = [ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if "model name" in ln]
        cpu = names[0].split(":", 1)[1].strip() if names else cpu
    except OSError:
        pass
    return f"{platform.system()} {platform.machine()}, {cpu}, {os.cpu_count()} cores"


def parse_size(text: str) -> int:
    units = {"KIB": 1 << 10, "MIB": MiB, "GIB": 1 << 30}
    for unit, scale in units.items():
        if text.upper().endswith(unit):
            return int(float(text[: -len(unit)]) * scale)
    return int(text)


def measure(budget: str, prompts: int, warmups: int, log_dir: Path) -> dict[str, Any]:
    model = dense_model()
    spec = ServerSpec(OURS, model.path, ("--cache-budget", budget), label="memory")
    server = Server(spec, log_dir).start()
    blas = server.blas()
    try:
        with httpx.Client(base_url=server.url, timeout=600.0) as client:
            for i in range(warmups):
                chat(client, 100_000 + i)
            base = server.rss_bytes() or 0
            rss: list[int] = []
            prompt_tokens: list[int] = []
            started = time.perf_counter()
            for i in range(prompts):
                reply = chat(client, i)
                prompt_tokens.append(reply["usage"]["prompt_tokens"])
                rss.append(server.rss_bytes() or 0)
            elapsed = time.perf_counter() - started
            stats = client.get("/v1/cache").json()["stats"]
    finally:
        server.stop()
    budget_bytes = parse_size(budget)
    growth = rss[-1] - base
    return {
        "model": model.description,
        "machine": machine(),
        "blas": blas,
        "budget_bytes": budget_bytes,
        "warmups": warmups,
        "prompts": prompts,
        "prompt_tokens_mean": sum(prompt_tokens) / len(prompt_tokens),
        "rss_after_warmup_mib": base / MiB,
        "rss_end_mib": rss[-1] / MiB,
        "rss_peak_mib": max(rss) / MiB,
        "growth_mib": growth / MiB,
        "peak_growth_mib": (max(rss) - base) / MiB,
        "growth_over_budget": growth / budget_bytes,
        "rss_every_10_mib": [round(r / MiB, 1) for r in rss[9::10]],
        "store_stats": stats,
        "seconds": elapsed,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", default="64MiB", help="--cache-budget for the server")
    parser.add_argument("--prompts", type=int, default=PROMPTS)
    parser.add_argument("--warmups", type=int, default=WARMUPS)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/memory"))
    args = parser.parse_args(argv)
    result = measure(args.budget, args.prompts, args.warmups, args.out / "logs")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "memory.json").write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"budget {result['budget_bytes'] / MiB:.0f} MiB: RSS {result['rss_after_warmup_mib']:.0f}"
        f" -> {result['rss_end_mib']:.0f} MiB after {result['prompts']} prompts"
        f" (growth {result['growth_mib']:.0f} MiB = {result['growth_over_budget']:.2f}x the"
        f" budget; peak growth {result['peak_growth_mib']:.0f} MiB)"
    )
    print("RSS every 10 prompts (MiB):", result["rss_every_10_mib"])


if __name__ == "__main__":
    main()
