"""The real engine behind a live server, driven by the official openai client."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import httpx
from support.live import live_server, openai_client
from support.models import TEST_CACHE, loaded_test_model
from support.server_fakes import serving

from mlx_prefix.cache.store import CheckpointKind
from mlx_prefix.cache.types import EntryInfo
from mlx_prefix.config import EngineConfig
from mlx_prefix.engine.engine import Engine
from mlx_prefix.records import PromptInput
from mlx_prefix.server.protocol.messages import conversation_from_dicts

SYSTEM = "You are the help desk of a public library. Answer in one short sentence. " * 4


# Batch-invariant: the soak compares every batched answer with the same request alone.
live = live_server(
    lambda kind: Engine(loaded_test_model(kind), TEST_CACHE, EngineConfig(deterministic=True)),
    params=["dense", "qwen3_5"],
)


def ask(client, question: str, **extra):
    return client.chat.completions.create(
        model="default",
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        max_tokens=8,
        temperature=0,
        **extra,
    )


def test_repeat_reports_cached_tokens_and_the_same_answer_as_a_cold_run(engine, client):
    ask(client, "Where are the atlases?")
    warm = ask(client, "When does the library close?")
    cold = ask(
        client, "When does the library close?", extra_body={"prefix_cache": {"enabled": False}}
    )
    assert warm.usage.prompt_tokens_details.cached_tokens > 40
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.choices[0].message.content == cold.choices[0].message.content
    engine.store.check_integrity()


def test_streaming_with_usage_through_the_real_engine(client):
    whole = ask(client, "Can I renew online?")
    stream = ask(client, "Can I renew online?", stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 40


def test_cache_endpoint_and_metrics_reflect_real_hits(live):
    url, _ = live
    body = httpx.get(f"{url}/v1/cache").json()
    assert body["stats"]["hits"] >= 1 and body["stats"]["tokens_reused"] > 40
    assert body["entries"] and all(e["tokens"] > 0 for e in body["entries"])
    assert all(e["kind"] in CheckpointKind.__members__ for e in body["entries"])
    metrics = httpx.get(f"{url}/metrics").text
    cached = [
        line for line in metrics.splitlines() if line.startswith("mlx_prefix_cached_tokens_total")
    ]
    assert cached and float(cached[0].split()[-1]) > 40


def test_a_prompt_longer_than_the_context_is_a_400_and_the_server_goes_on(live):
    url, engine = live
    huge = "word " * 5000
    original = engine.model
    engine.model = dataclasses.replace(original, context_length=1024)
    try:
        r = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": "default", "messages": [{"role": "user", "content": huge}]},
        )
    finally:
        engine.model = original
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert httpx.get(f"{url}/health").status_code == 200


def test_disk_tier_shows_in_cache_stats_and_metrics(tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    from mlx_prefix.config import DiskConfig

    disk = DiskConfig(scope="full", directory=str(tmp_path), min_tokens=16)
    engine = Engine(loaded_test_model("dense"), TEST_CACHE, disk_config=disk)
    with serving(engine) as (url, _):
        with openai_client(url) as client:
            ask(client, "Is there wifi?")
        deadline = time.monotonic() + 30
        while engine.disk.pending and time.monotonic() < deadline:  # written when idle
            time.sleep(0.01)
        body = httpx.get(f"{url}/v1/cache").json()
        metrics = httpx.get(f"{url}/metrics").text
    stats = body["stats"]["disk"]
    files = list(tmp_path.glob("*.safetensors"))
    assert stats["directory"] == str(tmp_path)
    assert stats["saves"] == len(files) >= 1 and stats["files"] == len(files)
    assert stats["bytes"] == sum(f.stat().st_size for f in files)
    assert stats["pending_saves"] == 0 and stats["budget_bytes"] == disk.budget_bytes
    assert stats["misses"] == 1 and stats["hits"] == 0  # the one request found nothing
    families = {f.name: f for f in text_string_to_metric_families(metrics)}
    value = {s.name: s.value for f in families.values() for s in f.samples}
    assert families["mlx_prefix_disk_saves"].type == "counter"
    assert value["mlx_prefix_disk_saves_total"] == stats["saves"]
    assert families["mlx_prefix_disk_files"].type == "gauge"
    assert value["mlx_prefix_disk_files"] == len(files)
    assert value["mlx_prefix_disk_bytes"] == stats["bytes"]
    assert value["mlx_prefix_disk_budget_bytes"] == disk.budget_bytes


def test_warm_and_pin_over_http_with_the_real_engine():
    # The fake engine's view of /v1/cache is checked against this one's (same schema).
    engine = Engine(loaded_test_model("dense"), TEST_CACHE)
    system = {"role": "system", "content": SYSTEM}
    with serving(engine) as (url, _), httpx.Client(base_url=url, timeout=60) as http:
        r = http.post("/v1/cache/warm", json={"messages": [system], "pin": True})
        assert r.status_code == 200, r.text
        warm = r.json()
        assert warm["pinned"] is True and warm["cached_tokens"] == 0
        tokens = engine.plan(PromptInput(messages=conversation_from_dicts([system]))).tokens
        assert warm["prompt_tokens"] == len(tokens)
        entries = http.get("/v1/cache").json()["entries"]
        pinned = [e for e in entries if e["pinned"]]
        assert pinned and all(e["nbytes"] > 0 and e["refs"] == 0 for e in pinned)
        assert {e["kind"] for e in entries} <= set(CheckpointKind.__members__)
        assert set(entries[0]) == {f.name for f in dataclasses.fields(EntryInfo)}
        again = http.post("/v1/cache/warm", json={"messages": [system]}).json()
        # Served from the warm-up: all of it but the tokens after the last grid point.
        assert again["cached_tokens"] == engine.planner.grid.align(tokens, len(tokens) - 1) > 0

        def answer(cache: bool) -> dict:
            body = {
                "model": "default",
                "messages": [system, {"role": "user", "content": "Are there study rooms?"}],
                "max_tokens": 8,
                "temperature": 0,
                "prefix_cache": {"enabled": cache},
            }
            return http.post("/v1/chat/completions", json=body).json()

        warm_reply, cold_reply = answer(True), answer(False)
        assert warm_reply["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert warm_reply["choices"][0]["message"] == cold_reply["choices"][0]["message"]
        engine.views.flush_cache()
        assert http.get("/v1/cache").json()["entries"] == []


def test_soak_of_streaming_non_streaming_and_abandoned_requests(live):
    # 24 concurrent clients over HTTP: streamed and whole answers, and clients that hang
    # up midway. Every answer matches the same request served alone, abandoned requests
    # stop (their bytes leave the budget), and the cache stays consistent.
    url, engine = live
    questions = [f"Question {i}: which floor has the {i * 3}th shelf?" for i in range(24)]

    def body(q: str, stream: bool) -> dict:
        return {
            "model": "default",
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
            "max_tokens": 6,
            "temperature": 0,
            "stream": stream,
        }

    with httpx.Client(base_url=url, timeout=120) as c:
        alone = {
            q: c.post("/v1/chat/completions", json=body(q, False)).json()["choices"][0]["message"][
                "content"
            ]
            for q in questions
        }

    async def client(i: int, q: str, http: httpx.AsyncClient) -> tuple[str, str | None]:
        if i % 3 == 2:  # hang up after the first chunk
            async with http.stream("POST", "/v1/chat/completions", json=body(q, True)) as r:
                async for _ in r.aiter_lines():
                    break
            return q, None
        if i % 3 == 1:
            r = await http.post("/v1/chat/completions", json=body(q, False))
            return q, r.json()["choices"][0]["message"]["content"]
        text = []
        async with http.stream("POST", "/v1/chat/completions", json=body(q, True)) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    delta = json.loads(line[6:])["choices"]
                    text.append(delta[0]["delta"].get("content") or "" if delta else "")
        return q, "".join(text)

    async def main() -> list[tuple[str, str | None]]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            return await asyncio.gather(*(client(i, q, http) for i, q in enumerate(questions)))

    for q, text in asyncio.run(main()):
        if text is not None:
            assert text == alone[q], q
    deadline = time.monotonic() + 30
    while engine.lifecycle.pending and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.lifecycle.pending == 0
    stats = engine.store.stats()
    assert stats.active_bytes == 0 and stats.hits >= len(questions)
    engine.store.check_integrity()
    assert httpx.get(f"{url}/health").status_code == 200


def _reference(engine: Engine, ids: list[int], steps: int, n: int) -> list[list[tuple[str, float]]]:
    """Greedy continuation of `ids` by direct forward passes: per position, the `n` most
    likely tokens (text, logprob) of log_softmax(logits), most likely first."""
    import mlx.core as mx
    import numpy as np

    model, tokenizer = engine.model.model, engine.model.tokenizer
    out = []
    for _ in range(steps):
        logits = model(mx.array([ids]))[0, -1].astype(mx.float32)
        logprobs = np.array(logits - mx.logsumexp(logits))
        top = np.argsort(-logprobs, kind="stable")[:n]
        out.append([(tokenizer.decode([int(t)]), float(logprobs[t])) for t in top])
        ids = [*ids, int(top[0])]
    return out


def _close(got: list[tuple[str, float]], want: list[tuple[str, float]]) -> bool:
    return [t for t, _ in got] == [t for t, _ in want] and all(
        abs(a - b) < 1e-4 for (_, a), (_, b) in zip(got, want, strict=True)
    )


def test_top_logprobs_match_a_direct_forward_pass_streamed_and_not(live):
    url, engine = live
    messages = [{"role": "user", "content": "Which shelf has the atlases?"}]
    chat_body = {"model": "default", "messages": messages, "max_tokens": 4, "temperature": 0,
                 "logprobs": True, "top_logprobs": 3}  # fmt: skip
    prompt = "The reading room opens at"
    text_body = {"model": "default", "prompt": prompt, "max_tokens": 4, "temperature": 0,
                 "logprobs": 2}  # fmt: skip
    with httpx.Client(base_url=url, timeout=120) as http:
        whole = http.post("/v1/chat/completions", json=chat_body).json()["choices"][0]
        streamed = []
        with http.stream("POST", "/v1/chat/completions", json={**chat_body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    streamed += (choice.get("logprobs") or {}).get("content") or []
        text = http.post("/v1/completions", json=text_body).json()["choices"][0]
        text_streamed = []
        with http.stream("POST", "/v1/completions", json={**text_body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    lp = json.loads(line[6:])["choices"][0]["logprobs"]
                    text_streamed += lp["top_logprobs"] if lp else []

    content = whole["logprobs"]["content"]
    assert streamed == content and len(content) >= 1
    ids = list(engine.plan(PromptInput(messages=conversation_from_dicts(messages))).tokens)
    reference = _reference(engine, ids, len(content), 3)
    for position, want in zip(content, reference, strict=True):
        got = [(a["token"], a["logprob"]) for a in position["top_logprobs"]]
        assert _close(got, want), (got, want)
        assert position["token"] == want[0][0] and abs(position["logprob"] - want[0][1]) < 1e-4
        assert all(a["bytes"] == list(a["token"].encode()) for a in position["top_logprobs"])

    lp = text["logprobs"]
    assert text_streamed == lp["top_logprobs"] and len(lp["tokens"]) >= 1
    offsets = [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    assert lp["text_offset"] == offsets
    reference = _reference(engine, list(engine.plan(PromptInput(text=prompt)).tokens),
                           len(lp["tokens"]), 2)  # fmt: skip
    for token, token_lp, top, want in zip(
        lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], reference, strict=True
    ):
        assert _close(list(top.items()), want), (top, want)  # greedy: the sampled is top 1
        assert token == want[0][0] and abs(token_lp - want[0][1]) < 1e-4
