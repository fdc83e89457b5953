from __future__ import annotations

import socket
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mlx_prefix.errors import InvalidRequest, ModelNotFound
from mlx_prefix.models.load import choose_dtype, load_model, resolve_model_path
from mlx_prefix.models.testing import cached_test_model, make_test_model


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    attempts: list[object] = []

    def refuse(self: socket.socket, address: object) -> None:
        attempts.append(address)
        raise OSError("network disabled in tests")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    return attempts


def _float_dtypes(model: object) -> set[str]:
    return {
        str(p.dtype).removeprefix("mlx.core.")
        for _, p in tree_flatten(model.parameters())  # type: ignore[attr-defined]
        if mx.issubdtype(p.dtype, mx.floating)
    }


def test_identity_fields_are_filled() -> None:
    path = cached_test_model("dense")
    lm = load_model(str(path))
    ident = lm.identity
    assert ident.source == str(path.resolve())
    assert ident.adapter is None
    assert ident.dtype == "float32"
    assert len(ident.weights_fingerprint) == 32 and int(ident.weights_fingerprint, 16) >= 0
    assert len(ident.chat_template_hash) == 16
    assert len(ident.key()) == 16 and int(ident.key(), 16) >= 0
    assert lm.name == path.name
    assert lm.path == path.resolve()
    assert lm.context_length == 4096
    assert lm.tokenizer.chat_template is not None


def test_key_is_stable_across_loads() -> None:
    path = cached_test_model("dense")
    assert load_model(str(path)).identity.key() == load_model(str(path)).identity.key()


def test_key_changes_when_weights_change(tmp_path: Path) -> None:
    folder = make_test_model("dense", tmp_path / "m", seed=0)
    before = load_model(str(folder)).identity
    make_test_model("dense", folder, seed=1)
    after = load_model(str(folder)).identity
    assert before.source == after.source
    assert before.weights_fingerprint != after.weights_fingerprint
    assert before.key() != after.key()


def test_key_changes_with_dtype() -> None:
    path = cached_test_model("dense")
    f32 = load_model(str(path))
    f16 = load_model(str(path), dtype="float16")
    assert f16.identity.dtype == "float16"
    assert _float_dtypes(f16.model) == {"float16"}
    assert f16.identity.weights_fingerprint == f32.identity.weights_fingerprint
    assert f16.identity.key() != f32.identity.key()


def test_key_changes_with_chat_template() -> None:
    plain = load_model(str(cached_test_model("dense"))).identity
    think = load_model(str(cached_test_model("dense", think_template=True))).identity
    assert plain.chat_template_hash != think.chat_template_hash


def test_choose_dtype_upcasts_half_precision_on_cpu_only() -> None:
    assert choose_dtype(mx.cpu, "float16") == "float32"
    assert choose_dtype(mx.cpu, "bfloat16") == "float32"
    assert choose_dtype(mx.cpu, "float32") == "float32"
    assert choose_dtype(mx.gpu, "bfloat16") == "bfloat16"
    assert choose_dtype(mx.gpu, "float16") == "float16"


def test_half_precision_checkpoint_follows_choose_dtype(tmp_path: Path) -> None:
    folder = make_test_model("dense", tmp_path / "half")
    weights = mx.load(str(folder / "model.safetensors"))
    half = {k: v.astype(mx.bfloat16) for k, v in weights.items()}
    mx.save_safetensors(str(folder / "model.safetensors"), half)
    lm = load_model(str(folder))
    expected = choose_dtype(mx.default_device(), "bfloat16")
    assert lm.identity.dtype == expected
    assert _float_dtypes(lm.model) == {expected}


def test_missing_folder_raises_model_not_found(no_network: list[object]) -> None:
    with pytest.raises(ModelNotFound, match="/no/such/model-folder"):
        load_model("/no/such/model-folder")
    assert no_network == []


def test_folder_without_config_raises_model_not_found(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound, match="no config.json"):
        resolve_model_path(str(tmp_path))


def test_bogus_repo_offline_raises_model_not_found_without_network(
    monkeypatch: pytest.MonkeyPatch, no_network: list[object]
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFound, match="no-such-org/no-such-model-xyz") as info:
        load_model("no-such-org/no-such-model-xyz")
    assert "\n" not in info.value.message
    assert no_network == []


def test_unknown_dtype_is_rejected() -> None:
    with pytest.raises(InvalidRequest, match="float8"):
        load_model(str(cached_test_model("dense")), dtype="float8")


def test_missing_adapter_raises_model_not_found(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound, match="adapter"):
        load_model(str(cached_test_model("dense")), adapter=str(tmp_path / "nope"))


def test_repo_id_resolves_from_offline_hub_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, no_network: list[object]
) -> None:
    import huggingface_hub.constants

    sha = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--tiny-org--tiny-dense"
    make_test_model("dense", repo / "snapshots" / sha)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(sha)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    lm = load_model("tiny-org/tiny-dense")
    assert lm.name == "tiny-org/tiny-dense"
    assert lm.identity.source == f"tiny-org/tiny-dense@{sha}"
    assert lm.path == repo / "snapshots" / sha
    assert no_network == []


def _damaged(tmp_path: Path, damage: str) -> Path:
    folder = make_test_model("dense", tmp_path / damage)
    if damage == "truncated-weights":
        weights = folder / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])
    elif damage == "no-tokenizer":
        for path in folder.glob("tokenizer*"):
            path.unlink()
    elif damage == "bad-tokenizer":
        (folder / "tokenizer.json").write_text("{}")
    elif damage == "unknown-architecture":
        (folder / "config.json").write_text('{"model_type": "no-such-architecture"}')
    return folder


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        ("truncated-weights", "incomplete download or corrupt file"),
        ("no-tokenizer", "no tokenizer files"),
        ("bad-tokenizer", "could not be loaded: tokenizer: "),  # the parser's own words follow
        ("unknown-architecture", "not supported"),
    ],
)
def test_unloadable_folder_raises_one_line_model_not_found(
    tmp_path: Path, damage: str, reason: str
) -> None:
    folder = _damaged(tmp_path, damage)
    with pytest.raises(ModelNotFound) as info:
        load_model(str(folder))
    message = info.value.message
    assert message.startswith(f"model '{folder}' could not be loaded: ")
    assert reason in message and "\n" not in message
    assert info.value.param == "model"


def test_unloadable_adapter_names_the_adapter(tmp_path: Path) -> None:
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    with pytest.raises(ModelNotFound) as info:
        load_model(str(cached_test_model("dense")), adapter=str(adapter))
    assert "could not be loaded: adapter: " in info.value.message
    assert info.value.param == "adapter"
