"""mlx-lm's tokenizer load, without parsing the whole tokenizer.json in Python.

`mlx_lm.tokenizer_utils.load` json-loads the whole tokenizer.json (megabytes: the
vocabulary and the merges) only to read its "decoder" entry, which picks the streaming
detokenizer. The parse's millions of temporary objects are freed, but the pymalloc arenas
they filled stay pinned by the few small objects transformers' load keeps alive among
them, so a server that loads and unloads models all day grows with every load (issue 52,
item 4: +0.6 MiB a load of SmolLM2's tokenizer). Here the decoder is read from the
tokenizer transformers has just built (its Rust decoder serialized: a few hundred bytes),
and the rest is mlx-lm's load step for step: the same detokenizer choice, EOS ids, chat
template module and tool parser (tests/models/test_models_tokenizer.py compares the two on every
real tokenizer the tests carry).
"""

from __future__ import annotations

import importlib
import json
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

__all__ = ["decoder_description", "detokenizer_class", "load_tokenizer"]


def load_tokenizer(
    model_path: Path,
    tokenizer_config_extra: dict[str, Any] | None = None,
    eos_token_ids: int | list[int] | None = None,
) -> TokenizerWrapper:
    """`mlx_lm.utils.load_tokenizer` of a local folder (resolve_model's), as mlx-lm builds
    it, but the detokenizer picked from the loaded tokenizer's decoder."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper, _infer_tool_parser
    from mlx_lm.utils import _tokenizer_defaults
    from transformers import AutoTokenizer

    path = Path(model_path)
    defaults = _tokenizer_defaults(path) or {}
    if eos_token_ids is None:
        eos_token_ids = defaults.get("eos_token_ids")
    if isinstance(eos_token_ids, int):
        eos_token_ids = [eos_token_ids]

    tokenizer = AutoTokenizer.from_pretrained(path, **(tokenizer_config_extra or {}))
    config = tokenizer.init_kwargs

    chat_template = None
    response_format = None
    chat_template_type = config.get("chat_template_type", defaults.get("chat_template_type"))
    if chat_template_type:
        module = importlib.import_module(f"mlx_lm.chat_templates.{chat_template_type}")
        # A template in the checkpoint replaces only the default template (as mlx-lm).
        if "chat_template_type" in config or tokenizer.chat_template is None:
            chat_template = module.apply_chat_template
        response_format = getattr(module, "RESPONSE_FORMAT", None)

    tool_parser_type = config.get("tool_parser_type", defaults.get("tool_parser_type"))
    if tool_parser_type is None:
        tool_parser_type = _infer_tool_parser(tokenizer)
    tool_parser = tool_call_start = tool_call_end = None
    if tool_parser_type is not None:
        tools = importlib.import_module(f"mlx_lm.tool_parsers.{tool_parser_type}")
        tool_parser = tools.parse_tool_call
        tool_call_start = tools.tool_call_start
        tool_call_end = tools.tool_call_end
        config["tool_parser_type"] = tool_parser_type

    return TokenizerWrapper(
        tokenizer,
        detokenizer_class(tokenizer, path),
        eos_token_ids=eos_token_ids,
        chat_template=chat_template,
        tool_parser=tool_parser,
        tool_call_start=tool_call_start,
        tool_call_end=tool_call_end,
        response_format=response_format,
    )


def detokenizer_class(tokenizer: Any, folder: Path) -> Any:
    """mlx-lm's choice of streaming detokenizer (`tokenizer_utils.load`): SPM, SPM
    keeping a leading space, BPE, or the naive one, from the folder's decoder."""
    from mlx_lm import tokenizer_utils as mlx_tokenizers

    if not (folder / "tokenizer.json").is_file():  # mlx-lm looks no further either
        return mlx_tokenizers.NaiveStreamingDetokenizer
    decoder = decoder_description(tokenizer, folder / "tokenizer.json")
    if mlx_tokenizers._is_spm_decoder(decoder):
        return mlx_tokenizers.SPMStreamingDetokenizer
    if mlx_tokenizers._is_spm_decoder_no_space(decoder):
        return partial(mlx_tokenizers.SPMStreamingDetokenizer, trim_space=False)
    if mlx_tokenizers._is_bpe_decoder(decoder):
        return mlx_tokenizers.BPEStreamingDetokenizer
    return mlx_tokenizers.NaiveStreamingDetokenizer


def decoder_description(tokenizer: Any, tokenizer_file: Path) -> Any:
    """The decoder's JSON (tokenizer.json's "decoder" entry), from the Rust decoder the
    tokenizer runs; a tokenizer without one (a Python tokenizer beside a tokenizer.json)
    has the file read by the Rust parser instead. None: no decoder."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        from tokenizers import Tokenizer

        backend = Tokenizer.from_file(str(tokenizer_file))
    decoder = backend.decoder
    if decoder is None:
        return None
    try:
        return json.loads(decoder.__getstate__())
    except Exception:  # noqa: BLE001 (a custom Python decoder has no JSON: the naive one)
        return None
