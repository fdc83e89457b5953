"""The device benchmark's models: random weights of real shapes, 4-bit, built in the run
(the lent GPU machine reaches no hub).

- `hybrid`: Qwen3.5-4B's text model (mlx-lm's qwen3_5: Gated DeltaNet linear attention,
  full attention every 4th layer): hidden 2560, 32 layers, MLP 9216, 16 heads of 256 and
  4 KV heads, linear attention 16 key / 32 value heads of 128.
- `dense`: Qwen3-8B (mlx-lm's qwen3): hidden 4096, 36 layers, MLP 12288, 32 heads of 128
  and 8 KV heads.

Both get Qwen3's real tokenizer and chat template (tests/data/tokenizers/qwen3), so the
vocabulary is its 151,669 entries: Qwen3-8B's own (its checkpoint pads the table to
151,936), where Qwen3.5-4B's is 248,320 (its embedding and output head are 40% smaller
here; the layers are its own). Weights are bfloat16 on a GPU, as published checkpoints
are, then quantized to 4 bits in groups of 64 (mlx-lm's convert default), scales in
bfloat16. `--small` builds the same architectures a few layers deep and narrow, in
float32 (the CPU computes half precision 50-100x slower), for a smoke run on the CPU.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TOKENIZER = Path(__file__).resolve().parents[2] / "tests" / "data" / "tokenizers" / "qwen3"
BITS, GROUP = 4, 64

HYBRID_4B: dict[str, Any] = {
    "model_type": "qwen3_5",
    "tie_word_embeddings": True,
    "text_config": {
        "model_type": "qwen3_5_text",
        "hidden_size": 2560,
        "intermediate_size": 9216,
        "num_hidden_layers": 32,
        "full_attention_interval": 4,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "rms_norm_eps": 1e-6,
        "linear_num_value_heads": 32,
        "linear_num_key_heads": 16,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "tie_word_embeddings": True,
        "max_position_embeddings": 65536,
        "vocab_size": 0,  # the tokenizer's
        "rope_parameters": {
            "type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
        },
    },
}

DENSE_8B: dict[str, Any] = {
    "model_type": "qwen3",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "max_position_embeddings": 65536,
    "vocab_size": 0,
}

# --small: the same architectures, narrow and shallow (every width a multiple of the
# quantization group).
_SMALL_DENSE = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
}
_SMALL_HYBRID = {
    **_SMALL_DENSE,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
}


@dataclass(frozen=True)
class Shape:
    key: str  # "hybrid" | "dense"
    description: str
    config: dict[str, Any]
    dtype: str  # the checkpoint's floating dtype: bfloat16 (GPU) | float32 (--small)


def shapes(small: bool) -> dict[str, Shape]:
    hybrid = json.loads(json.dumps(HYBRID_4B))
    dense = json.loads(json.dumps(DENSE_8B))
    if small:
        hybrid["text_config"].update(_SMALL_HYBRID)
        dense.update(_SMALL_DENSE)
        return {
            "hybrid": Shape(
                "hybrid", "qwen3_5 (hybrid), small: 4 layers of 256", hybrid, "float32"
            ),
            "dense": Shape("dense", "qwen3 (dense), small: 4 layers of 256", dense, "float32"),
        }
    return {
        "hybrid": Shape("hybrid", "Qwen3.5-4B-shaped hybrid (qwen3_5), 4-bit", hybrid, "bfloat16"),
        "dense": Shape("dense", "Qwen3-8B-shaped dense (qwen3), 4-bit", dense, "bfloat16"),
    }


def build(shape: Shape, dest: Path, seed: int = 0) -> Path:
    """Write a loadable 4-bit model folder of `shape` into `dest` (once: an existing
    folder is reused). Layer by layer, so at most one layer's unquantized weights are
    in memory at a time."""
    if (dest / "config.json").is_file():
        return dest
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from mlx_prefix.models.testing import copy_tokenizer

    tmp = dest.with_name(dest.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    vocab, bos, eos = copy_tokenizer(TOKENIZER, tmp)
    config = json.loads(json.dumps(shape.config))
    config.get("text_config", config)["vocab_size"] = vocab
    config.update({"bos_token_id": bos, "eos_token_id": eos, "torch_dtype": shape.dtype})
    config["quantization"] = {"group_size": GROUP, "bits": BITS}
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    dtype = getattr(mx, shape.dtype)
    model.apply(lambda a: a.astype(dtype) if mx.issubdtype(a.dtype, mx.floating) else a)
    nn.quantize(model, group_size=GROUP, bits=BITS)  # lazily: evaluated piece by piece
    weights: dict[str, mx.array] = {}
    for name, value in tree_flatten(model.parameters()):
        mx.eval(value)
        weights[name] = value
    mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
    index = {"metadata": {}, "weight_map": dict.fromkeys(sorted(weights), "model.safetensors")}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tmp.replace(dest)
    return dest


def nbytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))
