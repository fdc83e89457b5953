"""models/tokenizer.py: mlx-lm's tokenizer load without parsing the whole tokenizer.json in
Python (issue 52, item 4: that parse's garbage left pymalloc arenas pinned, so every
load/unload cycle grew the server). It must build what mlx-lm builds: the same streaming
detokenizer, EOS ids, chat template module and tool parser, on every real tokenizer the
tests carry and every family template."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from mlx_lm.utils import load_tokenizer as mlx_lm_load_tokenizer
from support.template_models import (
    DATA,
    GEMMA4_CONTROLS,
    GPT_OSS_TOKENIZER,
    QWEN3_TOKENIZER,
    TEMPLATES,
    _tokenizer_files,
)
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from mlx_prefix.models.default import ensure_default_model
from mlx_prefix.models.testing import cached_test_model
from mlx_prefix.models.tokenizer import load_tokenizer


def _unpacked(source: Path, dest: Path) -> Path:
    """A folder with `source`'s tokenizer files, tokenizer.json unpacked."""
    dest.mkdir()
    packed = source / "tokenizer.json.gz"
    if packed.is_file():
        (dest / "tokenizer.json").write_bytes(gzip.decompress(packed.read_bytes()))
    else:
        shutil.copyfile(source / "tokenizer.json", dest / "tokenizer.json")
    shutil.copyfile(source / "tokenizer_config.json", dest / "tokenizer_config.json")
    return dest


