"""Every request's reuse explained (issue 46), on the real engine with a tiny model: each
reason produced by a scripted client over chat, Messages and Responses (the official
SDKs), streamed and not, and read back from GET /v1/cache/requests, /metrics and the
log; another origin's prompt is `new` for a client and none of its text reaches it.

Each test talks as its own Origin: a namespace of its own, so its history starts empty
whatever ran before on the module's server."""

from __future__ import annotations

import itertools
import json
import logging
import subprocess
import sys
from dataclasses import dataclass

import anthropic
import httpx
import openai
import pytest
from support.live import anthropic_client, live_server, openai_client
from support.models import TEST_CACHE, loaded_test_model
from support.server_fakes import serving

from mlx_prefix.config import CacheConfig, EngineConfig
from mlx_prefix.engine.engine import Engine
from mlx_prefix.prompt.request.render import common_prefix_length
from mlx_prefix.records import PromptInput
from mlx_prefix.server.protocol.messages import conversation_from_dicts

APIS = [(api, stream) for api in ("chat", "messages", "responses") for stream in (False, True)]
IDS = [f"{api}-{'stream' if stream else 'whole'}" for api, stream in APIS]
NO_PREFETCH = EngineConfig(prefetch_next_turn=False)  # what each request reuses is its own

LIBRARY = (
    "You are the help desk of a public library. The atlases are kept on the third floor, "
    "beside the {colour} map cabinet, and may not leave the reading room. "
)
SYSTEM = LIBRARY.format(colour="blue") * 3
_origins = itertools.count(20000)


def new_origin() -> str:
    return f"http://localhost:{next(_origins)}"


@dataclass
class Client:
    """One scripted client of one API family, as one Origin (one namespace)."""

    url: str
    api: str
    stream: bool
    origin: str

    def send(self, system: str, turns: list[tuple[str, str]], **extra) -> tuple[str, int]:
        """One request of plain turns: the reply's text and its cached prompt tokens."""
        if self.api == "messages":
            turns = [(r, t or ".") for r, t in turns]  # Anthropic refuses empty text
        return self.send_raw(system, [{"role": r, "content": t} for r, t in turns], **extra)

    def send_raw(self, system: str, items: list[dict], **extra) -> tuple[str, int]:
        """One request of messages (or Responses input items) in this API's own shape."""
        headers = {"Origin": self.origin} if self.origin else {}
        if self.api == "messages":
            with anthropic_client(self.url, default_headers=headers) as c:
                return _messages(c, system, items, self.stream, extra)
        with openai_client(self.url, default_headers=headers) as c:
            if self.api == "chat":
                messages = [{"role": "system", "content": system}, *items]
                return _chat(c, messages, self.stream, extra)
            return _responses(c, system, items, self.stream, extra)

    def records(self) -> list[dict]:
        headers = {"Origin": self.origin} if self.origin else {}
        r = httpx.get(f"{self.url}/v1/cache/requests", headers=headers)
        r.raise_for_status()
        return r.json()["data"]


