"""What a request may do to the chat template over HTTP, on a real tiny model: template
variables only (no template of its own, no tokenisation switches), and a bounded
rendering time, after which the server keeps serving."""

from __future__ import annotations

import time

import httpx
from support.live import live_server
from support.models import TEST_CACHE

from mlx_prefix.engine.engine import Engine
from mlx_prefix.models.load import load_model
from mlx_prefix.models.testing import cached_test_model
from mlx_prefix.prompt.request import render

SPIN = (  # ChatML, looping for hours when a request sets the template variable `spin`
    "{% if spin %}{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}"
    "{% endfor %}{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chat(c: httpx.Client, **kwargs) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kwargs}
    return c.post("/v1/chat/completions", json=body)


live = live_server(
    lambda: Engine(load_model(str(cached_test_model("dense")), chat_template=SPIN), TEST_CACHE)
)


def test_a_request_cannot_replace_the_template(http):
    pwned = {"chat_template": "PWNED {{ messages[0].content }}"}
    r = chat(http, chat_template_kwargs=pwned)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "chat_template_kwargs.chat_template"
    assert "'chat_template'" in error["message"]
    for key in ("tokenize", "continue_final_message", "documents"):
        r = chat(http, chat_template_kwargs={key: True})
        assert r.status_code == 400 and f"'{key}'" in r.json()["error"]["message"]


def test_a_template_loop_ends_with_a_400_and_the_server_keeps_serving(http, monkeypatch):
    monkeypatch.setattr(render, "RENDER_TIMEOUT_S", 0.5)
    started = time.monotonic()
    r = chat(http, chat_template_kwargs={"spin": True})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "template_timeout"
    assert time.monotonic() - started < 60  # bounded, generously for any machine
    ok = chat(http)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] is not None
