"""Issue 22: every API route also under its unprefixed path, from one table, with the
same middleware; model names (served id, folder, alias, unknown -> the default model,
--strict-model-names); /v1/models in OpenAI's shape with the aliases."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
from support.live import live_server, openai_client
from support.server_fakes import DEFAULT_REPLY, FakeEngine, FakeModel, serving

from mlx_prefix.cli import build_parser
from mlx_prefix.cli.serve_args import server_settings
from mlx_prefix.errors import ModelNotFound
from mlx_prefix.server.routes import API_ROUTES, ROUTES
from mlx_prefix.server.served.names import ModelNames, ModelRegistry, ServedModel

SYSTEM = "You answer questions about the opening hours of a small public library. " * 3


live = live_server(
    lambda: FakeEngine(FakeModel(path=Path("/models/org/SmolLM-fake"))),
    aliases=("house-model", "claude-sonnet-4-5"),
)


def chat_body(question: str, **extra) -> dict:
    return {
        "model": "fake-model",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        **extra,
    }


def messages_body(question: str, **extra) -> dict:
    return {
        "model": "claude-sonnet-4-5",
        "max_tokens": 64,
        "system": SYSTEM,
        "messages": [{"role": "user", "content": question}],
        **extra,
    }


def test_one_table_serves_every_api_route_under_both_prefixes():
    paths = {(r.path, tuple(sorted(r.methods or ()))) for r in ROUTES}
    for path, _, methods in API_ROUTES:
        for prefix in ("/v1", ""):
            assert any(p == prefix + path and set(methods) <= set(m) for p, m in paths), path
    short = {path for path, _, _ in API_ROUTES}
    assert {"/chat/completions", "/completions", "/models", "/messages"} <= short
    assert {"/messages/count_tokens", "/responses", "/responses/{response_id}"} <= short


@pytest.mark.parametrize("suffix", ["/v1", ""])
def test_openai_client_with_and_without_v1(live, suffix):
    url, _ = live
    with openai_client(url, path=suffix) as client:
        r = client.chat.completions.create(model="fake-model", messages=chat_body("hi")["messages"])
        assert r.choices[0].message.content == DEFAULT_REPLY
        c = client.completions.create(model="fake-model", prompt="Once upon a time")
        assert c.choices[0].text == DEFAULT_REPLY
        assert [m.id for m in client.models.list().data] == [
            "fake-model",
            "house-model",
            "claude-sonnet-4-5",
        ]
        assert client.models.retrieve("house-model").id == "fake-model"
        first = client.responses.create(model="gpt-4o-mini", instructions=SYSTEM, input="hi")
        assert first.output_text == DEFAULT_REPLY and first.model == "fake-model"
        second = client.responses.create(
            model="x", instructions=SYSTEM, input="more", previous_response_id=first.id
        )
        assert second.usage.input_tokens_details.cached_tokens > 20  # the chain's history
        assert client.responses.retrieve(second.id).output_text == DEFAULT_REPLY
        client.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(first.id)


_VARYING = ("id", "created", "created_at", "completed_at", "usage")


def _strip(body):
    """A reply without what differs between any two requests (ids, times, usage)."""
    if isinstance(body, list):
        return [_strip(v) for v in body]
    if isinstance(body, dict):
        return {k: _strip(v) for k, v in body.items() if k not in _VARYING}
    return body


@pytest.mark.parametrize(
    "path, body",
    [
        ("/chat/completions", chat_body("When do you open on Sunday?")),
        ("/completions", {"model": "fake-model", "prompt": SYSTEM + " When do you close?"}),
        ("/messages", messages_body("Is there a reading room?")),
        ("/responses", {"model": "fake-model", "instructions": SYSTEM, "input": "Any maps?"}),
    ],
)
def test_short_path_equals_the_v1_path_and_hits_its_cache(live, path, body):
    url, _ = live
    long = httpx.post(f"{url}/v1{path}", json=body)
    short = httpx.post(f"{url}{path}", json=body)
    assert long.status_code == short.status_code == 200
    assert _strip(long.json()) == _strip(short.json())
    usage = short.json()["usage"]
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details", {})
    cached = usage.get("cache_read_input_tokens", details)
    if isinstance(cached, dict):
        cached = cached["cached_tokens"]
    assert cached > 20  # the second request read the first one's prefix


@pytest.mark.parametrize("path", ["/models", "/models/fake-model", "/messages/count_tokens"])
def test_short_read_paths_equal_the_v1_ones(live, path):
    url, _ = live
    if path.endswith("count_tokens"):
        long = httpx.post(f"{url}/v1{path}", json=messages_body("count me"))
        short = httpx.post(f"{url}{path}", json=messages_body("count me"))
    else:
        long, short = httpx.get(f"{url}/v1{path}"), httpx.get(f"{url}{path}")
    assert long.status_code == short.status_code == 200
    assert long.json() == short.json()


@pytest.mark.parametrize(
    "path, body",
    [
        ("/chat/completions", {"model": "fake-model", "messages": []}),
        ("/chat/completions", chat_body("x", max_tokens="ten")),
        ("/completions", {"model": "fake-model"}),
        ("/messages", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
        ("/messages", messages_body("x", temperature=7)),
        ("/responses", {"model": "fake-model"}),
        ("/responses", {"model": "fake-model", "input": "x", "background": True}),
    ],
)
def test_bad_body_on_a_short_path_gets_the_same_400(live, path, body):
    url, _ = live
    long, short = httpx.post(f"{url}/v1{path}", json=body), httpx.post(f"{url}{path}", json=body)
    assert long.status_code == short.status_code == 400
    assert long.json() == short.json()
    anthropic_shape = path.startswith("/messages")
    assert ("type" in long.json()) is anthropic_shape
    assert httpx.get(f"{url}/health").status_code == 200


@pytest.mark.parametrize("name", ["gpt-4o-mini", "test", "claude-haiku-4-5-20251001"])
def test_an_unknown_model_name_is_served_by_the_default_model(live, name):
    url, _ = live
    r = httpx.post(f"{url}/chat/completions", json={**chat_body("unknown"), "model": name})
    assert r.status_code == 200 and r.json()["model"] == "fake-model"
    m = httpx.post(f"{url}/v1/messages", json={**messages_body("unknown"), "model": name})
    assert m.status_code == 200 and m.json()["model"] == "fake-model"
    r = httpx.post(f"{url}/responses", json={"model": name, "input": "unknown"})
    assert r.status_code == 200 and r.json()["model"] == "fake-model"


@pytest.mark.parametrize(
    "name", ["fake-model", "house-model", "/models/org/SmolLM-fake", "SmolLM-fake", "default"]
)
def test_served_names_and_aliases_select_the_model(live, name):
    url, _ = live
    r = httpx.post(f"{url}/v1/chat/completions", json={**chat_body("alias"), "model": name})
    assert r.json()["model"] == "fake-model"
    assert r.json()["choices"][0]["message"]["content"] == DEFAULT_REPLY


def test_models_list_in_openai_and_anthropic_shapes(live):
    url, _ = live
    data = httpx.get(f"{url}/v1/models").json()
    assert data["object"] == "list"
    cards = {c["id"]: c for c in data["data"]}
    assert set(cards) == {"fake-model", "house-model", "claude-sonnet-4-5"}
    assert all(c["object"] == "model" and c["owned_by"] == "mlx-prefix" for c in cards.values())
    assert cards["fake-model"]["aliases"] == ["house-model", "claude-sonnet-4-5"]
    assert cards["house-model"]["alias_of"] == "fake-model"
    anthropic = httpx.get(f"{url}/models", headers={"anthropic-version": "2023-06-01"}).json()
    assert [m["id"] for m in anthropic["data"]] == list(cards)
    assert all(m["type"] == "model" for m in anthropic["data"])
    assert anthropic["has_more"] is False


def test_strict_model_names_refuse_unknown_names_in_each_family_shape():
    with serving(strict_model_names=True) as (url, _):
        chat = httpx.post(f"{url}/chat/completions", json={**chat_body("x"), "model": "gpt-4o"})
        assert chat.status_code == 404 and chat.json()["error"]["code"] == "model_not_found"
        msg = httpx.post(f"{url}/messages", json={**messages_body("x"), "model": "claude-x"})
        assert msg.status_code == 404
        assert msg.json()["type"] == "error"
        assert msg.json()["error"]["type"] == "not_found_error"
        ok = httpx.post(f"{url}/messages", json={**messages_body("x"), "model": "fake-model"})
        assert ok.status_code == 200
        resp = httpx.post(f"{url}/responses", json={"model": "gpt-4o", "input": "x"})
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"


def test_api_key_guards_short_paths_and_accepts_x_api_key():
    with serving(api_key="sekrit") as (url, _):
        for path in ("/v1/models", "/models"):
            assert httpx.get(url + path).status_code == 401
            assert httpx.get(url + path, headers={"x-api-key": "sekrit"}).status_code == 200
            auth = {"Authorization": "Bearer sekrit"}
            assert httpx.get(url + path, headers=auth).status_code == 200
            assert httpx.get(url + path, headers={"x-api-key": "nope"}).status_code == 401
        refused = httpx.post(f"{url}/messages", json=messages_body("hi"))
        assert refused.status_code == 401
        assert refused.json()["error"]["type"] == "authentication_error"
        refused = httpx.post(f"{url}/responses", json={"model": "m", "input": "hi"})
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{url}/health").status_code == 200
        # The dashboard's page and files are open (the page asks for the key); its data
        # and actions are API routes under /v1 and need the key like any other.
        assert httpx.get(f"{url}/dashboard").status_code == 200
        assert httpx.get(f"{url}/dashboard/static/dashboard.js").status_code == 200
        assert httpx.get(f"{url}/v1/dashboard").status_code == 401
        key = {"x-api-key": "sekrit"}
        assert httpx.get(f"{url}/v1/dashboard", headers=key).status_code == 200
        assert httpx.get(f"{url}/dashboard/other", headers=key).status_code == 404
        assert httpx.get(f"{url}/dashboard/other").status_code == 401


def test_cors_and_body_limit_are_the_same_on_short_paths():
    with serving(max_body_bytes=2048) as (url, _):
        page = {"Origin": "https://evil.example"}
        assert httpx.get(f"{url}/v1/dashboard", headers=page).status_code == 403
        for path in ("/v1/responses", "/responses"):
            r = httpx.post(url + path, json={"model": "m", "input": "x"}, headers=page)
            assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
        for path in ("/v1/chat/completions", "/chat/completions"):
            assert httpx.post(url + path, json=chat_body("x"), headers=page).status_code == 403
            local = {"Origin": "http://localhost:3000"}
            ok = httpx.post(url + path, json=chat_body("x"), headers=local)
            assert ok.headers["access-control-allow-origin"] == "http://localhost:3000"
            big = httpx.post(url + path, json=chat_body("x" * 4000))
            assert big.status_code == 413


def test_registry_rules():
    engine = FakeEngine(FakeModel(path=Path("/m/org/Folder")))
    served = ServedModel.of(engine, ["a1", "a1", "a2"]).names
    assert served == ModelNames("fake-model", ("a1", "a2"), "/m/org/Folder")
    registry = ModelRegistry([served, ModelNames("other")])
    for name in ("fake-model", "a2", "/m/org/Folder", "/m/org/Folder/", "Folder", "default", None):
        assert registry.resolve(name) is served
    assert registry.resolve("other").id == "other"
    assert registry.resolve("anything-else") is served
    strict = ModelRegistry([ServedModel.of(engine).names], strict=True)
    with pytest.raises(ModelNotFound, match="anything-else"):
        strict.resolve("anything-else")
    with pytest.raises(ValueError, match="a1"):
        ModelRegistry([served, ModelNames("other", ("a1",))])


def test_serve_flags_and_env_fallbacks(monkeypatch):
    parse = build_parser().parse_args
    args = parse(["serve", "--alias", "x", "--alias", "claude-y", "--strict-model-names"])
    settings = server_settings(args)
    assert settings.aliases == ("x", "claude-y") and settings.strict_model_names is True
    assert settings.keep_billing_header is False
    monkeypatch.setenv("MLX_PREFIX_SERVER_ALIASES", "gpt-4o-mini, test")
    monkeypatch.setenv("MLX_PREFIX_SERVER_STRICT_MODEL_NAMES", "1")
    monkeypatch.setenv("MLX_PREFIX_SERVER_KEEP_BILLING_HEADER", "true")
    from_env = server_settings(parse(["serve"]))
    assert from_env.aliases == ("gpt-4o-mini", "test")
    assert from_env.strict_model_names is True and from_env.keep_billing_header is True
    assert server_settings(parse(["serve", "--alias", "z"])).aliases == ("z",)
