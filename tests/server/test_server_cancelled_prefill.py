"""A client that hangs up mid-prefill (issue 55): its prompt's computed part stays in the
cache, the same request sent again over HTTP resumes there and answers as a cold one,
and GET /v1/cache/requests names the reason (`cancelled`). The engine is real; its
prefill step is held at a grid point until the server has seen the client go, so where
the cancel lands never depends on the machine's speed."""

from __future__ import annotations

import json
import threading

import httpx
from support.engine_helpers import wait_for
from support.models import TEST_CACHE, loaded_test_model
from support.server_fakes import raw_post, serving

from mlx_prefix.config import EngineConfig
from mlx_prefix.engine.engine import Engine

CHAT = "/v1/chat/completions"
DOC = " ".join(f"Shelf {i} holds {i % 7} jars of {('plum', 'fig')[i % 2]} jam." for i in range(40))
MESSAGES = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": DOC}]


def test_a_client_gone_mid_prefill_leaves_its_prefix_for_the_resend():
    config = EngineConfig(prefetch_next_turn=False, prefill_tokens_per_step=1,
                          finish_cancelled=False)  # fmt: skip
    engine = Engine(loaded_test_model("dense"), TEST_CACHE, config)
    reached, go, landed = threading.Event(), threading.Event(), []
    step = engine.loop.prefill.step

    def hold_midway(*args, **kwargs):
        out = step(*args, **kwargs)
        tasks = engine.loop.prefill.tasks
        if tasks and tasks[0].position >= 192 and not reached.is_set():
            landed.append(tasks[0].position)
            reached.set()
            go.wait(60)  # until the server has seen the client go
        return out

    engine.loop.prefill.step = hold_midway
    body = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0, "stream": True}
    with serving(engine) as (url, _):
        with raw_post(url, CHAT, json.dumps(body).encode()):
            assert reached.wait(120)
            handle = engine.loop.prefill.tasks[0].job.handle
        assert wait_for(handle.cancelled.is_set), "the hang-up did not cancel the request"
        go.set()
        assert wait_for(lambda: engine.lifecycle.pending == 0)
        engine.loop.prefill.step = step
        (at,) = landed
        exact = {"messages": MESSAGES, "max_tokens": 6, "temperature": 0, "logprobs": True}
        with httpx.Client(base_url=url, timeout=120) as c:
            warm = c.post(CHAT, json=exact).json()
            cold = c.post(CHAT, json={**exact, "prefix_cache": {"enabled": False}}).json()
            records = c.get("/v1/cache/requests").json()
        cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == at  # the hit happened: where the hang-up stopped the prefill
        assert warm["choices"][0]["message"] == cold["choices"][0]["message"]
        assert warm["choices"][0]["logprobs"] == cold["choices"][0]["logprobs"]
        resend = next(r for r in records["data"] if r["id"] == warm["id"])
        assert resend["reason"] == "cancelled" and f"resumed at token {at}" in resend["detail"]
