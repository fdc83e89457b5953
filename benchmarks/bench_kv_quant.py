"""Quantized KV cache: memory per cached token and hit == cold, float vs 8-bit vs 4-bit.

For each setting an Engine serves one long chat prompt three times on the default
model (or --model): first (stores its checkpoints), again (a hit) and with the cache
off (cold). We report what the store counts for the entry holding the whole prompt
(bytes per token: packed data + scales + biases for quantized KV, step padding
included, as the byte budget sees it), the store's resident bytes, the time to the
first token warm and cold, decode tokens/s, and whether the hit's tokens and logprobs equal the cold
run's bit for bit.

    python benchmarks/bench_kv_quant.py [--tokens 2048] [--start 0] [--bits float,8,4]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from mlx_prefix.config import CacheConfig, EngineConfig
from mlx_prefix.engine.engine import Engine
from mlx_prefix.engine.keys import entry_key
from mlx_prefix.models.load import load_model
from mlx_prefix.platform import startup_line
from mlx_prefix.records import (
    CachePreference,
    DoneEvent,
    ErrorEvent,
    PromptInput,
    SamplingParams,
    TokenEvent,
    Usage,
)
from mlx_prefix.server.protocol.messages import conversation_from_dicts

SAMPLING = SamplingParams(max_tokens=16, temperature=0.0, logprobs=True)
TOPICS = ("the harbor", "the orchard", "the copper mine", "the river lock", "the old mill")


@dataclass(frozen=True, slots=True)
class Row:
    kv: str  # "float" or "<bits>-bit"
    prompt_tokens: int
    entry_tokens: int  # the stored entry holding the whole prompt
    entry_bytes: int
    bytes_per_token: float
    resident_bytes: int  # the store's bytes after the three requests
    cached_tokens: int  # restored by the hit
    ttft_cold_s: float
    ttft_hit_s: float
    decode_tps: float  # the cold run's decode tokens/s (one request at a time when quantized)
    hit_equals_cold: bool  # tokens and logprobs, bit for bit


@dataclass(frozen=True, slots=True)
class Reply:
    tokens: list[int]
    logprobs: list[float]
    usage: Usage


def run(engine: Engine, prompt: PromptInput, *, cache: bool = True) -> Reply:
    tokens, logprobs = [], []
    for event in engine.submit(prompt, SAMPLING, CachePreference(cache)).events(timeout=1800):
        if isinstance(event, TokenEvent) and event.token is not None:
            tokens.append(event.token)
            logprobs.append(event.logprob)
        elif isinstance(event, ErrorEvent):
            raise SystemExit(f"engine error: {event.message}")
        elif isinstance(event, DoneEvent):
            return Reply(tokens, logprobs, event.usage)
    raise SystemExit("no reply")


def prompt_of(tokens: int) -> PromptInput:
    """A chat whose user message is roughly `tokens` tokens long."""
    lines = [
        f"Note {i}: the survey of {TOPICS[i % len(TOPICS)]} found item {i * 7}."
        for i in range(tokens // 16)
    ]
    text = "Summarize these notes in one sentence.\n" + "\n".join(lines)
    return PromptInput(messages=conversation_from_dicts([{"role": "user", "content": text}]))


def bench(model, bits: int | None, args: argparse.Namespace) -> Row:
    config = EngineConfig(
        kv_bits=bits, kv_group_size=args.group_size, quantized_kv_start=args.start
    )
    cache = CacheConfig(budget_bytes=8 << 30)
    engine = Engine(model, cache, config)
    try:
        prompt = prompt_of(args.tokens)
        first = run(engine, prompt)
        hit = run(engine, prompt)
        cold = run(engine, prompt, cache=False)
        key = entry_key(engine.model_key, CachePreference())
        entries = [e for e in engine.store.entries() if e.model_key == key]
        entry = max(entries, key=lambda e: e.tokens)
        return Row(
            kv="float" if bits is None else f"{bits}-bit",
            prompt_tokens=first.usage.prompt_tokens,
            entry_tokens=entry.tokens,
            entry_bytes=entry.nbytes,
            bytes_per_token=entry.nbytes / entry.tokens,
            resident_bytes=engine.cache_stats()["bytes"],
            cached_tokens=hit.usage.cached_tokens,
            ttft_cold_s=cold.usage.ttft_s,
            ttft_hit_s=hit.usage.ttft_s,
            decode_tps=cold.usage.decode_tokens_per_s,
            hit_equals_cold=(hit.tokens, hit.logprobs) == (cold.tokens, cold.logprobs),
        )
    finally:
        engine.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--tokens", type=int, default=2048, help="prompt length, roughly")
    p.add_argument("--start", type=int, default=0, help="--quantized-kv-start")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--bits", default="float,8,4")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "out" / "kv_quant.json")
    args = p.parse_args()
    print(startup_line(), file=sys.stderr)
    model = load_model(args.model)
    settings = [None if b == "float" else int(b) for b in args.bits.split(",")]
    rows = []
    for bits in settings:
        rows.append(bench(model, bits, args))
        print(f"done: {rows[-1]}", file=sys.stderr, flush=True)
    base = next((r.bytes_per_token for r in rows if r.kv == "float"), None)
    print(f"{'kv':>6} {'tokens':>6} {'B/token':>9} {'vs float':>8} {'resident MiB':>12} "
          f"{'cached':>6} {'ttft cold':>9} {'ttft hit':>8} {'decode':>7}  hit==cold")  # fmt: skip
    for r in rows:
        ratio = f"{base / r.bytes_per_token:.2f}x" if base else "-"
        print(
            f"{r.kv:>6} {r.prompt_tokens:>6} {r.bytes_per_token:>9.0f} {ratio:>8} "
            f"{r.resident_bytes / 2**20:>12.1f} {r.cached_tokens:>6} {r.ttft_cold_s:>8.2f}s "
            f"{r.ttft_hit_s:>7.2f}s {r.decode_tps:>7.1f}  {r.hit_equals_cold}"
        )
    report = {
        "machine": platform.platform(),
        "startup": startup_line(),
        "args": {k: str(v) for k, v in vars(args).items()},
        "rows": [asdict(r) for r in rows],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    if not all(r.hit_equals_cold for r in rows):
        raise SystemExit("a hit differed from its cold run")


if __name__ == "__main__":
    main()
