"""Several models behind one live server (server/served/pool.py): the request's `model`
and `adapters` select the engine, each with its own cache in one shared byte budget;
models load on demand and the least recently used is unloaded past --max-models."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import httpx
import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from support.models import TEST_CACHE
from support.pool_server import pool_server
from support.server_fakes import wait_until

from mlx_prefix.config import CacheConfig, DiskConfig
from mlx_prefix.models.load import load_model
from mlx_prefix.models.testing import make_test_model
from mlx_prefix.server import ServerSettings

SYSTEM = "You are the help desk of a public library. Answer in one short sentence. " * 4
# Every request's deadline: a request may load a model on demand, which a loaded machine
# takes seconds for (httpx's own default, 5 s, failed count_tokens once under load).
T = 120


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    a = make_test_model("dense", root / "tiny-a", seed=0)
    b = make_test_model("dense", root / "tiny-b", seed=1)
    long = make_test_model("dense", root / "tiny-long", seed=4, context=8192)
    broken = make_test_model("dense", root / "tiny-broken", seed=2)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated: loading fails
    return {
        "a": a,
        "b": b,
        "long": long,
        "broken": broken,
        "lora": _lora_adapter(a, root / "lora-a"),
    }


def _lora_adapter(model_folder: Path, dest: Path) -> Path:
    """A LoRA adapter for `model_folder` with random non-zero lora_b (a fresh adapter's
    lora_b is zero and would change nothing), saved as mlx-lm saves one."""
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model = load_model(str(model_folder)).model
    params = {"rank": 4, "scale": 20.0, "dropout": 0.0}
    linear_to_lora_layers(model, 2, params)
    mx.random.seed(3)
    lora = {
        k: (mx.random.normal(v.shape) * 0.5 if k.endswith("lora_b") else v)
        for k, v in tree_flatten(model.trainable_parameters())
        if k.rsplit(".", 1)[-1] in ("lora_a", "lora_b")
    }
    dest.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dest / "adapters.safetensors"), lora)
    config = {"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": params}
    (dest / "adapter_config.json").write_text(json.dumps(config))
    return dest


def served(folders, cache=TEST_CACHE, disk=None, **settings):
    """A live server of model a (the default) that loads others on demand: by default
    the other folders are --allowed-models (a request may name only what is allowed)."""
    allowed = tuple(str(folders[k]) for k in ("b", "broken", "lora", "long") if k in folders)
    settings.setdefault("allowed_models", allowed)
    return pool_server(folders["a"], cache, disk=disk, **settings)


def ask(url: str, model: str | None, question: str, path="/v1/chat/completions", **extra):
    body = {
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": 8,
        "temperature": 0,
        **extra,
    }
    if model is not None:
        body["model"] = model
    return httpx.post(url + path, json=body, timeout=T)


def answer(r: httpx.Response) -> tuple[str, int]:
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens_details"][
        "cached_tokens"
    ]


COLD = {"prefix_cache": {"enabled": False}}


def test_two_models_served_alternately_each_cache_hits_and_equals_its_cold_run(folders):
    budget = CacheConfig(budget_bytes=1 << 30, prefill_chunk=32, checkpoint_interval=64)
    b = str(folders["b"])
    with served(folders, cache=budget, max_models=2) as (url, pool):
        first = {m: answer(ask(url, m, "Where are the atlases?")) for m in ("default", b)}
        warm = {m: answer(ask(url, m, "When does it close?")) for m in ("default", b)}
        cold = {m: answer(ask(url, m, "When does it close?", **COLD)) for m in ("default", b)}
        reply = ask(url, b, "When does it close?").json()
        engines = [s.engine for s in pool.resident()]
        for path in ("/v1/cache", "/metrics", "/v1/dashboard", "/health"):
            assert httpx.get(url + path, timeout=T).status_code == 200, path
    for m in ("default", b):
        assert first[m][1] == 0 and warm[m][1] > 40  # each hits its own cache
        assert warm[m][0] == cold[m][0] and cold[m][1] == 0
    assert warm["default"][0] != warm[b][0]  # two models really answered
    assert reply["model"] == b
    assert len(engines) == 2 and engines[0].store is engines[1].store  # one byte budget
    assert engines[0].model_key != engines[1].model_key
    engines[0].store.check_integrity()
    assert pool.loads == 1 and pool.unloads == 0


def test_shared_budget_holds_both_models_entries_under_one_limit(folders):
    small = CacheConfig(budget_bytes=200_000, prefill_chunk=32, checkpoint_interval=64)
    b = str(folders["b"])
    with served(folders, cache=small, max_models=2) as (url, pool):
        for i in range(4):
            for m in ("default", b):
                answer(ask(url, m, f"Question number {i} about the opening hours?"))
        store = pool.resident()[0].engine.store
        stats = store.stats()
    assert stats.budget_bytes == 200_000
    assert stats.bytes + stats.active_bytes <= stats.budget_bytes
    assert stats.evictions > 0  # the two models' entries competed for the one budget
    store.check_integrity()


def test_max_models_1_unloads_the_least_recently_used_and_reloads_it(folders):
    b = str(folders["b"])
    with served(folders, max_models=1) as (url, pool):
        a1 = answer(ask(url, "tiny-a", "Can I renew online?"))
        first_a = pool.primary()
        b1 = answer(ask(url, b, "Can I renew online?"))
        assert [s.id for s in pool.resident()] == [b]
        assert pool.unloads == 1 and first_a.lifecycle.pending == 0
        # the unloaded engine let go of its weights
        assert all(p.size == 0 for _, p in tree_flatten(first_a.model.model.parameters()))
        a2 = answer(ask(url, "tiny-a", "Can I renew online?"))
        b2 = answer(ask(url, b, "Can I renew online?"))
        models = httpx.get(url + "/v1/models", timeout=T).json()["data"]
    assert a2[0] == a1[0] and b2[0] == b1[0]  # reloaded: the same answers
    assert pool.loads == 3 and pool.unloads == 3
    resident = {c["id"]: c["resident"] for c in models}
    assert resident == {"tiny-a": False, b: True}


def test_an_unloaded_model_finds_its_disk_entries_again(folders, tmp_path):
    disk = DiskConfig(scope="full", directory=str(tmp_path / "disk"), min_tokens=16)
    b = str(folders["b"])
    with served(folders, disk=disk, max_models=1) as (url, pool):
        first = answer(ask(url, "default", "Is there a reading room?"))
        assert wait_until(lambda: pool.primary().disk.pending == 0)
        answer(ask(url, b, "Is there a reading room?"))  # unloads a: its memory entries go
        assert wait_until(lambda: pool.primary().disk.pending == 0)
        again = answer(ask(url, "default", "Is there a reading room?"))
        disk_cache = pool.primary().disk.cache
        files = {e.model_key.split("/")[0] for e in disk_cache.entries()}
    assert again[0] == first[0] and again[1] > 40  # restored from a's own files
    assert len(files) == 2  # one shared disk cache, each model's files under its key
    assert pool.unloads == 2


def test_unknown_names_keep_the_default_but_a_path_is_a_404(folders):
    with served(folders, max_models=2) as (url, pool):
        r = ask(url, "claude-sonnet-4-5", "Hello?")
        assert r.status_code == 200 and r.json()["model"] == "tiny-a"
        missing = ask(url, "/no/such/model", "Hello?")
        assert missing.status_code == 404
        err = missing.json()["error"]
        assert err["code"] == "model_not_found" and err["param"] == "model"
        assert "'/no/such/model' is not served here" in err["message"]
        m = httpx.post(
            url + "/v1/messages",
            json={
                "model": "./no/such/model",
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "Hello?"}],
            },
            timeout=T,
        )
        assert m.status_code == 404
        assert m.json()["type"] == "error" and m.json()["error"]["type"] == "not_found_error"
        assert "is not served here" in m.json()["error"]["message"]
        assert pool.loads == 0


def test_a_request_never_loads_a_folder_the_operator_did_not_name(folders, tmp_path):
    # Issue 35: an extension naming a local folder made the server unload its model and
    # load the folder; the 404s told /etc ("no config.json") from a missing path.
    other = make_test_model("dense", tmp_path / "not-allowed", seed=4)
    with served(folders, max_models=1, allowed_models=()) as (url, pool):
        messages = {}
        for name in ("/etc", "/no/such/folder", str(other), str(folders["b"])):
            r = ask(url, name, "Hello?")
            assert r.status_code == 404, r.text
            messages[name] = r.json()["error"]["message"].replace(name, "NAME")
            got = httpx.get(url + "/v1/models/" + name.replace("/", "%2F"), timeout=T)
            assert got.status_code == 404
            assert got.json()["error"]["message"].replace(name, "NAME") == messages[name]
        assert len(set(messages.values())) == 1  # nothing says what exists on disk
        lora = ask(url, None, "Hello?", adapters=str(folders["lora"]))
        missing = ask(url, None, "Hello?", adapters="/no/such/adapter")
        assert lora.status_code == missing.status_code == 404
        assert lora.json()["error"]["param"] == "adapters"
        lora_message = lora.json()["error"]["message"].replace(str(folders["lora"]), "NAME")
        assert lora_message == missing.json()["error"]["message"].replace(
            "/no/such/adapter", "NAME"
        )
        assert pool.loads == pool.unloads == 0
        assert [s.id for s in pool.resident()] == ["tiny-a"]
        assert ask(url, None, "Hello?").status_code == 200


def test_allowed_models_are_selected_by_path_or_folder_name(folders):
    b = str(folders["b"])
    with served(folders, max_models=2, allowed_models=(b,)) as (url, pool):
        by_path = ask(url, b, "Where is the map room?")
        by_name = ask(url, "tiny-b", "Where is the map room?")
        assert by_path.json()["model"] == by_name.json()["model"] == b
        assert answer(by_path)[0] == answer(by_name)[0] and pool.loads == 1


def test_strict_model_names_refuses_unknown_names(folders):
    with served(folders, max_models=2, strict_model_names=True) as (url, _):
        assert ask(url, "claude-sonnet-4-5", "Hello?").status_code == 404
        assert ask(url, "tiny-a", "Hello?").status_code == 200


def test_a_model_that_fails_to_load_is_one_clear_error_and_the_default_keeps_serving(folders):
    broken = str(folders["broken"])
    with served(folders, max_models=2) as (url, pool):
        r = ask(url, broken, "Hello?")
        assert r.status_code in (404, 500)
        message = r.json()["error"]["message"]
        assert "could not be loaded" in message and "\n" not in message
        assert ask(url, "default", "Hello?").status_code == 200
        assert pool.loads == 0 and [s.id for s in pool.resident()] == ["tiny-a"]


@pytest.mark.parametrize("memory", ["room for both", "room for one"])
def test_a_failed_load_never_unloads_what_is_serving(folders, monkeypatch, memory):
    import mlx_prefix.server.served.pool as model_pool

    if memory == "room for one":  # the new model can only load once the default is gone
        monkeypatch.setattr(model_pool, "available_memory", lambda: 0)
    with served(folders, max_models=1) as (url, pool):
        default = pool.primary()
        r = ask(url, str(folders["broken"]), "Hello?")
        assert r.status_code == 404 and "could not be loaded" in r.json()["error"]["message"]
        assert pool.unloads == 0 and pool.primary() is default  # never unloaded
        assert ask(url, "default", "Hello?").status_code == 200


def test_a_load_failing_after_the_unload_loads_the_served_model_again(folders, tmp_path):
    # A folder that passes the pre-load check but that mlx-lm cannot load, where memory
    # holds one model only: the default is unloaded for it, then loaded back.
    import shutil

    odd = tmp_path / "odd-model"
    shutil.copytree(folders["b"], odd)
    config = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**config, "model_type": "no_such_family"}))
    with served(folders, max_models=1, allowed_models=(str(odd),)) as (url, pool):
        pool._memory = lambda: 0
        r = ask(url, str(odd), "Hello?")
        assert r.status_code == 404 and "could not be loaded" in r.json()["error"]["message"]
        assert [s.id for s in pool.resident()] == ["tiny-a"] and pool.unloads == 1
        assert answer(ask(url, "default", "Hello?"))[0]


def test_a_model_too_large_for_memory_is_refused(folders, monkeypatch):
    import mlx_prefix.server.served.pool as model_pool

    monkeypatch.setattr(model_pool, "available_memory", lambda: 1000)  # bytes
    with served(folders, max_models=2) as (url, pool):
        r = ask(url, str(folders["b"]), "Hello?")
        assert r.status_code == 507 and "GiB" in r.json()["error"]["message"]
        assert pool.loads == 0 and ask(url, None, "Hello?").status_code == 200
    # With one model resident at most, unloading it frees what the other needs.
    monkeypatch.setattr(model_pool, "available_memory", lambda: 0)
    with served(folders, max_models=1) as (url, pool):
        assert ask(url, str(folders["b"]), "Hello?").status_code == 200
        assert pool.unloads == 1


def test_model_alias_selects_its_folder_and_is_listed(folders):
    with served(folders, max_models=2, model_aliases=(f"second={folders['b']}",)) as (url, _):
        listed = {c["id"]: c for c in httpx.get(url + "/v1/models", timeout=T).json()["data"]}
        second = listed["second"]
        assert second["alias_of"] == str(folders["b"]) and not second["resident"]
        via_alias = ask(url, "second", "Where is the map room?")
        via_folder = ask(url, str(folders["b"]), "Where is the map room?", **COLD)
        assert via_alias.json()["model"] == "second"
        assert answer(via_alias)[0] == answer(via_folder)[0]
        listed = {c["id"]: c for c in httpx.get(url + "/v1/models", timeout=T).json()["data"]}
        assert listed["second"]["resident"] and listed["second"]["context_length"] == 4096


def test_an_adapter_is_its_own_engine_and_cache(folders):
    lora = str(folders["lora"])
    with served(folders, max_models=3) as (url, pool):
        base = answer(ask(url, None, "Which floor has the periodicals?"))
        first = answer(ask(url, None, "Which floor has the periodicals?", adapters=lora))
        assert first[1] == 0  # the base model's entries are not the adapter's
        assert first[0] != base[0]  # the adapter changes the answer
        warm = answer(ask(url, None, "Which floor has the periodicals?", adapters=lora))
        cold = answer(ask(url, None, "Which floor has the periodicals?", adapters=lora, **COLD))
        assert warm[1] > 40 and warm[0] == cold[0] == first[0]
        again = answer(ask(url, None, "Which floor has the periodicals?"))
        assert again[0] == base[0] and again[1] > 40
        listed = {c["id"]: c for c in httpx.get(url + "/v1/models", timeout=T).json()["data"]}
        assert listed["tiny-a"]["adapters"] == [str(Path(lora).resolve())]
        keys = {s.engine.model_key for s in pool.resident()}
        assert len(keys) == 2
        messages = {
            "model": "tiny-a",
            "max_tokens": 8,
            "temperature": 0,
            "system": SYSTEM,
            "messages": [{"role": "user", "content": "Which floor has the periodicals?"}],
        }
        with_lora = httpx.post(url + "/v1/messages", json={**messages, "adapters": lora}, timeout=T)
        assert with_lora.status_code == 200, with_lora.text
        assert with_lora.json()["content"][0]["text"] == first[0]
        assert with_lora.json()["usage"]["cache_read_input_tokens"] > 40
        missing = ask(url, None, "Hello?", adapters="/no/such/adapter")
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "adapters"


def test_count_tokens_and_warm_use_the_named_model(folders):
    b = str(folders["b"])
    with served(folders, max_models=2) as (url, pool):
        body = {"model": b, "messages": [{"role": "user", "content": "Count these words."}]}
        r = httpx.post(url + "/v1/messages/count_tokens", json=body, timeout=T)
        assert r.status_code == 200 and r.json()["input_tokens"] > 0
        assert [s.id for s in pool.resident()] == ["tiny-a", b]
        warm = httpx.post(url + "/v1/cache/warm", json={**body, "model": "default"}, timeout=T)
        assert warm.status_code == 200


def test_flush_removes_every_resident_models_entries(folders):
    b = str(folders["b"])
    with served(folders, max_models=2) as (url, pool):
        for m in ("default", b):
            answer(ask(url, m, "Where are the atlases?"))
        store = pool.resident()[0].engine.store
        assert len({e.model_key.split("/")[0] for e in store.entries()}) == 2
        removed = httpx.delete(url + "/v1/cache", timeout=T).json()["removed"]
        assert removed > 0 and store.entries() == []
        for m in ("default", b):  # neither model hits what was flushed
            assert answer(ask(url, m, "Where are the atlases?"))[1] == 0


def test_each_model_has_its_own_context_limit(folders):
    long = str(folders["long"])
    with served(folders, max_models=2) as (url, pool):
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6000}
        short = httpx.post(url + "/v1/chat/completions", json=body, timeout=T)
        assert short.status_code == 400 and "(4096)" in short.json()["error"]["message"]
        # The 8192-token model accepts what the default model's context could not hold
        # (streamed, and left after its first event: the reply itself is not the point).
        with httpx.stream(
            "POST",
            url + "/v1/chat/completions",
            json={**body, "model": long, "stream": True},
            timeout=T,
        ) as r:
            assert r.status_code == 200, r.read()
            next(r.iter_lines())
        over = httpx.post(
            url + "/v1/chat/completions",
            json={**body, "model": long, "max_tokens": 9000},
            timeout=T,
        )
        assert over.status_code == 400 and "(8192)" in over.json()["error"]["message"]
        assert over.json()["error"]["param"] == "max_tokens"


def test_settings_refuse_a_malformed_model_alias():
    with pytest.raises(ValueError, match="NAME=PATH"):
        ServerSettings(model_aliases=("no-equals-sign",))
    assert ServerSettings(model_aliases="x=/a, y=/b").model_alias_map() == {"x": "/a", "y": "/b"}
    with pytest.raises(ValueError, match="max_models"):
        replace(ServerSettings(), max_models=0)


def test_serve_flags_and_the_sharded_refusal(monkeypatch):
    import mlx_prefix.cli.sharded as sharded
    from mlx_prefix.cli import build_parser
    from mlx_prefix.cli.serve import cmd_serve
    from mlx_prefix.cli.serve_args import server_settings
    from mlx_prefix.errors import InvalidRequest

    argv = ["serve", "--max-models", "3", "--model-alias", "x=/a", "--model-alias", "y=org/r"]
    args = build_parser().parse_args(argv)
    settings = server_settings(args)
    assert settings.max_models == 3 and settings.model_alias_map() == {"x": "/a", "y": "org/r"}
    allowed = build_parser().parse_args(["serve", "--allowed-models", "/m/b", "org/r"])
    assert server_settings(allowed).allowed_models == ("/m/b", "org/r")
    monkeypatch.setenv("MLX_PREFIX_SERVER_ALLOWED_MODELS", "/m/c, org/s")
    from_env = server_settings(build_parser().parse_args(["serve"]))
    assert from_env.allowed_models == ("/m/c", "org/s")
    monkeypatch.setattr(sharded, "launched_group", lambda: object())
    with pytest.raises(InvalidRequest, match="unsharded"):
        cmd_serve(args)


def test_unloading_waits_for_the_running_requests_of_the_model(folders):
    import threading

    b = str(folders["b"])
    with served(folders, max_models=1) as (url, pool):
        first_chunk = threading.Event()
        lines: list[str] = []

        def stream_a() -> None:
            body = {"model": "tiny-a", "prompt": "Once upon a time", "max_tokens": 48}
            body |= {"temperature": 0, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=T) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    first_chunk.set()

        streamer = threading.Thread(target=stream_a)
        streamer.start()
        assert first_chunk.wait(60)
        engine_a = pool.primary()
        r = ask(url, b, "Hello?")  # needs a's place: waits for the stream to end
        streamer.join(60)
    assert r.status_code == 200 and pool.unloads == 1
    events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert all("error" not in e for e in events)
    assert events[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    assert lines[-1] == "data: [DONE]" or lines[-2] == "data: [DONE]"
    assert engine_a.lifecycle.pending == 0
