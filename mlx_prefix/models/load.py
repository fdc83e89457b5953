"""Load a model + tokenizer through mlx-lm and compute its cache identity."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from mlx_prefix.arrays import named_arrays
from mlx_prefix.errors import InvalidRequest, ModelNotFound
from mlx_prefix.models import linear_scan
from mlx_prefix.models.identity import ModelIdentity, chat_template_hash, fingerprint_files
from mlx_prefix.models.preflight import context_length
from mlx_prefix.models.resolve import ResolvedModel, resolve_model, resolve_model_path
from mlx_prefix.models.stops import add_reply_stops
from mlx_prefix.models.template import ensure_template, template_args, template_text

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import mlx.nn as nn
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from mlx_prefix.vision.family import VisionFamily

__all__ = [
    "LoadedModel",
    "ModelIdentity",
    "finish_loading",
    "cast_weights",
    "choose_dtype",
    "context_length",
    "load_model",
    "resolve_model_path",
]

_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model", "vocab.json")


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: TokenizerWrapper
    identity: ModelIdentity
    name: str  # id served in /v1/models: folder basename or repo id
    path: Path
    context_length: int | None  # from config; None if the config does not say
    # apply_chat_template arguments of every request (--chat-template-args)
    template_args: dict[str, Any] = field(default_factory=dict)
    # A vision checkpoint's tower and image handling (vision/tower.py); None: text only.
    vision: VisionFamily | None = None


def choose_dtype(device: mx.Device, checkpoint_dtype: str) -> str:
    """The dtype to hold floating weights in on `device`.

    On CPU, float16/bfloat16 matmuls are 50-100x slower than float32, so half-precision
    checkpoints are upcast; on GPU the checkpoint's own dtype is kept.
    """
    if device == mx.cpu and checkpoint_dtype in ("float16", "bfloat16"):
        return "float32"
    return checkpoint_dtype


def load_model(
    spec: str | None = None,
    *,
    adapter: str | None = None,
    dtype: str | None = None,
    chat_template: str | None = None,
    use_default_chat_template: bool = False,
    chat_template_args: str | None = None,
    trust_remote_code: bool = False,
) -> LoadedModel:
    """Resolve `spec` (see `resolve_model`), load it with mlx-lm, cast, fingerprint.

    `dtype` overrides `choose_dtype`. Quantized layers stay quantized; only their
    floating parameters (scales, biases, norms, embeddings) are cast. The template
    options are models/template.py's.
    """
    from mlx_lm.utils import load_adapters
    from mlx_lm.utils import load_model as mlx_lm_load_model

    from mlx_prefix.models.tokenizer import load_tokenizer

    if dtype is not None and dtype not in _DTYPES:
        raise InvalidRequest(
            f"dtype '{dtype}' is not supported (choose from {', '.join(_DTYPES)})", param="dtype"
        )
    defaults = template_args(chat_template_args)
    options = tokenizer_config(chat_template, trust_remote_code)
    resolved = resolve_model(spec)
    adapter_path = _resolve_adapter(adapter)
    label = spec if spec is not None else resolved.name
    # mlx_lm.utils.load's three steps, taken one by one to say which part failed.
    part = "model"
    try:
        model, config = mlx_lm_load_model(resolved.path)
        if adapter_path is not None:
            part = "adapter"
            model = load_adapters(model, str(adapter_path))
            model.eval()
            # Not lazy: the LoRA layers' arrays would belong to this thread's stream, and
            # a server loads on a thread of its own (server/served/pool.py).
            mx.eval(model.parameters())
        part = "tokenizer"
        tokenizer = load_tokenizer(resolved.path, options, eos_token_ids=config.get("eos_token_id"))
        ensure_template(tokenizer, use_default_chat_template)
    except Exception as e:  # noqa: BLE001
        # A damaged, incomplete or unsupported folder fails in mlx-lm, safetensors,
        # transformers or tokenizers with about any exception type (a truncated file:
        # RuntimeError; bad JSON: ValueError; a config missing a field: TypeError).
        reason = load_failure(part, e, resolved.path)
        message = f"model '{label}' could not be loaded: {reason}"
        raise ModelNotFound(message, param="adapter" if part == "adapter" else "model") from e

    loaded = finish_loading(model, tokenizer, config, resolved, dtype, defaults, adapter_path)
    loaded.vision = _load_vision(loaded, label)
    # Building the model drew its random initial weights (replaced by the file's) from
    # MLX's global key: each draw left the key a lazy split of the one before, a chain
    # no one evaluates (greedy decoding never draws), held as long as the process. It
    # kept ~0.45 MiB per load of SmolLM2 (a server switching models grew with it).
    mx.eval(mx.random.state)
    return loaded


def _load_vision(loaded: LoadedModel, label: str) -> VisionFamily | None:
    """The folder's vision part, its hooks installed in the text model (vision/tower.py);
    None for a text-only folder. mlx-vlm is imported only here."""
    from mlx_prefix.vision.tower import carries_tower, is_vision_config, load_vision, read_config

    if not is_vision_config(read_config(loaded.path)):
        return None
    if not carries_tower(loaded.path):
        log.info("model '%s': its files hold no vision tower; serving it as a text model", label)
        return None
    try:
        family = load_vision(loaded.path, _DTYPES[loaded.identity.dtype], loaded.tokenizer)
    except Exception as e:  # noqa: BLE001 (mlx-vlm missing, an unserved family, bad weights)
        reason = load_failure("vision tower", e, loaded.path)
        raise ModelNotFound(f"model '{label}' could not be loaded: {reason}", param="model") from e
    assert family is not None
    family.install(loaded.model)
    return family


def tokenizer_config(chat_template: str | None, trust_remote_code: bool) -> dict[str, Any]:
    """mlx-lm's tokenizer options for --chat-template and --trust-remote-code."""
    options: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if chat_template is not None:
        options["chat_template"] = template_text(chat_template)
    return options


