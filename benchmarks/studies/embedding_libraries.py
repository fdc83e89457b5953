"""mlx-lm's model classes (what /v1/embeddings runs) against PyPI mlx-embeddings' on the
same weights and padded batches: time per forward and the vectors' agreement.

    <venv with mlx-lm and mlx-embeddings>/bin/python \
        benchmarks/studies/embedding_libraries.py FOLDER

mlx-embeddings is not a dependency of mlx-prefix (GPL-3.0, and it pulls mlx-vlm), so run
this with a Python that has both, such as the vllm-mlx peer's venv (`.peers/vllm-mlx`).
FOLDER is a qwen3 embedding folder (`mlx_prefix.embeddings.testing.make_embedding_test_model`
writes random ones; the shapes, not the values, set the time). The two forwards run
alternately, so load from other processes falls on both alike; the median is reported.
Self-contained: no mlx_prefix import.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
import numpy as np


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("folder", type=Path)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--shapes", default="1x32,16x48,4x256", help="BATCHxLENGTH, comma-separated")
    args = p.parse_args()
    config = json.loads((args.folder / "config.json").read_text())
    weights = mx.load(str(args.folder / "model.safetensors"))

    import mlx_lm.models.qwen3 as lm_qwen3
    from mlx_embeddings.utils import load_model as embeddings_load

    lm = lm_qwen3.Model(lm_qwen3.ModelArgs.from_dict(config))
    lm.load_weights([(f"model.{k}", v) for k, v in weights.items()])
    em = embeddings_load(args.folder)
    mx.eval(lm.parameters(), em.parameters())

    def run_lm(ids: mx.array, lengths: mx.array) -> mx.array:
        # As mlx_prefix/embeddings/model.py: right padding under the causal mask, last token.
        h = lm.model(ids)
        v = h[mx.arange(ids.shape[0]), lengths - 1]
        v = v / mx.linalg.norm(v, axis=-1, keepdims=True)
        mx.eval(v)
        return v

    def run_em(ids: mx.array, lengths: mx.array) -> mx.array:
        mask = (mx.arange(ids.shape[1])[None] < lengths[:, None]).astype(mx.int32)
        v = em(ids, attention_mask=mask).text_embeds
        mx.eval(v)
        return v

    rng = np.random.default_rng(0)
    print("| batch x length | mlx-lm | mlx-embeddings | lowest cosine |")
    print("|---|---:|---:|---:|")
    for shape in args.shapes.split(","):
        batch, length = map(int, shape.split("x"))
        lens = rng.integers(max(1, length * 3 // 4), length + 1, batch)
        lens[0] = length
        ids = mx.array(rng.integers(10, config["vocab_size"] - 1, (batch, length)))
        lengths = mx.array(lens)
        a, b = np.array(run_lm(ids, lengths)), np.array(run_em(ids, lengths))
        cosine = float((a * b).sum(-1).min())
        times: dict[str, list[float]] = {"lm": [], "em": []}
        for _ in range(args.repeats):
            for name, run in (("lm", run_lm), ("em", run_em)):
                t = time.perf_counter()
                run(ids, lengths)
                times[name].append(time.perf_counter() - t)
        lm_ms, em_ms = (statistics.median(times[k]) * 1000 for k in ("lm", "em"))
        row = f"| {batch} x {length} | {lm_ms:.0f} ms | {em_ms:.0f} ms | {cosine:.6f} |"
        print(row, flush=True)


if __name__ == "__main__":
    main()
