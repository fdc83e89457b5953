"""Aider itself (`aider --message`, PyPI aider-chat) against the server over the chat
completions API (through LiteLLM's `openai/` provider), configured as the README says: an
edit round trip, and a second run that reads at least 95% of its input from the cache.

Aider has no function tools: the model's reply carries the edit (here the `whole` file
format) and Aider applies it; with `--auto-test` it then runs the test command and sends
a failing command's output back to the model. Its model-settings file caps the reply
(`extra_params.max_tokens`: the test model's noise never ends by itself) and its
metadata file gives the context length, so Aider looks nothing up on the network.
`make test-deps` installs it into a venv of its own under .test-clients/aider.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from agent_e2e import CLIENTS, DONE, DONE_DIRECTIVE, RUN_TIMEOUT_S, Counted, real_server
from server_fakes import FakeEngine, serving

VERSION = "0.86.2"
AIDER = CLIENTS / "aider" / "bin" / "aider"


def aider_version() -> str:
    if not AIDER.exists():
        return "Aider is not installed: run `make test-deps` (needs pip)"
    out = subprocess.run([str(AIDER), "--version"], capture_output=True, text=True, timeout=120)
    if VERSION not in out.stdout:
        return f"Aider in .test-clients is not {VERSION}: run `make test-deps`"
    return ""


WHY = aider_version()
pytestmark = pytest.mark.skipif(bool(WHY), reason=WHY)

SETTINGS = """\
- name: openai/default
  edit_format: whole
  extra_params:
    max_tokens: 8
"""
METADATA = {
    "openai/default": {
        "max_input_tokens": 32768,
        "max_output_tokens": 8,
        "input_cost_per_token": 0,
        "output_cost_per_token": 0,
        "litellm_provider": "openai",
        "mode": "chat",
    }
}


def run_aider(url: str, tmp: Path, message: str, *extra: str) -> str:
    """One `aider --message` run in tmp/work; what it printed."""
    home, work = tmp / "home", tmp / "work"
    home.mkdir(exist_ok=True)
    work.mkdir(exist_ok=True)
    (home / ".aider.model.settings.yml").write_text(SETTINGS)
    (home / ".aider.model.metadata.json").write_text(json.dumps(METADATA))
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "OPENAI_API_BASE": f"{url}/v1",
        "OPENAI_API_KEY": "local",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    }
    flags = ["--no-git", "--no-check-update", "--no-analytics", "--no-show-release-notes"]
    done = subprocess.run(
        [str(AIDER), "--model", "openai/default", "--message", message, "--yes-always", *flags]
        + ["--no-pretty", "--no-stream", *extra],
        cwd=work,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert done.returncode == 0, f"aider failed (exit {done.returncode}): {done.stderr[-2000:]}"
    return done.stdout


def test_an_edit_round_trip(tmp_path):
    # The first reply writes hello.txt in the whole-file format; the test command fails
    # printing the directive that makes the next reply "All done.", which Aider sends back.
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "hello.txt").write_text("Hi\n")
    edit = "hello.txt\n```\nHello\n```\n"
    test = f"echo '{DONE_DIRECTIVE}'; exit 1"
    with serving(FakeEngine()) as (url, engine):
        out = run_aider(
            url, tmp_path, f"Greet. [[reply:{edit}]]", "--auto-test", "--test-cmd", test
        )
    assert (tmp_path / "work" / "hello.txt").read_text() == "Hello\n"
    assert len(engine.submissions) == 2
    sent_back = engine.submissions[1].prompt.messages[-1]
    assert sent_back.role == "user" and DONE_DIRECTIVE in sent_back.content
    assert DONE in out


def test_a_second_run_reads_its_prompt_from_the_cache(tmp_path, capsys):
    with real_server() as url:
        run_aider(url, tmp_path, "Say hi")
        with Counted(url) as second:
            run_aider(url, tmp_path, "Say hi")
    with capsys.disabled():
        print(f"\naider --message, second run: {second}")
    assert second.prompt > 300  # Aider's real prompt reached the model
    assert second.cached >= 0.95 * second.prompt
