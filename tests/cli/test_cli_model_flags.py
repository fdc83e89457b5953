"""mlx_lm.server's model flags: --chat-template, --use-default-chat-template,
--chat-template-args, --trust-remote-code, and serve's --log-level."""

from __future__ import annotations

import json
import logging
import shutil
import threading

import pytest
from support.engine_helpers import chat, run, warm_equals_cold

from mlx_prefix.cli import build_parser, main
from mlx_prefix.cli.args import model_from_args
from mlx_prefix.config import CacheConfig
from mlx_prefix.engine.engine import Engine
from mlx_prefix.errors import InvalidRequest
from mlx_prefix.models.load import load_model
from mlx_prefix.models.template import CHATML
from mlx_prefix.models.testing import cached_test_model
from mlx_prefix.prompt.request.plan import PromptPlanner
from mlx_prefix.records import PromptInput
from mlx_prefix.server.protocol.messages import conversation_from_dicts

# A template that shows what it was given: the flavour argument and each message.
SHOWING = (
    "[{{ flavour | default('plain') }}]"
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
HELLO = PromptInput(messages=conversation_from_dicts([{"role": "user", "content": "hello"}]))


def rendered(loaded, prompt: PromptInput = HELLO) -> str:
    planner = PromptPlanner(loaded.tokenizer, CacheConfig(), loaded.template_args)
    return loaded.tokenizer.decode(list(planner.plan(prompt).tokens))


def args_for(*flags: str):
    return build_parser().parse_args(["serve", "--model", str(cached_test_model("dense")), *flags])


def test_chat_template_replaces_the_tokenizers_and_changes_the_cache_key(tmp_path):
    own = load_model(str(cached_test_model("dense")))
    text_flag = model_from_args(args_for("--chat-template", SHOWING))
    template_file = tmp_path / "t.jinja"
    template_file.write_text(SHOWING)
    file_flag = model_from_args(args_for("--chat-template", str(template_file)))
    assert rendered(text_flag) == rendered(file_flag) == "[plain]<user>hello<assistant>"
    assert rendered(own) != rendered(text_flag)
    # Entries rendered under another template never match: the key differs.
    assert text_flag.identity.chat_template_hash != own.identity.chat_template_hash
    assert text_flag.identity == file_flag.identity


def test_a_chat_template_that_is_neither_a_template_nor_a_file_is_one_line(capsys):
    argv = ["serve", "--model", str(cached_test_model("dense")), "--chat-template", "nope"]
    codes: list[int] = []  # in a thread: main() clears that thread's MLX streams
    thread = threading.Thread(target=lambda: codes.append(main(argv)))
    thread.start()
    thread.join(120)
    assert codes == [1]
    assert capsys.readouterr().err.splitlines()[-1] == (
        "mlx-prefix: error: --chat-template 'nope' is neither a Jinja template nor a file"
    )


def test_chat_template_args_reach_every_request_and_a_request_overrides_them():
    loaded = model_from_args(
        args_for("--chat-template", SHOWING, "--chat-template-args", '{"flavour": "salty"}')
    )
    assert rendered(loaded) == "[salty]<user>hello<assistant>"
    own = PromptInput(messages=HELLO.messages, chat_template_kwargs={"flavour": "sweet"})
    assert rendered(loaded, own) == "[sweet]<user>hello<assistant>"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{not json", "--chat-template-args is not JSON"),
        ("[1, 2]", "--chat-template-args must be a JSON object"),
    ],
)
def test_bad_chat_template_args_are_refused_at_startup(value, message):
    with pytest.raises(InvalidRequest, match=message):
        model_from_args(args_for("--chat-template-args", value))


def test_chat_template_args_may_not_set_what_the_server_sets():
    loaded = model_from_args(args_for("--chat-template-args", '{"add_generation_prompt": false}'))
    with pytest.raises(InvalidRequest, match="--chat-template-args may not set"):
        Engine(loaded).shutdown()


def test_use_default_chat_template_gives_a_model_without_one_chatml(tmp_path):
    folder = tmp_path / "no-template"
    shutil.copytree(cached_test_model("dense"), folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    del config["chat_template"]
    config_path.write_text(json.dumps(config))

    bare = load_model(str(folder))
    with pytest.raises(InvalidRequest, match="no chat template"):
        rendered(bare)
    fixed = load_model(str(folder), use_default_chat_template=True)
    assert fixed.tokenizer.chat_template == CHATML
    text = rendered(fixed)
    assert text.endswith("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n")
    # A model that has a template keeps it.
    own = load_model(str(cached_test_model("dense")), use_default_chat_template=True)
    assert own.tokenizer.chat_template != CHATML

    engine = Engine(fixed, CacheConfig())  # served, and cached, under ChatML
    try:
        run(engine, chat(("system", "Be brief. " * 40), ("user", "hello")))
        warm = warm_equals_cold(engine, chat(("system", "Be brief. " * 40), ("user", "bye")))
        assert warm.usage.cached_tokens > 0
    finally:
        engine.shutdown()


def test_trust_remote_code_reaches_the_tokenizer_loader(monkeypatch):
    from mlx_prefix.models import tokenizer

    seen: list[dict] = []
    real = tokenizer.load_tokenizer

    def spy(path, tokenizer_config_extra=None, **kwargs):
        seen.append(dict(tokenizer_config_extra or {}))
        return real(path, tokenizer_config_extra, **kwargs)

    monkeypatch.setattr(tokenizer, "load_tokenizer", spy)
    model_from_args(args_for())
    model_from_args(args_for("--trust-remote-code"))
    assert [s["trust_remote_code"] for s in seen] == [False, True]


@pytest.mark.parametrize(
    ("flags", "debug", "info"),
    [
        ([], False, True),
        (["--log-level", "WARNING"], False, False),
        (["--log-level", "debug"], True, True),
    ],
)
def test_log_level_sets_the_servers_logging(monkeypatch, flags, debug, info):
    from mlx_prefix.server import app

    seen: dict[str, bool] = {}

    def run(server) -> None:  # instead of serving: look at the logging, then return
        engine_log = logging.getLogger("mlx_prefix.engine")
        seen.update(
            debug=engine_log.isEnabledFor(logging.DEBUG), info=engine_log.isEnabledFor(logging.INFO)
        )

    monkeypatch.setattr(app._GracefulServer, "run", run)
    logger = logging.getLogger("mlx_prefix")
    monkeypatch.setattr(logger, "level", logger.level)  # restored after the test
    argv = ["serve", "--model", str(cached_test_model("dense")), "--port", "0", *flags]
    codes: list[int] = []  # in a thread: main() clears that thread's MLX streams
    thread = threading.Thread(target=lambda: codes.append(main(argv)))
    thread.start()
    thread.join(120)
    assert codes == [0]
    assert seen == {"debug": debug, "info": info}
