"""Random-weight embedding model folders laid out like Qwen3-Embedding's, for tests and
the benchmark: mlx-lm's qwen3 classes, weights saved as the bare backbone (no `model.`
prefix, no LM head), sentence-transformers' modules.json and 1_Pooling/config.json, and
the default model's SmolLM2 tokenizer. No network."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlx_prefix.arrays import named_arrays
from mlx_prefix.models.testing import write_tokenizer

SIZES: dict[str, dict[str, Any]] = {
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
    },
    # Qwen3-Embedding-0.6B's shapes (its 151,669-token vocabulary aside): what the
    # benchmark measures, since the weights' values do not change the work.
    "qwen3-0.6b": {
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
    },
}
_POOLING_FLAGS = {"lasttoken": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens",
                  "cls": "pooling_mode_cls_token"}  # fmt: skip
_ST = "sentence_transformers.models."


def make_embedding_test_model(
    dest: Path,
    *,
    size: str = "tiny",
    pooling: str = "lasttoken",
    normalize: bool = True,
    matryoshka: bool = True,
    seed: int = 0,
) -> Path:
    """Write a loadable embedding model folder into `dest` (created if missing); return it."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    vocab_size = write_tokenizer(dest, think_template=False)
    config = {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        **SIZES[size],
        "vocab_size": vocab_size,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "is_matryoshka": matryoshka,
    }
    module = importlib.import_module("mlx_lm.models.qwen3")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    # The bare backbone, as Qwen3-Embedding's checkpoint holds it.
    weights = {k.removeprefix("model."): v for k, v in named_arrays(model.parameters())}
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "pt"})
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    modules = [
        {"idx": 0, "name": "0", "path": "", "type": f"{_ST}Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": f"{_ST}Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": f"{_ST}Normalize"})
    (dest / "modules.json").write_text(json.dumps(modules, indent=2) + "\n")
    (dest / "1_Pooling").mkdir(exist_ok=True)
    flags = {flag: name == pooling for name, flag in _POOLING_FLAGS.items()}
    pool = {"word_embedding_dimension": config["hidden_size"], **flags, "include_prompt": True}
    (dest / "1_Pooling" / "config.json").write_text(json.dumps(pool, indent=2) + "\n")
    return dest
