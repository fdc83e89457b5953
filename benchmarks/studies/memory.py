"""Memory under a small cache budget (issue 35, item 11): does the server stay near it?

`mlx-prefix serve` with the bundled SmolLM2-135M-Instruct (float32), `--cache-budget
64MiB --disk-cache off` (servers.py), fast BLAS preloaded. Ten warm-up chats, then 150
distinct chats of ~150 words each (consecutive KJV verses from distinct offsets, so no
two share more than the chat template), each asking for a 2-token reply, one at a time.
The server's RSS (/proc VmRSS) is read after the warm-ups and after every request; the
figure to watch is its growth over the 150, against the budget. The store's own count of
what it holds (GET /v1/cache) is reported beside it.

Two more measurements (`--mode`):
- burst (issue 47): 16 chats at once; RSS before the burst (idle), right after its last
  reply, and after 3 s idle (the engine trims the freed heap once it goes idle,
  EngineConfig.idle_trim_s); run again with the trim off (MLX_PREFIX_ENGINE_IDLE_TRIM_S=
  none) for the figure without it.
- swaps (issue 44): a second model loaded on demand beside SmolLM2 (--max-models 2,
  --keep-alive 2s): RSS before it loads, once loaded, once unloaded when idle (goal:
  within 10% of before); then --max-models 1, RSS after each of three swaps and back.

Measured 2026-11-27 on a 2-core AMD EPYC (Linux, OpenBLAS), SmolLM2-135M float32:
- burst: RSS 715 MiB before, 1116 right after the burst, 716 after 3 s idle with the
  trim; 1117 still after 3 s without it (glibc kept the burst's 400 MiB of freed heap).
- swaps, idle unload: 667 MiB before the second model loads, 735 loaded, 687 once it was
  unloaded when idle (1.03x before: the goal is 1.10x). Swaps with --max-models 1: start
  668, then micro 163 / SmolLM2 702, 209 / 728, 214 / 732 over three swaps (before the
  trim on unload: 171 -> 702 -> 1222 -> 1700, ~500 MiB kept per swap).

    python -m mlx_prefix.blas_exec python -m benchmarks.studies.memory [--budget 64MiB]
    python -m mlx_prefix.blas_exec python -m benchmarks.studies.memory --mode burst
    python -m mlx_prefix.blas_exec python -m benchmarks.studies.memory --mode swaps
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

from ..corpus import verses
from ..models import dense_model
from ..servers import OURS, Server, ServerSpec

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


BURST = 16
IDLE_S = 3.0  # idle long enough for the engine's trim (1 s) and the pool's poll


def burst(log_dir: Path, trim: bool) -> dict[str, Any]:
    """RSS before a burst of BURST chats, right after it, and after IDLE_S idle."""
    from concurrent.futures import ThreadPoolExecutor

    model = dense_model()
    spec = ServerSpec(OURS, model.path, (), label="burst" if trim else "burst-no-trim")
    saved = os.environ.get("MLX_PREFIX_ENGINE_IDLE_TRIM_S")
    os.environ["MLX_PREFIX_ENGINE_IDLE_TRIM_S"] = "1.0" if trim else "none"
    try:
        server = Server(spec, log_dir).start()
    finally:
        if saved is None:
            os.environ.pop("MLX_PREFIX_ENGINE_IDLE_TRIM_S")
        else:
            os.environ["MLX_PREFIX_ENGINE_IDLE_TRIM_S"] = saved
    try:
        with httpx.Client(base_url=server.url, timeout=600.0) as client:
            chat(client, 200_000)
            time.sleep(IDLE_S)
            before = server.rss_bytes() or 0
            with ThreadPoolExecutor(BURST) as pool:
                list(pool.map(lambda i: chat(client, 300_000 + i), range(BURST)))
            right_after = server.rss_bytes() or 0
            time.sleep(IDLE_S)
            idle = server.rss_bytes() or 0
    finally:
        server.stop()
    return {
        "trim": trim,
        "burst": BURST,
        "rss_before_mib": before / MiB,
        "rss_right_after_mib": right_after / MiB,
        "rss_idle_mib": idle / MiB,
    }


def swaps(log_dir: Path) -> dict[str, Any]:
    """A second model loaded beside SmolLM2 and unloaded when idle; then swapped in and
    out three times with --max-models 1."""
    from mlx_prefix.models.testing import make_test_model

    from ..models import dense_model as default

    micro = Path(log_dir).parent / "micro-model"
    if not (micro / "config.json").is_file():
        make_test_model("dense", micro)
    base = default()

    def serve(*args: str) -> Server:
        spec = ServerSpec(OURS, base.path, ("--allowed-models", str(micro), *args), "swaps")
        return Server(spec, log_dir).start()

    def ask(client: httpx.Client, model: str) -> None:
        body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        client.post("/v1/chat/completions", json=body).raise_for_status()

    out: dict[str, Any] = {}
    server = serve("--max-models", "2", "--keep-alive", "2s")
    try:
        with httpx.Client(base_url=server.url, timeout=600.0) as client:
            ask(client, "default")
            time.sleep(IDLE_S)
            out["idle_before_load_mib"] = (server.rss_bytes() or 0) / MiB
            ask(client, str(micro))
            out["idle_loaded_mib"] = (server.rss_bytes() or 0) / MiB
            deadline = time.monotonic() + 60
            while str(micro) in [m["id"] for m in client.get("/v1/ps").json()["models"]]:
                if time.monotonic() > deadline:
                    raise RuntimeError("the second model was not unloaded when idle")
                time.sleep(0.25)
            time.sleep(1.0)
            out["idle_unloaded_mib"] = (server.rss_bytes() or 0) / MiB
    finally:
        server.stop()
    server = serve("--max-models", "1")
    try:
        with httpx.Client(base_url=server.url, timeout=600.0) as client:
            ask(client, "default")
            time.sleep(IDLE_S)
            steps = [("start", (server.rss_bytes() or 0) / MiB)]
            for i in range(3):
                for name, model in (("micro", str(micro)), ("default", "default")):
                    ask(client, model)
                    time.sleep(IDLE_S)
                    steps.append((f"swap {i + 1} -> {name}", (server.rss_bytes() or 0) / MiB))
            out["swaps_mib"] = steps
    finally:
        server.stop()
    out["unloaded_over_before"] = out["idle_unloaded_mib"] / out["idle_before_load_mib"]
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=("growth", "burst", "swaps"), default="growth")
    parser.add_argument("--budget", default="64MiB", help="--cache-budget for the server")
    parser.add_argument("--prompts", type=int, default=PROMPTS)
    parser.add_argument("--warmups", type=int, default=WARMUPS)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/memory"))
    args = parser.parse_args(argv)
    if args.mode != "growth":
        args.out.mkdir(parents=True, exist_ok=True)
        if args.mode == "burst":
            result = {
                "machine": machine(),
                "runs": [burst(args.out / "logs", t) for t in (True, False)],
            }
        else:
            result = {"machine": machine(), **swaps(args.out / "logs")}
        (args.out / f"{args.mode}.json").write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(result, indent=1))
        return
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
