"""A tiny real model whose every reply is one word: what an agent's run needs to end by
itself (random weights never stop, and an agent launched with the output cap a 32K
context gives, 4096 tokens, would decode for minutes on a CPU).

The model is one of models/testing.py's, its weights rewritten so that its output head
reads the current token alone: every layer's output projection is zero, so the residual
stream after the last layer is the token's embedding. Every token's embedding is one
vector u except the reply word's (v); the head maps u to the word and v to the end of
turn. Each layer still computes its attention, recurrence and cache state from the
prompt (the prefix cache stores and restores them as for any model), only their sum is
not read. The head's rows are set from the hidden states the model itself produces
(read through a temporary identity head), so the final norm's form does not matter.
"""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from tokenizers import Tokenizer

from mlx_prefix.models.testing import cached_test_model

_OUTPUTS = ("o_proj.weight", "down_proj.weight", "out_proj.weight")
MARGIN = 60.0  # logit gap: any temperature an agent sends still picks the scripted token


def scripted_model(dest: Path, word: str = "Hi", **kwargs) -> Path:
    """A copy of `cached_test_model(**kwargs)` in `dest` that answers `word` and ends."""
    source = cached_test_model(**kwargs)
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(source, dest)
    config = json.loads((dest / "config.json").read_text())
    for cfg in (config, config.get("text_config") or {}):
        if "tie_word_embeddings" in cfg:
            cfg["tie_word_embeddings"] = False
    ids = (
        Tokenizer.from_file(str(dest / "tokenizer.json")).encode(word, add_special_tokens=False).ids
    )
    assert len(ids) == 1, f"{word!r} is {len(ids)} tokens"
    eos = config["eos_token_id"]
    eos = eos[0] if isinstance(eos, list) else eos

    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    saved = mx.load(str(dest / "model.safetensors"))
    model.load_weights(list(saved.items()), strict=False)
    weights = dict(tree_flatten(model.parameters()))
    embed = next(k for k in weights if k.endswith("embed_tokens.weight"))
    head = next(k for k in weights if k.endswith("lm_head.weight"))
    vocab, width = weights[embed].shape
    for k in weights:
        if k.endswith(_OUTPUTS):
            weights[k] = mx.zeros_like(weights[k])
    u, v = mx.zeros((width,)), mx.zeros((width,))
    u[0], v[1] = 4.0, 4.0
    table = mx.broadcast_to(u, (vocab, width))
    weights[embed] = mx.where(mx.arange(vocab)[:, None] == ids[0], v, table)
    weights[head] = mx.concatenate([mx.eye(width), mx.zeros((vocab - width, width))])
    model.load_weights(list(weights.items()))
    other = (ids[0] + 1) % vocab
    hidden = model(mx.array([[other, ids[0]]]))[0, :, :width]  # [2, D]: h(u), h(v)
    hu, hv = hidden[0], hidden[1]
    rows = mx.zeros((vocab, width))
    rows[ids[0]] = hu * (MARGIN / mx.sum(hu * hu))
    rows[eos] = hv * (MARGIN / mx.sum(hv * hv))
    weights[head] = rows
    model.load_weights(list(weights.items()))
    logits = model(mx.array([[other, ids[0]]]))[0]
    assert mx.argmax(logits[0]).item() == ids[0] and mx.argmax(logits[1]).item() == eos
    mx.save_safetensors(str(dest / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})  # fmt: skip
    index = {"metadata": {}, "weight_map": dict.fromkeys(sorted(weights), "model.safetensors")}
    (dest / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return dest
