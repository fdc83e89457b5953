"""What the canonical chunk grid costs in prefill speed.

Prefills the same chat prompt (many messages, so many grid points) cold, cut three ways:
our grid (multiples of 512 + message starts + generation-prompt ends), plain 512-token
chunks, and plain 2048-token chunks (mlx_lm's default prefill step). Run it with the fast
BLAS: `python -m mlx_prefix.blas_exec python -m benchmarks.studies.grid`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlx_prefix.config import CacheConfig
from mlx_prefix.engine.forward.runner import prefill
from mlx_prefix.models.load import load_model
from mlx_prefix.prompt.request.grid import ChunkGrid
from mlx_prefix.prompt.request.plan import PromptPlanner
from mlx_prefix.records import PromptInput
from mlx_prefix.server.protocol.messages import conversation_from_dicts


def agent_conversation(turns: int) -> PromptInput:
    messages = [{"role": "system", "content": "You are a coding agent with shell tools. " * 20}]
    for i in range(turns):
        messages.append(
            {"role": "user", "content": f"Step {i}: list the files and fix test {i}. " * 4}
        )
        messages.append(
            {"role": "assistant", "content": f"Running the tests for step {i} now. " * 5}
        )
    messages.append({"role": "user", "content": "Summarize what you changed."})
    return PromptInput(messages=conversation_from_dicts(messages))


def document_question(words: int) -> PromptInput:
    text = " ".join(
        f"clause {i} of the agreement covers delivery and payment." for i in range(words // 8)
    )
    return PromptInput(
        messages=conversation_from_dicts(
            [
                {"role": "system", "content": "You answer questions about contracts."},
                {"role": "user", "content": text + "\n\nWhat does clause 12 cover?"},
            ]
        )
    )


def time_prefill(model, tokens, grid: ChunkGrid, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        cache = make_prompt_cache(model)
        start = time.perf_counter()
        logits = prefill(model, cache, tokens, 0, grid, lambda p: None)
        mx.eval(logits)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M")
    parser.add_argument("--turns", type=int, default=24)
    parser.add_argument(
        "--document", type=int, default=0, help="words: a one-question document instead"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/grid.json"))
    args = parser.parse_args()

    loaded = load_model(args.model)
    planner = PromptPlanner(loaded.tokenizer, CacheConfig())
    prompt = document_question(args.document) if args.document else agent_conversation(args.turns)
    tokens = planner.plan(prompt).tokens
    grids = {
        "ours, C=256": dataclasses.replace(planner.grid, chunk_size=256),
        "ours, C=512": dataclasses.replace(planner.grid, chunk_size=512),
        "plain 256 chunks": ChunkGrid(256),
        "plain 512 chunks": ChunkGrid(512),
        "plain 2048 chunks": ChunkGrid(2048),
    }
    time_prefill(loaded.model, tokens[:256], planner.grid, 1)  # warm-up
    rows = {}
    for name, grid in grids.items():
        seconds = time_prefill(loaded.model, tokens, grid, args.repeats)
        chunks = len(grid.chunk_ends(tokens, 0))
        rows[name] = {"seconds": seconds, "tokens_per_s": len(tokens) / seconds, "chunks": chunks}
    print(f"{loaded.name}: {len(tokens)} prompt tokens, best of {args.repeats}")
    print(f"{'cut':<24}{'chunks':>8}{'seconds':>10}{'tok/s':>10}")
    for name, row in rows.items():
        print(f"{name:<24}{row['chunks']:>8}{row['seconds']:>10.3f}{row['tokens_per_s']:>10.1f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"model": loaded.name, "tokens": len(tokens), "rows": rows}, indent=2)
    )


if __name__ == "__main__":
    main()
