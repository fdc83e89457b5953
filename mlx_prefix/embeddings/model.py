"""An embedding model: a decoder checkpoint loaded with mlx-lm's classes, backbone only,
pooled and normalised the way its sentence-transformers files say.

Pooling (`1_Pooling/config.json`): last token, mean or first token; `modules.json`
listing a Normalize module means unit vectors. A folder without those files is pooled as
decoder embedding models are (Qwen3-Embedding, gte-Qwen2, e5-mistral): last token,
normalised. Modules the server cannot run (a Dense projection, say) are refused at load,
never skipped.

Matryoshka (`dimensions`): a model trained so that a prefix of its vector is an embedding
too says so in config.json (`is_matryoshka`, or the `matryoshka_dimensions` it allows,
vLLM's convention) or the operator does (--embedding-matryoshka). Then `dimensions`
truncates the vector and renormalises it (if the model normalises); otherwise only the
model's own size is accepted.

Batches are right-padded: the models are causal, so a row's positions never attend to the
padding after them, and their RoPE positions are their own. Long rows go through in
chunks over mlx-lm's KV cache, so attention never holds more than chunk x length scores.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np

from mlx_prefix.arrays import named_arrays
from mlx_prefix.errors import ModelNotFound
from mlx_prefix.models.load import cast_weights, context_length, load_failure
from mlx_prefix.models.resolve import resolve_model

if TYPE_CHECKING:
    import mlx.nn as nn

POOLING_MODES = ("lasttoken", "mean", "cls")
CHUNK_TOKENS = 512  # per row and forward: attention scores are [rows, heads, 512, length]
_ST = "sentence_transformers.models."
_RUNNABLE = {f"{_ST}Transformer", f"{_ST}Pooling", f"{_ST}Normalize"}


@dataclass(frozen=True)
class Pooling:
    mode: str  # one of POOLING_MODES
    normalize: bool  # unit vectors (cosine similarity is a dot product)
    matryoshka: bool = False  # a prefix of the vector is an embedding too
    matryoshka_dimensions: tuple[int, ...] = ()  # the prefixes allowed (empty: any)


@dataclass
class EmbeddingModel:
    model: nn.Module  # mlx-lm's Model, its LM head removed; `model.model` is the backbone
    tokenizer: Any  # the Hugging Face tokenizer (fast): batch encoding in one call
    name: str  # the served id: folder basename or repo id
    path: Path
    pooling: Pooling
    dimensions: int  # the vector's full size (the backbone's hidden size)
    vocab_size: int
    context_length: int | None
    dtype: str
    weights_bytes: int  # what the weights hold in memory (reported beside the chat model's)
    _tokenizer_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def allowed_dimensions(self, dims: int) -> bool:
        if dims == self.dimensions:
            return True
        if not self.pooling.matryoshka or not 1 <= dims < self.dimensions:
            return False
        return not self.pooling.matryoshka_dimensions or dims in self.pooling.matryoshka_dimensions

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Token ids as the model's tokenizer adds them (special tokens included: Qwen3-
        Embedding's appends the end-of-text token its last-token pooling reads). No MLX:
        any thread, one at a time (a call sets the Rust tokenizer's truncation and
        padding, and two threads doing so at once fail with "Already borrowed")."""
        with self._tokenizer_lock:
            encoded = self.tokenizer(texts, add_special_tokens=True)["input_ids"]
        return [list(ids) for ids in encoded]

    def embed(self, rows: list[list[int]], chunk: int = CHUNK_TOKENS) -> np.ndarray:
        """Pooled (and normalised, if the model does) float32 vectors [len(rows), dimensions]
        of non-empty token lists, computed together. MLX: call it on one thread only."""
        from mlx_lm.models.cache import make_prompt_cache

        lengths = mx.array([len(r) for r in rows])  # [B]
        width = max(len(r) for r in rows)
        ids = mx.array([r + [0] * (width - len(r)) for r in rows])  # [B, L], right-padded
        # One forward needs no cache (and its buffer copies); longer rows go in chunks.
        cache = make_prompt_cache(self.model) if width > chunk else None
        pooled = None  # [B, D] float32
        for start in range(0, width, chunk):
            h = self.model.model(ids[:, start : start + chunk], cache=cache)  # [B, C, D]
            part = _pool_chunk(h.astype(mx.float32), lengths, start, self.pooling.mode)
            pooled = part if pooled is None else pooled + part
            mx.eval(pooled, [c.state for c in cache or ()])
        assert pooled is not None
        if self.pooling.mode == "mean":
            pooled = pooled / lengths[:, None].astype(mx.float32)
        if self.pooling.normalize:
            pooled = normalized(pooled)
        return np.array(pooled).reshape(len(rows), -1)


def _pool_chunk(h: mx.array, lengths: mx.array, start: int, mode: str) -> mx.array:
    """Chunk [start, start + C) of every row's hidden states h [B, C, D] -> its share of the
    pooled vector [B, D]: the last token's state if it lies in the chunk, the first
    token's (cls) in the first chunk, the sum of the real tokens' states (mean)."""
    positions = start + mx.arange(h.shape[1])[None, :]  # [1, C]
    if mode == "lasttoken":
        pick = positions == (lengths[:, None] - 1)  # [B, C]
    elif mode == "cls":
        pick = mx.broadcast_to(positions == 0, (h.shape[0], h.shape[1]))
    else:
        pick = positions < lengths[:, None]
    return (h * pick[..., None].astype(h.dtype)).sum(axis=1)


