"""Tiny random-weight models of the other recurrent families mlx-lm ships (LFM2's short
convolutions, Mamba's selective scan, Mamba-2's SSD mixer in mamba2, falcon_h1 and
granitemoehybrid, Jamba's Mamba mixer), built like models/testing.py's kinds and
loaded once per process. Kept out of TEST_MODEL_KINDS: the tests that run every kind
need not run these."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlx_prefix.models.load import load_model
from mlx_prefix.models.testing import make_test_model

_SMALL: dict[str, Any] = {
    "hidden_size": 64,
    "vocab_size": 0,  # set to the tokenizer's vocab size
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}
_ATTENTION: dict[str, Any] = {"num_attention_heads": 4, "num_key_value_heads": 2}
_MAMBA2: dict[str, Any] = {  # falcon_h1 and granitemoehybrid spell Mamba-2 alike
    "mamba_n_heads": 4,
    "mamba_d_head": 16,
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
    "mamba_n_groups": 1,
    "mamba_conv_bias": True,
    "mamba_proj_bias": False,
}

RECURRENT_CONFIGS: dict[str, dict[str, Any]] = {
    "lfm2": {  # conv, attention, conv, attention
        "model_type": "lfm2",
        **_SMALL,
        **_ATTENTION,
        "num_hidden_layers": 4,
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_dim": 64,
        "block_ff_dim": 128,
        "block_multiple_of": 16,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
        "rope_theta": 10000.0,
        "layer_types": ["conv", "full_attention", "conv", "full_attention"],
    },
    "mamba": {  # Mamba-1 x2
        "model_type": "mamba",
        **_SMALL,
        "intermediate_size": 128,
        "state_size": 16,
        "num_hidden_layers": 2,
        "conv_kernel": 4,
        "use_bias": False,
        "use_conv_bias": True,
        "time_step_rank": 8,
        "tie_word_embeddings": False,  # tied, its random weights echo the last token
    },
    "mamba2": {  # Mamba-2 x2
        "model_type": "mamba2",
        **_SMALL,
        "num_heads": 4,
        "head_dim": 16,
        "intermediate_size": 64,
        "state_size": 16,
        "num_hidden_layers": 2,
        "layer_norm_epsilon": 1e-5,
        "conv_kernel": 4,
        "n_groups": 1,
        "use_bias": False,
        "use_conv_bias": True,
        "time_step_limit": [0.001, 100.0],
        "time_step_rank": "auto",
        "expand": 1,  # transformers checks hidden_size * expand == num_heads * head_dim
    },
    "falcon_h1": {  # attention beside Mamba-2 in each of 2 layers
        "model_type": "falcon_h1",
        **_SMALL,
        **_ATTENTION,
        **_MAMBA2,
        "head_dim": 16,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "mamba_d_ssm": 64,
        "mamba_expand": 1,
        "rope_theta": 10000.0,
    },
    "granitemoehybrid": {  # Mamba-2, attention, Mamba-2, attention (dense MLP)
        "model_type": "granitemoehybrid",
        **_SMALL,
        **_ATTENTION,
        **_MAMBA2,
        "intermediate_size": 128,
        "shared_intermediate_size": 128,
        "num_hidden_layers": 4,
        "attention_bias": False,
        "embedding_multiplier": 1.0,
        "attention_multiplier": 0.25,
        "logits_scaling": 1.0,
        "residual_multiplier": 1.0,
        "rms_norm_eps": 1e-5,
        "mamba_expand": 1,
        "layer_types": ["mamba", "attention", "mamba", "attention"],
    },
    "lfm2_moe": {  # conv, attention, conv, attention; experts after the first
        "model_type": "lfm2_moe",
        **_SMALL,
        **_ATTENTION,
        "intermediate_size": 128,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "use_expert_bias": True,
        "num_dense_layers": 1,
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "rope_theta": 10000.0,
        "layer_types": ["conv", "full_attention", "conv", "full_attention"],
    },
    "plamo2": {  # Mamba-2 style, attention, Mamba-2 style, attention
        "model_type": "plamo2",
        **_SMALL,
        **_ATTENTION,
        "hidden_size_per_head": 16,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_num_heads": 4,
        "mamba_step": 2,
        "rms_norm_eps": 1e-6,
    },
    "recurrent_gemma": {  # recurrent, recurrent, local attention
        "model_type": "recurrent_gemma",
        **_SMALL,
        **_ATTENTION,
        "num_key_value_heads": 1,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "attention_bias": False,
        "conv1d_width": 4,
        "logits_soft_cap": 30.0,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "attention_window_size": 32,  # wrapped by the test prompts
        "block_types": ["recurrent", "recurrent", "attention"],
    },
    "rwkv7": {  # RWKV-7 x2
        "model_type": "rwkv7",
        **_SMALL,
        "intermediate_size": 128,
        "norm_eps": 1e-5,
        "head_dim": 16,
        "num_hidden_layers": 2,
        "a_low_rank_dim": 8,
        "v_low_rank_dim": 8,
        "gate_low_rank_dim": 8,
        "decay_low_rank_dim": 8,
        "tie_word_embeddings": False,
    },
    "jamba": {  # Mamba, attention, Mamba, attention (dense MLP)
        "model_type": "jamba",
        **_SMALL,
        **_ATTENTION,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "attn_layer_offset": 1,
        "attn_layer_period": 2,
        "expert_layer_offset": 1,
        "expert_layer_period": 8,
        "mamba_d_conv": 4,
        "mamba_d_state": 16,
        "mamba_expand": 2,
        "mamba_dt_rank": 8,
        "num_experts": 1,
        "num_experts_per_tok": 1,
        "rms_norm_eps": 1e-5,
    },
}

# Kinds whose recurrent layers mlx-lm initialises to zeros (Griffin's Conv1d and RG-LRU
# gates): random instead, or their state would never reach an output.
_ZERO_INIT = {"recurrent_gemma", "rwkv7"}

_root: Path | None = None
_loaded: dict[str, Any] = {}


def _randomize_zeros(folder: Path) -> None:
    path = str(folder / "model.safetensors")
    weights = mx.load(path)
    key = mx.random.key(1)
    for name, w in weights.items():
        if not mx.any(w).item():
            key, draw = mx.random.split(key)
            weights[name] = 0.3 * mx.random.normal(w.shape, dtype=w.dtype, key=draw)
    mx.save_safetensors(path, weights, metadata={"format": "mlx"})


def loaded_recurrent_model(kind: str):
    """The `kind` model of RECURRENT_CONFIGS (seed 0), written and loaded once."""
    global _root
    if kind not in _loaded:
        if _root is None:
            _root = Path(tempfile.mkdtemp(prefix="mlx-prefix-recurrent-models-"))
            atexit.register(shutil.rmtree, _root, ignore_errors=True)
        folder = make_test_model(kind, _root / kind, config=RECURRENT_CONFIGS[kind])
        if kind in _ZERO_INIT:
            _randomize_zeros(folder)
        _loaded[kind] = load_model(str(folder))
    return _loaded[kind]
