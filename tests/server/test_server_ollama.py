"""Ollama's API (server/routes/ollama/) against a fake engine: the shapes its clients
read (the official `ollama` Python package and raw HTTP), what each body field becomes,
the model names, and every bad input answered in Ollama's error shape while the server
goes on serving. The real engine behind it: test_server_ollama_live.py."""

from __future__ import annotations

import json
import logging
import time

import httpx
import ollama
import pytest
from support.live import live_server, tool_calling_engine
from support.server_fakes import (
    DEFAULT_REPLY,
    raw_post,
    serving,
    wait_until,
)

from mlx_prefix.config import FOREVER
from mlx_prefix.server.protocol.ollama.options import parse_keep_alive

MAX_BODY = 64 * 1024
USER = [{"role": "user", "content": "Hello there"}]


live = live_server(tool_calling_engine, max_body_bytes=MAX_BODY)


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=30)


def lines(r: httpx.Response) -> list[dict]:
    return [json.loads(line) for line in r.text.splitlines() if line]


# -- the probes and the listings -------------------------------------------------------


def test_root_answers_ollama_is_running_and_a_browser_gets_the_dashboard(url):
    r = httpx.get(url + "/")
    assert r.status_code == 200 and r.text == "Ollama is running"
    assert httpx.head(url + "/").status_code == 200
    page = httpx.get(url + "/", headers={"Accept": "text/html,*/*"}, follow_redirects=False)
    assert page.status_code == 307 and page.headers["location"] == "/dashboard"
    version = httpx.get(url + "/api/version").json()
    assert version["version"].count(".") == 2 and "mlx_prefix" in version


def test_tags_show_and_ps_as_the_client_reads_them(ollama_client):
    [model] = ollama_client.list().models
    assert model.model == "fake-model:latest" and model.details.format == "safetensors"
    shown = ollama_client.show("fake-model:latest")
    assert shown.capabilities == ["completion", "tools", "thinking"]  # from its tokenizer
    assert shown.modelinfo["unknown.context_length"] == 4096
    [running] = ollama_client.ps().models
    assert running.model == "fake-model:latest" and running.context_length == 4096
    assert running.expires_at.year > 2300  # kept until another model needs the place


def test_names_with_a_tag_select_the_served_model_and_others_are_a_404_when_strict():
    with serving(strict_model_names=True) as (url, engine):
        with ollama.Client(host=url) as c:
            for name in ("fake-model", "fake-model:latest", "default"):
                assert c.chat(model=name, messages=USER).message.content == DEFAULT_REPLY
            with pytest.raises(ollama.ResponseError) as e:
                c.chat(model="llama3.2:3b", messages=USER)
    assert e.value.status_code == 404 and e.value.error.startswith("model 'llama3.2:3b' not found")


def test_an_unknown_name_is_answered_by_the_served_model_by_default(ollama_client):
    r = ollama_client.chat(model="qwen3.5:4b", messages=USER)
    assert r.model == "fake-model:latest" and r.message.content == DEFAULT_REPLY


# -- generation ------------------------------------------------------------------------


def test_chat_whole_and_streamed_agree_and_end_with_counts_and_durations(url, ollama_client):
    whole = ollama_client.chat(model="m", messages=USER, stream=False)
    parts = list(ollama_client.chat(model="m", messages=USER, stream=True))
    assert "".join(p.message.content for p in parts) == whole.message.content == DEFAULT_REPLY
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    for final in (whole, parts[-1]):
        assert final.done_reason == "stop" and final.prompt_eval_count > 0
        assert final.eval_count == len(DEFAULT_REPLY.split())
        assert isinstance(final.total_duration, int) and final.total_duration > 0
        assert final.created_at.endswith("Z")
    r = post(url, "/api/chat", {"model": "m", "messages": USER})  # stream is the default
    assert r.headers["content-type"].startswith("application/x-ndjson")
    last = lines(r)[-1]
    assert last["prompt_eval_cached_count"] == last["prompt_eval_count"] - 1  # seen before


def test_generate_renders_system_and_prompt_raw_sends_the_text_as_is(ollama_client, engine):
    r = ollama_client.generate(model="m", prompt="Why?", system="Be brief.")
    assert r.response == DEFAULT_REPLY and r.done_reason == "stop"
    sent = engine.submissions[-1].prompt
    assert [(m.role, m.content) for m in sent.messages] == [
        ("system", "Be brief."),
        ("user", "Why?"),
    ]
    ollama_client.generate(model="m", prompt="<|im_start|>user\nWhy?", raw=True)
    assert engine.submissions[-1].prompt.text == "<|im_start|>user\nWhy?"


