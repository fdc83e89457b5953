"""A long prefill shows its progress (issue 55, item 5): ProgressEvents from the engine to
a request that asked, `generate`'s bar on a terminal, llama.cpp's `return_progress`
chunks on a chat stream."""

from __future__ import annotations

import io

import httpx
from support.engine_helpers import GREEDY, chat, collect, open_engine
from support.live import live_server
from support.models import TEST_CACHE, loaded_test_model

from mlx_prefix.cli.progress import PrefillBar, wants_bar
from mlx_prefix.config import EngineConfig
from mlx_prefix.engine.engine import Engine
from mlx_prefix.records import (
    CachePreference,
    DoneEvent,
    ProgressEvent,
    SamplingParams,
    TokenEvent,
)

SYSTEM = "You are the help desk of a public library. Answer in one short sentence. " * 12
# One grid chunk (TEST_CACHE.prefill_chunk) per engine turn: a turn per event.
ONE_CHUNK_A_TURN = EngineConfig(prefill_tokens_per_step=TEST_CACHE.prefill_chunk)


def events_of(engine: Engine, question: str, progress: bool) -> list:
    handle = engine.submit(
        chat(("system", SYSTEM), ("user", question)),
        SamplingParams(max_tokens=4, temperature=0.0),
        CachePreference(),
        progress=progress,
    )
    return list(handle.events(timeout=600))


def test_progress_events_count_up_to_the_prompt_before_the_first_token():
    with open_engine(loaded_test_model("dense"), TEST_CACHE, ONE_CHUNK_A_TURN) as engine:
        events = events_of(engine, "Where are the atlases?", progress=True)
        again = events_of(engine, "When does the library close?", progress=True)
        quiet = events_of(engine, "Can I renew online?", progress=False)

    def progress(evs: list) -> list[ProgressEvent]:
        return [e for e in evs if isinstance(e, ProgressEvent)]

    cold = progress(events)
    done = events[-1]
    assert isinstance(done, DoneEvent)
    total = done.usage.prompt_tokens
    assert len(cold) >= total // TEST_CACHE.prefill_chunk  # one per grid chunk
    assert cold[0].cached == 0 and cold[0].processed == 0
    assert [e.processed for e in cold] == sorted({e.processed for e in cold})
    assert cold[-1].processed == total and all(e.total == total for e in cold)
    first_token = next(i for i, e in enumerate(events) if isinstance(e, TokenEvent))
    assert all(not isinstance(e, ProgressEvent) for e in events[first_token:])
    # The second question restores the system prompt: its first event says so.
    warm = progress(again)
    hit = again[-1].usage.cached_tokens
    assert hit > 40
    assert warm[0].cached == warm[0].processed == hit
    assert warm[-1].processed == again[-1].usage.prompt_tokens
    assert progress(quiet) == []


def test_the_bar_draws_on_a_terminal_only_and_not_with_quiet():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert wants_bar(Terminal(), quiet=False)
    assert not wants_bar(Terminal(), quiet=True)
    assert not wants_bar(io.StringIO(), quiet=False)
    screen = Terminal()
    bar = PrefillBar(screen)
    for done in (96, 160, 224):
        bar.update(ProgressEvent(total=224, cached=96, processed=done, elapsed_s=1.0))
    drawn = screen.getvalue()
    bar.close()
    assert "prefill" in drawn and "/224" in drawn and "cached 96" in drawn


live = live_server(lambda: Engine(loaded_test_model("dense"), TEST_CACHE, ONE_CHUNK_A_TURN))


def test_return_progress_streams_llama_cpp_progress_chunks(client):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hours?"}]
    plain = client.chat.completions.create(
        model="default", messages=messages, max_tokens=6, temperature=0, stream=True
    )
    plain_text = "".join(c.choices[0].delta.content or "" for c in plain if c.choices)
    stream = client.chat.completions.create(
        model="default",
        messages=messages,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"return_progress": True, "prefix_cache": {"enabled": False}},
    )
    chunks = list(stream)
    progress = [
        c.model_extra["prompt_progress"] for c in chunks if c.model_extra.get("prompt_progress")
    ]
    usage = chunks[-1].usage
    assert usage.prompt_tokens_details.cached_tokens == 0
    assert len(progress) >= usage.prompt_tokens // TEST_CACHE.prefill_chunk
    assert all(p["total"] == usage.prompt_tokens and p["cache"] == 0 for p in progress)
    assert progress[-1]["processed"] == usage.prompt_tokens
    assert [p["processed"] for p in progress] == sorted({p["processed"] for p in progress})
    first_text = next(i for i, c in enumerate(chunks) if c.choices and c.choices[0].delta.content)
    last_progress = max(i for i, c in enumerate(chunks) if c.model_extra.get("prompt_progress"))
    assert last_progress < first_text
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain_text  # progress chunks carry no text


def test_return_progress_without_a_stream_is_refused_naming_the_field(live):
    url, _ = live
    r = httpx.post(
        f"{url}/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 2,
            "return_progress": True,
        },
        timeout=60,
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "return_progress"


def test_a_request_run_to_its_end_with_progress_answers_as_without(make_engine):
    engine = make_engine()
    prompt = chat(("system", SYSTEM), ("user", "Is there parking?"))
    plain = collect(engine.submit(prompt, GREEDY, CachePreference(enabled=False)))
    with_bar = engine.submit(prompt, GREEDY, CachePreference(enabled=False), progress=True)
    tokens = [e.token for e in with_bar.events(timeout=600) if isinstance(e, TokenEvent)]
    assert [t for t in tokens if t is not None] == plain.tokens
