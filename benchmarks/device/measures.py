"""What the device benchmark measures, one function each, on a model folder and servers
started by the caller (one at a time: each measures alone on the device).

- prefill: one cold prompt of `prefill_tokens`, `mlx-prefix generate` (the canonical chunk
  grid, checkpoints captured) against `mlx_lm.generate` (its own 2048-token chunks), each
  in a fresh process: prompt tokens/s as each reports it;
- decode: 1, 8 and 32 concurrent streams of distinct short prompts, EOS suppressed so every
  stream runs its `max_tokens`: output tokens/s from the first token to the last, all
  streams together;
- agent: a long system prompt, a turn, a pause (an agent's tool runs), then the next turn:
  its TTFT against the same request cold (another session's prompt, same length);
- issue 33's throughput workload (benchmarks/workloads/throughput.py), as `make bench` runs
  it, less the `--deterministic` row.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from ..client import Request, send
from ..corpus import passage, sentence
from ..harness import Context, ServerResult
from ..models import Tokens
from ..names import OURS
from ..server_process import Server
from ..workloads import throughput

PROMPT_STATS = re.compile(r"Prompt:\s*(\d+) tokens,\s*([\d.]+) tokens-per-sec")
_PREFILL_OFFSET, _AGENT_OFFSET = 5000, 9000


def prefill_text(tokens: Tokens, n: int) -> str:
    return "Summarize this text in one line.\n\n" + passage(_PREFILL_OFFSET, n, tokens.count)


def _run(cmd: list[str], stdin: str, timeout: float) -> subprocess.CompletedProcess:
    py = sys.executable
    return subprocess.run(
        [py, "-m", "mlx_prefix.blas_exec", *cmd],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def prefill_ours(model: Path, text: str, timeout: float = 600) -> dict[str, Any]:
    """`mlx-prefix generate`, one token after the prompt, no disk tier."""
    py = sys.executable
    cmd = [py, "-m", "mlx_prefix", "generate", "-", "--model", str(model), "-n", "1", "--json",
           "--disk-cache", "off"]  # fmt: skip
    t = time.perf_counter()
    out = _run(cmd, text, timeout)
    wall = time.perf_counter() - t
    try:
        usage = json.loads(out.stdout.strip().splitlines()[-1])["usage"]
    except (IndexError, json.JSONDecodeError, KeyError):
        return {"error": f"exit {out.returncode}: {out.stderr[-400:]}", "wall_s": wall}
    return {
        "prompt_tokens": usage["prompt_tokens"],
        "tps": usage["prefill_tokens_per_s"],
        "ttft_s": usage["ttft_s"],
        "wall_s": wall,
    }


def prefill_mlx_lm(model: Path, text: str, timeout: float = 600) -> dict[str, Any]:
    """`mlx_lm.generate`, one token after the same prompt (its chat template applied, as
    ours is)."""
    py = sys.executable
    cmd = [py, "-m", "mlx_lm", "generate", "--model", str(model), "--prompt", "-",
           "--max-tokens", "1", "--temp", "0.0"]  # fmt: skip
    t = time.perf_counter()
    out = _run(cmd, text, timeout)
    wall = time.perf_counter() - t
    found = PROMPT_STATS.search(out.stdout + out.stderr)
    if out.returncode != 0 or found is None:
        return {"error": f"exit {out.returncode}: {out.stderr[-400:]}", "wall_s": wall}
    return {"prompt_tokens": int(found.group(1)), "tps": float(found.group(2)), "wall_s": wall}


def no_eos(tokens: Tokens) -> dict[str, Any]:
    """The request field that keeps a random model from ending early (both servers honour
    OpenAI's logit_bias)."""
    tok = tokens._tok
    ids = {tok.eos_token_id, tok.pad_token_id, tok.convert_tokens_to_ids("<|endoftext|>")}
    return {"logit_bias": {str(i): -100 for i in sorted(i for i in ids if isinstance(i, int))}}


async def decode(
    client: httpx.AsyncClient, server: Server, streams: int, max_tokens: int, bias: dict
) -> dict[str, Any]:
    """`streams` requests at once; tokens/s over all of them, first token to last."""
    requests = [
        Request(
            messages=[{"role": "user", "content": f"Stream {i}: {sentence(40 + 13 * i)}"}],
            max_tokens=max_tokens,
            extra=bias,
        )
        for i in range(streams)
    ]
    replies = await asyncio.gather(*(send(client, server, r) for r in requests))
    timed = [r for r in replies if len(r.chunk_times) > 1]
    tokens = sum(r.completion_tokens or 0 for r in replies)
    if not timed:
        return {"streams": streams, "tokens": tokens, "tps": None}
    after_first = sum(max(0, (r.completion_tokens or 0) - 1) for r in timed)
    span = max(r.chunk_times[-1] for r in timed) - min(r.chunk_times[0] for r in timed)
    per_stream = [
        ((r.completion_tokens or 0) - 1) / (r.chunk_times[-1] - r.chunk_times[0]) for r in timed
    ]
    return {
        "streams": streams,
        "tokens": tokens,
        "tps": after_first / span if span > 0 else None,
        "per_stream_tps": sum(per_stream) / len(per_stream),
        "ttft_s": max(r.ttft_s or 0.0 for r in replies),
    }


async def agent(
    client: httpx.AsyncClient,
    server: Server,
    tokens: Tokens,
    system_tokens: int,
    reply_tokens: int,
    pause_s: float,
    bias: dict,
) -> dict[str, Any]:
    """An agent's second turn, warm, against the same request cold."""

    def system(session: str) -> str:
        head = f"Session {session}. You are a coding agent; these are the repository notes.\n\n"
        return head + passage(_AGENT_OFFSET, system_tokens, tokens.count)

    first = [
        {"role": "system", "content": system("a")},
        {"role": "user", "content": "Read the notes and list the three most important files."},
    ]
    turn = await send(client, server, Request(messages=first, max_tokens=reply_tokens, extra=bias))
    await asyncio.sleep(pause_s)  # the tool runs; a server may prefetch meanwhile
    second = [
        *first,
        {"role": "assistant", "content": turn.text},
        {"role": "user", "content": "Now open the first one and explain its main function."},
    ]
    ask = Request(messages=second, max_tokens=4, extra=bias)
    warm = await send(client, server, ask)
    cold_messages = [{"role": "system", "content": system("b")}, *second[1:]]
    cold = await send(client, server, Request(messages=cold_messages, max_tokens=4, extra=bias))
    ratio = warm.ttft_s / cold.ttft_s if warm.ttft_s and cold.ttft_s else None
    return {
        "prompt_tokens": warm.prompt_tokens,
        "cached_tokens": warm.cached_tokens,
        "first_ttft_s": turn.ttft_s,
        "warm_ttft_s": warm.ttft_s,
        "cold_ttft_s": cold.ttft_s,
        "warm_over_cold": ratio,
    }


class DeviceContext(Context):
    """The throughput workload's context: cold twins only for mlx-prefix (its own switch);
    the peer's would start another mlx_lm.server, more than the device's time allows."""

    async def check(self, client, server, result, label, request, warm) -> None:
        if server.name == OURS:
            await super().check(client, server, result, label, request, warm)
        else:
            result.notes.append("no cold check here (another server start)")


async def throughput_on(ctx: DeviceContext, server: Server, client: httpx.AsyncClient) -> dict:
    res: ServerResult = await throughput.measure(ctx, server.name, server, client)
    return {
        "extra": res.extra,
        "wall_s": res.wall_s,
        "checks": [{"label": c.label, "match": c.match} for c in res.checks],
        "notes": res.notes,
    }


def generate_decode(ctx: DeviceContext) -> dict[str, Any]:
    """mlx_lm.generate on the throughput workload's single-stream decode request."""
    res = throughput.generate_reference(ctx)
    return {"extra": res.extra, "wall_s": res.wall_s, "notes": res.notes}
