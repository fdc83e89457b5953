"""How much prefill work a span of tokens takes, estimated from the model's layers.

The value eviction policy (cache/eviction/policy.py) ranks checkpoints by the prefill work
they save per byte they hold; only ratios matter, so an estimate in FLOPs does:
- per token, 2 FLOPs per weight a token passes through: the non-embedding weights
  (packed quantized ones unpacked; a mixture of experts' expert weights scaled by the
  share of experts a token visits), plus the recurrent layers' state updates;
- per full-attention layer, 4 * heads * head_dim FLOPs per (query, earlier key) pair:
  the cost of position p grows with p, so the tokens deep in a long prompt cost more;
- per sliding-window layer the same, up to the window.
The layers' kinds come from the model's own cache list; the sizes from its config.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from mlx_lm.models.cache import make_prompt_cache

from mlx_prefix.arrays import named_arrays
from mlx_prefix.cache.layers import kind_of, layers_of
from mlx_prefix.models.load import LoadedModel


@dataclass(frozen=True, slots=True)
class PrefillCost:
    per_token: float  # FLOPs per token independent of its position
    attention: float  # FLOPs per (query, key) pair, summed over the full-attention layers
    windowed: tuple[tuple[float, int], ...] = ()  # (FLOPs per pair, window) per sliding layer

    def __call__(self, start: int, end: int) -> float:
        """FLOPs to prefill positions [start, end) of a sequence."""
        if end <= start:
            return 0.0
        work = (end - start) * self.per_token
        work += self.attention * (_pairs(end) - _pairs(start))
        for flops, window in self.windowed:
            work += flops * (_window_pairs(end, window) - _window_pairs(start, window))
        return work


def _pairs(n: int) -> int:
    """(query, key) pairs of causal attention over n positions: 1 + 2 + ... + n."""
    return n * (n + 1) // 2


def _window_pairs(n: int, window: int) -> int:
    if n <= window:
        return _pairs(n)
    return _pairs(window) + (n - window) * window


def estimate_prefill_cost(model: LoadedModel) -> PrefillCost:
    """The prefill cost of `model`, from its weights, cache list and config.json."""
    config = _config(model)
    text = {**config, **(config.get("text_config") or {})}
    heads = int(text.get("num_attention_heads") or 0)
    hidden = int(text.get("hidden_size") or 0)
    head_dim = int(text.get("head_dim") or (hidden // heads if heads else 0))
    pair = 4.0 * heads * head_dim
    full = 0
    windowed: list[tuple[float, int]] = []
    recurrent = 0
    for c in layers_of(make_prompt_cache(model.model)):
        role = kind_of(c).cost_role
        if role == "window":
            windowed.append((pair, int(c.max_size)))
        elif role == "recurrent":
            recurrent += 1
        else:
            full += 1
    per_token = 2.0 * _weights_per_token(model, text) + recurrent * _state_flops(text)
    return PrefillCost(per_token, full * pair, tuple(windowed))


def _config(model: LoadedModel) -> dict[str, Any]:
    try:
        return json.loads((model.path / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def _weights_per_token(model: LoadedModel, text: dict[str, Any]) -> float:
    experts = int(text.get("num_experts") or text.get("n_routed_experts") or 0)
    active = int(text.get("num_experts_per_tok") or 0)
    expert_share = active / experts if experts and active else 1.0
    bits = int((text.get("quantization") or {}).get("bits") or 0)
    total = 0.0
    for name, a in named_arrays(model.model.parameters()):
        if "embed" in name or "lm_head" in name or not hasattr(a, "size"):
            continue
        if name.endswith(("scales", "biases")) and bits:
            continue  # quantization metadata, not weights a token multiplies by
        size = float(a.size)
        if bits and "uint" in str(a.dtype):
            size *= 32 / bits  # packed: 32 / bits weights per uint32
        if "switch" in name or ".experts." in name:
            size *= expert_share
        total += size
    return total


def _state_flops(text: dict[str, Any]) -> float:
    """FLOPs per token of one recurrent layer's state update and read (about 6 per
    state element), for the state layouts mlx-lm's hybrids use."""
    if text.get("linear_num_value_heads"):  # gated DeltaNet (Qwen3-Next, Qwen3.5)
        size = (
            text["linear_num_value_heads"]
            * text.get("linear_key_head_dim", 0)
            * text.get("linear_value_head_dim", 0)
        )
    elif text.get("mamba_num_heads"):  # Mamba-2 (Nemotron-H)
        size = (
            text["mamba_num_heads"] * text.get("mamba_head_dim", 0) * text.get("ssm_state_size", 0)
        )
    else:
        size = 0
    return 6.0 * size


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def kv_bytes_per_token(model: LoadedModel) -> int:
    """Bytes of attention KV one more token of context costs (keys and values of every
    full-attention layer, in the weights' dtype); sliding windows and recurrent state
    are bounded, so they add nothing per token. From config.json and the cache list."""
    config = _config(model)
    text = {**config, **(config.get("text_config") or {})}
    heads = int(text.get("num_attention_heads") or 0)
    kv_heads = int(text.get("num_key_value_heads") or heads)
    hidden = int(text.get("hidden_size") or 0)
    head_dim = int(text.get("head_dim") or (hidden // heads if heads else 0))
    full = sum(
        1
        for c in layers_of(make_prompt_cache(model.model))
        if kind_of(c).cost_role not in ("window", "recurrent")
    )
    return full * kv_heads * head_dim * 2 * _DTYPE_BYTES.get(model.identity.dtype, 2)
