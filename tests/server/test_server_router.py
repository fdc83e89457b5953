"""SGLang's router (the real binary, sglang-router 0.3.2 from PyPI, as `make test-deps`
installs it) in front of two mlx-prefix replicas of a tiny model: it registers them
through the worker routes (server/routes/worker.py) with the key it was given, and a
session's second turn lands on the replica that served its first and hits its cache, over
chat completions and over Responses (whose body the router rewrites).
Skips saying why where the router is not installed."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest
from support.live import post_chat
from support.paths import REPO
from support.served_process import StderrReader

from benchmarks.studies.router_process import Router, find_router
from mlx_prefix.models.testing import cached_test_model

ROOT = REPO
KEY = "replica-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
RECIPE = ("--policy", "manual", "--assignment-mode", "min_group")
ROUTING_KEY = "X-SMG-Routing-Key"


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[str]]:
    python, why = find_router()
    if python is None:
        pytest.skip(why)
    model = cached_test_model("dense")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs, readers, urls = [], [], []
    try:
        for _ in range(2):
            cmd = [sys.executable, "-m", "mlx_prefix.blas_exec", sys.executable, "-m"]
            cmd += ["mlx_prefix", "serve", "--model", str(model), "--port", "0"]
            cmd += ["--api-key", KEY, "--no-prefetch", "--disk-cache", "off"]
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            procs.append(proc)
            readers.append(StderrReader(proc))
            urls.append(f"http://127.0.0.1:{readers[-1].port(timeout=300)}")
        yield urls
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for reader, proc in zip(readers, procs, strict=False):
            reader.text(timeout=30)  # stderr read to its end
            assert proc.stderr is not None
            proc.stderr.close()


def served_by(urls: list[str], reply_id: str) -> int:
    """The replica whose request records hold `reply_id`."""
    for i, url in enumerate(urls):
        records = httpx.get(f"{url}/v1/cache/requests", headers=AUTH, timeout=60).json()["data"]
        if any(r["id"] == reply_id for r in records):
            return i
    raise AssertionError(f"no replica served {reply_id}")


def chat(url: str, messages: list[dict], headers: dict[str, str]) -> dict:
    body = {"messages": messages, "max_tokens": 6, "temperature": 0.0}
    return post_chat(url, body, headers=headers)


@pytest.mark.parametrize("policy", ["recipe", "cache_aware"])
def test_a_sessions_second_turn_lands_where_its_first_did_and_hits_its_cache(
    replicas, tmp_path, policy
):
    args = (*RECIPE, "--api-key", KEY) if policy == "recipe" else ("--api-key", KEY)
    router = Router(replicas, args, log_path=tmp_path / "router.log").start(timeout_s=300)
    try:
        workers = httpx.get(f"{router.url}/workers", headers=AUTH, timeout=30).json()["workers"]
        # Registered through /server_info: the served model's name is the worker's model.
        assert {w["model_id"] for w in workers} == {"tiny-dense"}
        assert all(w["is_healthy"] for w in workers)
        headers = {**AUTH, ROUTING_KEY: f"session-{policy}"}
        system = f"You are the {policy} test's assistant. " + "Keep answers short. " * 40
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": "Name three rivers of Europe, please."},
        ]
        first = chat(router.url, messages, headers)
        messages += [
            {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
            {"role": "user", "content": "And three mountains?"},
        ]
        second = chat(router.url, messages, headers)
    finally:
        router.stop()
    home = served_by(replicas, first["id"])
    assert served_by(replicas, second["id"]) == home
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= first["usage"]["prompt_tokens"]  # the whole first turn restored
    # The same turn cold, on the replica that never saw the session: the same answer.
    other = replicas[1 - home]
    httpx.delete(f"{other}/v1/cache", headers=AUTH, timeout=60).raise_for_status()
    cold = chat(other, messages, AUTH)
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] < first["usage"]["prompt_tokens"]
    assert cold["choices"][0]["message"] == second["choices"][0]["message"]


def test_responses_pass_the_router_and_a_chained_turn_hits_its_replicas_cache(replicas, tmp_path):
    # The router rewrites a Responses body, adding SGLang's `priority: 0`, `top_k: -1`,
    # `min_p: 0.0`, `repetition_penalty: 1.0` (and temperature/top_p 1.0 when unset): the
    # server honours them; a priority it cannot honour is refused, through the router too.
    router = Router(replicas, (*RECIPE, "--api-key", KEY), log_path=tmp_path / "router.log")
    router.start(timeout_s=300)
    headers = {**AUTH, ROUTING_KEY: "session-responses"}
    body = {"model": "tiny-dense", "max_output_tokens": 6, "temperature": 0.0}
    instructions = "You are the Responses test's assistant. " + "Keep answers short. " * 40
    try:
        url = f"{router.url}/v1/responses"
        first = httpx.post(
            url,
            json={**body, "instructions": instructions, "input": "Name three rivers."},
            headers=headers,
            timeout=300,
        )
        assert first.status_code == 200, first.text
        second = httpx.post(
            url,
            json={**body, "instructions": instructions, "input": "And three mountains?",
                  "previous_response_id": first.json()["id"]},
            headers=headers,
            timeout=300,
        )  # fmt: skip
        assert second.status_code == 200, second.text
        refused = httpx.post(
            url, json={**body, "input": "Hi", "priority": 5}, headers=headers, timeout=300
        )
    finally:
        router.stop()
    # The chained turn found the first on its replica (the store is per replica) and
    # restored the whole first turn from its cache.
    usage = second.json()["usage"]
    assert usage["input_tokens_details"]["cached_tokens"] >= first.json()["usage"]["input_tokens"]
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "priority"
