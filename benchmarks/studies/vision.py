"""Images in an agent conversation (issue 42): mlx-prefix, mlx-vlm's own server and
vllm-mlx side by side on the same tiny random-weight Qwen3.5 vision model (the tests'
hybrid with M-RoPE, mlx_prefix/vision/testing.py, 32K context, Qwen3.5's own template).

The conversation: a long agent system prompt, then
  turn 1  a screenshot (256x256 PNG) and a question
  turn 2  the same history with a fixed reply, a follow-up question (no new image)
  turn 3  the history again, a new screenshot of the same size and a question
and two more requests: turn 2 behind a system prompt differing in its first word (a cold
turn 2 of the same length), and turn 1 with another image of the same size ("swap"). Each
server is its own process, the servers one after another; a server is started twice, so
that the swap request also runs first on a fresh process (its reference answer).

Goals (issue 42): turn 2 reads >= 0.95 of what it shares with turn 1 from the cache; turn
3 reuses turns 1-2 the same way; the swap reuses nothing past the image's start, and
answers as on a fresh server; TTFT of turn 2 <= 0.3x the cold turn 2. Shared prefixes are
counted on mlx-prefix's own cache key (images salted: vision/key.py).

    python -m mlx_prefix.blas_exec .venv/bin/python -m benchmarks.studies.vision [--servers ...]

Writes benchmarks/results/vision/<timestamp>.json and renders RESULTS.md again.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from PIL import Image

from .. import corpus, peers
from ..client import Reply, Request, send
from ..names import MLX_VLM, OURS, VLLM
from ..server_process import Server, ServerSpec

HERE = Path(__file__).resolve().parents[1]  # benchmarks/
DATA = HERE.parent / "tests" / "data"
SERVERS = (OURS, MLX_VLM, VLLM)
SPECS_EXTRA: dict[str, tuple[str, ...]] = {OURS: (), MLX_VLM: (), VLLM: ("--mllm",)}
# mlx-vlm's automatic prefix cache is off unless asked for; in memory, as the others.
ENV: dict[str, tuple[tuple[str, str], ...]] = {
    MLX_VLM: (("APC_ENABLED", "1"), ("APC_DISK_ENABLED", "0")),
}
SYSTEM_TOKENS = 8000
SIDE = 256  # pixels: 64 image tokens each for the test model's processor
MAX_TOKENS = 16
REPLIES = (
    "The submit button overlaps the footer and the error banner is cut off on the right.",
    "Its background is #2b6cb0 on a #2c5282 border, which is too little contrast.",
)
QUESTIONS = (
    "Here is a screenshot of the settings page. What looks wrong?",
    "What colour is the submit button, exactly?",
    "I changed the layout; here is the new screenshot. Is it fixed?",
)


def png(seed: int) -> str:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)
    out = tempfile.SpooledTemporaryFile()
    Image.fromarray(pixels).save(out, format="PNG")
    out.seek(0)
    return "data:image/png;base64," + base64.b64encode(out.read()).decode()


def user(text: str, image: str | None = None) -> dict[str, Any]:
    if image is None:
        return {"role": "user", "content": text}
    part = {"type": "image_url", "image_url": {"url": image}}
    return {"role": "user", "content": [{"type": "text", "text": text + "\n"}, part]}


@dataclass(frozen=True)
class Conversation:
    turns: tuple[list[dict[str, Any]], ...]  # turn 1, 2, 3 messages
    cold_turn2: list[dict[str, Any]]
    swap: list[dict[str, Any]]  # turn 1 with another image of the same size


def conversation(count: Any) -> Conversation:
    system = "You are a coding agent. You read the user's screenshots closely.\n"
    system += corpus.passage(4200, SYSTEM_TOKENS, count)
    first, second, third = png(1), png(2), png(3)
    t1 = [{"role": "system", "content": system}, user(QUESTIONS[0], first)]
    t2 = [*t1, {"role": "assistant", "content": REPLIES[0]}, user(QUESTIONS[1])]
    t3 = [*t2, {"role": "assistant", "content": REPLIES[1]}, user(QUESTIONS[2], second)]
    cold = [{"role": "system", "content": "Hello. " + system}, *t2[1:]]
    swap = [t1[0], user(QUESTIONS[0], third)]
    return Conversation((t1, t2, t3), cold, swap)


@dataclass
class Keys:
    """mlx-prefix's cache keys of the requests: what they share, where images start."""

    lengths: dict[str, int] = field(default_factory=dict)
    shared: dict[str, int] = field(default_factory=dict)  # with the request before it
    image_start: int = 0  # turn 1's (and the swap's) image


