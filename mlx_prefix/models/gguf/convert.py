"""Convert a llama-architecture GGUF file into an mlx-lm / Hugging Face model folder.

The folder holds `config.json`, `model.safetensors` (float32, HF tensor names) and the
tokenizer files. Quantized GGUF blocks (Q4_0/Q4_1/Q8_0, which `mx.load` maps onto MLX
affine quantization) are dequantized: float32 is the fast path on CPU.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mlx.core as mx
from tqdm import tqdm

from mlx_prefix.arrays import load_gguf
from mlx_prefix.models.gguf.tokenizer import write_tokenizer

# GGUF quantization blocks hold 32 weights (ggml QK4_0 / QK4_1 / QK8_0).
_GGUF_GROUP_SIZE = 32

_TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)")


class UnsupportedGGUF(ValueError):
    pass


def convert_gguf(gguf_path: Path, dest: Path, *, desc: str | None = None) -> None:
    """Write a complete model folder for `gguf_path` into the existing empty dir `dest`."""
    weights, metadata = load_gguf(gguf_path)
    arch = metadata.get("general.architecture")
    if arch != "llama":
        raise UnsupportedGGUF(f"GGUF architecture {arch!r} is not supported (only llama)")
    config = _llama_config(metadata, has_output="output.weight" in weights)

    converted: dict[str, mx.array] = {}
    bases = sorted({k.rsplit(".", 1)[0] for k in weights})
    for base in tqdm(
        bases, desc=desc or f"Converting {gguf_path.name}", unit="tensor", file=sys.stderr
    ):
        name, tensor = _convert_tensor(base, weights, config)
        mx.eval(tensor)
        converted[name] = tensor
    mx.save_safetensors(str(dest / "model.safetensors"), converted, metadata={"format": "mlx"})
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_tokenizer(metadata, dest, model_max_length=config["max_position_embeddings"])


def _llama_config(md: Mapping[str, Any], *, has_output: bool) -> dict[str, Any]:
    def get(key: str) -> Any:
        value = md[f"llama.{key}"]
        return value.item() if hasattr(value, "item") else value

    hidden = int(get("embedding_length"))
    n_head = int(get("attention.head_count"))
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(get("attention.head_count_kv")),
        "head_dim": int(md.get("llama.rope.dimension_count", hidden // n_head)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base")),
        "max_position_embeddings": int(get("context_length")),
        "vocab_size": len(md["tokenizer.ggml.tokens"]),
        "tie_word_embeddings": not has_output,
        "torch_dtype": "float32",
    }
    for key, field in (
        ("bos", "bos_token_id"),
        ("eos", "eos_token_id"),
        ("padding", "pad_token_id"),
    ):
        if (value := md.get(f"tokenizer.ggml.{key}_token_id")) is not None:
            config[field] = int(value.item())
    return config


def _convert_tensor(
    base: str, weights: Mapping[str, mx.array], config: Mapping[str, Any]
) -> tuple[str, mx.array]:
    tensor = _dequantize(base, weights)
    if m := _BLOCK_RE.fullmatch(base):
        layer, part = m.groups()
        if part not in _BLOCK_NAMES:
            raise UnsupportedGGUF(f"unexpected GGUF tensor {base!r}")
        if part == "attn_q":
            tensor = _unpermute(tensor, config["num_attention_heads"])
        elif part == "attn_k":
            tensor = _unpermute(tensor, config["num_key_value_heads"])
        return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.weight", tensor
    if base not in _TOP_LEVEL_NAMES:
        raise UnsupportedGGUF(f"unexpected GGUF tensor {base!r}")
    return f"{_TOP_LEVEL_NAMES[base]}.weight", tensor


def _dequantize(base: str, weights: Mapping[str, mx.array]) -> mx.array:
    w = weights[f"{base}.weight"]
    scales = weights.get(f"{base}.scales")
    if scales is None:
        return w.astype(mx.float32)
    # A uint32 packs 32 // bits values and each group of 32 has one scale, so
    # packed words per row / groups per row == bits.
    bits = w.shape[-1] // scales.shape[-1]
    return mx.dequantize(
        w,
        scales.astype(mx.float32),
        weights[f"{base}.biases"].astype(mx.float32),
        group_size=_GGUF_GROUP_SIZE,
        bits=bits,
    )


def _unpermute(w: mx.array, n_head: int) -> mx.array:
    """Inverse of llama.cpp convert_hf_to_gguf `permute`.

    HF stores each head's rotary dims as [first half | second half]; llama.cpp
    interleaves them pairwise. Rows: [n_head, head_dim/2, 2] -> [n_head, 2, head_dim/2].
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
