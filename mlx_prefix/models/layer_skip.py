"""A "layer-skip" draft model: a model folder's first N transformer layers with its own
embeddings, final norm and LM head, saved as a loadable folder. It shares the tokenizer
by construction, so it can draft for the full model (engine/decode/speculative.py); tests and
benchmarks/studies/speculative.py use it where no smaller sibling checkpoint is at hand.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import mlx.core as mx

from mlx_prefix.arrays import load_safetensors

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers")


def make_layer_skip_draft(source: Path, dest: Path, layers: int) -> Path:
    """Write `source`'s first `layers` layers to `dest` (created if missing); return it."""
    source, dest = Path(source), Path(dest)
    config = json.loads((source / "config.json").read_text())
    key = next(k for k in _LAYER_COUNT_KEYS if k in config)
    if not 0 < layers <= config[key]:
        raise ValueError(f"layers must be between 1 and {config[key]}, not {layers}")
    config[key] = layers
    weights: dict[str, mx.array] = {}
    for file in sorted(source.glob("*.safetensors")):
        for name, value in load_safetensors(file).items():
            found = _LAYER.search(name)
            if found is None or int(found.group(1)) < layers:
                weights[name] = value
    dest.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for file in source.iterdir():
        if file.is_file() and file.name.startswith(("tokenizer", "special_tokens", "vocab")):
            shutil.copy2(file, dest / file.name)
    for extra in ("merges.txt", "chat_template.jinja", "generation_config.json"):
        if (source / extra).exists():
            shutil.copy2(source / extra, dest / extra)
    return dest
