"""Rebuild a Hugging Face tokenizer folder from a GGUF file's `tokenizer.ggml.*` metadata.

Only byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`) are supported: that is
what llama-family GGUFs such as SmolLM2 carry. Built with the `tokenizers` library, fully
offline; the result loads with `transformers.AutoTokenizer` and `mlx_lm.utils.load`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

# llama.cpp token types (llama_token_type): 3 = CONTROL, 4 = USER_DEFINED.
_CONTROL = 3
_USER_DEFINED = 4

# GGUF `tokenizer.ggml.pre` names whose llama.cpp regex splits digits one by one before
# the GPT-2 regex (llama-vocab.cpp); the HF equivalent is Digits(individual) + ByteLevel.
_INDIVIDUAL_DIGITS_PRE = frozenset({"smollm", "starcoder", "refact", "deepseek-coder"})


class UnsupportedTokenizer(ValueError):
    pass


def write_tokenizer(metadata: Mapping[str, Any], dest: Path, *, model_max_length: int) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into `dest`."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedTokenizer(f"GGUF tokenizer model {kind!r} is not supported (only gpt2)")

    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    token_types = _as_ints(metadata.get("tokenizer.ggml.token_type"), default=[1] * len(tokens))

    bpe = models.BPE(
        vocab={t: i for i, t in enumerate(tokens)},
        merges=merges,
        fuse_unk=False,
        byte_fallback=False,
    )
    tok = Tokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if metadata.get("tokenizer.ggml.pre") in _INDIVIDUAL_DIGITS_PRE:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens(
        [
            AddedToken(tokens[i], special=True, normalized=False)
            for i, t in enumerate(token_types)
            if t == _CONTROL
        ]
    )
    tok.add_tokens(
        [
            AddedToken(tokens[i], special=False, normalized=False)
            for i, t in enumerate(token_types)
            if t == _USER_DEFINED
        ]
    )
    tok.save(str(dest / "tokenizer.json"))

    def special(key: str) -> str | None:
        idx = _as_int(metadata.get(f"tokenizer.ggml.{key}_token_id"))
        return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

    specials = {
        "bos_token": special("bos"),
        "eos_token": special("eos"),
        "pad_token": special("padding"),
        "unk_token": special("unknown"),
    }
    specials = {k: v for k, v in specials.items() if v is not None}
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(_as_int(metadata.get("tokenizer.ggml.add_bos_token")) or False),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        **specials,
        # As transformers' save_pretrained writes it: without this list, every load of
        # the folder json-parses the whole tokenizer.json in Python to find the added
        # tokens, whose garbage left pymalloc arenas pinned (issue 52, item 4).
        "added_tokens_decoder": {
            str(i): {
                "content": t.content,
                "lstrip": t.lstrip,
                "normalized": t.normalized,
                "rstrip": t.rstrip,
                "single_word": t.single_word,
                "special": t.special,
            }
            for i, t in sorted(tok.get_added_tokens_decoder().items())
        },
    }
    if template := metadata.get("tokenizer.chat_template"):
        config["chat_template"] = template
    (dest / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (dest / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")


def _as_int(value: Any) -> int | None:
    """GGUF scalars come back from `mx.load` as 0-d arrays."""
    if value is None:
        return None
    return int(value.item()) if hasattr(value, "item") else int(value)


def _as_ints(value: Any, *, default: list[int]) -> list[int]:
    if value is None:
        return default
    return [int(v) for v in (value.tolist() if hasattr(value, "tolist") else value)]
