"""serve --temp / --top-p / --top-k / --min-p / --max-tokens: the server's values for
fields a request leaves out (mlx_lm.server's flags). A request's own value wins."""

from __future__ import annotations

import httpx
import pytest
from support.live import post_chat
from support.models import TEST_CACHE, loaded_test_model
from support.server_fakes import serving

from mlx_prefix.cli import build_parser
from mlx_prefix.cli.serve_args import server_settings
from mlx_prefix.engine.engine import Engine
from mlx_prefix.server.settings import ServerSettings

MESSAGES = [{"role": "user", "content": "Tell me about the sea and the ships on it."}]


def served(**settings):
    """A live server with these settings on a fresh engine (leaving it shuts both down)."""
    return serving(Engine(loaded_test_model("dense"), TEST_CACHE), **settings)


def chat(url: str, path: str = "/v1/chat/completions", **body) -> dict:
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 12, **body}
    return post_chat(url, body, path=path)


def text(reply: dict) -> str:
    return reply["choices"][0]["message"]["content"]


def test_flags_reach_the_settings():
    args = build_parser().parse_args(
        [
            "serve",
            "--temp",
            "0.7",
            "--top-p",
            "0.9",
            "--top-k",
            "40",
            "--min-p",
            "0.05",
            "--max-tokens",
            "64",
        ]  # fmt: skip
    )
    s = server_settings(args)
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.default_max_tokens) == (
        0.7, 0.9, 40, 0.05, 64
    )  # fmt: skip
    unset = server_settings(build_parser().parse_args(["serve"]))
    assert (unset.temperature, unset.top_k, unset.default_max_tokens) == (None, None, 512)


@pytest.mark.parametrize(
    "bad", [{"temperature": 3.0}, {"top_p": 1.5}, {"top_k": -1}, {"min_p": 2.0}]
)
def test_out_of_range_defaults_are_refused_at_startup(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        ServerSettings(**bad)


def test_default_top_k_1_makes_hot_sampling_greedy_unless_the_request_says():
    with served() as (url, _):
        greedy = text(chat(url, temperature=0.0))
        hot = {text(chat(url, temperature=1.5, seed=s)) for s in range(4)}
    assert hot != {greedy}  # at 1.5 the tiny model's replies wander
    with served(top_k=1) as (url, _):
        assert {text(chat(url, temperature=1.5, seed=s)) for s in range(4)} == {greedy}
        assert {text(chat(url, temperature=1.5, seed=s, top_k=0)) for s in range(4)} == hot


def test_default_temperature_applies_when_the_request_leaves_it_out():
    with served() as (url, _):
        greedy = text(chat(url))  # this route's own default: temperature 0
        seeded = text(chat(url, temperature=1.5, seed=7))
    with served(temperature=1.5) as (url, _):
        assert text(chat(url, seed=7)) == seeded
        assert text(chat(url, seed=7, temperature=0.0)) == greedy


def test_default_max_tokens_bounds_replies_that_name_none():
    with served(default_max_tokens=3) as (url, _):
        body = {"model": "m", "messages": MESSAGES, "temperature": 0.0}
        reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()
    assert reply["usage"]["completion_tokens"] <= 3
    assert reply["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("adapters", "/some/lora"),
        ("draft_model", "tiny-draft"),
        ("num_draft_tokens", 3),
        ("role_mapping", {"user": "USER: "}),
    ],
)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_mlx_lm_fields_this_server_cannot_honour_are_400s_naming_them(field, value, path):
    body = {"model": "m", "max_tokens": 2, field: value}
    body |= {"messages": MESSAGES} if "chat" in path else {"prompt": "Hello"}
    with serving() as (url, _):
        r = httpx.post(url + path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == field
        body[field] = None  # as some clients send every field: absent, not refused
        assert httpx.post(url + path, json=body).status_code == 200
