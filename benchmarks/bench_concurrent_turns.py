"""Concurrent conversations: do later turns read their previous prompt (issue 55 item 6)?

Twelve sessions of five turns each, sent at once to one server serving the micro test
model (mlx_prefix.models.testing, dense): each session sends its next turn as soon as its
reply is in (its prompt, the reply and a new question), so turns of different sessions
arrive together and their short rests stack (engine/prefill/tails.py). Per later turn it
reports the tokens the server said were cached over its previous prompt's tokens, and
the share of later turns reading >= 0.9 of it; with the trace's wall time.

Over HTTP the turns arrive with the jitter of their clients: a rest that arrives first
computes alone before the next is admitted, and on the CPU only rests of about one
length stack, so few long rests meet. `--in-process` drives an Engine directly and
submits each round's twelve turns together (the next prefill step held until all are
queued: what tests/support/engine_helpers.py `submit_together` does), the case where every
session's rest is ready in the same step.

`--baseline-src DIR` runs a server from another source tree first (its PYTHONPATH: e.g.
`git archive main mlx_prefix | tar -x -C DIR`), then this tree's, alternating `--rounds`
times on the same machine, so the wall-time ratio compares like with like under load.

    python -m mlx_prefix.blas_exec python -m benchmarks.bench_concurrent_turns \\
        --baseline-src /tmp/base --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from .names import OURS
from .server_process import Server, ServerSpec

WORDS = (
    "harbor meadow copper ledger quarry lantern orchard pebble canyon willow ember "
    "thistle marble falcon saddle beacon cobalt prairie timber walnut glacier velvet"
).split()


SHORT = "the cat sat on a mat and then it ran to see my dog".split()


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)) + "."


def sessions(count: int, question_words: int, seed: int = 0) -> list[list[str]]:
    """Each session's user messages: a long first one (a document or task of its own),
    then short follow-ups of one-token words, all of one length (on the CPU only rests
    of about one length stack: tails.py `padding_allowance`)."""
    rng = random.Random(seed)
    return [
        [f"Session {s}. Read this: {_text(rng, rng.randint(120, 220))}"]
        + [
            f"Question {t}: " + " ".join(rng.choice(SHORT) for _ in range(question_words))
            for t in range(1, 5)
        ]
        for s in range(count)
    ]


def _reply(text: str, args: argparse.Namespace) -> str:
    """What the client sends back as the reply: the model's, or with `--fixed-reply N` N
    one-token words (the micro model's random replies re-tokenize to different lengths;
    replies of one length give every session's rest one length, the shape that stacks
    on the CPU)."""
    return " ".join(SHORT[:1] * args.fixed_reply) if args.fixed_reply else text


async def _session(
    client: httpx.AsyncClient, system: str, questions: list[str], args: argparse.Namespace
) -> list[dict[str, int]]:
    max_tokens = args.max_tokens
    messages: list[dict[str, str]] = [{"role": "system", "content": system}]
    turns = []
    for question in questions:
        messages.append({"role": "user", "content": question})
        body = {
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": False,
        }
        reply = await client.post("/v1/chat/completions", json=body)
        reply.raise_for_status()
        data = reply.json()
        usage = data["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        turns.append({"prompt": usage["prompt_tokens"], "cached": cached})
        reply_text = _reply(data["choices"][0]["message"]["content"], args)
        messages.append({"role": "assistant", "content": reply_text})
    return turns


async def trace(url: str, args: argparse.Namespace) -> dict[str, Any]:
    system = "You are a careful assistant. " + _text(random.Random(99), args.system_words)
    plan = sessions(args.sessions, args.question_words)
    async with httpx.AsyncClient(base_url=url, timeout=600.0) as client:
        started = time.perf_counter()
        if args.serial:
            results = [await _session(client, system, q, args) for q in plan]
        else:
            jobs = (_session(client, system, q, args) for q in plan)
            results = await asyncio.gather(*jobs)
        wall = time.perf_counter() - started
    return _reads(results, wall)


def engine_trace(model: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The trace on an in-process Engine, each round's turns submitted together."""
    import threading

    from mlx_prefix.config import CacheConfig, EngineConfig
    from mlx_prefix.conversation import Message
    from mlx_prefix.engine.engine import Engine
    from mlx_prefix.models.load import load_model
    from mlx_prefix.records import DoneEvent, PromptInput, SamplingParams, TokenEvent

    system = "You are a careful assistant. " + _text(random.Random(99), args.system_words)
    plan = sessions(args.sessions, args.question_words)
    config = EngineConfig(prefetch_next_turn=not args.no_prefetch)
    engine = Engine(load_model(model), CacheConfig(), config)
    gate, step = threading.Event(), engine._prefill.step

    def held(*a: Any, **k: Any) -> Any:
        gate.wait(60)  # every turn of the round is queued before a prefill step runs
        return step(*a, **k)

    engine._prefill.step = held  # type: ignore[method-assign]
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    histories = [[Message("system", system)] for _ in plan]
    results: list[list[dict[str, int]]] = [[] for _ in plan]
    try:
        started = time.perf_counter()
        for turn in range(len(plan[0])):
            gate.clear()
            handles = []
            for history, questions in zip(histories, plan, strict=True):
                history.append(Message("user", questions[turn]))
                handles.append(engine.submit(PromptInput(messages=tuple(history)), sampling))
            gate.set()
            for history, handle, out in zip(histories, handles, results, strict=True):
                text = []
                for event in handle.events(timeout=600):
                    if isinstance(event, TokenEvent):
                        text.append(event.text)
                    elif isinstance(event, DoneEvent):
                        usage = event.usage
                        out.append({"prompt": usage.prompt_tokens, "cached": usage.cached_tokens})
                history.append(Message("assistant", _reply("".join(text), args)))
        wall = time.perf_counter() - started
        stacked = engine._prefill.tails_stacked
    finally:
        engine.shutdown()
    return {**_reads(results, wall), "stacked_rests": stacked}


