"""Ollama's API over the real engine, driven by the official `ollama` Python package:
chat and generate (whole and streamed), a second request served from the cache and
answering as a cold run, tools, thinking, a format schema, embed, list, show and ps,
and keep_alive on a pool that loads models on demand (an unload of a model not loaded
loads nothing; a keep_alive past Go's longest duration is for good, and /api/ps lists it).

A random model never writes a tool call or its reasoning, so those replies are scripted
at the sampler (a request with a SCRIPTS seed samples the script's tokens, then EOS), as
in test_server_reasoning_live.py; everything else is the real path."""

from __future__ import annotations

import json

import httpx
import ollama
from support.engine_helpers import scripted_engine
from support.live import live_server
from support.models import loaded_test_model
from support.pool_server import pool_server
from support.server_fakes import serving, wait_until
from support.structured import PERSON, check_person

from mlx_prefix.config import FOREVER
from mlx_prefix.models.testing import make_test_model

SYSTEM = "You are the help desk of a public library. Answer in one short sentence. " * 4
GREEDY = {"temperature": 0, "num_predict": 8}
COLD = {"prefix_cache": {"enabled": False}}
TOOL = {"type": "function", "function": {"name": "find_book", "description": "Find a book",
        "parameters": {"type": "object", "properties": {"title": {"type": "string"}}}}}  # fmt: skip
CALL_SEED, THINK_SEED = 9001, 9002
SCRIPTS = {
    CALL_SEED: '<tool_call>\n{"name": "find_book", "arguments": {"title": "Dune"}}\n</tool_call>',
    THINK_SEED: "<think>\nThey want the hours.\n</think>\n\nNine to five.",
}


