"""Prompt lookup decoding (--prompt-lookup / a request's prompt_lookup): decode tokens/s
with lookup on and off in one engine, the acceptance, and whether each reply equals
plain decoding's (tokens and logprobs; --deterministic).

On the default model (SmolLM2-135M-Instruct), two workloads:
  copy  the prompt holds a 40-line Python file and asks for it back unchanged (what an
        agent's edit or rewrite does)
  chat  a plain question whose answer copies nothing (lookup must not slow it down)
Runs alternate off / on so that a loaded machine's drift hits both alike; the median of
the repeats is reported.

    python benchmarks/bench_prompt_lookup.py [--k 8] [--max-tokens 160] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.bench_speculative import reply  # one request's tokens, logprobs, usage
from mlx_prefix.config import CacheConfig, EngineConfig
from mlx_prefix.engine.engine import Engine
from mlx_prefix.models.default import ensure_default_model
from mlx_prefix.models.load import load_model
from mlx_prefix.records import (
    PromptInput,
    SamplingParams,
)
from mlx_prefix.server.protocol.messages import conversation_from_dicts

FILE = "\n".join(
    f"def field_{i}(record):\n    return record.get('field_{i}', {i * 7})\n" for i in range(14)
).splitlines()[:40]
WORKLOADS = {
    "copy": "Repeat the following file exactly, line for line, with no comment:\n\n"
    + "\n".join(FILE),
    "chat": "Write a short story about an old lighthouse keeper and a storm at sea.",
}


@dataclass(frozen=True, slots=True)
class Row:
    workload: str
    lookup: int  # the request's prompt_lookup (0: off)
    completion_tokens: int
    decode_tps: float  # median over the repeats
    drafted: int  # per run
    accepted: int
    same_as_plain: bool  # tokens and logprobs equal to the off run's, every repeat


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--k", type=int, default=8, help="prompt_lookup when on")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "out" / "prompt_lookup.json")
    args = p.parse_args()
    model = load_model(str(ensure_default_model()))
    config = EngineConfig(deterministic=True, prefetch_next_turn=False)
    engine = Engine(model, CacheConfig(), config)
    rows: list[Row] = []
    try:
        for name, text in WORKLOADS.items():
            messages = conversation_from_dicts([{"role": "user", "content": text}])
            prompt = PromptInput(messages=messages)
            tps: dict[int, list[float]] = {0: [], args.k: []}
            seen: dict[int, list] = {0: [], args.k: []}
            counts = {0: (0, 0), args.k: (0, 0)}
            for _ in range(args.repeats):
                for k in (0, args.k):
                    sampling = SamplingParams(
                        max_tokens=args.max_tokens, temperature=0.0, logprobs=True, prompt_lookup=k
                    )
                    before = engine.lookup
                    drafted0, accepted0 = before.drafted, before.accepted
                    tokens, logprobs, usage = reply(engine, prompt, sampling)
                    stats = engine.lookup
                    counts[k] = (stats.drafted - drafted0, stats.accepted - accepted0)
                    tps[k].append(usage.decode_tokens_per_s)
                    seen[k].append((tokens, logprobs))
                    print(name, k, len(tokens), round(usage.decode_tokens_per_s, 2), counts[k],
                          file=sys.stderr)  # fmt: skip
            plain = seen[0][0]
            for k in (0, args.k):
                rows.append(
                    Row(
                        workload=name,
                        lookup=k,
                        completion_tokens=len(plain[0]),
                        decode_tps=round(statistics.median(tps[k]), 2),
                        drafted=counts[k][0],
                        accepted=counts[k][1],
                        same_as_plain=all(s == plain for s in seen[k]),
                    )
                )
    finally:
        engine.shutdown()
    base = {r.workload: r.decode_tps for r in rows if r.lookup == 0}
    print(
        f"{'workload':<8} {'lookup':>6} {'tokens':>6} {'tok/s':>7} {'x off':>6} {'accept':>7} same"
    )
    for r in rows:
        accept = f"{r.accepted / r.drafted:.0%}" if r.drafted else "-"
        speedup = r.decode_tps / base[r.workload] if base.get(r.workload) else 0.0
        print(
            f"{r.workload:<8} {r.lookup:>6} {r.completion_tokens:>6} {r.decode_tps:>7.2f} "
            f"{speedup:>6.2f} {accept:>7} {r.same_as_plain}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"machine": platform.machine(), "k": args.k, "load": os.getloadavg()}
    args.out.write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1))


if __name__ == "__main__":
    main()