def _chat(c: openai.OpenAI, messages: list, stream: bool, extra: dict) -> tuple[str, int]:
    args = dict(model="default", messages=messages, max_tokens=8, temperature=0, extra_body=extra)
    if not stream:
        done = c.chat.completions.create(**args)
        return done.choices[0].message.content or "", done.usage.prompt_tokens_details.cached_tokens
    text, cached = "", None
    for chunk in c.chat.completions.create(
        **args, stream=True, stream_options={"include_usage": True}
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens
    assert cached is not None
    return text, cached


def _messages(c: anthropic.Anthropic, system: str, messages, stream: bool, extra: dict):
    args = dict(
        model="default",
        system=system,
        messages=messages,
        max_tokens=8,
        extra_body=extra,
    )
    if stream:
        with c.messages.stream(**args) as s:
            done = s.get_final_message()
    else:
        done = c.messages.create(**args)
    text = "".join(b.text for b in done.content if b.type == "text")
    return text, done.usage.cache_read_input_tokens or 0


def _responses(c: openai.OpenAI, system: str, items, stream: bool, extra: dict):
    args = dict(
        model="default",
        instructions=system,
        input=items,
        max_output_tokens=8,
        temperature=0,
        extra_body=extra,
    )
    if stream:
        done = None
        for event in c.responses.create(**args, stream=True):
            if event.type in ("response.completed", "response.incomplete"):
                done = event.response
        assert done is not None
    else:
        done = c.responses.create(**args)
    return done.output_text, done.usage.input_tokens_details.cached_tokens


live = live_server(lambda: Engine(loaded_test_model("dense"), TEST_CACHE, NO_PREFETCH))


def tokens(engine: Engine, system: str, turns: list[tuple[str, str]]) -> tuple[int, ...]:
    dicts = [{"role": "system", "content": system}] + [{"role": r, "content": t} for r, t in turns]
    return engine.plan(PromptInput(messages=conversation_from_dicts(dicts))).tokens


@pytest.mark.parametrize(("api", "stream"), APIS, ids=IDS)
def test_a_turn_appended_is_a_hit(live, api, stream):
    url, _ = live
    client = Client(url, api, stream, new_origin())
    question = [("user", "Where are the atlases?")]
    reply, _ = client.send(SYSTEM, question)
    turns = [*question, ("assistant", reply), ("user", "And the globes?")]
    _, cached = client.send(SYSTEM, turns)
    second, first = client.records()
    assert first["reason"] == "new" and first["cached_tokens"] == 0
    assert second["reason"] == "hit", second
    assert second["cached_tokens"] == cached > 0 and second["source"] == "memory"
    assert second["api"] == api and second["diverged_at"] >= cached
    assert second["lost_tokens"] < TEST_CACHE.prefill_chunk  # at most the grid's rest


@pytest.mark.parametrize(("api", "stream"), APIS, ids=IDS)
def test_one_word_changed_mid_system_prompt_is_edited_at_that_token(live, api, stream):
    url, engine = live
    client = Client(url, api, stream, new_origin())
    question = [("user", "Where are the atlases?")]
    edited = LIBRARY.format(colour="blue") + LIBRARY.format(colour="green") * 2
    client.send(SYSTEM, question)
    _, cached = client.send(edited, question)
    record = client.records()[0]
    at = common_prefix_length(tokens(engine, SYSTEM, question), tokens(engine, edited, question))
    assert record["reason"] == "edited", record
    assert record["diverged_at"] == at and record["location"] == {"message": 0, "role": "system"}
    assert "blue" in record["before"] and "green" in record["after"]
    assert "green" not in record["before"]
    assert len(record["before"]) <= 120 and len(record["after"]) <= 120
    assert 0 < record["cached_tokens"] == cached <= at
    # The stored prompt's rest was computed again.
    assert record["lost_tokens"] == len(tokens(engine, SYSTEM, question)) - 1 - cached


@pytest.mark.parametrize(("api", "stream"), APIS, ids=IDS)
def test_a_timestamp_in_the_system_prompt_is_volatile(live, api, stream):
    url, _ = live
    client = Client(url, api, stream, new_origin())
    for second in (1, 2, 3):
        system = SYSTEM + f"Current time: 2026-11-27 10:14:0{second}. " + SYSTEM
        client.send(system, [("user", "Where are the atlases?")])
    third, second, first = client.records()
    assert [first["reason"], second["reason"], third["reason"]] == ["new", "edited", "volatile"]
    assert third["diverged_at"] == second["diverged_at"]
    assert third["location"] == {"message": 0, "role": "system"}
    assert "10:14:02" in third["before"] and "10:14:03" in third["after"]
    assert third["lost_tokens"] > 0


@pytest.mark.parametrize(("api", "stream"), APIS, ids=IDS)
def test_another_origins_prompt_is_new_and_none_of_its_text_reaches_the_client(live, api, stream):
    url, _ = live
    owner = Client(url, api, stream, new_origin())
    other = Client(url, api, stream, new_origin())
    secret = SYSTEM + "The safe's code is Zanzibar-4471. "
    owner.send(secret, [("user", "Where are the atlases?")])
    _, cached = other.send(secret, [("user", "Where are the atlases?")])
    (record,) = other.records()
    assert cached == 0 and record["reason"] == "new"
    assert record["diverged_at"] is None and record["before"] is None and record["after"] is None
    seen = httpx.get(f"{url}/v1/cache/requests", headers={"Origin": other.origin}).text
    seen += httpx.get(f"{url}/v1/dashboard", headers={"Origin": other.origin}).text
    assert "Zanzibar" not in seen and owner.records()[0]["id"] not in seen
    # The owner's record is its own; a local client without an Origin (admin) sees both.
    everything = httpx.get(f"{url}/v1/cache/requests", params={"limit": 500}).json()["data"]
    ids = {r["id"] for r in everything}
    assert record["id"] in ids and owner.records()[0]["id"] in ids


def test_a_cache_salt_or_a_disabled_cache_is_said_so(live):
    url, _ = live
    client = Client(url, "chat", False, new_origin())
    question = [("user", "Where are the atlases?")]
    client.send(SYSTEM, question, cache_salt="alice")
    client.send(SYSTEM, question, cache_salt="bob")
    client.send(SYSTEM, question, cache_salt="bob", prefix_cache={"enabled": False})
    disabled, salted, _ = client.records()
    assert salted["reason"] == "settings" and "cache_salt" in salted["detail"]
    assert disabled["reason"] == "disabled" and disabled["cached_tokens"] == 0
    assert disabled["lost_tokens"] > 0  # what the bob entry would have served


def test_the_limit_is_honoured_or_refused(live):
    url, _ = live
    client = Client(url, "chat", False, new_origin())
    for question in ("One?", "Two?", "Three?"):
        client.send(SYSTEM, [("user", question)])
    headers = {"Origin": client.origin}
    got = httpx.get(f"{url}/v1/cache/requests", params={"limit": 2}, headers=headers).json()
    assert len(got["data"]) == 2 and got["data"][0]["id"] == client.records()[0]["id"]
    for bad in ({"limit": "0"}, {"limit": "many"}, {"since": "1"}):
        r = httpx.get(f"{url}/v1/cache/requests", params=bad, headers=headers)
        assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(bad))


