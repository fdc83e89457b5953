"""server/replies/sse.py: every API family streams through one writer (sse-starlette's
EventSourceResponse): the events' bytes as framed, comment pings on an idle stream that
the official clients skip, and a client that leaves cancels the engine request."""

from __future__ import annotations

import json

import httpx
import pytest
from support.live import anthropic_client, openai_client
from support.server_fakes import FakeEngine, raw_post, serving, wait_until

import mlx_prefix.server.replies.sse as sse

REPLY = "Hello from the fake engine, one word at a time."
SLOW = "[[delay:0.15]] Say hello."  # each word waits 0.15 s: pings come in between


@pytest.fixture
def fast_pings(monkeypatch):
    monkeypatch.setattr(sse, "PING_S", 0.05)


def test_event_framing():
    assert sse.event({"type": "message_stop"}) == (
        b'event: message_stop\ndata: {"type": "message_stop"}\n\n'
    )
    assert sse.chunk({"type": "x", "text": "é"}) == 'data: {"type": "x", "text": "é"}\n\n'.encode()


def test_an_idle_stream_gets_comment_pings_between_its_events(fast_pings):
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": SLOW}]}
    with serving() as (url, _):
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
            raw = b"".join(r.iter_raw())
    events = raw.split(b"\n\n")
    pings = [e for e in events if e.startswith(b": ping")]
    assert pings, "no ping on a stream idle longer than the ping interval"
    assert raw.endswith(sse.DONE)
    data = [e for e in events if e.startswith(b"data: ")]
    assert all(b"\n" not in e for e in pings) and len(data) > len(REPLY.split())


def test_the_official_clients_read_a_pinged_stream_whole(fast_pings):
    question = [{"role": "user", "content": SLOW}]
    with serving() as (url, _):
        with openai_client(url) as client:
            chunks = client.chat.completions.create(model="m", messages=question, stream=True)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert text == REPLY
            events = client.responses.create(model="m", input=SLOW, stream=True)
            done = [e for e in events if e.type == "response.completed"]
            assert done[0].response.output_text == REPLY
        with anthropic_client(url) as client:
            with client.messages.stream(model="m", max_tokens=64, messages=question) as stream:
                assert stream.get_final_text() == REPLY


QUESTION = [{"role": "user", "content": SLOW}]
BODIES = {
    "/v1/chat/completions": {"model": "m", "stream": True, "messages": QUESTION},
    "/v1/messages": {"model": "m", "stream": True, "max_tokens": 64, "messages": QUESTION},
    "/v1/responses": {"model": "m", "stream": True, "input": SLOW},
}


@pytest.mark.parametrize("path", BODIES)
def test_a_client_leaving_mid_stream_cancels_the_request(fast_pings, path):
    engine = FakeEngine()
    with serving(engine) as (url, _):
        with raw_post(url, path, json.dumps(BODIES[path]).encode()) as sock:
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        assert wait_until(lambda: engine.handles and engine.handles[-1].cancelled.is_set(), 5)
