"""POST /v1/embeddings against a live server: the official `openai` SDK
(`client.embeddings.create`) and raw HTTP, a fake chat engine beside a real tiny
embedding model on its worker thread."""

from __future__ import annotations

import base64
from dataclasses import replace

import httpx
import numpy as np
import openai
import pytest
from support.live import live_server
from support.server_fakes import serving

TEXTS = ["The quick brown fox", "jumps over the lazy dog again and again", "Hi"]
TOL = {"rtol": 1e-4, "atol": 1e-5}


live = live_server(embeddings=True, embedding_aliases=("text-embedding-3-small",))


def vectors(response) -> np.ndarray:
    return np.array([d.embedding for d in response.data], dtype=np.float32)


def test_sdk_default_base64_equals_the_model_and_float(client, embedding_model):
    r = client.embeddings.create(model="tiny-embed", input=TEXTS)  # the SDK asks for base64
    rows = embedding_model.tokenize(TEXTS)
    want = np.stack([embedding_model.embed([row])[0] for row in rows])  # each input alone
    np.testing.assert_allclose(vectors(r), want, **TOL)
    assert [d.index for d in r.data] == [0, 1, 2] and r.object == "list"
    assert r.model == "tiny-embed"
    n = sum(map(len, rows))
    assert r.usage.prompt_tokens == n and r.usage.total_tokens == n

    floats = client.embeddings.create(model="tiny-embed", input=TEXTS, encoding_format="float")
    assert vectors(floats).tolist() == vectors(r).tolist()  # the same float32 bits


def test_base64_is_little_endian_float32_of_the_floats(http):
    body = {"model": "tiny-embed", "input": "one string"}
    b64 = http.post("/v1/embeddings", json={**body, "encoding_format": "base64"}).json()
    floats = http.post("/v1/embeddings", json=body).json()  # float is the API's default
    raw = base64.b64decode(b64["data"][0]["embedding"])
    assert np.frombuffer(raw, "<f4").tolist() == floats["data"][0]["embedding"]
    assert len(floats["data"][0]["embedding"]) == 64


def test_token_id_input_equals_text_input(client, embedding_model):
    rows = embedding_model.tokenize(TEXTS)
    text = vectors(client.embeddings.create(model="tiny-embed", input=TEXTS))
    many = client.embeddings.create(model="tiny-embed", input=rows)
    np.testing.assert_allclose(vectors(many), text, **TOL)
    one = client.embeddings.create(model="tiny-embed", input=rows[1])  # a single list of ids
    assert len(one.data) == 1 and one.usage.prompt_tokens == len(rows[1])
    np.testing.assert_allclose(vectors(one)[0], text[1], **TOL)


def test_dimensions_truncate_and_renormalise(client):
    full = vectors(client.embeddings.create(model="tiny-embed", input=TEXTS))
    short = vectors(client.embeddings.create(model="tiny-embed", input=TEXTS, dimensions=16))
    assert short.shape == (3, 16)
    want = full[:, :16] / np.linalg.norm(full[:, :16], axis=1, keepdims=True)
    np.testing.assert_allclose(short, want, **TOL)
    np.testing.assert_allclose(np.linalg.norm(short, axis=1), 1.0, rtol=1e-5)


def test_names_aliases_unprefixed_path_and_user(http, live):
    for name in ("tiny-embed", "text-embedding-3-small", None):
        body = {"input": "x", "user": "user-1234"} | ({"model": name} if name else {})
        r = http.post("/embeddings", json=body)  # the unprefixed twin
        assert r.status_code == 200 and r.json()["model"] == "tiny-embed"
    cards = {c["id"]: c for c in http.get("/v1/models").json()["data"]}
    card = cards["tiny-embed"]
    assert card["type"] == "embedding" and card["dimensions"] == 64
    assert card["weights_bytes"] > 0 and card["matryoshka"] is True
    assert cards["text-embedding-3-small"]["alias_of"] == "tiny-embed"
    assert http.get("/v1/models/tiny-embed").json()["dimensions"] == 64


def error(r: httpx.Response) -> tuple[int, str | None, str | None]:
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"}
    return r.status_code, e["param"], e["code"]


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({}, "input", None),
        ({"input": []}, "input", None),
        ({"input": ""}, "input", None),
        ({"input": ["a", ""]}, "input", None),
        ({"input": ["a", 1]}, "input", None),
        ({"input": [[1, 2], []]}, "input", None),
        ({"input": [[1, 2], ["a"]]}, "input", None),
        ({"input": [1, 2, 10**9]}, "input", None),  # outside the vocabulary
        ({"input": {"text": "a"}}, "input", None),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format", None),
        ({"input": "a", "dimensions": 65}, "dimensions", None),
        ({"input": "a", "dimensions": 0}, "dimensions", None),
        ({"input": "a", "user": 7}, "user", None),
        ({"input": "a", "truncate": True}, "truncate", None),  # a peer's field: refused
        ({"input": "a", "model": "fake-model"}, "model", None),  # the chat model
    ],
)
def test_bad_bodies_are_400_naming_the_field(http, body, param, code):
    assert error(http.post("/v1/embeddings", json=body)) == (400, param, code)


