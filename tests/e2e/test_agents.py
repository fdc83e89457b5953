"""The coding agents themselves (Claude Code, Codex CLI, OpenCode, Qwen Code, Continue's
CLI, Crush, Aider) against a live server, each configured as docs/clients.md says: one table
of agents (agents.py) drives each test, and an agent `make test-deps` did not install
skips saying why.

The real engine's replies are noise (random weights), so a tool round trip cannot come
from it: the fake engine replies with a call to one of the agent's own tools (the
`[[reply:...]]` directive of server_fakes), the agent runs it, and the tool's output
holds the directive for the next reply, so a reply of "All done." proves that the
output came back. The cache is measured on the real engine (a tiny qwen3_5 hybrid with a
32K context): two runs of the same prompt, the second reading at least 95% of its input
from the cache, as the server's token counters say whatever the agent reports. With its
billing header kept, Claude Code's sessions differ at that header, and GET
/v1/cache/requests says so (issue 46): `volatile`, at the header's text.
"""

from __future__ import annotations

import time

import httpx
import pytest
from support.agent_e2e import DONE, DONE_DIRECTIVE, Counted, scripted_server
from support.agents import AGENTS, Agent
from support.engine_helpers import open_engine
from support.server_fakes import FakeEngine, serving

from mlx_prefix.config import CacheConfig
from mlx_prefix.models.load import load_model
from mlx_prefix.models.testing import cached_test_model

TRIPS = [agent for agent in AGENTS if agent.trip is not None]
AIDER = next(agent for agent in AGENTS if agent.name == "aider")
CLAUDE = next(agent for agent in AGENTS if agent.name == "claude_code")


def installed(agent: Agent):
    program, why = agent.found
    if program is None:
        pytest.skip(why)
    return program


@pytest.mark.parametrize("agent", AGENTS, ids=lambda agent: agent.name)
def test_a_second_run_reads_its_prompt_from_the_cache(agent, tmp_path, capsys):
    program = installed(agent)
    with agent.server() as url:
        started = time.perf_counter()
        first = agent.run(program, url, tmp_path, "Say hi")
        middle = time.perf_counter()
        with Counted(url) as counted:
            second = agent.run(program, url, tmp_path, "Say hi")
        ended = time.perf_counter()
    agent.reported(first, second)
    with capsys.disabled():
        print(
            f"\n{agent.name}: first run {middle - started:.1f}s, second run "
            f"{ended - middle:.1f}s: {counted}"
        )
    assert counted.prompt > agent.prompt_tokens  # the agent's real prompt reached the model
    assert counted.cached >= 0.95 * counted.prompt


@pytest.mark.parametrize("agent", TRIPS, ids=lambda agent: agent.name)
def test_a_tool_call_round_trip(agent, tmp_path):
    program = installed(agent)
    trip = agent.trip
    assert trip is not None
    with scripted_server() as (url, engine):
        output = agent.run(program, url, tmp_path, trip.prompt(tmp_path))
    trip.answered(output)
    # The request after the call carried it back with the tool's output.
    reply, result = trip.sent_back(engine.submissions).prompt.messages[-2:]
    assert reply.tool_calls[0].name == trip.tool
    assert result.role == "tool" and result.tool_call_id == reply.tool_calls[0].id
    assert DONE_DIRECTIVE in result.content


def test_an_edit_round_trip(tmp_path):
    # Aider has no function tools. The first reply writes hello.txt in the whole-file
    # format; the test command fails printing the directive that makes the next reply
    # "All done.", which Aider sends back.
    aider = installed(AIDER)
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "hello.txt").write_text("Hi\n")
    edit = "hello.txt\n```\nHello\n```\n"
    test = f"echo '{DONE_DIRECTIVE}'; exit 1"
    with serving(FakeEngine()) as (url, engine):
        message = f"Greet. [[reply:{edit}]]"
        out = AIDER.run(aider, url, tmp_path, message, "--auto-test", "--test-cmd", test)
    assert (tmp_path / "work" / "hello.txt").read_text() == "Hello\n"
    assert len(engine.submissions) == 2
    sent_back = engine.submissions[1].prompt.messages[-1]
    assert sent_back.role == "user" and DONE_DIRECTIVE in sent_back.content
    assert DONE in out


def test_claude_codes_kept_billing_header_shows_as_volatile_on_its_text(tmp_path):
    """Three sessions, three first prompts: the header's `cc_version` suffix changes
    each time, right at the prompt's start, and everything after it is computed again.
    The second session's first request is `edited` there, the third's `volatile`."""
    claude = installed(CLAUDE)
    model = load_model(str(cached_test_model("dense", think_template=True, context=32768)))
    with (
        open_engine(model, CacheConfig(budget_bytes=2 << 30)) as engine,
        serving(engine, keep_billing_header=True) as (url, _),
    ):
        for prompt in ("Say hi", "Say hello", "Name a colour"):
            run = CLAUDE.run(claude, url, tmp_path, prompt)
            assert run["api_error_status"] is None, run["result"]
        records = httpx.get(f"{url}/v1/cache/requests", params={"limit": 100}).json()["data"]
    assert {r["api"] for r in records} == {"messages"}
    changed = [r for r in reversed(records) if r["reason"] in ("edited", "volatile")]
    # Each later session's first request; the others continue their session (hits).
    assert [r["reason"] for r in changed] == ["edited", "volatile"], records
    volatile = changed[-1]
    assert volatile["location"] == {"message": 0, "role": "system"}
    assert "cc_version=" in volatile["before"] and "cc_version=" in volatile["after"]
    assert volatile["before"] != volatile["after"]
    assert volatile["diverged_at"] < 32 and volatile["lost_tokens"] > 8000
