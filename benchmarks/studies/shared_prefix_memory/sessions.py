"""The sessions and restore parts (see __init__.py)."""

from __future__ import annotations

import argparse
import re
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from ...models import Tokens
from ...names import OURS, PEER, VLLM
from ...servers import Server, ServerSpec, unavailable
from .serve import TINY_KV_PER_TOKEN, TINY_LONG_CONFIG, MiB, _text, stream, tiny_long_model


def session_specs(model: Path, budget: int, log_dir: Path) -> list[ServerSpec]:
    specs = [
        ServerSpec(OURS, model, ("--cache-budget", str(budget), "--no-prefetch"), "ours"),
        ServerSpec(PEER, model, ("--prompt-cache-bytes", str(budget)), "peer"),
    ]
    problem = unavailable(VLLM)
    if problem is None:
        # vllm-mlx's prefix cache has its own memory limit flag; the closest to "the same
        # bytes" it takes.
        specs.append(ServerSpec(VLLM, model, ("--cache-memory-mb", str(budget // MiB)), "vllm-mlx"))
    else:
        print(f"  vllm-mlx left out: {problem}", flush=True)
    return specs


def measure_sessions(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    path = tiny_long_model()
    tokens = Tokens(path)
    system = "You are a coding agent. Tools: read, write, run. " + _text(
        52000, args.session_system_tokens, tokens
    )
    results: dict[str, Any] = {}
    for spec in session_specs(path, args.budget, log_dir):
        if args.servers and spec.label not in args.servers:
            continue
        server = Server(spec, log_dir)
        try:
            server.start()
        except Exception as e:  # a peer that cannot start is reported, not fatal
            results[spec.label] = {"error": str(e)}
            continue
        try:
            results[spec.label] = run_sessions(server, system, tokens, args)
        finally:
            server.stop()
    return {
        "part": "sessions",
        "model": f"random llama, SmolLM2 tokenizer, {TINY_LONG_CONFIG}",
        "kv_per_token": TINY_KV_PER_TOKEN,
        "budget_bytes": args.budget,
        "servers": results,
    }


def run_sessions(
    server: Server, system: str, tokens: Tokens, args: argparse.Namespace
) -> dict[str, Any]:
    sessions = [[{"role": "system", "content": system}] for _ in range(args.sessions)]
    rows = []
    for step in range(args.steps):
        for i, messages in enumerate(sessions):
            result = _text(60000 + 5000 * i + 450 * step, args.result_tokens, tokens)
            messages.append({"role": "user", "content": f"Tool result (step {step}):\n{result}"})
            reply = stream(server, messages, args.reply_tokens)
            messages.append({"role": "assistant", "content": reply.text})
            rows.append(
                {
                    "session": i,
                    "step": step,
                    "prompt_tokens": reply.prompt_tokens,
                    "cached_tokens": reply.cached_tokens,
                    "ttft_s": reply.ttft_s,
                }  # fmt: skip
            )
    if server.name == VLLM:  # it reports no cached tokens; its log says each fetch's
        for row, cached in zip(rows, vllm_cached(server), strict=False):
            row["cached_tokens"] = cached
    later = [r for r in rows if r["step"] > 0]
    out: dict[str, Any] = {
        "rows": rows,
        "reused_per_turn": statistics.fmean(r["cached_tokens"] or 0 for r in later),
        "prompt_per_turn": statistics.fmean(r["prompt_tokens"] or 0 for r in later),
        "reused_share": sum(r["cached_tokens"] or 0 for r in later)
        / max(1, sum(r["prompt_tokens"] or 0 for r in later)),
        "ttft_median_s": statistics.median(r["ttft_s"] or 0.0 for r in later),
    }
    if server.name == OURS:
        data = httpx.get(server.url + "/v1/dashboard", timeout=60).json()
        out["held_bytes"] = data["memory"]["bytes"]
        out["entries"] = len([n for n in data["tree"] if n["entry_id"] is not None])
        out["evictions"] = data["memory"]["evictions"]
    summary = {k: v for k, v in out.items() if k != "rows"}
    print(f"  {server.spec.label}: {summary}", flush=True)
    return out


def vllm_cached(server: Server) -> list[int]:
    """vllm-mlx's cached tokens per request, in order, from its log's `[cache_fetch]`
    lines (its usage carries none); the warm-up request's first line left out."""
    return vllm_cached_from(Path(server._log.name))  # type: ignore[union-attr]


def vllm_cached_from(log: Path) -> list[int]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if "[cache_fetch]" not in line:
            continue
        found = re.search(r"cached=(\d+)", line)
        out.append(int(found.group(1)) if found and " HIT " in line else 0)
    return out[1:]


# -- part 3: restore time and warm-turn TTFT ---------------------------------------------


def measure_restore(args: argparse.Namespace) -> dict[str, Any]:
    import mlx.core as mx

    from mlx_prefix.config import CacheConfig, EngineConfig
    from mlx_prefix.conversation import Message
    from mlx_prefix.engine.engine import Engine
    from mlx_prefix.engine.prefill import phase as prefill_phase
    from mlx_prefix.models.load import load_model
    from mlx_prefix.records import CachePreference, PromptInput, SamplingParams, TokenEvent

    path = tiny_long_model()
    tokens = Tokens(path)
    loaded = load_model(str(path))
    restores: list[float] = []
    real = prefill_phase.restore_longest

    def timed(*a, **k):
        t = time.perf_counter()
        found = real(*a, **k)
        if found.cache is not None:
            mx.eval([c.state for c in found.cache])
        restores.append(time.perf_counter() - t)
        return found

    prefill_phase.restore_longest = timed
    steps: list[float] = []
    rows: list[dict[str, Any]] = []

    def one_turn(engine: Engine, messages: list, n: int, turn: int) -> dict[str, Any]:
        restores.clear()
        steps.clear()
        start = time.perf_counter()
        handle = engine.submit(
            PromptInput(messages=tuple(messages)),
            SamplingParams(max_tokens=8, temperature=0.0),
            CachePreference(),
        )
        ttft, text, usage = None, [], None
        for event in handle.events(timeout=7200):
            if isinstance(event, TokenEvent):
                ttft = ttft or time.perf_counter() - start
                text.append(event.text)
            elif hasattr(event, "usage"):
                usage = event.usage
        return {
            "tokens": n,
            "turn": turn,  # 4: the third turn again (a regenerate)
            "prompt_tokens": usage.prompt_tokens if usage else None,
            "cached_tokens": usage.cached_tokens if usage else None,
            "restore_ms": restores[0] * 1e3 if restores else None,
            "first_step_ms": steps[0] * 1e3 if steps else None,
            "ttft_ms": ttft * 1e3 if ttft else None,
            "text": "".join(text),
        }

    try:
        for n in args.lengths:
            config = EngineConfig(prefetch_next_turn=False)
            engine = Engine(loaded, CacheConfig(budget_bytes=8 << 30), config)
            real_step = engine.loop.prefill.step

            def step(*a, _real=real_step, **k):
                t = time.perf_counter()
                out = _real(*a, **k)
                steps.append(time.perf_counter() - t)
                return out

            engine.loop.prefill.step = step
            try:
                messages = [Message("user", _text(90000, n, tokens) + "\n\nSummarize.")]
                # Three turns (the first cold), then the third again `repeat` times: a
                # regenerate, restored from its own entry (after: a chain of 3 pieces).
                for turn in range(3 + args.repeat):
                    row = one_turn(engine, messages, n, min(turn, 3) + 1)
                    rows.append(row)
                    print(f"  {row}", flush=True)
                    if turn < 2:
                        messages += [
                            Message("assistant", row.pop("text")),
                            Message("user", _text(95000 + 300 * turn, 100, tokens)),
                        ]
                    else:
                        row.pop("text")
            finally:
                engine.shutdown()
    finally:
        prefill_phase.restore_longest = real
    return {
        "part": "restore",
        "model": f"random llama, SmolLM2 tokenizer, {TINY_LONG_CONFIG}",
        "kv_per_token": TINY_KV_PER_TOKEN,
        "rows": rows,
    }


# -- the table (benchmarks/results/standalone/shared_prefix_memory.md) -------------------
