"""Speculative decoding (--draft-model): decode tokens/s against plain decoding, cold and
warm (a cache hit that restores the draft's KV beside the model's), and the acceptance.

On the default model (SmolLM2-135M-Instruct), with two drafts:
  layer-skip  the model's first N layers with its own norm and head (no training:
              what a draft costs when nothing smaller shares the tokenizer)
  self        the model as its own draft: every greedy token accepted, the ceiling of
              the mechanism (each step still pays k draft forwards of the full model)
Every speculative reply is checked equal to the plain one (tokens and logprobs).

    python benchmarks/studies/speculative.py [--layers 16] [--max-tokens 48] [--k 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from mlx_prefix.config import CacheConfig, EngineConfig
from mlx_prefix.engine.engine import Engine
from mlx_prefix.models.default import ensure_default_model
from mlx_prefix.models.layer_skip import make_layer_skip_draft
from mlx_prefix.models.load import LoadedModel, load_model
from mlx_prefix.records import (
    CachePreference,
    DoneEvent,
    ErrorEvent,
    PromptInput,
    SamplingParams,
    TokenEvent,
)
from mlx_prefix.server.protocol.messages import conversation_from_dicts

SYSTEM = (
    "You are a helpful assistant for a small harbour town. You know its history, its "
    "lighthouse, the fishing fleet, the ferry timetable and the weather on the coast. "
) * 6
QUESTION = "Write a short story about the old lighthouse keeper and the storm."


@dataclass(frozen=True, slots=True)
class Row:
    draft: str  # none | layer-skip | self
    run: str  # cold | warm
    cached_tokens: int
    completion_tokens: int
    decode_tps: float  # completion tokens after the first / their seconds
    drafted: int  # draft tokens proposed in this run
    accepted: int  # of those, accepted
    same_as_plain: bool  # tokens and logprobs equal to plain decoding's


def reply(engine: Engine, prompt: PromptInput, sampling: SamplingParams):
    handle = engine.submit(prompt, sampling, CachePreference())
    tokens, logprobs = [], []
    for event in handle.events(timeout=1800):
        if isinstance(event, TokenEvent) and event.token is not None:
            tokens.append(event.token)
            logprobs.append(event.logprob)
        elif isinstance(event, ErrorEvent):
            raise RuntimeError(event.message)
        elif isinstance(event, DoneEvent):
            return tokens, logprobs, event.usage
    raise RuntimeError("no final event")


def bench(
    name: str, model: LoadedModel, draft: LoadedModel | None, args, plain: dict | None
) -> list[Row]:
    config = EngineConfig(num_draft_tokens=args.k, prefetch_next_turn=False)
    engine = Engine(model, CacheConfig(), config, draft=draft)
    prompt = PromptInput(
        messages=conversation_from_dicts(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
        )
    )
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, logprobs=True)
    rows = []
    try:
        for run in ("cold", "warm"):
            before = engine.loop.decode.speculator.stats
            drafted0, accepted0 = (before.drafted, before.accepted) if before else (0, 0)
            tokens, logprobs, usage = reply(engine, prompt, sampling)
            if plain is not None and run not in plain:
                plain[run] = (tokens, logprobs)
            stats = engine.loop.decode.speculator.stats
            rows.append(
                Row(
                    draft=name,
                    run=run,
                    cached_tokens=usage.cached_tokens,
                    completion_tokens=usage.completion_tokens,
                    decode_tps=round(usage.decode_tokens_per_s, 2),
                    drafted=stats.drafted - drafted0 if stats else 0,
                    accepted=stats.accepted - accepted0 if stats else 0,
                    same_as_plain=plain is not None and plain[run] == (tokens, logprobs),
                )
            )
            print(rows[-1], file=sys.stderr)
    finally:
        engine.shutdown()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=16, help="layers of the layer-skip draft")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--k", type=int, default=3, help="--num-draft-tokens")
    out = Path(__file__).parents[1] / "out"  # benchmarks/out
    p.add_argument("--out", type=Path, default=out / "speculative.json")
    args = p.parse_args()
    source = ensure_default_model()
    model = load_model(str(source))
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_layer_skip_draft(source, Path(tmp) / "layer-skip", args.layers)
        layer_skip = load_model(str(folder))
        plain: dict = {}
        rows = bench("none", model, None, args, plain)
        rows += bench(f"layer-skip-{args.layers}", model, layer_skip, args, plain)
        rows += bench("self", model, load_model(str(source)), args, plain)
    base = {r.run: r.decode_tps for r in rows if r.draft == "none"}
    print(f"{'draft':<14} {'run':<5} {'cached':>6} {'tok/s':>7} {'x plain':>7} {'accept':>7} same")
    for r in rows:
        accept = f"{r.accepted / r.drafted:.0%}" if r.drafted else "-"
        speedup = r.decode_tps / base[r.run] if base.get(r.run) else 0.0
        print(
            f"{r.draft:<14} {r.run:<5} {r.cached_tokens:>6} {r.decode_tps:>7.2f} "
            f"{speedup:>7.2f} {accept:>7} {r.same_as_plain}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"machine": platform.machine(), "k": args.k, "layers": args.layers}
    args.out.write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1))


if __name__ == "__main__":
    main()
