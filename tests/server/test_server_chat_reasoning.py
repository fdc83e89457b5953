"""reasoning_effort on /v1/chat/completions (what OpenCode, Aider and Continue send when a
model is set to reason): "none" is the chat template's thinking switch turned off, the
other levels a reasoning budget (server/protocol/effort.py), or a 400 naming it."""

from __future__ import annotations

import httpx
import pytest
from support.server_fakes import FakeEngine, serving

from mlx_prefix.errors import InvalidRequest
from mlx_prefix.server.protocol.chat import parse_chat
from mlx_prefix.server.protocol.request import Limits

LIMITS = Limits(default_max_tokens=64, max_tokens=1000)
MESSAGES = [{"role": "user", "content": "hi"}]


def kwargs(**body):
    return parse_chat({"messages": MESSAGES, **body}, LIMITS).prompt.chat_template_kwargs


def sampling(**body):
    return parse_chat({"messages": MESSAGES, **body}, LIMITS).sampling


@pytest.mark.parametrize(
    ("effort", "switch", "budget"),
    [
        ("none", {"enable_thinking": False}, 0),
        ("minimal", {}, 256),
        ("low", {}, 1024),
        ("medium", {}, 4096),
        ("high", {}, None),
    ],
)
def test_reasoning_effort_is_the_switch_or_a_budget(effort, switch, budget):
    assert kwargs(reasoning_effort=effort) == switch
    assert sampling(reasoning_effort=effort).reasoning_budget == budget


def test_without_reasoning_effort_the_template_keeps_its_default():
    assert kwargs() == {}


def test_the_requests_own_switch_wins():
    sent = {"enable_thinking": True, "other": 1}
    assert kwargs(reasoning_effort="none", chat_template_kwargs=sent) == sent


@pytest.mark.parametrize("effort", ["extreme", 3])
def test_an_unknown_effort_is_refused_naming_it(effort):
    with pytest.raises(InvalidRequest) as raised:
        kwargs(reasoning_effort=effort)
    assert raised.value.param == "reasoning_effort"


def test_the_switch_reaches_the_engine():
    with serving(FakeEngine()) as (url, engine):
        body = {"model": "m", "messages": MESSAGES, "reasoning_effort": "none"}
        assert httpx.post(f"{url}/v1/chat/completions", json=body).status_code == 200
    assert engine.submissions[0].prompt.chat_template_kwargs == {"enable_thinking": False}