def keys(folder: Path, conv: Conversation) -> Keys:
    from mlx_prefix.config import CacheConfig
    from mlx_prefix.models.load import load_model
    from mlx_prefix.prompt.request.plan import PromptPlanner
    from mlx_prefix.prompt.request.render import common_prefix_length
    from mlx_prefix.records import PromptInput
    from mlx_prefix.server.protocol.messages import conversation_from_dicts

    model = load_model(str(folder))
    planner = PromptPlanner(model.tokenizer, CacheConfig(), vision=model.vision)

    def plan(messages: list[dict[str, Any]]) -> Any:
        return planner.plan(PromptInput(messages=conversation_from_dicts(messages)))

    t1, t2, t3 = (plan(m) for m in conv.turns)
    swap = plan(conv.swap)
    out = Keys()
    for name, p in (("turn1", t1), ("turn2", t2), ("turn3", t3), ("swap", swap)):
        out.lengths[name] = len(p.tokens)
    out.shared["turn2"] = common_prefix_length(t1.tokens, t2.tokens)
    out.shared["turn3"] = common_prefix_length(t2.tokens, t3.tokens)
    out.shared["swap"] = common_prefix_length(t1.tokens, swap.tokens)
    assert t1.vision is not None
    out.image_start = t1.vision.spans[0].start
    return out


def measured(reply: Reply) -> dict[str, Any]:
    return {
        "ttft_s": reply.ttft_s,
        "prompt_tokens": reply.prompt_tokens,
        "cached_tokens": reply.cached_tokens,
        "text": reply.text,
    }


async def one_server(name: str, folder: Path, conv: Conversation, logs: Path) -> dict[str, Any]:
    spec = ServerSpec(name, folder, SPECS_EXTRA[name], env=ENV.get(name, ()))
    out: dict[str, Any] = {}
    async with httpx.AsyncClient(timeout=None) as client:

        async def ask(messages: list[dict[str, Any]]) -> dict[str, Any]:
            req = Request(messages=messages, max_tokens=MAX_TOKENS)
            return measured(await send(client, server, req))

        server = Server(spec, logs).start()
        try:
            out["swap_fresh"] = await ask(conv.swap)  # its reference answer
        finally:
            server.stop()
        server = Server(spec, logs).start()
        try:
            for i, messages in enumerate(conv.turns, 1):
                out[f"turn{i}"] = await ask(messages)
            out["cold_turn2"] = await ask(conv.cold_turn2)
            out["swap"] = await ask(conv.swap)
            out["blas"] = server.blas()
        finally:
            server.stop()
    return out


def log(msg: str) -> None:
    print(f"[bench_vision {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def model_folder(root: Path) -> Path:
    from mlx_prefix.vision.testing import make_vision_test_model

    return make_vision_test_model(
        "qwen3_5",
        root / "tiny-vl-qwen3_5",
        tokenizer=DATA / "tokenizers" / "qwen3",
        chat_template=(DATA / "templates" / "Qwen3.5-4B.jinja").read_text(),
        context=32768,
    )


def main(argv: list[str] | None = None) -> int:
    from .. import run
    from ..report import kept, machine
    from ..report import vision as report_vision

    p = argparse.ArgumentParser(prog="python -m benchmarks.studies.vision", description=__doc__)
    p.add_argument("--servers", nargs="+", default=list(SERVERS), choices=SERVERS)
    p.add_argument("--report-dir", type=Path, default=HERE)
    args = p.parse_args(argv)
    started = time.perf_counter()
    load = [round(os.getloadavg()[0], 1), None]
    root = Path(tempfile.mkdtemp(prefix="bench-vision-"))
    folder = model_folder(root)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    conv = conversation(lambda text: len(tok.encode(text)))
    doc: dict[str, Any] = {
        "timestamp": datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ"),
        "machine": machine.machine_info(),
        "versions": {**machine.versions(), **peers.mlx_vlm_version()},
        "model": "tiny random-weight Qwen3.5 vision model (vision/testing.py: 4 text layers "
        "of 128, linear and full attention, M-RoPE; 2 vision blocks of 32), float32",
        "system_tokens": SYSTEM_TOKENS,
        "max_tokens": MAX_TOKENS,
        "keys": asdict(keys(folder, conv)),
        "servers": {},
        "left_out": {},
    }
    problems = {MLX_VLM: peers.mlx_vlm_problem(), VLLM: peers.vllm_mlx_problem()}
    for name in args.servers:
        if problems.get(name):
            doc["left_out"][name] = problems[name]
            log(f"{name} left out: {problems[name]}")
            continue
        log(f"{name} ...")
        try:
            doc["servers"][name] = asyncio.run(one_server(name, folder, conv, root / "logs"))
        except Exception as e:  # a peer that cannot load the model or take the images
            doc["left_out"][name] = f"{type(e).__name__}: {e}"[:600]
            log(f"{name} failed: {doc['left_out'][name]}")
    load[1] = round(os.getloadavg()[0], 1)
    doc["load"] = load
    doc["elapsed_s"] = round(time.perf_counter() - started, 1)
    path = report_vision.keep(doc, args.report_dir)
    log(f"wrote {path}")
    docs = kept.kept(args.report_dir)
    if docs:
        log(f"wrote {run.render(docs, args.report_dir)}")
    print(json.dumps(report_vision.goals(doc), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
