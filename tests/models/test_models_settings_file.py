"""The per-model settings file (models/settings_file.py, cli/loader.py): every key
changes what the server does, a request's own fields win, and a bad file is one error
naming the file and the line, before any model loads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from support.server_fakes import FakeEngine, LiveServer

from mlx_prefix.cli import build_parser
from mlx_prefix.cli.loader import engine_loader
from mlx_prefix.config import FOREVER
from mlx_prefix.models.settings_file import (
    SettingsFileError,
    load_models_file,
    parse_models_file,
)
from mlx_prefix.models.testing import cached_test_model, make_test_model
from mlx_prefix.records import PromptInput
from mlx_prefix.server import ServerSettings, create_app
from mlx_prefix.server.protocol.messages import conversation_from_dicts
from mlx_prefix.server.served.names import ModelSpec

GOOD = """\
# settings for two models
[models."org/big"]
aliases = ["big", "b"]
context_length = 8192
temperature = 0.6
top_p = 0.9
top_k = 20
min_p = 0.05
max_tokens = 64
chat_template_kwargs = { enable_thinking = false }
draft_model = "org/small"
kv_bits = 8
kv_group_size = 32
keep_alive = "10m"

[models.'local-one']
pinned = true
keep_alive = -1
"""


def test_every_key_is_read():
    f = parse_models_file(GOOD)
    big, local = f.models["org/big"], f.models["local-one"]
    assert big.aliases == ("big", "b") and big.context_length == 8192
    assert (big.temperature, big.top_p, big.top_k, big.min_p, big.max_tokens) == (
        0.6, 0.9, 20, 0.05, 64,
    )  # fmt: skip
    assert big.chat_template_kwargs == {"enable_thinking": False}
    assert (big.draft_model, big.kv_bits, big.kv_group_size) == ("org/small", 8, 32)
    assert big.keep_alive_s == 600 and local.keep_alive_s == FOREVER and local.pinned
    assert f.find("b") is big and f.find("org/big/") is big and f.find("nope") is None


@pytest.mark.parametrize(
    "change, line, message",
    [
        (("top_k = 20", "top_k = 2.5"), 7, "top_k: must be an integer"),
        (("temperature = 0.6", "temperature = 3"), 5, "temperature: must be between 0 and 2"),
        (("kv_bits = 8", "kv_bits = 7"), 12, "kv_bits: must be one of 2, 3, 4, 5, 6, 8"),
        (('keep_alive = "10m"', 'keep_alive = "ten"'), 14, "keep_alive: not a duration"),
        (("pinned = true", "pined = true"), 17, "unknown setting 'pined' for 'local-one'"),
        (('aliases = ["big", "b"]', 'aliases = ["local-one"]'), 3, "also names 'local-one'"),
        (("context_length = 8192", "context_length = 0"), 4, "context_length: must be"),
        (("[models.'local-one']", "[model.'local-one']"), 16, "unknown section 'model'"),
        (("max_tokens = 64", "max_tokens = "), 9, "Invalid value (at line 9, column 14)"),
    ],
)
def test_a_bad_line_is_one_error_naming_the_file_and_the_line(tmp_path, change, line, message):
    path = tmp_path / "models.toml"
    path.write_text(GOOD.replace(*change))
    with pytest.raises(SettingsFileError) as err:
        load_models_file(path)
    assert str(err.value).startswith(f"{path}")
    assert f"line {line}" in str(err.value) and message in str(err.value)


def test_the_default_file_is_optional_a_named_one_is_not(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_PREFIX_HOME", str(tmp_path))
    monkeypatch.delenv("MLX_PREFIX_MODELS_FILE", raising=False)
    assert load_models_file().models == {}
    (tmp_path / "models.toml").write_text(GOOD)
    assert set(load_models_file().models) == {"org/big", "local-one"}
    with pytest.raises(SettingsFileError, match="no such settings file"):
        load_models_file(tmp_path / "other.toml")


def test_serve_stops_at_a_bad_file_before_loading_a_model(tmp_path):
    bad = tmp_path / "models.toml"
    bad.write_text(GOOD.replace("top_p = 0.9", "top_p = yes"))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlx_prefix",
            "serve",
            "--models-file",
            str(bad),
            "--model",
            str(tmp_path / "no-such-model"),
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "MLX_PREFIX_HOME": str(tmp_path)},
    )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        f"mlx-prefix: error: {bad}: Invalid value (at line 6, column 9)"
    )


# -- what the server does with them ---------------------------------------------------


def test_sampling_defaults_and_aliases_apply_and_a_request_wins():
    settings = parse_models_file(
        '[models.fake-model]\naliases = ["fm"]\ntemperature = 0.3\ntop_p = 0.5\n'
        "top_k = 7\nmin_p = 0.1\nmax_tokens = 5\n"
    )
    engine = FakeEngine()
    app = create_app(engine, ServerSettings(strict_model_names=True), model_settings=settings)
    with LiveServer(app) as server:
        url = server.url + "/v1/chat/completions"
        hi = [{"role": "user", "content": "Hi"}]
        assert httpx.post(url, json={"model": "fm", "messages": hi}).status_code == 200
        own = {"temperature": 0.9, "top_p": 0.8, "top_k": 3, "max_tokens": 9}
        assert httpx.post(url, json={"model": "fm", "messages": hi, **own}).status_code == 200
        assert httpx.post(url, json={"model": "nope", "messages": hi}).status_code == 404
        cards = httpx.get(server.url + "/v1/models").json()["data"]
    first, second = (s.sampling for s in engine.submissions)
    assert (first.temperature, first.top_p, first.top_k, first.min_p, first.max_tokens) == (
        0.3, 0.5, 7, 0.1, 5,
    )  # fmt: skip
    assert (second.temperature, second.top_p, second.top_k, second.max_tokens) == (0.9, 0.8, 3, 9)
    assert {"id": "fm", "alias_of": "fake-model"}.items() <= cards[1].items()


def test_a_model_named_only_in_the_file_is_served_on_demand_under_its_name(tmp_path):
    other = make_test_model("dense", tmp_path / "other", seed=3)
    settings = parse_models_file(f'[models."{other}"]\naliases = ["o"]\n')
    loaded: list[ModelSpec] = []

    def loader(spec, store, disk):
        loaded.append(spec)
        return FakeEngine()

    app = create_app(FakeEngine(), ServerSettings(), loader, model_settings=settings)
    with LiveServer(app) as server:
        body = {"model": "o", "messages": [{"role": "user", "content": "Hi"}]}
        reply = httpx.post(server.url + "/v1/chat/completions", json=body).json()
    assert [s.folder for s in loaded] == [other] and reply["model"] == str(other)


def _loaded_engine(tmp_path: Path, folder: Path, table: str, *flags: str):
    args = build_parser().parse_args(["serve", "--model", str(folder), *flags])
    settings = parse_models_file(f'[models."{folder}"]\n{table}')
    spec = ModelSpec(folder, None, str(folder))
    return engine_loader(args, settings)(spec, None, None)


def test_context_length_chat_template_kwargs_kv_bits_and_draft_model(tmp_path):
    think = cached_test_model("qwen3_5", think_template=True)
    plain = _loaded_engine(tmp_path, think, "")
    tuned = _loaded_engine(tmp_path, think, "context_length = 1000\nchat_template_kwargs = "
                           "{ enable_thinking = false }\n")  # fmt: skip
    wide = make_test_model("dense", tmp_path / "wide", head_dim=32)
    kv = _loaded_engine(tmp_path, wide, "kv_bits = 4\nkv_group_size = 32\n")
    draft_folder = make_test_model("dense", tmp_path / "draft", seed=5)
    target = make_test_model("dense", tmp_path / "target", seed=6)
    drafted = _loaded_engine(tmp_path, target, f'draft_model = "{draft_folder}"\n')
    try:
        assert plain.model.context_length == 4096 and tuned.model.context_length == 1000
        prompt = PromptInput(messages=conversation_from_dicts([{"role": "user", "content": "Hi"}]))
        decode = tuned.model.tokenizer.decode
        assert decode(list(tuned.plan(prompt).tokens)).endswith("<think>\n\n</think>\n\n")
        assert not decode(list(plain.plan(prompt).tokens)).endswith("</think>\n\n")
        assert tuned.model.template_args == {"enable_thinking": False}
        assert plain.kv_quant is None and (kv.kv_quant.bits, kv.kv_quant.group_size) == (4, 32)
        assert plain.draft is None and drafted.draft is not None
        assert drafted.draft.path == draft_folder.resolve()
    finally:
        for engine in (plain, tuned, kv, drafted):
            engine.shutdown()