def test_metrics_count_requests_and_tokens_lost_per_reason_and_misses_are_logged(live, caplog):
    url, _ = live
    client = Client(url, "chat", False, new_origin())
    question = [("user", "Where are the atlases?")]

    def counters() -> dict[str, float]:
        text = httpx.get(f"{url}/metrics").text
        return {
            line.split(" ")[0]: float(line.split(" ")[1])
            for line in text.splitlines()
            if line.startswith("mlx_prefix_cache_reason_")
        }

    before = counters()
    with caplog.at_level(logging.INFO, logger="mlx_prefix.explain"):
        client.send(SYSTEM, question)
        client.send(SYSTEM.replace("third", "fourth", 1), question)
        record = client.records()[0]
    after = counters()
    edited = 'mlx_prefix_cache_reason_requests_total{reason="edited"}'
    lost = 'mlx_prefix_cache_reason_lost_tokens_total{reason="edited"}'
    assert after[edited] == before.get(edited, 0) + 1
    assert after[lost] == before.get(lost, 0) + record["lost_tokens"] > 0
    lines = [r.getMessage() for r in caplog.records if record["id"] in r.getMessage()]
    assert len(lines) == 1 and "edited" in lines[0] and "fourth" in lines[0]


# The tiny model's entries hold 512 bytes of KV a token, each token once (about 74 KiB
# for the longer system prompt's 149 tokens), and a decoding request's batch cache holds
# room for 256 steps (128 KiB) in the same budget. 272 KiB: the second system prompt is
# stored (from 224 KiB up) and pushes the first one's checkpoints out (up to 320 KiB).
TIGHT = CacheConfig(budget_bytes=272 << 10, prefill_chunk=32, checkpoint_interval=64)
tight = live_server(lambda: Engine(loaded_test_model("dense"), TIGHT, NO_PREFETCH), name="tight")


