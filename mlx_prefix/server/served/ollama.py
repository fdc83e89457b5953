"""The served models as Ollama's clients see them: names with a tag (`name:latest`),
and what /api/tags, /api/show and /api/ps say of a model, read from its folder (config,
weight file headers, chat template) and, once loaded, its tokenizer. No MLX: the weight
files' headers give the parameter count, their sizes the model's size on disk.

Names: /api/tags lists each served name with a tag, as Ollama lists its models
(`tiny:latest`), and a name a client sends back is read leniently, as the OpenAI routes
read theirs: the name as is, else without its tag (`qwen3.5:4b` -> `qwen3.5` when that
is a served name); a name that selects nothing is answered by the default model unless
the server runs with --strict-model-names (served/names.py).
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlx_prefix.models.library.catalog import knows_reasoning, renders_tools, template_text

from .names import ModelSelector

TAG = "latest"
# safetensors dtypes -> Ollama's quantization names for unquantized weights
_FLOAT_NAMES = {"F32": "F32", "F16": "F16", "BF16": "BF16", "float32": "F32",
                "float16": "F16", "bfloat16": "BF16"}  # fmt: skip
_BITS_PER_U32 = 32


def listed_name(name: str) -> str:
    """A served name as /api/tags lists it: with a tag."""
    return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:{TAG}"


def requested_name(selector: ModelSelector, name: str) -> str:
    """The server's name for an Ollama client's `name` (its tag dropped when only the
    name without it selects a model)."""
    if selector.named(name):
        return name
    base, sep, tag = name.rpartition(":")
    if sep and base and "/" not in tag and selector.named(base):
        return base
    return name


@dataclass(frozen=True)
class ModelFacts:
    """What Ollama's model listings say of one model."""

    family: str  # config.json's model_type
    parameters: int  # counted from the weight files' headers (0: unknown)
    quantization: str  # "Q4", "Q8", or the float dtype ("F32", "BF16", ...)
    size: int  # bytes of weight files on disk
    digest: str  # sha256 hex of the files' names, sizes and times
    modified_at: str  # RFC 3339: the folder's config.json's time
    config: dict[str, Any] = field(default_factory=dict)
    template: str = ""  # the chat template's text (Jinja, not Ollama's Go templates)

    @property
    def parameter_size(self) -> str:
        n = self.parameters
        if n >= 1e9:
            return f"{n / 1e9:.1f}B"
        if n >= 1e6:
            return f"{n / 1e6:.0f}M"
        return f"{n / 1e3:.0f}K" if n else ""

    def details(self) -> dict[str, Any]:
        return {
            "parent_model": "",
            "format": "safetensors",
            "family": self.family,
            "families": [self.family],
            "parameter_size": self.parameter_size,
            "quantization_level": self.quantization,
        }

    def model_info(self, context_length: int | None) -> dict[str, Any]:
        """llama.cpp's GGUF keys (what Ollama's /api/show reports), from config.json."""
        text = self.config.get("text_config") or self.config
        arch = self.family
        info: dict[str, Any] = {
            "general.architecture": arch,
            "general.parameter_count": self.parameters,
        }
        for key, name in (
            ("hidden_size", "embedding_length"),
            ("num_hidden_layers", "block_count"),
            ("intermediate_size", "feed_forward_length"),
            ("num_attention_heads", "attention.head_count"),
            ("num_key_value_heads", "attention.head_count_kv"),
            ("vocab_size", "vocab_size"),
        ):
            if isinstance(text.get(key), int):
                info[f"{arch}.{name}"] = text[key]
        if context_length:
            info[f"{arch}.context_length"] = context_length
        return info


def facts(folder: Path | None, dtype: str | None = None) -> ModelFacts:
    """The facts of the model in `folder` (None or missing: what is unknown stays empty);
    `dtype`: what a loaded model's floating weights are held in. Reads files: call it
    off the event loop."""
    if folder is None or not (folder / "config.json").is_file():
        stamp = datetime.datetime.now(datetime.timezone.utc)
        return ModelFacts(
            "unknown", 0, _float_name(dtype), 0, _digest(str(folder)), _rfc3339(stamp)
        )
    return _folder_facts(folder, (folder / "config.json").stat().st_mtime_ns, dtype)


@functools.lru_cache(maxsize=64)
def _folder_facts(folder: Path, mtime_ns: int, dtype: str | None) -> ModelFacts:
    config = json.loads((folder / "config.json").read_text())
    files = sorted(folder.glob("*.safetensors"))
    quant = config.get("quantization") or config.get("quantization_config") or {}
    bits = quant.get("bits") if isinstance(quant, dict) else None
    count, stored = 0, None
    for path in files:
        n, kind = _header_counts(path, bits)
        count += n
        stored = stored or kind
    template = template_text(folder)
    stamp = datetime.datetime.fromtimestamp(mtime_ns / 1e9, datetime.timezone.utc)
    listing = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    return ModelFacts(
        family=str(config.get("model_type") or "unknown"),
        parameters=count,
        quantization=f"Q{bits}" if isinstance(bits, int) else _float_name(dtype or stored),
        size=sum(size for _, size, _ in listing),
        digest=_digest(json.dumps([str(folder), mtime_ns, listing])),
        modified_at=_rfc3339(stamp),
        config=config,
        template=template,
    )


def _header_counts(path: Path, bits: int | None) -> tuple[int, str | None]:
    """Parameters in one safetensors file (packed quantized weights unpacked; their
    scales and biases not counted) and its first floating dtype."""
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    count, floating = 0, None
    for name, entry in header.items():
        if name == "__metadata__" or not isinstance(entry, dict):
            continue
        if bits and name.endswith((".scales", ".biases")):
            continue
        n = 1
        for dim in entry.get("shape", ()):
            n *= dim
        if entry.get("dtype") == "U32" and bits:
            n *= _BITS_PER_U32 // bits
        elif entry.get("dtype") in _FLOAT_NAMES and floating is None:
            floating = entry["dtype"]
        count += n
    return count, floating


def capabilities(tokenizer: Any, template: str, vision: bool) -> list[str]:
    """Ollama's capability names for a chat model: from its loaded tokenizer, else from
    its chat template's text; "vision" where it takes images (apps offer an image upload
    only then)."""
    caps = ["completion"]
    if tokenizer is not None:
        tools = bool(getattr(tokenizer, "has_tool_calling", False))
        thinking = bool(getattr(tokenizer, "has_thinking", False))
    else:
        tools, thinking = renders_tools(template), knows_reasoning(template)
    return caps + ["tools"] * tools + ["thinking"] * thinking + ["vision"] * vision


def _float_name(dtype: str | None) -> str:
    return _FLOAT_NAMES.get(str(dtype), str(dtype or "").upper())


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _rfc3339(stamp: datetime.datetime) -> str:
    return stamp.isoformat(timespec="microseconds").replace("+00:00", "Z")
