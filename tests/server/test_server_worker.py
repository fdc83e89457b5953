"""What SGLang's router asks a worker (server/routes/worker.py), answered through the app
with its middleware: the key it is given is required, and the answers are the truth."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import pytest
from support.server_fakes import FakeEngine, FakeModel, serving, wait_until

KEY = "router-key"
AUTH = {"Authorization": f"Bearer {KEY}"}  # what the router sends (its --api-key)
ROUTER_PATHS = ["/server_info", "/get_server_info", "/model_info", "/get_model_info", "/get_load"]


@pytest.mark.parametrize("path", ROUTER_PATHS)
def test_the_router_routes_require_the_key_the_router_sends(path):
    with serving(api_key=KEY) as (url, _), httpx.Client(base_url=url, timeout=30) as c:
        assert c.get(path).status_code == 401
        assert c.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.get(path, headers=AUTH).status_code == 200
        assert c.post("/flush_cache").status_code == 401
        # The router's health check sends no key: /health needs none.
        assert c.get("/health").json()["status"] == "ok"


def test_model_and_server_info_name_the_served_model_its_path_and_tokenizer(tmp_path: Path):
    folder = tmp_path / "Tiny-Model"
    folder.mkdir()
    (folder / "tokenizer.json").write_text("{}")
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    (folder / "config.json").write_text(json.dumps(config))
    engine = FakeEngine(FakeModel(name="tiny-model", path=folder))
    with serving(engine, api_key=KEY) as (url, _), httpx.Client(base_url=url, timeout=30) as c:
        server = c.get("/server_info", headers=AUTH).json()
        model = c.get("/model_info", headers=AUTH).json()
        assert c.get("/get_model_info", headers=AUTH).json() == model
        assert c.get("/get_server_info", headers=AUTH).json() == server
    # The router takes served_model_name as the worker's model id, model_path (or
    # tokenizer_path) as the tokenizer it loads.
    assert server["served_model_name"] == "tiny-model"
    assert server["model_path"] == str(folder)
    assert server["context_length"] == 4096
    assert model["model_path"] == str(folder)
    assert model["tokenizer_path"] == str(folder)
    assert model["is_generation"] is True
    assert model["model_type"] == "llama"
    assert model["architectures"] == ["LlamaForCausalLM"]


def test_a_folder_without_a_tokenizer_names_none():
    with serving(api_key=KEY) as (url, _), httpx.Client(base_url=url, timeout=30) as c:
        model = c.get("/model_info", headers=AUTH).json()
    assert model["model_path"] == "/models/org/fake-model"  # FakeModel's: not on disk
    assert model["tokenizer_path"] is None
    assert model["model_type"] is None


def test_get_load_counts_the_requests_running_and_their_tokens():
    with serving(api_key=KEY) as (url, engine), httpx.Client(base_url=url, timeout=60) as c:

        def load() -> dict:
            body = c.get("/get_load", headers=AUTH).json()
            assert isinstance(body, list) and len(body) == 1  # one entry per DP rank
            return body[0]

        assert load() == {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}
        body = {"messages": [{"role": "user", "content": "[[hang:120]] hello"}], "max_tokens": 4}
        ask = threading.Thread(
            target=lambda: c.post("/v1/chat/completions", json=body, headers=AUTH), daemon=True
        )
        ask.start()
        try:
            assert wait_until(lambda: load()["num_reqs"] == 1)
            running = load()
            assert running["num_waiting_reqs"] == 0
            assert running["num_tokens"] >= engine.handles[0].prompt_tokens > 0
        finally:
            engine.unhang.set()
            ask.join(60)
        assert wait_until(lambda: load()["num_reqs"] == 0)


def test_flush_cache_as_the_router_sends_it_empties_the_cache():
    with serving(api_key=KEY) as (url, engine), httpx.Client(base_url=url, timeout=30) as c:
        body = {"messages": [{"role": "user", "content": "remember this"}], "max_tokens": 4}
        c.post("/v1/chat/completions", json=body, headers=AUTH).raise_for_status()
        assert engine.views.cache_entries()
        assert c.post("/flush_cache", headers=AUTH).json()["removed"] >= 1
        assert engine.views.cache_entries() == []