def _reads(results: list[list[dict[str, int]]], wall: float) -> dict[str, Any]:
    reads = [
        turns[i]["cached"] / turns[i - 1]["prompt"]
        for turns in results
        for i in range(1, len(turns))
    ]
    good = sum(r >= 0.9 for r in reads)
    return {
        "wall_s": wall,
        "later_turns": len(reads),
        "read_ge_0.9": good,
        "share": good / len(reads),
        "min_read": min(reads),
        "turns": results,
    }


def run_in_process(src: str, model: Path, args: argparse.Namespace) -> dict:
    """engine_trace in a process of its own running `src` (its PYTHONPATH)."""
    cmd = [sys.executable, "-m", "benchmarks.bench_concurrent_turns", "--engine-child"]
    cmd += [str(model), *sys.argv[1:]]
    env = dict(os.environ, PYTHONPATH=f"{src}:{Path(__file__).resolve().parents[1]}")
    # `-m` puts the working directory first on sys.path: run where `src` is imported.
    done = subprocess.run(cmd, env=env, cwd=src, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_server(src: str, model: Path, log_dir: Path, args: argparse.Namespace) -> dict:
    env = (("PYTHONPATH", src),)
    label = "base" if src != args.this else "this"
    extra = ("--log-level", "debug", *args.server_arg)
    spec = ServerSpec(OURS, model, extra, label, env=env)
    here = os.getcwd()
    os.chdir(src)  # `-m` puts the working directory first on sys.path: import `src`
    try:
        server = Server(spec, log_dir).start()
    finally:
        os.chdir(here)
    try:
        result = asyncio.run(trace(server.url, args))
    finally:
        server.stop()
    log = (log_dir / f"{label}-{server.port}.log").read_text(errors="replace")
    # engine/prefill/tails.py logs each stacked forward ("stacked N rests, ...")
    result["stacked_rests"] = sum(
        int(line.split("stacked ", 1)[1].split()[0])
        for line in log.splitlines()
        if "stacked " in line and " rests, " in line
    )
    return result


def main(argv: list[str] | None = None) -> None:
    from mlx_prefix.models.testing import make_test_model

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sessions", type=int, default=12)
    p.add_argument("--system-words", type=int, default=60)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--question-words", type=int, default=12)
    p.add_argument("--fixed-reply", type=int, default=0, help="send back N words as the reply")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--serial", action="store_true", help="one session at a time")
    p.add_argument("--baseline-src", help="a source tree to run first (its PYTHONPATH)")
    p.add_argument("--out", type=Path, help="write the results here as JSON")
    p.add_argument("--server-arg", action="append", default=[], help="passed to both servers")
    p.add_argument("--in-process", action="store_true", help="an Engine, turns submitted together")
    p.add_argument(
        "--no-prefetch",
        action="store_true",
        help="--in-process: no next-turn prefetch (a server never idle between turns)",
    )
    p.add_argument("--engine-child", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.engine_child:
        print(json.dumps(engine_trace(args.engine_child, args)))
        return
    work = Path(tempfile.mkdtemp(prefix="bench-turns-"))
    model = make_test_model("dense", work / "micro-model")
    this = args.this = os.environ.get("PYTHONPATH") or str(Path(__file__).resolve().parents[1])
    out: dict[str, list] = {"base": [], "this": []}
    for _ in range(args.rounds):
        for label, src in (("base", args.baseline_src), ("this", this)):
            if src is None:
                continue
            if args.in_process:
                out[label].append(run_in_process(src, model, args))
            else:
                out[label].append(run_server(src, model, work / "logs", args))
    for label, runs in out.items():
        for r in runs:
            print(
                f"{label}: {r['read_ge_0.9']}/{r['later_turns']} later turns read >= 0.9 "
                f"(share {r['share']:.2f}, min {r['min_read']:.2f}), wall {r['wall_s']:.1f} s, "
                f"{r['stacked_rests']} rests stacked"
            )
    if out["base"]:
        ratio = sum(r["wall_s"] for r in out["this"]) / sum(r["wall_s"] for r in out["base"])
        print(f"wall time this / base: {ratio:.2f} (load {os.getloadavg()[0]:.1f})")
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