def finish_loading(
    model: nn.Module,
    tokenizer: TokenizerWrapper,
    config: dict[str, Any],
    resolved: ResolvedModel,
    dtype: str | None,
    template_defaults: dict[str, Any],
    adapter_path: Path | None = None,
    shard: str | None = None,
) -> LoadedModel:
    """Cast the floating weights (`dtype`, else `choose_dtype`) and compute the identity:
    the steps after mlx-lm's load, shared with sharded loading (engine/sharded/load.py)."""
    target = cast_weights(model, dtype)
    add_reply_stops(tokenizer)
    linear_scan.install()  # off Metal: gated-delta prefill as a chunked scan

    weight_files = [resolved.path / "config.json", *resolved.path.glob("model*.safetensors")]
    if adapter_path is not None:
        weight_files += [p for p in adapter_path.iterdir() if p.suffix in (".json", ".safetensors")]
    identity = ModelIdentity(
        source=resolved.source,
        adapter=str(adapter_path) if adapter_path else None,
        dtype=target,
        weights_fingerprint=fingerprint_files(weight_files),
        chat_template_hash=chat_template_hash(getattr(tokenizer, "chat_template", None)),
        shard=shard,
        prefill_scan=linear_scan.uses_scan(model),
    )
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        identity=identity,
        name=resolved.name,
        path=resolved.path,
        context_length=context_length(config),
        template_args=template_defaults,
    )


def cast_weights(model: nn.Module, dtype: str | None) -> str:
    """Cast `model`'s floating weights to `dtype` (else `choose_dtype`'s); return it."""
    target = dtype or choose_dtype(mx.default_device(), _dominant_dtype(model))
    _cast_floating(model, _DTYPES[target])
    return target


def load_failure(part: str, error: Exception, path: Path) -> str:
    """One line: which part failed and why (library messages can span several lines)."""
    if part == "tokenizer" and not _has_tokenizer_files(path):
        return f"no tokenizer files ({' or '.join(_TOKENIZER_FILES[:2])}) in {path}"
    text = " ".join(str(error).split()) or type(error).__name__
    if isinstance(error, KeyError):
        text = f"missing key {text}"
    if len(text) > 300:
        text = text[:297] + "..."
    return text if part == "model" else f"{part}: {text}"


def _has_tokenizer_files(path: Path) -> bool:
    return any((path / name).is_file() for name in _TOKENIZER_FILES) or any(path.glob("*.tiktoken"))


def _resolve_adapter(adapter: str | None) -> Path | None:
    if adapter is None:
        return None
    path = Path(adapter).expanduser()
    if not (path / "adapter_config.json").is_file():
        raise ModelNotFound(
            f"adapter '{adapter}' not found: no adapter_config.json in that folder",
            param="adapter",
        )
    return path.resolve()


def _dominant_dtype(model: nn.Module) -> str:
    """The floating dtype holding most parameter elements (packed quantized ints excluded)."""
    sizes: dict[str, int] = {}
    for _, p in named_arrays(model.parameters()):
        if mx.issubdtype(p.dtype, mx.floating):
            name = str(p.dtype).removeprefix("mlx.core.")
            sizes[name] = sizes.get(name, 0) + p.size
    return max(sizes, key=sizes.__getitem__) if sizes else "float32"


def _cast_floating(model: nn.Module, dtype: mx.Dtype) -> None:
    # Some models keep parameters such as SSM A_log in float32 on purpose.
    keep = getattr(model, "cast_predicate", None) or (lambda _: True)
    updates = [
        (k, p.astype(dtype))
        for k, p in named_arrays(model.parameters())
        if mx.issubdtype(p.dtype, mx.floating) and p.dtype != dtype and keep(k)
    ]
    if updates:
        model.load_weights(updates, strict=False)
        mx.eval(model.parameters())
