"""What a speculative verify of k+1 positions costs against k+1 plain decode steps, on the
tiny random-weight test models (models/testing.py): hybrid (qwen3_5: GatedDeltaNet;
nemotron_h: Mamba-2), sliding window (gemma3_text) and dense for reference.

Each trial starts from the same prefilled prompt and times, batch-invariant as
--deterministic runs them (engine/decode/batch.py, one request decoding alone):
  steps     k+1 decode steps, each read before the next
  kept      a verify of k+1 rows whose drafts are all kept (no rollback)
  cut       a verify whose draft is cut mid-way: the cache is put back and the kept
            half computed again (cache/layers/rewind.py; a trim for dense and sliding)
  rejected  a verify whose first draft token is rejected: put back, one row again
each until its logits and the cache are evaluated, the modes in turn. The median of the
trials is reported with the machine's load average, which moves these figures on a shared CPU.

With --rows B, B requests decode together (prompt lookup's default forward, not
batch-invariant: engine/decode/verify_rows.py) and the same modes compare k+1 batched
steps with one verify of B rows x (k+1): kept by every row; *cut*, half the rows kept
all and the other half only their first (those put back and computed again, one
second forward of one position); *rejected*, every row only its first.

    python benchmarks/studies/hybrid_verify.py [--k 2 4 8] [--trials 7] [--rows 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlx_prefix.engine.decode.batch import DecodeBatch
from mlx_prefix.engine.decode.sampling import TokenSampler
from mlx_prefix.engine.decode.verify_rows import settle_verified, verify_forward
from mlx_prefix.engine.forward import rowwise
from mlx_prefix.engine.forward.runner import ChunkWork, compute_chunks
from mlx_prefix.models.load import load_model
from mlx_prefix.models.testing import cached_test_model
from mlx_prefix.records import SamplingParams

PROMPT = [10 + (7 * i) % 990 for i in range(200)]
MODES = ("steps", "kept", "cut", "rejected")


def _fresh(model, rows: int = 0) -> DecodeBatch:
    """One request alone, batch-invariant (`rows` 0), or `rows` requests as prompt
    lookup decodes them by default."""
    batch = DecodeBatch(model, 1) if not rows else DecodeBatch(model, exact_verify=False)
    for member in range(max(1, rows)):
        cache = make_prompt_cache(model)
        compute_chunks(model, [ChunkWork(cache, PROMPT, 0, len(PROMPT))], group=False)
        mx.eval([c.state for c in cache])
        sampler = TokenSampler(SamplingParams(temperature=0.0))
        batch.add(member, cache, sampler, PROMPT[-1], steps=16 if rows else 0)
    batch.join()
    mx.eval([c.state for c in batch.cache])
    return batch


def _trial(model, mode: str, k: int, rows: int = 0) -> float:
    batch = _fresh(model, rows)
    tokens = [PROMPT[-1], *(100 + i for i in range(k))]
    start = time.perf_counter()
    if mode == "steps":
        for _ in range(k + 1):
            batch.step()
    elif rows:
        logits, held = verify_forward(batch, [tokens] * rows)
        mx.eval(logits)
        kept = {"kept": [k + 1] * rows, "rejected": [1] * rows}.get(
            mode, [k + 1 if i % 2 == 0 else 1 for i in range(rows)]
        )
        settle_verified(batch, [tokens] * rows, held, range(rows), kept, [0] * rows)
        mx.eval([c.state for c in batch.cache])
    else:
        logits = batch.verify(tokens)
        mx.eval(logits)
        kept = {"kept": k + 1, "cut": (k + 2) // 2, "rejected": 1}[mode]
        batch.settle(len(PROMPT) - 1 + kept, 0, k + 1 - kept)
        mx.eval([c.state for c in batch.cache])
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--kinds", nargs="+", default=["qwen3_5", "nemotron_h", "sliding", "dense"])
    p.add_argument("--k", nargs="+", type=int, default=[2, 4, 8])
    p.add_argument("--trials", type=int, default=7)
    p.add_argument("--rows", type=int, default=0, help="requests decoding together (0: one)")
    out = Path(__file__).parents[1] / "out"  # benchmarks/out
    p.add_argument("--out", type=Path, default=out / "hybrid_verify.json")
    args = p.parse_args()
    rows = []
    batched = max(1, args.rows)
    print(f"load average before: {os.getloadavg()[0]:.1f}")
    for kind in args.kinds:
        model = load_model(str(cached_test_model(kind))).model
        rowwise.install(model)
        _trial(model, "kept", 2, args.rows)  # warm up
        for k in args.k:
            # Round-robin over the modes: a loaded machine's drift hits each alike.
            times: dict[str, list[float]] = {mode: [] for mode in MODES}
            for _ in range(args.trials):
                for mode in MODES:
                    times[mode].append(_trial(model, mode, k, args.rows))
            ms = {mode: 1000 * statistics.median(t) for mode, t in times.items()}
            row = {"kind": kind, "k": k, "rows": batched}
            row |= {f"{m}_ms": round(v, 2) for m, v in ms.items()}
            row |= {f"{m}_vs_steps": round(ms[m] / ms["steps"], 2) for m in MODES[1:]}
            rows.append(row)
            print(
                f"{kind:<11} B={batched} k={k}: {k + 1} steps {ms['steps']:7.1f} ms | verify kept "
                f"{ms['kept']:6.1f} ({row['kept_vs_steps']:.2f}x) cut {ms['cut']:6.1f} "
                f"({row['cut_vs_steps']:.2f}x) rejected {ms['rejected']:6.1f} "
                f"({row['rejected_vs_steps']:.2f}x)",
                flush=True,
            )
    load = os.getloadavg()[0]
    print(f"load average after: {load:.1f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"load_average": load, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