@pytest.mark.parametrize(("api", "stream"), APIS, ids=IDS)
def test_a_prefix_the_budget_evicted_is_evicted_with_the_memory_that_would_have_kept_it(
    tight, api, stream
):
    url, engine = tight
    client = Client(url, api, stream, new_origin())
    question = [("user", "Where are the atlases?")]
    reply, _ = client.send(SYSTEM, question)
    # A second conversation the budget cannot hold beside the first (a tight budget keeps
    # one conversation's KV about once: issue 55), so the first one's end is evicted.
    client.send(LIBRARY.format(colour="red") * 10, [("user", "Where are the globes?")])
    _, cached = client.send(SYSTEM, [*question, ("assistant", reply), ("user", "Thanks!")])
    record = client.records()[0]
    assert record["reason"] == "evicted", record
    assert record["cached_tokens"] == cached and record["lost_tokens"] > 0
    assert "evicted" in record["detail"] and "budget would have kept it" in record["detail"]
    assert engine.store.stats().evictions > 0


REASONING = "The catalogue should say where the atlases are kept."
PARAMETERS = {"type": "object", "properties": {"q": {"type": "string"}}}
TOOLS = {
    "chat": [{"type": "function", "function": {"name": "lookup", "parameters": PARAMETERS}}],
    "messages": [{"name": "lookup", "input_schema": PARAMETERS}],
    "responses": [{"type": "function", "name": "lookup", "parameters": PARAMETERS}],
}


