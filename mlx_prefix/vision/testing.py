"""Tiny random-weight vision model folders, laid out as mlx-community publishes them.

mlx-vlm's own model classes at tiny sizes, random float32 weights from a fixed seed,
saved as one `model.safetensors` with `vision_tower.*` beside `language_model.*` (what
mlx-vlm's convert writes), a config.json with both configs and the image token ids, a
preprocessor_config.json, and a real tokenizer with the family's vision tokens and chat
template (tests pass the vendored ones from tests/data). They load through the same path
as a real checkpoint: mlx-lm for the text, vision/tower.py for the tower.

| kind      | text (mlx-lm)                                  | tower (mlx-vlm)   | tokens    |
|-----------|------------------------------------------------|-------------------|-----------|
| `qwen3_5` | qwen3_5: linear, full, linear, full; M-RoPE    | qwen3_5, 2 blocks | t*h*w / 4 |
| `gemma3`  | gemma3_text: global layers (all KV, trimmable) | siglip, 2 blocks  | 4 each    |
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlx_prefix.arrays import named_arrays
from mlx_prefix.models.testing import QWEN3_5_LAYERS, copy_tokenizer
from mlx_prefix.vision.family import model_config

VISION_TEST_KINDS = ("qwen3_5", "gemma3")

# Qwen3's vocabulary ids of its vision tokens (tests/data/tokenizers/qwen3).
QWEN_IMAGE_PAD, QWEN_VIDEO_PAD, QWEN_VISION_START, QWEN_VISION_END = 151655, 151656, 151652, 151653

_QWEN_TEXT: dict[str, Any] = {
    "model_type": "qwen3_5_text",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    **QWEN3_5_LAYERS,
    # Half the head rotated (8 dims, 4 frequencies) so every M-RoPE axis has one.
    "rope_parameters": {
        "type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "mrope_section": [2, 1, 1],
    },
}
_QWEN_VISION: dict[str, Any] = {
    "model_type": "qwen3_5",
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "out_hidden_size": 128,
    "num_heads": 2,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 64,
    "in_channels": 3,
    "deepstack_visual_indexes": [],
}
# Images between 32x32 and 256x256 pixels after resizing: 1 to 64 tokens each.
_QWEN_PROCESSOR: dict[str, Any] = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "size": {"shortest_edge": 32 * 32, "longest_edge": 256 * 256},
}


def make_vision_test_model(
    kind: str,
    dest: Path,
    *,
    tokenizer: Path,
    chat_template: str,
    seed: int = 0,
    context: int = 8192,
    vision_overrides: dict[str, Any] | None = None,
) -> Path:
    """Write a loadable vision model folder of `kind` into `dest`; return it. The same
    kind and seed always give the same weights. `vision_overrides`: fields of the tower's
    config over the tiny one's (a wider, deeper tower: one whose memory shows)."""
    if kind not in VISION_TEST_KINDS:
        raise ValueError(f"unknown vision test kind {kind!r}; choose from {VISION_TEST_KINDS}")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    vocab, bos, eos = copy_tokenizer(Path(tokenizer), dest)
    tok_config_path = dest / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text())
    tok_config["chat_template"] = chat_template
    tok_config_path.write_text(json.dumps(tok_config, indent=1) + "\n")
    if kind == "qwen3_5":
        config, processor = _qwen_config(vocab, bos, eos, context), _QWEN_PROCESSOR
    else:
        config, processor = _gemma_config(vocab, bos, eos, context), _GEMMA_PROCESSOR
        # Gemma's templates write the boi token alone for an image (its processor adds
        # the rest): Qwen3.5's template rendering images that way, on Qwen3's vocabulary.
        tok_config["chat_template"] = chat_template.replace(
            "<|vision_start|><|image_pad|><|vision_end|>", "<|vision_start|>"
        )
        tok_config_path.write_text(json.dumps(tok_config, indent=1) + "\n")
    config["vision_config"].update(vision_overrides or {})
    _save(kind, config, dest, seed)
    (dest / "preprocessor_config.json").write_text(json.dumps(processor, indent=1) + "\n")
    return dest


def _qwen_config(vocab: int, bos: int | None, eos: list[int], context: int) -> dict[str, Any]:
    text = dict(_QWEN_TEXT, vocab_size=vocab, max_position_embeddings=context)
    return {
        "model_type": "qwen3_5",
        "tie_word_embeddings": True,
        "image_token_id": QWEN_IMAGE_PAD,
        "video_token_id": QWEN_VIDEO_PAD,
        "vision_start_token_id": QWEN_VISION_START,
        "vision_end_token_id": QWEN_VISION_END,
        "vocab_size": vocab,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "float32",
        "text_config": json.loads(json.dumps(text)),
        "vision_config": dict(_QWEN_VISION),
    }


# Gemma 3 on Qwen3's vocabulary: boi, the soft image token and eoi are Qwen's vision
# tokens. All layers global (sliding_window_pattern 1): every cache is a KVCache, the
# trimmable "dense" case; an image is 4 tokens (a 32 px image, 8 px patches, pooled 2x2).
_GEMMA_TEXT: dict[str, Any] = {
    "model_type": "gemma3_text",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rms_norm_eps": 1e-6,
    "query_pre_attn_scalar": 32,
    "sliding_window": 512,
    "sliding_window_pattern": 1,
    "rope_global_base_freq": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "mm_tokens_per_image": 4,
}
_GEMMA_VISION: dict[str, Any] = {
    "model_type": "siglip_vision_model",
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "patch_size": 8,
    "image_size": 32,
    "layer_norm_eps": 1e-6,
}
_GEMMA_PROCESSOR: dict[str, Any] = {
    "image_processor_type": "SiglipImageProcessor",
    "size": {"height": 32, "width": 32},
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}


def _gemma_config(vocab: int, bos: int | None, eos: list[int], context: int) -> dict[str, Any]:
    text = dict(_GEMMA_TEXT, vocab_size=vocab, max_position_embeddings=context)
    return {
        "model_type": "gemma3",
        "vocab_size": vocab,
        "hidden_size": text["hidden_size"],
        "boi_token_index": QWEN_VISION_START,
        "image_token_index": QWEN_IMAGE_PAD,
        "eoi_token_index": QWEN_VISION_END,
        "mm_tokens_per_image": text["mm_tokens_per_image"],
        "pad_token_id": eos[-1] if eos else 0,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "float32",
        "text_config": text,
        "vision_config": dict(_GEMMA_VISION),
    }


def _save(kind: str, config: dict[str, Any], dest: Path, seed: int) -> None:
    import importlib

    module = importlib.import_module(f"mlx_vlm.models.{kind}")
    mx.random.seed(seed)
    model = module.Model(model_config(module, config))
    flat = named_arrays(model.parameters())
    weights = {
        k: v
        for k, v in flat
        if not k.startswith("language_model.lm_head")  # tied to the embeddings
    }
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    index = {"metadata": {}, "weight_map": dict.fromkeys(sorted(weights), "model.safetensors")}
    (dest / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
