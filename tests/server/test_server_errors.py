"""Bad input, engine failures and disconnects: each gets a 4xx/5xx in the OpenAI error shape
(or an SSE error event), and the server keeps serving."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from support.live import live_server, openai_client
from support.server_fakes import DEFAULT_REPLY, FakeEngine, FakeModel, raw_post, serving, wait_until

MAX_BODY = 64 * 1024
CONTEXT = 2000
CHAT = "/v1/chat/completions"


live = live_server(lambda: FakeEngine(FakeModel(context_length=CONTEXT)), max_body_bytes=MAX_BODY)


@pytest.fixture
def http(live) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live[0], timeout=10) as c:
        yield c
        assert c.get("/health").json()["status"] == "ok"  # still serving after the error


def assert_error(r: httpx.Response, status: int, code: str | None = None, param: str | None = None):
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if code is not None:
        assert body["error"]["code"] == code
    if param is not None:
        assert body["error"]["param"] == param
    return body["error"]


def chat(**fields) -> dict:
    return {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], **fields}


BAD_CHAT_BODIES = {
    "non-object body": ([1, 2, 3], None),
    "messages missing": ({"model": "fake-model"}, "messages"),
    "messages not a list": (chat(messages="hello"), "messages"),
    "messages empty": (chat(messages=[]), "messages"),
    "message not an object": (chat(messages=["hi"]), "messages[0]"),
    "unknown role": (chat(messages=[{"role": "wizard", "content": "hi"}]), "messages[0].role"),
    "missing role": (chat(messages=[{"content": "hi"}]), "messages[0].role"),
    "missing content": (chat(messages=[{"role": "user"}]), "messages[0].content"),
    "null user content": (chat(messages=[{"role": "user", "content": None}]), None),
    "content a number": (chat(messages=[{"role": "user", "content": 5}]), None),
    "image part without a url": (
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        "messages[0].content[0].image_url.url",
    ),
    "max_tokens a string": (chat(max_tokens="ten"), "max_tokens"),
    "max_tokens a float": (chat(max_tokens=1.5), "max_tokens"),
    "max_tokens negative": (chat(max_tokens=-1), "max_tokens"),
    "max_tokens zero": (chat(max_tokens=0), "max_tokens"),
    "max_tokens over context": (chat(max_tokens=CONTEXT + 1), "max_tokens"),
    "max_tokens huge": (chat(max_completion_tokens=10**12), "max_completion_tokens"),
    "temperature a string": (chat(temperature="hot"), "temperature"),
    "temperature out of range": (chat(temperature=5), "temperature"),
    "top_p a bool": (chat(top_p=True), "top_p"),
    "n=2": (chat(n=2), "n"),
    "stream a string": (chat(stream="yes"), "stream"),
    "stop not strings": (chat(stop=[1, 2]), "stop"),
    "stop too many": (chat(stop=[str(i) for i in range(17)]), "stop"),
    "stop too long": (chat(stop=["ok", "x" * 1025]), "stop"),
    "seed a string": (chat(seed="x"), "seed"),
    "seed negative": (chat(seed=-1), "seed"),
    "seed 2**64": (chat(seed=2**64), "seed"),
    "top_logprobs without logprobs": (chat(top_logprobs=3), "top_logprobs"),
    "top_logprobs over 20": (chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    "tools not a list": (chat(tools={"type": "function"}), "tools"),
    "bad tool_choice": (chat(tool_choice="sometimes"), "tool_choice"),
    "functions and tools": (
        chat(functions=[{"name": "f"}], tools=[{"type": "function", "function": {"name": "f"}}]),
        "functions",
    ),
    "function_call unknown": (
        chat(functions=[{"name": "f"}], function_call="always"),
        "function_call",
    ),
    "function_call names no function": (
        chat(functions=[{"name": "f"}], function_call={"name": "g"}),
        "function_call",
    ),
    "function message without name": (
        chat(messages=[{"role": "function", "content": "x"}]),
        "messages[0].name",
    ),
    "bad prefix_cache scope": (chat(prefix_cache={"scope": "forever"}), "prefix_cache.scope"),
    "prefix_cache not an object": (chat(prefix_cache=True), "prefix_cache"),
    "prefix_cache key typo": (chat(prefix_cache={"enable": False}), "prefix_cache.enable"),
    "stop with response_format": (
        chat(stop=["}"], response_format={"type": "json_object"}),
        "stop",
    ),
    "include_usage not a bool": (
        chat(stream=True, stream_options={"include_usage": "yes"}),
        "stream_options.include_usage",
    ),
    "model a number": (chat(model=3), "model"),
}


@pytest.mark.parametrize("body,param", BAD_CHAT_BODIES.values(), ids=BAD_CHAT_BODIES.keys())
def test_bad_chat_body(http, engine, body, param):
    before = len(engine.submissions)
    error = assert_error(http.post(CHAT, json=body), 400, param=param)
    assert error["type"] == "invalid_request_error"
    assert len(engine.submissions) == before  # rejected before reaching the engine


BAD_COMPLETION_BODIES = {
    "prompt missing": ({"model": "fake-model"}, "prompt"),
    "prompt token ids": ({"prompt": [1, 2, 3]}, "prompt"),
    "prompt two strings": ({"prompt": ["a", "b"]}, "prompt"),
    "logprobs out of range": ({"prompt": "a", "logprobs": 9}, "logprobs"),
    "echo": ({"prompt": "a", "echo": True}, "echo"),
    "best_of": ({"prompt": "a", "best_of": 3}, "best_of"),
}


@pytest.mark.parametrize(
    "body,param", BAD_COMPLETION_BODIES.values(), ids=BAD_COMPLETION_BODIES.keys()
)
def test_bad_completion_body(http, body, param):
    assert_error(http.post("/v1/completions", json=body), 400, param=param)


@pytest.mark.parametrize("raw", [b"{not json", b"", b"\xff\xfe", b'{"messages": [}'])
def test_malformed_json(http, raw):
    r = http.post(CHAT, content=raw, headers={"content-type": "application/json"})
    assert "JSON" in assert_error(r, 400)["message"]


@pytest.mark.parametrize(
    "raw",
    [
        b'{"messages": ' + b"[" * 30_000 + b"]" * 30_000 + b"}",  # under MAX_BODY
        b'{"messages": [{"role": "user", "content": "hi"}], "seed": ' + b"7" * 5000 + b"}",
        b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
    ],
    ids=["30k deep", "5000-digit integer", "NaN"],
)
def test_json_python_parses_badly_is_a_400(http, engine, raw):
    before = len(engine.submissions)
    r = http.post(CHAT, content=raw, headers={"content-type": "application/json"})
    message = assert_error(r, 400)["message"]
    assert "not number" not in message
    assert len(engine.submissions) == before


@pytest.mark.parametrize(
    "path,raw,param",
    [
        (CHAT, rb'{"messages": [{"role": "user", "content": "hi \ud800"}]}', "messages[0].content"),
        ("/v1/completions", rb'{"prompt": "\udc00 there"}', "prompt"),
        ("/v1/cache/warm", rb'{"prompt": "\udc00 there"}', "prompt"),
    ],
)
def test_lone_surrogate_is_a_400(http, engine, path, raw, param):
    before = len(engine.submissions)
    r = http.post(path, content=raw, headers={"content-type": "application/json"})
    assert "surrogate" in assert_error(r, 400, param=param)["message"]
    assert len(engine.submissions) == before


@pytest.mark.parametrize("path", [CHAT, "/v1/completions", "/v1/cache/warm"])
@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_page_must_send_json_but_other_clients_need_not_say_so(http, engine, path, content_type):
    valid = chat() if path == CHAT else {"prompt": "hi"}
    body = json.dumps(valid).encode()
    headers = {"content-type": content_type} if content_type else {}
    before = len(engine.submissions)
    page = {**headers, "origin": "http://localhost:3000"}
    r = http.post(path, content=body, headers=page)
    assert "application/json" in assert_error(r, 415, code="unsupported_media_type")["message"]
    assert len(engine.submissions) == before
    assert http.post(path, content=body, headers=headers).status_code == 200  # curl -d


def test_json_with_charset_is_json(http):
    body = json.dumps(chat()).encode()
    r = http.post(CHAT, content=body, headers={"content-type": "Application/JSON; charset=utf-8"})
    assert r.status_code == 200, r.text


def test_prompt_longer_than_context(http):
    r = http.post(CHAT, json=chat(messages=[{"role": "user", "content": "word " * (CONTEXT + 10)}]))
    assert_error(r, 400, code="context_length_exceeded")


def test_prompt_plus_explicit_max_tokens_over_context(http, engine):
    # The fake counts words: the prompt is about 1500 tokens of a 2000-token context.
    long = [{"role": "user", "content": "word " * 1500}]
    for name in ("max_tokens", "max_completion_tokens"):
        queued = len(engine.handles)
        r = http.post(CHAT, json=chat(messages=long, **{name: 600}))
        error = assert_error(r, 400, code="context_length_exceeded", param="messages")
        assert f"lower {name}" in error["message"] and "600 for the completion" in error["message"]
        assert len(engine.handles) == queued  # refused before anything was queued
    assert http.post(CHAT, json=chat(messages=long, max_tokens=400)).status_code == 200
    # The default max_tokens (512 here) is clamped to the context, as OpenAI's default is.
    assert (
        http.post(
            CHAT, json=chat(messages=[{"role": "user", "content": "word " * 1900}])
        ).status_code
        == 200
    )
    r = http.post("/v1/completions", json={"prompt": "word " * 1500, "max_tokens": 600})
    assert_error(r, 400, code="context_length_exceeded", param="prompt")


def test_body_too_large_by_content_length(http):
    r = http.post(CHAT, content=b"x" * (MAX_BODY + 1), headers={"content-type": "application/json"})
    assert_error(r, 413, code="payload_too_large")


def test_body_too_large_when_streamed_without_length(http):
    def chunks():
        for _ in range(4):
            yield b" " * (MAX_BODY // 2)

    r = http.post(CHAT, content=chunks(), headers={"content-type": "application/json"})
    assert "transfer-encoding" in r.request.headers  # no Content-Length was sent
    assert_error(r, 413, code="payload_too_large")


def test_unknown_route_and_method(http):
    assert_error(http.get("/v1/nothing-here"), 404, code="not_found")
    assert_error(http.get(CHAT), 405, code="method_not_allowed")


def test_unknown_model_with_strict_names():
    with serving(strict_model_names=True) as (url, _):
        for path in (CHAT, "/chat/completions"):
            r = httpx.post(url + path, json=chat(model="llama-9000"))
            error = assert_error(r, 404, "model_not_found")
            assert "fake-model" in error["message"]
            assert error["param"] == "model"


def test_engine_busy(http):
    r = http.post(CHAT, json=chat(messages=[{"role": "user", "content": "[[busy]]"}]))
    assert_error(r, 429, code="server_busy")


def test_engine_crash_at_submit(http):
    r = http.post(CHAT, json=chat(messages=[{"role": "user", "content": "[[crash]]"}]))
    assert assert_error(r, 500)["type"] == "server_error"


def test_error_mid_generation_non_streaming(http):
    r = http.post(CHAT, json=chat(messages=[{"role": "user", "content": "[[fail_after:3]]"}]))
    error = assert_error(r, 500, code="generation_failed")
    assert "mid-stream" in error["message"]


def sse_payloads(text: str) -> list:
    events = [e for e in text.split("\n\n") if e.strip()]
    assert all(e.startswith("data: ") for e in events)
    return [e[len("data: ") :] for e in events]


def test_error_mid_generation_streaming(http):
    body = chat(messages=[{"role": "user", "content": "[[fail_after:3]]"}], stream=True)
    with http.stream("POST", CHAT, json=body) as r:
        assert r.status_code == 200
        text = r.read().decode()  # returns: the server closed the stream
    payloads = sse_payloads(text)
    assert "[DONE]" not in payloads
    content = [json.loads(p)["choices"][0]["delta"].get("content", "") for p in payloads[:-1]]
    assert "".join(content) == "Hello from the"
    error = json.loads(payloads[-1])["error"]
    assert error["code"] == "generation_failed" and error["type"] == "server_error"


def test_error_mid_stream_reaches_openai_client(client):
    with pytest.raises(openai.APIError, match="mid-stream"):
        stream = client.chat.completions.create(
            model="fake-model",
            messages=[{"role": "user", "content": "[[fail_after:1]]"}],
            stream=True,
        )
        with stream:
            list(stream)


def test_client_disconnect_while_streaming_cancels(live, engine):
    body = chat(
        messages=[{"role": "user", "content": f"[[delay:0.5]] [[reply:{'word ' * 200}]]"}],
        stream=True,
    )
    with httpx.Client(base_url=live[0], timeout=10) as c:
        with c.stream("POST", CHAT, json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            handle = engine.handles[-1]
    assert wait_until(handle.cancelled.is_set), "disconnect did not cancel the request"
    assert wait_until(lambda: handle.finished)


def _disconnects(url: str) -> float:
    """Chat requests ended by their client hanging up (499), as /metrics counts them."""
    label = 'mlx_prefix_requests_total{endpoint="/v1/chat/completions",status="499"}'
    text = httpx.get(url + "/metrics").text
    return next((float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(label)), 0)


def test_client_disconnect_while_waiting_non_streaming_cancels(live, engine):
    body = json.dumps(
        chat(messages=[{"role": "user", "content": f"[[delay:0.5]] [[reply:{'w ' * 200}]]"}])
    ).encode()
    before, disconnected = len(engine.handles), _disconnects(live[0])
    with raw_post(live[0], CHAT, body):
        assert wait_until(lambda: len(engine.handles) > before)
    handle = engine.handles[-1]
    assert wait_until(handle.cancelled.is_set), "disconnect did not cancel the request"
    # Counted once the handler ended (the module's server counts other tests' too).
    assert wait_until(lambda: _disconnects(live[0]) == disconnected + 1)


def test_client_disconnect_ends_the_handler_even_if_the_engine_is_slow_to_stop(live, engine):
    # [[hang]]: the engine is inside a long step and acknowledges the cancel only once the
    # test lets it go. The handler must not wait for that: it ends (499) as soon as the
    # client is gone, while the engine is still in its step.
    body = json.dumps(chat(messages=[{"role": "user", "content": "[[hang:600]]"}])).encode()
    before, n_handles = _disconnects(live[0]), len(engine.handles)
    try:
        with raw_post(live[0], CHAT, body):
            assert wait_until(lambda: len(engine.handles) > n_handles, timeout=30)
        handle = engine.handles[-1]
        assert wait_until(lambda: _disconnects(live[0]) > before, timeout=60), (
            "the handler outlived its client"
        )
        assert handle.cancelled.is_set() and not handle.finished  # the engine is still in its step
    finally:
        engine.unhang.set()
    assert wait_until(lambda: handle.finished, timeout=30)
    engine.unhang.clear()


def test_server_survives_everything(http):
    r = http.post(CHAT, json=chat())
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"] == DEFAULT_REPLY


@pytest.fixture(scope="module")
def keyed():
    with serving(api_key="sekrit") as (url, engine):
        yield url


def test_api_key_required_on_v1(keyed):
    with httpx.Client(base_url=keyed) as c:
        error = assert_error(c.get("/v1/models"), 401, code="invalid_api_key")
        assert "missing" in error["message"]
        r = c.get("/v1/models", headers={"Authorization": "Bearer wrong"})
        assert "invalid" in assert_error(r, 401)["message"]
        assert c.get("/health").status_code == 200
        assert c.get("/metrics").status_code == 200
        preflight = c.options(
            CHAT,
            headers={
                "Origin": "http://localhost:5173",
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type",
            },
        )
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "http://localhost:5173"


def test_api_key_with_openai_client(keyed):
    with openai_client(keyed, api_key="sekrit") as client:
        r = client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "k"}]
        )
        assert r.choices[0].message.content == DEFAULT_REPLY
    with openai_client(keyed, api_key="nope") as client:
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