def tool_loop(api: str, answered: bool) -> list[dict]:
    """A question, a call made after some reasoning, its result; `answered`: then the
    answer and a new question (after which Qwen's template drops that reasoning)."""
    question = {"role": "user", "content": "Where are the atlases?"}
    answer = [
        {"role": "assistant", "content": "On the third floor."},
        {"role": "user", "content": "Thanks!"},
    ]
    if api == "chat":
        call = {"id": "call_1", "type": "function"}
        call["function"] = {"name": "lookup", "arguments": '{"q": "atlas"}'}
        turn = [
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": REASONING,
                "tool_calls": [call],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "third floor"},
        ]
    elif api == "messages":
        turn = [
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": REASONING, "signature": "-"},
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "lookup",
                        "input": {"q": "atlas"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "third floor"}
                ],
            },
        ]
    else:
        turn = [
            {"type": "reasoning", "id": "rs_1", "summary": [],
             "content": [{"type": "reasoning_text", "text": REASONING}]},
            {"type": "function_call", "call_id": "call_1", "name": "lookup",
             "arguments": '{"q": "atlas"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "third floor"},
        ]  # fmt: skip
    return [question, *turn, *(answer if answered else [])]


# Qwen3's template in short (models/testing.py): an assistant turn keeps its reasoning
# only while no new question follows it.
rerendering = live_server(
    lambda: Engine(loaded_test_model("dense", think_template=True), TEST_CACHE, NO_PREFETCH),
    name="rerendering",
)


@pytest.mark.parametrize(("api", "stream"), APIS, ids=IDS)
def test_a_template_that_drops_reasoning_is_re_rendered(rerendering, api, stream):
    url, _ = rerendering
    client = Client(url, api, stream, new_origin())
    client.send_raw(SYSTEM, tool_loop(api, answered=False), tools=TOOLS[api])
    _, cached = client.send_raw(SYSTEM, tool_loop(api, answered=True), tools=TOOLS[api])
    record = client.records()[0]
    assert record["reason"] == "re_rendered", record
    assert record["location"] == {"message": 2, "role": "assistant"}
    assert "catalogue" in record["before"] and "catalogue" not in record["after"]
    assert record["cached_tokens"] == cached > 0 and record["lost_tokens"] > 0


DOCUMENT = (
    "In the beginning God created the heaven and the earth. And the earth was without "
    "form, and void. "
) * 7 + "And God said, Let there be light. "
FIRST = (
    "Summarise it in one short sentence, please, for the reading group of Thursday "
    "evening, and keep it plain: the group reads it aloud before tea."
)


hybrid = live_server(
    lambda: Engine(loaded_test_model("qwen3_5"), TEST_CACHE, NO_PREFETCH), name="hybrid"
)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_new_question_after_a_document_restores_at_a_checkpoint_before_the_grid_point(
    hybrid, live, stream
):
    """The same document, another question at its end: an all-KV cache restores at the
    last grid point before the question (hit); a hybrid one only at an exact checkpoint,
    here the periodic one before it (grid), the tokens between computed again."""
    second = "Who wrote it and when was it first printed in English?"
    for (url, engine), reason in ((hybrid, "grid"), (live, "hit")):
        client = Client(url, "chat", stream, new_origin())
        client.send("You read documents.", [("user", DOCUMENT + FIRST)])
        _, cached = client.send("You read documents.", [("user", DOCUMENT + second)])
        record = client.records()[0]
        prompt = tokens(engine, "You read documents.", [("user", DOCUMENT + second)])
        at = record["diverged_at"]
        assert record["reason"] == reason, record
        assert at == common_prefix_length(
            prompt, tokens(engine, "You read documents.", [("user", DOCUMENT + FIRST)])
        )
        assert record["location"] == {"message": 1, "role": "user"}
        assert "Summarise" in record["before"] and "Who wrote" in record["after"]
        grid_point = engine.planner.grid.align(prompt, at)
        if reason == "grid":
            assert cached < grid_point and record["lost_tokens"] == at - cached
        else:
            assert cached == grid_point and record["lost_tokens"] == at - cached


def test_the_cli_prints_a_running_servers_recent_requests(live, capsys):
    # Not cli.main in-process: it ends by clearing this thread's MLX streams.
    from mlx_prefix.cli import build_parser
    from mlx_prefix.cli.cache import cmd_cache

    def explain(*flags: str) -> int:
        return cmd_cache(build_parser().parse_args(["cache", "explain", "--url", url, *flags]))

    url, _ = live
    client = Client(url, "chat", False, "")  # no Origin: the namespace the CLI reads
    question = [("user", "Where are the atlases?")]
    edited = LIBRARY.format(colour="blue") + LIBRARY.format(colour="green") * 2
    client.send(SYSTEM, question)
    client.send(edited, question)
    capsys.readouterr()
    assert explain("--limit", "1", "--json") == 0
    (line,) = capsys.readouterr().out.splitlines()
    record = json.loads(line)
    assert record["reason"] == "edited" and "green" in record["after"]
    assert explain("--limit", "3") == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:4] == ["time", "request", "api", "reason"]
    assert "edited" in table[1] and "msg 0 system" in table[1] and "green" in table[1]
    gone = subprocess.run(
        [sys.executable, "-m", "mlx_prefix", "cache", "explain", "--url", "http://127.0.0.1:9"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert gone.returncode == 1
    assert "error: no mlx-prefix server at http://127.0.0.1:9" in gone.stderr.splitlines()[-1]


def test_no_explain_keeps_no_records_and_says_so():
    with serving(explain_requests=False) as (url, _):
        r = httpx.get(f"{url}/v1/cache/requests")
        assert r.status_code == 404 and r.json()["error"]["code"] == "explain_off"
        assert httpx.get(f"{url}/v1/dashboard").json()["misses"] == []
