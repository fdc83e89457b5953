"""The models a run compares on, and client-side tokenization for reuse accounting.

- dense:  the bundled default, SmolLM2-135M-Instruct in float32.
- hybrid: no hybrid checkpoint is reachable offline, so a random-weight qwen3_5 (Gated
  DeltaNet linear attention + full attention every 4th layer) at a realistic small size,
  built once with mlx-lm's own classes and cached under the user cache dir. It gets the
  SmolLM2 tokenizer with `<think>` tokens and a Qwen3-style template (tools, tool calls,
  tool responses, reasoning kept only after the last user query). Its replies are noise,
  but its compute and cache structure are those of a real hybrid model.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlx_prefix.models.testing import THINK_CHAT_TEMPLATE as QWEN3_TOOLS_TEMPLATE

HYBRID_CONFIG: dict[str, Any] = {
    "model_type": "qwen3_5",
    "tie_word_embeddings": True,
    "text_config": {
        "model_type": "qwen3_5_text",
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 8,
        "full_attention_interval": 4,  # layers 3 and 7 are full attention
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rms_norm_eps": 1e-6,
        "linear_num_value_heads": 8,
        "linear_num_key_heads": 4,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "linear_conv_kernel_dim": 4,
        "tie_word_embeddings": True,
        "max_position_embeddings": 32768,
        "vocab_size": 0,  # the tokenizer's
        "rope_parameters": {
            "type": "default",
            "rope_theta": 1000000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
        },
    },
}


@dataclass(frozen=True)
class BenchModel:
    key: str  # "dense" | "hybrid" | a folder name for --model
    path: Path
    description: str


def dense_model() -> BenchModel:
    from mlx_prefix.models.default import ensure_default_model

    return BenchModel("dense", ensure_default_model(), "SmolLM2-135M-Instruct, float32")


def hybrid_model() -> BenchModel:
    from mlx_prefix.models.default import default_models_dir

    tag = hashlib.sha256(
        json.dumps([HYBRID_CONFIG, QWEN3_TOOLS_TEMPLATE], sort_keys=True).encode()
    ).hexdigest()[:10]
    dest = default_models_dir().parent / "bench-models" / f"qwen3_5-random-{tag}"
    if not (dest / "model.safetensors").is_file():
        _build_hybrid(dest)
    t = HYBRID_CONFIG["text_config"]
    desc = (
        f"random qwen3_5 (hybrid), hidden {t['hidden_size']}, {t['num_hidden_layers']} "
        f"layers ({t['num_hidden_layers'] // t['full_attention_interval']} full attention)"
    )
    return BenchModel("hybrid", dest, desc)


def _build_hybrid(dest: Path) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    # The test-model helper copies the SmolLM2 tokenizer and adds <think> tokens.
    from mlx_prefix.models.testing import _write_tokenizer

    tmp = dest.with_name(dest.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    vocab = _write_tokenizer(tmp, think_template=True)
    tok_config = json.loads((tmp / "tokenizer_config.json").read_text())
    tok_config["chat_template"] = QWEN3_TOOLS_TEMPLATE
    (tmp / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")

    config = json.loads(json.dumps(HYBRID_CONFIG))
    config["text_config"]["vocab_size"] = vocab
    config.update({"bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"})
    module = importlib.import_module("mlx_lm.models.qwen3_5")
    mx.random.seed(0)
    model = module.Model(module.ModelArgs.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tmp.replace(dest)


def resolve(key: str) -> BenchModel:
    if key == "dense":
        return dense_model()
    if key == "hybrid":
        return hybrid_model()
    path = Path(key).expanduser()
    if not path.is_dir():
        raise SystemExit(f"benchmarks: --model {key}: not a model folder (or 'dense'/'hybrid')")
    return BenchModel(path.name, path, str(path))


class Tokens:
    """The prompt token ids a server sees, rendered the way mlx-prefix renders them.

    Used only to count which tokens are new to a server (reuse accounting); both servers
    apply the same chat template, and each reply's prompt_tokens is checked against it.
    """

    def __init__(self, path: Path):
        from transformers import AutoTokenizer

        from mlx_prefix.prompt.render import ChatRenderer

        self._tok = AutoTokenizer.from_pretrained(str(path))
        self._renderer = ChatRenderer(self._tok)

    def chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        from mlx_prefix.prompt.render import normalize_messages

        text = self._renderer.render_text(normalize_messages(messages), tools=tools)
        return self._renderer.encode_chat(text)

    def text(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def count(self, text: str) -> int:
        return len(self.text(text))