def _spm_folder(dest: Path, decoder: Any, config: dict[str, Any]) -> Path:
    """A small SentencePiece-style BPE (byte fallback, Metaspace) with `decoder`."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁": 3, "a": 4, "b": 5, "▁a": 6, "▁b": 7}
    vocab |= {f"<0x{i:02X}>": 8 + i for i in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "a"), ("▁", "b")], byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoder
    dest.mkdir()
    tok.save(str(dest / "tokenizer.json"))
    base = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (dest / "tokenizer_config.json").write_text(json.dumps(base | config))
    return dest


SPM_TRIM = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
SPM_TRIM.append(decoders.Strip(content=" ", left=1))
SPM_KEEP = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """Every real tokenizer the tests carry, and small SentencePiece-style ones for the
    detokenizers no real one picks (mlx-lm's SPM with and without the leading space
    stripped, through transformers' own LlamaTokenizer too; the naive one)."""
    root = tmp_path_factory.mktemp("tokenizers")
    smollm2 = ensure_default_model()
    # A muse_spark config: mlx-lm's model module gives the tokenizer defaults (chat
    # template module, tool parser, EOS ids) that the checkpoint does not state.
    muse = shutil.copytree(smollm2, root / "muse-spark", ignore=shutil.ignore_patterns("*.safe*"))
    (muse / "config.json").write_text(json.dumps({"model_type": "muse_spark"}))
    typed = _unpacked(smollm2, root / "template-type")
    config = json.loads((typed / "tokenizer_config.json").read_text())
    config["chat_template_type"] = "deepseek_v32"
    (typed / "tokenizer_config.json").write_text(json.dumps(config))
    return {
        "SmolLM2": smollm2,
        "micro test model": cached_test_model("dense"),
        "Qwen3": _unpacked(QWEN3_TOKENIZER, root / "qwen3"),
        "gpt-oss": _unpacked(GPT_OSS_TOKENIZER, root / "gpt-oss"),
        "Gemma 4 controls": _unpacked(_tokenizer_files(GEMMA4_CONTROLS), root / "gemma4"),
        "muse_spark defaults": muse,
        "chat_template_type": typed,
        "SPM": _spm_folder(root / "spm", decoders.Sequence(SPM_TRIM), {}),
        "SPM as Llama": _spm_folder(
            root / "spm-llama", decoders.Sequence(SPM_TRIM), {"tokenizer_class": "LlamaTokenizer"}
        ),
        "SPM keeping the space": _spm_folder(root / "spm-keep", decoders.Sequence(SPM_KEEP), {}),
        "no decoder": _spm_folder(root / "naive", None, {}),
    }


def built(wrapper: Any) -> dict[str, Any]:
    """What mlx-lm's load decides, from a TokenizerWrapper."""
    detokenizer = wrapper._detokenizer
    return {
        "detokenizer": type(detokenizer).__name__,
        "trim_space": getattr(detokenizer, "trim_space", None),
        "eos_token_ids": sorted(wrapper.eos_token_ids),
        "chat_template": wrapper._chat_template,
        "response_format": wrapper._response_format,
        "tool_parser": wrapper.tool_parser,
        "tool_call": (wrapper.tool_call_start, wrapper.tool_call_end),
        "tool_parser_type": wrapper._tokenizer.init_kwargs.get("tool_parser_type"),
        "has_chat_template": wrapper.has_chat_template,
        "think": (wrapper.think_start, wrapper.think_end),
    }


def test_the_folders_cover_every_branch_of_mlx_lms_load(folders):
    picked = {built(load_tokenizer(path))["detokenizer"] for path in folders.values()}
    assert picked == {
        "BPEStreamingDetokenizer",
        "SPMStreamingDetokenizer",
        "NaiveStreamingDetokenizer",
    }
    assert built(load_tokenizer(folders["SPM keeping the space"]))["trim_space"] is False
    assert built(load_tokenizer(folders["SPM as Llama"]))["trim_space"] is True
    muse = built(load_tokenizer(folders["muse_spark defaults"]))
    assert muse["response_format"] and muse["tool_parser_type"] == "muse_spark"
    assert {200001, 200008} <= set(muse["eos_token_ids"])
    assert built(load_tokenizer(folders["chat_template_type"]))["chat_template"] is not None


@pytest.mark.parametrize(
    "name",
    [
        "SmolLM2",
        "micro test model",
        "Qwen3",
        "gpt-oss",
        "Gemma 4 controls",
        "muse_spark defaults",
        "chat_template_type",
        "SPM",
        "SPM as Llama",
        "SPM keeping the space",
        "no decoder",
    ],
)
def test_builds_what_mlx_lm_builds(folders, name):
    path = folders[name]
    config = (
        json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
    )
    eos = config.get("eos_token_id")  # as models/load.py passes it
    assert built(load_tokenizer(path, eos_token_ids=eos)) == built(
        mlx_lm_load_tokenizer(path, eos_token_ids=eos)
    )


@pytest.mark.parametrize("eos", [None, 7, [3, 5]])
@pytest.mark.parametrize("name", ["SmolLM2", "muse_spark defaults"])
def test_eos_ids_as_mlx_lm(folders, name, eos):
    """None: the model module's defaults (muse_spark's), else the tokenizer's EOS alone."""
    ours = built(load_tokenizer(folders[name], eos_token_ids=eos))
    assert ours == built(mlx_lm_load_tokenizer(folders[name], eos_token_ids=eos))


@pytest.mark.parametrize("family", sorted(TEMPLATES))
def test_builds_what_mlx_lm_builds_for_each_family_template(folders, family):
    """The tool parser is inferred from the template (--chat-template's path); on
    SmolLM2's tokenizer, which loads in a fraction of Qwen3's time."""
    options = {"chat_template": (DATA / "templates" / TEMPLATES[family]).read_text()}
    ours = built(load_tokenizer(folders["SmolLM2"], options))
    assert ours == built(mlx_lm_load_tokenizer(folders["SmolLM2"], options))


def test_the_detokenizer_decodes_as_the_tokenizer_does(folders):
    """SPM as Llama: transformers rebuilds this class's decoder; the one read is the one
    decode() runs, so the streaming text is decode()'s."""
    wrapper = load_tokenizer(folders["SPM as Llama"])
    ids = wrapper.encode("a b ab", add_special_tokens=False)
    detokenizer = wrapper.detokenizer
    for token in ids:
        detokenizer.add_token(token)
    detokenizer.finalize()
    assert detokenizer.text == wrapper.decode(ids) == "a b ab"


def test_the_whole_tokenizer_json_is_not_parsed_in_python(folders, monkeypatch):
    """Every JSON text Python parses while gpt-oss's tokenizer loads is recorded: none is
    its tokenizer.json (the Rust tokenizer reads it; the decoder read is a few hundred
    bytes). A folder as transformers saves it: tokenizer_config.json lists the added
    tokens (without them, as in the bundled SmolLM2 converted from GGUF, transformers
    itself parses tokenizer.json to find them)."""
    path = folders["gpt-oss"]
    size = (path / "tokenizer.json").stat().st_size
    parsed: list[int] = []
    decode = json.JSONDecoder.decode

    def recording(self: json.JSONDecoder, s: str, *args: Any, **kwargs: Any) -> Any:
        parsed.append(len(s))
        return decode(self, s, *args, **kwargs)

    monkeypatch.setattr(json.JSONDecoder, "decode", recording)
    wrapper = load_tokenizer(path)
    assert type(wrapper._detokenizer).__name__ == "BPEStreamingDetokenizer"
    assert parsed, "the recorder saw no parse at all (tokenizer_config.json is one)"
    assert max(parsed) < size // 10, (max(parsed), size)