def test_options_map_onto_sampling_with_ollama_defaults(ollama_client, engine, caplog):
    ollama_client.chat(model="m", messages=USER)
    default = engine.submissions[-1].sampling
    assert (default.temperature, default.top_k, default.top_p) == (0.8, 40, 0.9)
    assert default.repetition_context_size == 64 and default.seed is None
    options = {
        "temperature": 0.2, "top_p": 0.5, "top_k": 7, "min_p": 0.1, "seed": 42,
        "num_predict": 3, "stop": ["time."], "repeat_penalty": 1.3, "repeat_last_n": 16,
        "presence_penalty": 0.5, "frequency_penalty": 0.25,
        "num_gpu": 99, "num_thread": 4, "mirostat": 2, "something_new": True,
    }  # fmt: skip
    with caplog.at_level(logging.DEBUG, logger="mlx_prefix.server"):
        r = ollama_client.chat(model="m", messages=USER, options=options)
    s = engine.submissions[-1].sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (0.2, 0.5, 7, 0.1, 42)
    assert (s.max_tokens, s.stop, s.repetition_penalty) == (3, ("time.",), 1.3)
    assert s.repetition_context_size == s.presence_context_size == 16
    assert (s.presence_penalty, s.frequency_penalty) == (0.5, 0.25)
    assert r.eval_count == 3 and r.done_reason == "length"
    assert "options ignored: mirostat, num_gpu, num_thread, something_new" in caplog.text
    ollama_client.chat(model="m", messages=USER, options={"seed": -1, "num_predict": -1})
    s = engine.submissions[-1].sampling
    assert s.seed is None and s.max_tokens == 4096  # to the context's end


def test_num_ctx_bounds_prompt_and_reply_together(url, engine):
    body = {"model": "m", "messages": USER, "stream": False, "options": {"num_ctx": 6}}
    r = post(url, "/api/chat", body)
    prompt = engine.count_tokens(engine.submissions[-1].prompt)
    assert r.status_code == 200 and engine.submissions[-1].sampling.max_tokens == 6 - prompt
    r = post(url, "/api/chat", {**body, "options": {"num_ctx": 2}})
    assert r.status_code == 400 and "options.num_ctx" in r.json()["error"]


def test_format_json_or_a_schema_becomes_the_response_format(ollama_client, engine):
    ollama_client.chat(model="m", messages=USER, format="json")
    assert engine.submissions[-1].sampling.response_format.kind == "json_object"
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    ollama_client.chat(model="m", messages=USER, format=schema)
    fmt = engine.submissions[-1].sampling.response_format
    assert fmt.kind == "json_schema" and json.loads(fmt.schema) == schema
    assert list(json.loads(fmt.schema)["properties"]) == ["b", "a"]  # the order kept
    assert fmt.param == "format"


def test_think_levels_become_the_templates_switch_and_a_budget(ollama_client, engine):
    expected = {False: (False, 0), True: (True, None), "low": (True, 1024), "high": (True, None)}
    for think, (switch, budget) in expected.items():
        ollama_client.chat(model="m", messages=USER, think=think)
        sent = engine.submissions[-1]
        assert sent.prompt.chat_template_kwargs == {"enable_thinking": switch}
        assert sent.sampling.reasoning_budget == budget


