"""The models a run compares on, and client-side tokenization for reuse accounting.

- dense:  the bundled default, SmolLM2-135M-Instruct in float32.
- hybrid: no hybrid checkpoint is reachable offline, so a random-weight qwen3_5 (Gated
  DeltaNet linear attention + full attention every 4th layer) at a realistic small size,
  built once with mlx-lm's own classes and cached under the user cache dir. It gets the
  SmolLM2 tokenizer with `<think>` tokens and a Qwen3-style template (tools, tool calls,
  tool responses, reasoning kept only after the last user query). Its replies are noise,
  but its compute and cache structure are those of a real hybrid model.
- sharded-dense, sharded-hybrid (issue 16): both servers on 2 ranks under mlx.launch.
  SmolLM2's 9 heads and 3 KV heads do not split in two, so the dense one is a random
  llama of SmolLM2-135M's width (hidden 576, MLP 1536) with 8 heads and 2 KV heads and
  8 layers, SmolLM2's tokenizer and template; the hybrid one is the hybrid model above
  (8 heads, 2 KV heads, 8/4 linear heads, 8 layers). With SmolLM2's 30 layers, 2-rank
  mlx-prefix hung in its startup batching probe here (both ranks waiting in mx.eval).
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


# SmolLM2-135M's width with head counts that divide by 2 (its own: 9 and 3).
SHARDED_DENSE_CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "max_position_embeddings": 8192,
    "vocab_size": 0,  # the tokenizer's
}
SHARDED_RANKS = 2


@dataclass(frozen=True)
class BenchModel:
    key: str  # "dense" | "hybrid" | "sharded-dense" | "sharded-hybrid" | a folder name
    path: Path
    description: str
    ranks: int = 1  # both servers run on this many ranks (mlx.launch, ring backend)


def dense_model() -> BenchModel:
    from mlx_prefix.models.default import ensure_default_model

    return BenchModel("dense", ensure_default_model(), "SmolLM2-135M-Instruct, float32")


def _built(name: str, config: dict[str, Any], template: str | None) -> Path:
    """The model folder for `config`, built once under the user cache dir."""
    from mlx_prefix.models.default import default_models_dir

    tag = hashlib.sha256(json.dumps([config, template], sort_keys=True).encode()).hexdigest()
    dest = default_models_dir().parent / "bench-models" / f"{name}-random-{tag[:10]}"
    if not (dest / "model.safetensors").is_file():
        _build(dest, config, template)
    return dest


def hybrid_model() -> BenchModel:
    dest = _built("qwen3_5", HYBRID_CONFIG, QWEN3_TOOLS_TEMPLATE)
    t = HYBRID_CONFIG["text_config"]
    desc = (
        f"random qwen3_5 (hybrid), hidden {t['hidden_size']}, {t['num_hidden_layers']} "
        f"layers ({t['num_hidden_layers'] // t['full_attention_interval']} full attention)"
    )
    return BenchModel("hybrid", dest, desc)


def sharded_model(key: str) -> BenchModel:
    """`sharded-dense` or `sharded-hybrid`: served on SHARDED_RANKS ranks."""
    on = f"; both servers on {SHARDED_RANKS} ranks (mlx.launch, ring, tensor parallel)"
    if key == "sharded-hybrid":
        base = hybrid_model()
        return BenchModel(key, base.path, base.description + on, SHARDED_RANKS)
    c = SHARDED_DENSE_CONFIG
    desc = (
        f"random llama of SmolLM2-135M's width (hidden {c['hidden_size']}), "
        f"{c['num_hidden_layers']} layers, {c['num_attention_heads']} heads and "
        f"{c['num_key_value_heads']} KV heads, SmolLM2's tokenizer"
    )
    return BenchModel(key, _built("llama", c, None), desc + on, SHARDED_RANKS)


def _build(dest: Path, config: dict[str, Any], template: str | None) -> None:
    """Random float32 weights (seed 0) with mlx-lm's own class; the SmolLM2 tokenizer,
    with `<think>` tokens and `template` when one is given, else SmolLM2's template."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlx_prefix.models.testing import write_tokenizer

    tmp = dest.with_name(dest.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(tmp, think_template=template is not None)
    if template is not None:
        tok_config = json.loads((tmp / "tokenizer_config.json").read_text())
        tok_config["chat_template"] = template
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")

    config = json.loads(json.dumps(config))
    config.get("text_config", config)["vocab_size"] = vocab
    config.update({"bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"})
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(0)
    model = module.Model(module.ModelArgs.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
    # The index lets a pipeline-parallel load read only its own layers' weights.
    index = {"metadata": {}, "weight_map": dict.fromkeys(sorted(weights), "model.safetensors")}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tmp.replace(dest)


def resolve(key: str) -> BenchModel:
    if key == "dense":
        return dense_model()
    if key == "hybrid":
        return hybrid_model()
    if key in ("sharded-dense", "sharded-hybrid"):
        return sharded_model(key)
    path = Path(key).expanduser()
    if not path.is_dir():
        raise SystemExit(
            f"benchmarks: --model {key}: not a model folder (or 'dense', 'hybrid', "
            "'sharded-dense', 'sharded-hybrid')"
        )
    return BenchModel(path.name, path, str(path))


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens two prompts share from their start."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class Tokens:
    """The prompt token ids a server sees, rendered the way mlx-prefix renders them.

    Used only to count which tokens are new to a server (reuse accounting); both servers
    apply the same chat template, and each reply's prompt_tokens is checked against it.
    """

    def __init__(self, path: Path):
        from transformers import AutoTokenizer

        from mlx_prefix.prompt.request.render import ChatRenderer

        self._tok = AutoTokenizer.from_pretrained(str(path))
        self._renderer = ChatRenderer(self._tok)

    def chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        from mlx_prefix.server.protocol.messages import conversation_from_dicts

        text = self._renderer.render_text(conversation_from_dicts(messages), tools=tools)
        return self._renderer.encode_chat(text)

    def text(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def count(self, text: str) -> int:
        return len(self.text(text))
