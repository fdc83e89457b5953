"""Load and unload, over and over (issue 52, item 4): does the server's memory stay flat?

`mlx-prefix serve` with a micro random model as `--model`, a second model loaded on demand
(`--allowed-models`, `--max-models 2`) and unloaded when idle (`--keep-alive`): the
bundled SmolLM2-135M-Instruct (float32; `--kind text`), or a random vision model with
a tower of ~50 MB (`--kind vision`, its tower fed one image per cycle). One
request for the default model, then CYCLES times: one request for the second model,
wait until GET /v1/ps no longer lists it, 1 s more, read the server's RSS (/proc VmRSS).
The figure to watch is the spread of RSS over the cycles (goal: within 10 MiB) and the
last cycle against the first.

Writes <out>/unload_<kind>.json and benchmarks/results/standalone/unload_<kind>.md.

    python -m mlx_prefix.blas_exec python -m benchmarks.studies.unload [--kind text|vision]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

from ..servers import OURS, Server, ServerSpec
from .memory import machine

CYCLES = 20
IDLE_S = 1.0  # after the unload: the unload's own trim has run; the engine's idle trim too
MiB = 1 << 20
# Qwen3.5's tiny test tower made wide and deep: ~12.6M float32 parameters, ~50 MB.
WIDE_TOWER = {"hidden_size": 512, "intermediate_size": 2048, "num_heads": 8, "depth": 4}
HERE = Path(__file__).resolve().parents[1]  # benchmarks/
STANDALONE = HERE / "results" / "standalone"


def second_model(kind: str, root: Path) -> Path:
    """The model loaded on demand: SmolLM2 (text) or a random vision model whose tower
    holds ~50 MB of float32 weights (vision)."""
    if kind == "text":
        from ..models import dense_model

        return dense_model().path
    from mlx_prefix.vision.testing import make_vision_test_model

    tests = HERE.parent / "tests" / "data"
    folder = root / "vision-model"
    if not (folder / "config.json").is_file():
        make_vision_test_model(
            "qwen3_5",
            folder,
            tokenizer=tests / "tokenizers" / "qwen3",
            chat_template=(tests / "templates" / "Qwen3.5-4B.jinja").read_text(),
            vision_overrides=WIDE_TOWER,
        )
    return folder


def picture_url(seed: int) -> str:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, (224, 224, 3), dtype=np.uint8))
    out = io.BytesIO()
    img.save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def ask(client: httpx.Client, model: str, image: str | None = None) -> None:
    content: Any = "Hi"
    if image is not None:
        content = [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": image}},
        ]
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    client.post("/v1/chat/completions", json=body).raise_for_status()


def wait_unloaded(log: Path, count: int, limit_s: float = 120.0) -> None:
    """Until the server's log says its `count`th unload is done (GET /v1/ps stops listing
    a model as its unload starts: the memory is given back at its end)."""
    deadline = time.monotonic() + limit_s
    while log.read_text(errors="replace").count(" unloaded in ") < count:
        if time.monotonic() > deadline:
            raise RuntimeError("the second model was not unloaded when idle")
        time.sleep(0.2)


def os_threads(pid: int) -> int | None:
    """The server's OS threads (Linux /proc; None elsewhere): MLX keeps one per Python
    thread that used it, so a count that grows by cycle is a leak (mlx_threads.py)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Threads:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def cycles(kind: str, count: int, keep_alive: str, out: Path) -> dict[str, Any]:
    from mlx_prefix.models.testing import make_test_model

    micro = out / "micro-model"
    if not (micro / "config.json").is_file():
        make_test_model("dense", micro)
    second = second_model(kind, out)
    args = ("--allowed-models", str(second), "--max-models", "2", "--keep-alive", keep_alive)
    server = Server(ServerSpec(OURS, micro, args, label=f"unload-{kind}"), out / "logs").start()
    log = out / "logs" / f"unload-{kind}-{server.port}.log"
    rss: list[float] = []
    threads: list[int | None] = []
    try:
        with httpx.Client(base_url=server.url, timeout=600.0) as client:
            ask(client, "default")
            time.sleep(IDLE_S)
            before = (server.rss_bytes() or 0) / MiB
            for i in range(count):
                ask(client, str(second), picture_url(i) if kind == "vision" else None)
                wait_unloaded(log, i + 1)
                time.sleep(IDLE_S)
                rss.append((server.rss_bytes() or 0) / MiB)
                threads.append(os_threads(server.pid))
                print(f"cycle {i + 1}: RSS {rss[-1]:.0f} MiB, {threads[-1]} threads", flush=True)
    finally:
        server.stop()
    return {
        "kind": kind,
        "second_model": str(second),
        "machine": machine(),
        "keep_alive": keep_alive,
        "cycles": count,
        "rss_before_first_load_mib": round(before, 1),
        "rss_after_each_unload_mib": [round(r, 1) for r in rss],
        "os_threads_after_each_unload": threads,
        "spread_mib": round(max(rss) - min(rss), 1),
        "last_minus_first_mib": round(rss[-1] - rss[0], 1),
        "first_unload_over_before": round(rss[0] / before, 3),
    }


def markdown(result: dict[str, Any], label: str) -> str:
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M")
    what = "SmolLM2-135M-Instruct float32" if result["kind"] == "text" else "a random vision model"
    per = ", ".join(f"{r:.0f}" for r in result["rss_after_each_unload_mib"])
    return (
        f"## Load and unload {result['cycles']} times ({result['kind']}, issue 52)\n\n"
        f"`benchmarks/studies/unload.py --kind {result['kind']}`, {when} UTC, {result['machine']}"
        f" ({label}): {what} loaded on demand beside a micro model and unloaded when idle "
        f"(`--keep-alive {result['keep_alive']}`). Server RSS before the first load "
        f"{result['rss_before_first_load_mib']:.0f} MiB; after each unload (MiB): {per}. "
        f"Spread over the cycles **{result['spread_mib']:.0f} MiB** (goal: within 10), last "
        f"minus first {result['last_minus_first_mib']:.0f} MiB.\n"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kind", choices=("text", "vision"), default="text")
    parser.add_argument("--cycles", type=int, default=CYCLES)
    parser.add_argument("--keep-alive", default="2s")
    parser.add_argument("--label", default="", help="for the markdown line: whose code")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/unload"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    result = cycles(args.kind, args.cycles, args.keep_alive, args.out.resolve())
    (args.out / f"unload_{args.kind}.json").write_text(json.dumps(result, indent=1) + "\n")
    STANDALONE.mkdir(parents=True, exist_ok=True)
    (STANDALONE / f"unload_{args.kind}.md").write_text(markdown(result, args.label or "this code"))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