def normalized(x: mx.array) -> mx.array:
    """Rows scaled to unit length (sentence-transformers' F.normalize: eps 1e-12)."""
    norms = mx.sqrt((x * x).sum(axis=-1, keepdims=True))
    return x / mx.maximum(norms, 1e-12)


def truncate(vectors: np.ndarray, dims: int, normalize: bool) -> np.ndarray:
    """Matryoshka: the first `dims` components, renormalised if the model normalises."""
    out = vectors[:, :dims]
    if normalize:
        norms = np.linalg.norm(out, axis=-1, keepdims=True)
        out = out / np.maximum(norms, 1e-12)
    return np.ascontiguousarray(out, dtype=np.float32)


def load_embedding_model(
    spec: str, *, dtype: str | None = None, matryoshka: bool = False
) -> EmbeddingModel:
    """A local folder or cached hub id -> an EmbeddingModel (weights evaluated, so any
    thread may run it). One-line ModelNotFound (param `embedding_model`) on failure."""
    from mlx_lm.utils import load_model

    from mlx_prefix.models.tokenizer import load_tokenizer

    resolved = resolve_model(spec)
    part = "model"
    try:
        pooling = read_pooling(resolved.path, matryoshka)
        model, config = load_model(resolved.path, get_model_classes=_backbone_classes)
        part = "tokenizer"
        tokenizer = load_tokenizer(resolved.path)._tokenizer
    except Exception as e:  # noqa: BLE001 - any library's error, in one line
        reason = load_failure(part, e, resolved.path)
        raise ModelNotFound(
            f"embedding model '{spec}' could not be loaded: {reason}", param="embedding_model"
        ) from e
    target = cast_weights(model, dtype)
    text = config.get("text_config") or config
    return EmbeddingModel(
        model=model,
        tokenizer=tokenizer,
        name=resolved.name,
        path=resolved.path,
        pooling=pooling,
        dimensions=int(text["hidden_size"]),
        vocab_size=int(text["vocab_size"]),
        context_length=context_length(config),
        dtype=target,
        weights_bytes=sum(p.nbytes for _, p in named_arrays(model.parameters())),
    )


def read_pooling(folder: Path, matryoshka: bool = False) -> Pooling:
    """The folder's pooling: sentence-transformers' modules, else last token + normalise."""
    config = _json(folder / "config.json") or {}
    dims = tuple(int(d) for d in config.get("matryoshka_dimensions") or ())
    matryoshka = matryoshka or bool(config.get("is_matryoshka")) or bool(dims)
    modules = _json(folder / "modules.json")
    if modules is None:
        return Pooling("lasttoken", True, matryoshka, dims)
    kinds = [m.get("type", "") for m in modules]
    refused = [k for k in kinds if k not in _RUNNABLE]
    if refused:
        raise ValueError(f"modules.json: {', '.join(refused)} not supported")
    mode = "lasttoken"
    for m in modules:
        if m.get("type") == f"{_ST}Pooling":
            mode = _pooling_mode(_json(folder / m.get("path", "") / "config.json") or {})
    return Pooling(mode, f"{_ST}Normalize" in kinds, matryoshka, dims)


def _pooling_mode(cfg: dict[str, Any]) -> str:
    on = [k.removeprefix("pooling_mode_") for k, v in cfg.items() if k.startswith("pooling_")
          and v is True]  # fmt: skip
    names = {"cls_token": "cls", "mean_tokens": "mean", "lasttoken": "lasttoken"}
    if len(on) != 1 or on[0] not in names:
        raise ValueError(f"pooling {'+'.join(on) or 'none'} not supported (cls, mean, lasttoken)")
    if cfg.get("include_prompt") is False:
        raise ValueError("pooling without the prompt (include_prompt: false) not supported")
    return names[on[0]]


def _backbone_classes(config: dict[str, Any]) -> tuple[type, type]:
    """mlx-lm's classes for `config`, less the LM head (an embedding model has none, and
    its checkpoint often neither), reading checkpoints saved as the bare backbone
    (Qwen3-Embedding's keys have no `model.` prefix)."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config=config)

    class Backbone(model_class):  # type: ignore[misc, valid-type]
        def __init__(self, args: Any):
            super().__init__(args)
            if "model" not in self:
                raise ValueError(
                    f"model type {config.get('model_type')!r} has no `model` backbone to embed with"
                )
            if "lm_head" in self:
                del self.lm_head

        def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
            bare = not any(k.startswith("model.") for k in weights)
            if bare and any(k.startswith(("embed_tokens.", "layers.")) for k in weights):
                weights = {f"model.{k}": v for k, v in weights.items()}
            weights = super().sanitize(weights) if hasattr(super(), "sanitize") else weights
            return {k: v for k, v in weights.items() if not k.startswith("lm_head.")}

    Backbone.__name__ = f"{model_class.__name__}Backbone"
    return Backbone, args_class


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