def test_unknown_model_is_404_in_openai_shape(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.embeddings.create(model="nomic-embed-text", input="x")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    assert "tiny-embed" in e.value.body["message"]


def test_bounds_on_inputs_tokens_and_body(embedding_model):
    settings = {"embedding_max_inputs": 2, "embedding_max_tokens": 12, "max_body_bytes": 2000}
    with (
        serving(embeddings=embedding_model, **settings) as (url, _),
        httpx.Client(base_url=url, timeout=60) as http,
    ):
        post = lambda body: http.post("/v1/embeddings", json=body)  # noqa: E731
        assert error(post({"input": ["a", "b", "c"]})) == (400, "input", None)
        assert post({"input": list(range(1, 12))}).status_code == 200  # one input of ids
        assert error(post({"input": [list(range(1, 8))] * 2})) == (400, "input", None)
        assert error(post({"input": "word " * 400})) == (413, None, "payload_too_large")


def test_an_input_longer_than_the_context_is_refused(embedding_model):
    short = replace(embedding_model, context_length=8)
    with serving(embeddings=short) as (url, _), httpx.Client(base_url=url, timeout=60) as http:
        r = http.post("/v1/embeddings", json={"input": [[5, 6], list(range(1, 10))]})
        assert error(r) == (400, "input", "context_length_exceeded")
        assert "input[1] is 9 tokens" in r.json()["error"]["message"]


def test_dimensions_refused_for_a_model_not_trained_for_them(embedding_model):
    plain = replace(embedding_model, pooling=replace(embedding_model.pooling, matryoshka=False))
    with serving(embeddings=plain) as (url, _), httpx.Client(base_url=url, timeout=60) as http:
        r = http.post("/v1/embeddings", json={"input": "a", "dimensions": 16})
        assert error(r) == (400, "dimensions", None)
        assert "--embedding-matryoshka" in r.json()["error"]["message"]
        assert http.post("/v1/embeddings", json={"input": "a", "dimensions": 64}).status_code == 200


def test_without_an_embedding_model_a_clear_400():
    with serving() as (url, _), httpx.Client(base_url=url, timeout=60) as http:
        r = http.post("/v1/embeddings", json={"model": "x", "input": "a"})
        assert error(r) == (400, "model", "embeddings_not_served")
        assert "--embedding-model" in r.json()["error"]["message"]
        assert all(c.get("type") != "embedding" for c in http.get("/v1/models").json()["data"])


def test_api_key_and_origin_checks_apply(embedding_model):
    with (
        serving(embeddings=embedding_model, api_key="sekrit") as (url, _),
        httpx.Client(base_url=url) as http,
    ):
        for path in ("/v1/embeddings", "/embeddings"):
            assert error(http.post(path, json={"input": "a"}))[2] == "invalid_api_key"
        page = {"Authorization": "Bearer sekrit", "Origin": "https://evil.example"}
        r = http.post("/v1/embeddings", json={"input": "a"}, headers=page)
        assert error(r) == (403, None, "origin_not_allowed")
        ok = {"Authorization": "Bearer sekrit", "Origin": "chrome-extension://abcdef"}
        r = http.post("/v1/embeddings", json={"input": "a"}, headers=ok)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"]
        text = http.post("/v1/embeddings", content=b'{"input": "a"}', headers={**ok,
                         "Content-Type": "text/plain"})  # fmt: skip
        assert error(text) == (415, None, "unsupported_media_type")


def test_metrics_count_embedded_inputs_and_tokens(embedding_model):
    with (
        serving(embeddings=embedding_model) as (url, _),
        httpx.Client(base_url=url, timeout=60) as http,
    ):
        http.post("/v1/embeddings", json={"input": [[1, 2, 3], [4, 5]]}).raise_for_status()
        text = http.get("/metrics").text
    assert "mlx_prefix_embedding_inputs_total 2.0" in text
    assert "mlx_prefix_embedding_tokens_total 5.0" in text
    assert 'mlx_prefix_requests_total{endpoint="/v1/embeddings",status="200"} 1.0' in text
