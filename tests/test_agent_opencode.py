"""OpenCode itself (`opencode run`, npm opencode-ai) against the server over the chat
completions API, configured as the README says: a tool round trip, and a second run
that reads at least 95% of its input from the cache.

OpenCode sends `max_tokens` of the model's `limit.output` (32000 unless the config says
otherwise), so the config caps it: the test model's noise never ends by itself. Each
`opencode run` sends two requests: a title for the session (no tools) and the agent's
turn (10 tools, about 7.7K tokens of this tokenizer). `make test-deps` installs it (npm,
no postinstall: the test runs the platform package's binary itself).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from agent_e2e import (
    DONE,
    NODE_MODULES,
    OFFLINE,
    RUN_TIMEOUT_S,
    Counted,
    call,
    done_file,
    npm_package,
    real_server,
    scripted_server,
)

VERSION = "1.18.33"


def opencode_binary() -> tuple[Path | None, str]:
    """OpenCode's native binary for this platform, or why there is none."""
    folder, why = npm_package("opencode-ai", VERSION)
    if folder is None:
        return None, why
    for candidate in sorted(NODE_MODULES.glob("opencode-*/bin/opencode")):
        try:
            out = subprocess.run(
                [str(candidate), "--version"], capture_output=True, text=True, timeout=60
            )
        except OSError:
            continue  # another platform's binary
        if out.returncode == 0 and VERSION in out.stdout:
            return candidate, ""
    return None, "no OpenCode binary for this platform runs here"


BINARY, WHY = opencode_binary()
pytestmark = pytest.mark.skipif(BINARY is None, reason=WHY)


def config(url: str) -> dict:
    """The README's opencode.json for a server at `url`."""
    return {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            "mlx-prefix": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "mlx-prefix",
                "options": {"baseURL": f"{url}/v1", "apiKey": "local"},
                "models": {"default": {"limit": {"context": 32768, "output": 8}}},
            }
        },
        "model": "mlx-prefix/default",
        "autoupdate": False,
        "share": "disabled",
    }


def run_opencode(url: str, tmp: Path, prompt: str) -> list[dict]:
    """One `opencode run`; its JSON events."""
    home, work = tmp / "home", tmp / "work"
    home.mkdir(exist_ok=True)
    work.mkdir(exist_ok=True)
    (work / "opencode.json").write_text(json.dumps(config(url), indent=2))
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        **OFFLINE,
        "OPENCODE_DISABLE_MODELS_FETCH": "1",
        "OPENCODE_DISABLE_AUTOUPDATE": "1",
    }
    done = subprocess.run(
        # One word an argument: `opencode run` quotes an argument that holds a space.
        [str(BINARY), "run", "--format", "json", *prompt.split(" ")],
        cwd=work,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert events, f"opencode printed no events (exit {done.returncode}): {done.stderr[-2000:]}"
    assert not [e for e in events if e["type"] == "error"], events
    return events


def test_a_tool_call_round_trip(tmp_path):
    notes = done_file(tmp_path / "work")
    prompt = "Read the notes. " + call("read", {"filePath": str(notes)})
    with scripted_server() as (url, engine):
        events = run_opencode(url, tmp_path, prompt)
    tools = [e["part"] for e in events if e["type"] == "tool_use"]
    assert [(t["tool"], t["state"]["status"]) for t in tools] == [("read", "completed")]
    texts = [e["part"]["text"] for e in events if e["type"] == "text"]
    assert texts[-1] == DONE
    # The turn's second request carried the call back with the file's content.
    turn = [s for s in engine.submissions if s.prompt.tools]
    reply, result = turn[-1].prompt.messages[-2:]
    assert reply.tool_calls[0].name == "read"
    assert result.role == "tool" and result.tool_call_id == reply.tool_calls[0].id
    assert "[[reply:All done.]]" in result.content


def test_a_second_run_reads_its_prompt_from_the_cache(tmp_path, capsys):
    with real_server() as url:
        run_opencode(url, tmp_path, "Say hi")
        with Counted(url) as second:
            events = run_opencode(url, tmp_path, "Say hi")
    # The model's noise fills the reply: the step stops on its length cap.
    steps = [e["part"] for e in events if e["type"] == "step_finish"]
    assert steps and steps[-1]["reason"] == "length"
    tokens = steps[-1]["tokens"]  # what OpenCode read from the usage we sent
    assert tokens["cache"]["read"] >= 0.95 * (tokens["input"] + tokens["cache"]["read"])
    with capsys.disabled():
        print(f"\nopencode run, second run: {second}")
    assert second.prompt > 5000  # OpenCode's real prompt reached the model
    assert second.cached >= 0.95 * second.prompt
