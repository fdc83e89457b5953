"""reasoning_effort on /v1/chat/completions (what OpenCode, Aider and Continue send when a
model is set to reason): the chat template's thinking switch, or a 400 naming it."""

from __future__ import annotations

import httpx
import pytest
from server_fakes import FakeEngine, serving

from mlx_prefix.errors import InvalidRequest
from mlx_prefix.server.protocol.chat import parse_chat
from mlx_prefix.server.protocol.request import Limits

LIMITS = Limits(default_max_tokens=64, max_tokens=1000)
MESSAGES = [{"role": "user", "content": "hi"}]


def kwargs(**body):
    return parse_chat({"messages": MESSAGES, **body}, LIMITS).prompt.chat_template_kwargs


@pytest.mark.parametrize(
    ("effort", "thinking"),
    [("none", False), ("minimal", False), ("low", False), ("medium", True), ("high", True)],
)
def test_reasoning_effort_is_the_templates_thinking_switch(effort, thinking):
    assert kwargs(reasoning_effort=effort) == {"enable_thinking": thinking}


def test_without_reasoning_effort_the_template_keeps_its_default():
    assert kwargs() == {}


def test_the_requests_own_switch_wins():
    sent = {"enable_thinking": True, "other": 1}
    assert kwargs(reasoning_effort="low", chat_template_kwargs=sent) == sent


@pytest.mark.parametrize("effort", ["extreme", 3])
def test_an_unknown_effort_is_refused_naming_it(effort):
    with pytest.raises(InvalidRequest) as raised:
        kwargs(reasoning_effort=effort)
    assert raised.value.param == "reasoning_effort"


def test_the_switch_reaches_the_engine():
    with serving(FakeEngine()) as (url, engine):
        body = {"model": "m", "messages": MESSAGES, "reasoning_effort": "minimal"}
        assert httpx.post(f"{url}/v1/chat/completions", json=body).status_code == 200
    assert engine.submissions[0].prompt.chat_template_kwargs == {"enable_thinking": False}