def test_reasoning_comes_back_in_message_thinking(ollama_client):
    messages = [{"role": "user", "content": "[[reply:<think>Two and two.</think>Four.]]"}]
    r = ollama_client.chat(model="m", messages=messages)
    assert r.message.thinking == "Two and two." and r.message.content == "Four."
    parts = list(ollama_client.chat(model="m", messages=messages, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == "Two and two."


def test_tool_calls_come_back_with_arguments_as_objects_and_go_back_in(ollama_client, engine):
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    messages = [{"role": "user", "content": f"[[reply:{call}]]"}]
    for stream in (False, True):
        parts = ollama_client.chat(model="m", messages=messages, tools=[tool], stream=stream)
        calls = [c for p in ([parts] if not stream else parts) for c in p.message.tool_calls or ()]
        assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [
            ("get_weather", {"city": "Paris"})
        ]
    history = [
        *messages,
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "11 degrees", "tool_name": "get_weather"},
    ]  # fmt: skip
    ollama_client.chat(model="m", messages=history, tools=[tool])
    sent = engine.submissions[-1].prompt.messages
    assert sent[1].tool_calls[0].arguments == {"city": "Paris"}
    assert (sent[2].role, sent[2].name) == ("tool", "get_weather")


def test_logprobs_as_ollama_reports_them(url):
    body = {"model": "m", "messages": USER, "stream": False, "logprobs": True}
    r = post(url, "/api/chat", body).json()
    assert len(r["logprobs"]) == r["eval_count"] and r["logprobs"][0]["logprob"] == -0.25


def test_an_empty_request_loads_the_model_and_generates_nothing(ollama_client, engine):
    before = len(engine.submissions)
    r = ollama_client.chat(model="m", messages=[])
    assert r.done and r.done_reason == "load" and r.message.content == ""
    assert ollama_client.generate(model="m").done_reason == "load"
    assert len(engine.submissions) == before


def test_a_failure_mid_stream_is_an_error_line_the_client_raises(url, ollama_client):
    with pytest.raises(ollama.ResponseError, match="fake engine failed"):
        list(
            ollama_client.chat(
                model="m", messages=[{"role": "user", "content": "[[fail_after:2]]"}], stream=True
            )
        )
    r = post(
        url, "/api/chat", {"model": "m", "messages": [{"role": "user", "content": "[[busy]]"}]}
    )
    assert r.status_code == 429 and set(r.json()) == {"error"}


def test_a_client_leaving_a_stream_cancels_the_request(url, engine):
    body = {"model": "m", "messages": [{"role": "user", "content": "[[delay:0.2]]"}]}
    before = len(engine.handles)
    with raw_post(url, "/api/chat", json.dumps(body).encode()):
        assert wait_until(lambda: len(engine.handles) > before, timeout=5)
        time.sleep(0.1)
    assert wait_until(engine.handles[-1].cancelled.is_set, timeout=5)


# -- refusals, in Ollama's shape -------------------------------------------------------

BAD = [
    ("/api/chat", {"model": "m", "messages": "hi"}, "messages"),
    ("/api/chat", {"messages": USER}, "model is required"),
    ("/api/chat", {"model": 3, "messages": USER}, "model"),
    ("/api/chat", {"model": "m", "messages": USER, "format": "yaml"}, "format"),
    (
        "/api/chat",
        {
            "model": "m",
            "messages": USER,
            "format": "json",
            "tools": [{"type": "function", "function": {"name": "f"}}],
        },
        "format",
    ),  # noqa: E501
    (
        "/api/chat",
        {"model": "m", "messages": USER, "options": {"temperature": "hot"}},
        "temperature",
    ),  # noqa: E501
    ("/api/chat", {"model": "m", "messages": USER, "options": {"top_p": 2}}, "options.top_p"),
    ("/api/chat", {"model": "m", "messages": USER, "options": {"typical_p": 0.5}}, "typical_p"),
    (
        "/api/chat",
        {"model": "m", "messages": USER, "options": {"stop": "a" * 2000}},
        "options.stop",
    ),  # noqa: E501
    ("/api/chat", {"model": "m", "messages": USER, "options": []}, "options"),
    ("/api/chat", {"model": "m", "messages": USER, "think": "maybe"}, "think"),
    ("/api/chat", {"model": "m", "messages": USER, "keep_alive": "soon"}, "keep_alive"),
    ("/api/chat", {"model": "m", "messages": USER, "keep_alive": 0}, "keep_alive"),  # no loader
    ("/api/chat", {"model": "m", "messages": USER, "truncate": True}, "truncate"),
    ("/api/chat", {"model": "m", "messages": USER, "top_logprobs": 3}, "top_logprobs"),
    ("/api/chat", {"model": "m", "messages": USER, "n": 2}, "'n'"),
    ("/api/chat", {"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "role"),
    ("/api/chat", {"model": "m", "messages": [{"role": "user", "content": "x", "foo": 1}]}, "foo"),  # noqa: E501
    (
        "/api/chat",
        {"model": "m", "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]},
        "images",
    ),  # noqa: E501
    (
        "/api/chat",
        {"model": "m", "messages": [{"role": "assistant", "tool_calls": [{"function": {}}]}]},
        "tool_calls",
    ),  # noqa: E501
    ("/api/generate", {"model": "m", "prompt": "x", "images": ["aGk="]}, "images"),
    ("/api/generate", {"model": "m", "prompt": "x", "suffix": "y"}, "suffix"),
    ("/api/generate", {"model": "m", "prompt": "x", "template": "{{ .Prompt }}"}, "template"),
    ("/api/generate", {"model": "m", "prompt": "x", "context": [1, 2, 3]}, "context"),
    ("/api/generate", {"model": "m", "prompt": "x", "raw": True, "system": "s"}, "raw mode"),
    ("/api/generate", {"model": "m", "prompt": "x", "raw": True, "images": ["aGk="]}, "raw mode"),
    ("/api/generate", {"model": "m", "prompt": 7}, "prompt"),
    ("/api/show", {}, "model is required"),
    ("/api/embed", {"model": "m", "input": "x"}, "embedding model"),
    ("/api/push", {"model": "m"}, "push is not supported"),
    ("/api/create", {"model": "m", "from": "m"}, "create is not supported"),
    ("/api/copy", {"source": "m", "destination": "n"}, "copy is not supported"),
]


@pytest.mark.parametrize(("path", "body", "says"), BAD)
def test_bad_input_is_a_400_in_ollamas_shape_and_the_server_goes_on(url, path, body, says):
    r = post(url, path, body)
    assert r.status_code == 400, r.text
    assert set(r.json()) == {"error"} and says in r.json()["error"]
    assert post(url, "/api/chat", {"model": "m", "messages": USER, "stream": False}).is_success


def test_oversized_body_bad_json_unknown_route_and_a_pull_are_ollama_shaped(url):
    big = {"model": "m", "messages": [{"role": "user", "content": "x" * MAX_BODY}]}
    for r, status in (
        (post(url, "/api/chat", big), 413),
        (httpx.post(url + "/api/chat", content=b"{nope"), 400),
        (httpx.get(url + "/api/nothing"), 404),
        (httpx.request("DELETE", url + "/api/delete", json={"model": "m"}), 400),
        (post(url, "/api/pull", {"model": "llama3.2"}), 404),
    ):
        assert r.status_code == status and set(r.json()) == {"error"}, r.text
    assert post(url, "/api/pull", {"model": "fake-model"}).json() == {"status": "success"}


def test_every_guard_answers_in_ollamas_shape():
    with serving(api_key="sesame") as (url, _):
        for headers, status in (
            ({}, 401),
            ({"Host": "evil.example"}, 403),
            ({"Authorization": "Bearer sesame", "Origin": "https://evil.example"}, 403),
        ):
            r = httpx.get(url + "/api/tags", headers=headers)
            assert r.status_code == status and set(r.json()) == {"error"}
        with ollama.Client(host=url, headers={"Authorization": "Bearer sesame"}) as c:
            assert c.chat(model="m", messages=USER).message.content == DEFAULT_REPLY
        assert httpx.get(url + "/").text == "Ollama is running"  # the probe needs no key


def test_requests_show_in_metrics_and_the_dashboards_recent_list(url, ollama_client):
    ollama_client.chat(model="m", messages=[{"role": "user", "content": "count me " * 5}])
    ollama_client.chat(model="m", messages=[{"role": "user", "content": "count me " * 5}])
    metrics = httpx.get(url + "/metrics").text
    assert 'mlx_prefix_requests_total{endpoint="/api/chat",status="200"}' in metrics
    recent = httpx.get(url + "/v1/dashboard").json()["requests"]
    last = [r for r in recent if r["endpoint"] == "/api/chat"][-1]
    assert last["cached_tokens"] > 0


@pytest.mark.parametrize(
    ("value", "seconds"),
    [("5m", 300.0), ("1h30m", 5400.0), ("250ms", 0.25), (10, 10.0), ("0", 0.0), (0, 0.0),
     ("-1", FOREVER), (-1, FOREVER), ("-1m", FOREVER), ("300", 300.0), ("+90s", 90.0),
     ("1.5h", 5400.0), ("500us", 0.0005),
     # Go's longest duration (~292 years) and past it: for good, as Ollama keeps it.
     (1e12, FOREVER), ("1e12", FOREVER), (2**63 // 10**9 + 1, FOREVER), ("3000000h", FOREVER),
     (1e300, FOREVER), (9e9, 9e9), ("2000000h", 7.2e9)],
)  # fmt: skip
def test_keep_alive_reads_seconds_and_go_durations(value, seconds):
    assert parse_keep_alive(value) == seconds
