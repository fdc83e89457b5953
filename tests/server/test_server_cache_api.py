"""/v1/cache (stats + entries), warm and pin, flush, and Prometheus /metrics."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.live import post_chat
from support.server_fakes import raw_post, serving, wait_until

from mlx_prefix.cache.types import CheckpointKind, EntryInfo
from mlx_prefix.server.monitor.metrics import ServerMetrics

SYSTEM = {"role": "system", "content": "You are the shared system prompt of an extension. " * 4}


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    with serving() as (url, _engine), httpx.Client(base_url=url, timeout=10) as c:
        yield c


def metrics(http: httpx.Client) -> dict[tuple[str, tuple], float]:
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def chat(http: httpx.Client, text: str) -> dict:
    body = {"model": "default", "messages": [SYSTEM, {"role": "user", "content": text}]}
    return post_chat(http, body)["usage"]


def test_cache_info_starts_empty(http):
    body = http.get("/v1/cache").json()
    assert body["entries"] == []
    assert body["stats"]["entries"] == 0 and body["stats"]["hits"] == 0
    assert {"bytes", "bytes_by_kind", "budget_bytes", "hit_ratio", "evictions"} <= set(
        body["stats"]
    )


def test_the_fake_engine_lists_entries_in_the_real_schema(http):
    # The warm/pin tests below run against the fake; its entries must look like the
    # store's (asdict(EntryInfo)), which test_server_live checks over HTTP.
    http.post("/v1/cache/warm", json={"messages": [SYSTEM], "pin": True})
    (entry,) = http.get("/v1/cache").json()["entries"]
    assert set(entry) == {f.name for f in dataclasses.fields(EntryInfo)}
    assert entry["kind"] in CheckpointKind.__members__ and entry["nbytes"] > 0


def test_warm_pin_then_hit(http):
    r = http.post("/v1/cache/warm", json={"messages": [SYSTEM], "pin": True})
    assert r.status_code == 200, r.text
    warm = r.json()
    assert warm["prompt_tokens"] > 0 and warm["cached_tokens"] == 0 and warm["pinned"] is True
    (entry,) = http.get("/v1/cache").json()["entries"]
    assert entry["pinned"] is True and entry["tokens"] == warm["prompt_tokens"]
    assert entry["kind"] == "LAST_MESSAGE"  # the kind's name, not the IntEnum's value 3

    usage = chat(http, "what now?")
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached >= warm["prompt_tokens"] - 1  # the warmed system prompt was reused
    assert http.get("/v1/cache").json()["stats"]["hits"] == 1


def test_warm_with_prompt_and_repeat(http):
    first = http.post("/v1/cache/warm", json={"prompt": "a raw completion prefix"}).json()
    again = http.post("/v1/cache/warm", json={"prompt": "a raw completion prefix"}).json()
    assert first == {"prompt_tokens": 4, "cached_tokens": 0, "pinned": False}
    assert again["cached_tokens"] == 3


@pytest.mark.parametrize(
    "body,param",
    [
        ({}, None),
        ({"prompt": "a", "messages": [SYSTEM]}, None),
        ({"messages": []}, "messages"),
        ({"prompt": "a", "pin": "yes"}, "pin"),
        ({"prompt": "a", "model": 5}, "model"),
        ({"prompt": "a", "prefix_cache": {"enabled": False}}, "prefix_cache.enabled"),
    ],
)
def test_warm_bad_body(http, body, param):
    r = http.post("/v1/cache/warm", json=body)
    assert r.status_code in (400, 404)
    assert r.json()["error"]["param"] == param


def test_warm_timeout_is_a_504():
    with serving(warm_timeout_s=0.2) as (url, engine), httpx.Client(base_url=url) as c:
        # The warm-up would take 10 minutes: a 504 at all is the timeout's.
        r = c.post("/v1/cache/warm", json={"prompt": "[[delay:600]] slow"}, timeout=120)
        assert r.status_code == 504, r.text
        error = r.json()["error"]
        assert error["code"] == "timeout" and error["type"] == "server_error"
        assert "0.2s" in error["message"]
        assert wait_until(lambda: engine.warms_running == 0)  # the warm-up was cancelled


def test_warm_client_disconnect_ends_the_handler():
    with serving() as (url, engine):
        # A warm-up of 10 minutes: what ends before it, the client's leaving ended.
        body = json.dumps({"prompt": "[[delay:600]] slow"}).encode()
        with raw_post(url, "/v1/cache/warm", body):
            assert wait_until(lambda: engine.warms_running == 1, timeout=60)
        with httpx.Client(base_url=url) as c:
            key = ("mlx_prefix_requests_total", (("endpoint", "/v1/cache/warm"), ("status", "499")))
            assert wait_until(lambda: metrics(c).get(key) == 1, timeout=60)
        # The client left: its warm-up was cancelled, not left running for the delay.
        assert wait_until(lambda: engine.warms_running == 0, timeout=60)


def test_flush(http):
    chat(http, "one")
    chat(http, "two")
    assert len(http.get("/v1/cache").json()["entries"]) == 2
    r = http.delete("/v1/cache")
    assert r.status_code == 200 and r.json() == {"removed": 2}
    assert http.get("/v1/cache").json()["entries"] == []
    assert http.delete("/v1/cache").json() == {"removed": 0}


def test_metrics_change_after_requests(http):
    chat_ok = (
        "mlx_prefix_requests_total",
        (("endpoint", "/v1/chat/completions"), ("status", "200")),
    )
    before = metrics(http)
    for name in (
        "mlx_prefix_cache_bytes",
        "mlx_prefix_cache_entries",
        "mlx_prefix_cache_hit_ratio",
        "mlx_prefix_cache_evictions_total",
        "mlx_prefix_prompt_tokens_total",
        "mlx_prefix_cached_tokens_total",
        "mlx_prefix_completion_tokens_total",
        "mlx_prefix_time_to_first_token_seconds_count",
    ):
        assert (name, ()) in before, name
    assert before[("mlx_prefix_cache_entries", ())] == 0

    first = chat(http, "first")
    second = chat(http, "second")
    http.post("/v1/chat/completions", json={"messages": "bad"})
    after = metrics(http)

    assert after.get(chat_ok, 0) - before.get(chat_ok, 0) == 2
    bad = ("mlx_prefix_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "400")))
    assert after[bad] == 1
    prompt = first["prompt_tokens"] + second["prompt_tokens"]
    assert after[("mlx_prefix_prompt_tokens_total", ())] == prompt
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0
    assert after[("mlx_prefix_cached_tokens_total", ())] == cached
    completion = first["completion_tokens"] + second["completion_tokens"]
    assert after[("mlx_prefix_completion_tokens_total", ())] == completion
    assert after[("mlx_prefix_time_to_first_token_seconds_count", ())] == 2
    assert after[("mlx_prefix_cache_entries", ())] == 2
    assert after[("mlx_prefix_cache_bytes", ())] > 0
    assert after[("mlx_prefix_cache_hit_ratio", ())] == 0.5
    assert after[("mlx_prefix_cache_hits_total", ())] == 1


def test_disk_totals_are_counters_and_sizes_gauges():
    disk = {
        "directory": "/tmp/x", "files": 3, "bytes": 300, "budget_bytes": None, "hits": 5,
        "misses": 2, "saves": 7, "save_failures": 1, "load_failures": 0, "evictions": 4,
        "removed": 1, "pending_saves": 2,
    }  # fmt: skip
    text = ServerMetrics(lambda: {"hits": 1, "disk": dict(disk)}).exposition().decode()
    types = {f.name: f.type for f in text_string_to_metric_families(text)}
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    for key in (
        "hits",
        "misses",
        "saves",
        "save_failures",
        "load_failures",
        "evictions",
        "removed",
    ):
        assert types[f"mlx_prefix_disk_{key}"] == "counter", key
        assert samples[f"mlx_prefix_disk_{key}_total"] == disk[key]
    for key in ("files", "bytes", "pending_saves"):
        assert types[f"mlx_prefix_disk_{key}"] == "gauge", key
        assert samples[f"mlx_prefix_disk_{key}"] == disk[key]
    assert "mlx_prefix_disk_budget_bytes" not in types  # None: unlimited, nothing to export
    assert types["mlx_prefix_cache_hits"] == "counter"


def test_unknown_paths_share_one_metric_label(http):
    for path in ("/a", "/b", "/c"):
        http.get(path)
    other = ("mlx_prefix_requests_total", (("endpoint", "other"), ("status", "404")))
    assert metrics(http)[other] == 3


def test_two_apps_have_separate_registries():
    with serving() as (url_a, _), serving() as (url_b, _):
        with httpx.Client(base_url=url_a) as a, httpx.Client(base_url=url_b) as b:
            chat(a, "only on a")
            key = ("mlx_prefix_completion_tokens_total", ())
            assert metrics(a)[key] > 0
            assert metrics(b)[key] == 0