def ask(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


CHAT_A = {"model": "tiny-a", "messages": ask("Hi"), "options": GREEDY, "stream": False}


# The tiny dense model with a Qwen3-style template (tools, `<think>`), the scripted seeds,
# and the tiny embedding model beside it.
live = live_server(
    lambda: scripted_engine(loaded_test_model("dense", think_template=True), SCRIPTS),
    embeddings=True,
)


def last_request(url: str) -> dict:
    """The server's record of the last Ollama request (the dashboard's list)."""
    records = httpx.get(url + "/v1/dashboard").json()["requests"]
    return [r for r in records if r["endpoint"].startswith("/api/")][-1]


def test_a_second_chat_is_served_from_the_cache_and_answers_as_a_cold_run(
    url, engine, ollama_client
):
    ollama_client.chat(
        model="tiny-dense-think", messages=ask("Where are the atlases?"), options=GREEDY
    )
    warm = ollama_client.chat(
        model="tiny-dense-think:latest", messages=ask("When do you close?"), options=GREEDY
    )
    cached = last_request(url)["cached_tokens"]
    body = {"model": "tiny-dense-think", "messages": ask("When do you close?"),
            "options": GREEDY, "stream": False, **COLD}  # fmt: skip
    cold = httpx.post(url + "/api/chat", json=body, timeout=120).json()
    assert cached > 40 and cold["prompt_eval_cached_count"] == 0
    assert warm.message.content == cold["message"]["content"]
    assert warm.prompt_eval_count == cold["prompt_eval_count"]  # every prompt token counted
    assert (warm.eval_count, warm.done_reason) == (cold["eval_count"], cold["done_reason"])
    engine.store.check_integrity()


def test_streamed_chat_and_generate_equal_their_whole_replies(ollama_client):
    messages = ask("Can I renew online?")
    whole = ollama_client.chat(model="m", messages=messages, options=GREEDY)
    parts = list(ollama_client.chat(model="m", messages=messages, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in parts) == whole.message.content
    final = parts[-1]
    assert final.done and final.prompt_eval_count == whole.prompt_eval_count
    assert final.eval_duration > 0 and final.prompt_eval_duration > 0
    text = ollama_client.generate(
        model="m", prompt="Can I renew online?", system=SYSTEM, options=GREEDY
    )
    streamed = ollama_client.generate(
        model="m", prompt="Can I renew online?", system=SYSTEM, options=GREEDY, stream=True
    )
    assert "".join(p.response for p in streamed) == text.response
    assert text.response == whole.message.content  # the same rendered conversation
    raw = ollama_client.generate(model="m", prompt="Once upon a time", raw=True, options=GREEDY)
    assert raw.done and 0 < raw.eval_count <= 8


def test_a_tool_call_comes_back_as_an_object_and_its_result_reuses_the_history(url, ollama_client):
    messages = ask("Do you have Dune?")
    r = ollama_client.chat(model="m", messages=messages, tools=[TOOL], options={"seed": CALL_SEED})
    [call] = r.message.tool_calls
    assert call.function.name == "find_book" and call.function.arguments == {"title": "Dune"}
    assert r.done_reason == "stop"
    history = [
        *messages,
        r.message,
        {"role": "tool", "content": "Shelf 4", "tool_name": "find_book"},
    ]
    follow = ollama_client.chat(model="m", messages=history, tools=[TOOL], options=GREEDY)
    assert follow.message.content is not None
    assert last_request(url)["cached_tokens"] > 40  # system prompt, tools, the call


def test_reasoning_comes_back_in_message_thinking(ollama_client):
    options = {"seed": THINK_SEED}
    r = ollama_client.chat(model="m", messages=ask("Hours?"), think=True, options=options)
    assert r.message.thinking == "They want the hours." and r.message.content == "Nine to five."
    parts = list(
        ollama_client.chat(model="m", messages=ask("Hours?"), options=options, stream=True)
    )
    assert "".join(p.message.thinking or "" for p in parts) == "They want the hours."


def test_a_format_schema_gives_a_reply_that_follows_it(ollama_client):
    messages = [
        {"role": "system", "content": "You describe people as JSON objects. " * 4},
        {"role": "user", "content": "Describe the lighthouse keeper."},
    ]
    options = {"temperature": 1.0, "seed": 3, "top_k": 0, "top_p": 1.0, "num_predict": 80}
    r = ollama_client.chat(model="m", messages=messages, format=PERSON, options=options)
    assert r.done_reason == "stop"
    check_person(r.message.content)
    assert (
        json.loads(
            ollama_client.chat(
                model="m", messages=messages, format="json", options=options
            ).message.content
        )
        is not None
    )


def test_embed_gives_the_vectors_the_openai_route_gives(url, ollama_client):
    texts = ["The quick brown fox", "Hi"]
    r = ollama_client.embed(model="tiny-embed:latest", input=texts)
    openai_shaped = httpx.post(url + "/v1/embeddings", json={"model": "tiny-embed",
                               "input": texts, "encoding_format": "float"}).json()  # fmt: skip
    assert r.embeddings == [d["embedding"] for d in openai_shaped["data"]]
    assert r.prompt_eval_count == openai_shaped["usage"]["prompt_tokens"]
    legacy = ollama_client.embeddings(model="tiny-embed", prompt="Hi")
    assert list(legacy.embedding) == r.embeddings[1]


def test_list_show_and_ps_describe_the_served_models(ollama_client):
    names = {m.model for m in ollama_client.list().models}
    assert names == {"tiny-dense-think:latest", "tiny-embed:latest"}
    shown = ollama_client.show("tiny-dense-think")
    assert shown.capabilities == ["completion", "tools", "thinking"]
    assert shown.details.family == "llama" and shown.details.quantization_level == "F32"
    assert shown.details.parameter_size.endswith("M") and "<tool_call>" in shown.template
    assert shown.modelinfo["llama.context_length"] == 4096
    assert ollama_client.show("tiny-embed").capabilities == ["embedding"]
    running = {m.model: m for m in ollama_client.ps().models}
    assert running["tiny-dense-think:latest"].size > 0
    assert running["tiny-dense-think:latest"].context_length == 4096


def test_keep_alive_unloads_through_the_pool_and_the_next_request_loads_it_again(tmp_path):
    folder = make_test_model("dense", tmp_path / "tiny-a")
    with pool_server(folder) as (url, pool), ollama.Client(host=url) as c:
        before = c.chat(model="tiny-a", messages=ask("Hi"), options=GREEDY, keep_alive="1h")
        [row] = c.ps().models
        assert row.expires_at.year < 2300  # the request's deadline, not "never"
        unload = c.generate(model="tiny-a", keep_alive=0)
        assert unload.done_reason == "unload"
        assert wait_until(lambda: pool.unloads == 1, timeout=60)
        assert c.ps().models == []
        again = c.chat(model="tiny-a", messages=ask("Hi"), options=GREEDY, keep_alive=0)
        assert again.message.content == before.message.content and pool.loads == 1
        assert wait_until(lambda: pool.unloads == 2, timeout=60)  # 0: gone once answered
        c.chat(model="tiny-a", messages=ask("Hi"), options=GREEDY, keep_alive="1s")
        assert wait_until(lambda: pool.unloads == 3, timeout=60)  # once idle that long
        # Without keep_alive the server's rule is back: the --model one stays for good.
        c.chat(model="tiny-a", messages=ask("Hi"), options=GREEDY)
        [row] = c.ps().models
        assert row.expires_at.year > 2300


def test_keep_alive_is_refused_where_the_model_cannot_be_loaded_back():
    with serving() as (url, _):
        r = httpx.post(url + "/api/chat", json={"model": "m", "messages": [], "keep_alive": "5m"})
    assert r.status_code == 400 and "keep_alive" in r.json()["error"]


def test_an_unload_of_a_model_not_loaded_loads_nothing_and_evicts_nothing(tmp_path):
    a = make_test_model("dense", tmp_path / "tiny-a")
    b = str(make_test_model("dense", tmp_path / "tiny-b", seed=1))
    with pool_server(a, allowed_models=(b,), max_models=1) as (url, pool):
        before = httpx.post(url + "/api/chat", json=CHAT_A, timeout=120)
        assert before.status_code == 200, before.text
        generate = httpx.post(url + "/api/generate", json={"model": b, "keep_alive": 0})
        chat = httpx.post(url + "/api/chat", json={"model": b, "messages": [], "keep_alive": 0})
        assert [s.spec.id for s in pool.slots()] == ["tiny-a"]  # the serving model stayed
        assert pool.loads == 0 and pool.unloads == 0
        after = httpx.post(url + "/api/chat", json=CHAT_A, timeout=120)
    # Ollama's answers to an unload (docs/api.md): no load, no counts.
    listed = f"{b}:latest"
    assert generate.status_code == 200, generate.text
    g = generate.json()
    assert set(g) == {"model", "created_at", "response", "done", "done_reason"}
    assert (g["model"], g["response"], g["done"], g["done_reason"]) == (listed, "", True, "unload")
    assert chat.status_code == 200, chat.text
    c = chat.json()
    assert set(c) == {"model", "created_at", "message", "done", "done_reason"}
    assert c["message"] == {"role": "assistant", "content": ""}
    assert (c["model"], c["done"], c["done_reason"]) == (listed, True, "unload")
    assert after.json()["message"] == before.json()["message"]


def test_a_huge_keep_alive_is_for_good_and_ps_always_answers(tmp_path):
    folder = make_test_model("dense", tmp_path / "tiny-a")
    with pool_server(folder) as (url, pool), ollama.Client(host=url) as c:
        c.chat(model="tiny-a", messages=ask("Hi"), options=GREEDY, keep_alive=1e12)
        [slot] = pool.slots()
        assert slot.keep_alive_s == FOREVER  # past Go's longest duration: for good
        listed = httpx.get(url + "/api/ps")
        # A keep-alive no request can send (a library caller's) still lists.
        slot.keep_alive_s = 1e300
        again = httpx.get(url + "/api/ps")
        status = httpx.get(url + "/v1/ps")
    for r in (listed, again):
        assert r.status_code == 200, r.text
        [row] = r.json()["models"]
        assert row["expires_at"].startswith("2318-") and row["name"] == "tiny-a:latest"
    assert status.status_code == 200
