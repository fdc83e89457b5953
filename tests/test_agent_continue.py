"""Continue's CLI itself (`cn -p`, npm @continuedev/cli) against the server over the
chat completions API, configured as the README says: a tool round trip, and a second
run that reads at least 95% of its input from the cache.

`cn` reads a config.yaml (`--config`) naming the model under the `openai` provider with
the server as its `apiBase`; `defaultCompletionOptions.maxTokens` caps the reply (the
test model's noise never ends by itself). Its headless turn is one request (9 tools,
about 1.6K tokens of this tokenizer). `make test-deps` installs it (npm).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from agent_e2e import (
    DONE,
    OFFLINE,
    RUN_TIMEOUT_S,
    Counted,
    call,
    done_file,
    npm_package,
    real_server,
    scripted_server,
)

VERSION = "1.5.47"
FOLDER, WHY = npm_package("@continuedev/cli", VERSION)
if FOLDER is not None and shutil.which("node") is None:
    FOLDER, WHY = None, "Continue's CLI needs node on PATH"
pytestmark = pytest.mark.skipif(FOLDER is None, reason=WHY)

CONFIG = """\
name: mlx-prefix
version: 1.0.0
schema: v1
models:
  - name: mlx-prefix
    provider: openai
    model: default
    apiBase: {url}/v1
    apiKey: local
    roles: [chat, edit, apply]
    defaultCompletionOptions:
      maxTokens: 8
"""


def run_cn(url: str, tmp: Path, prompt: str) -> str:
    """One `cn -p` run; its answer."""
    home, work = tmp / "home", tmp / "work"
    home.mkdir(exist_ok=True)
    work.mkdir(exist_ok=True)
    config = tmp / "config.yaml"
    config.write_text(CONFIG.format(url=url))
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        **OFFLINE,
        "CONTINUE_METRICS_ENABLED": "0",
    }
    assert FOLDER is not None
    command = ["node", str(FOLDER / "dist" / "cn.js"), "-p", prompt, "--config", str(config)]
    done = subprocess.run(
        [*command, "--format", "json"],
        cwd=work,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert done.returncode == 0, f"cn failed (exit {done.returncode}): {done.stderr[-2000:]}"
    answer = json.loads(done.stdout)
    assert answer["status"] == "success", answer
    return answer["response"]


def test_a_tool_call_round_trip(tmp_path):
    notes = done_file(tmp_path / "work")
    prompt = "Read the notes. " + call("Read", {"filepath": str(notes)})
    with scripted_server() as (url, engine):
        answer = run_cn(url, tmp_path, prompt)
    assert answer == DONE
    # The second request carried the call back with the file's content.
    assert len(engine.submissions) == 2
    reply, result = engine.submissions[1].prompt.messages[-2:]
    assert reply.tool_calls[0].name == "Read"
    assert result.role == "tool" and result.tool_call_id == reply.tool_calls[0].id
    assert "[[reply:All done.]]" in result.content


def test_a_second_run_reads_its_prompt_from_the_cache(tmp_path, capsys):
    with real_server() as url:
        run_cn(url, tmp_path, "Say hi")
        with Counted(url) as second:
            run_cn(url, tmp_path, "Say hi")
    with capsys.disabled():
        print(f"\ncn -p, second run: {second}")
    assert second.prompt > 1000  # Continue's real prompt reached the model
    assert second.cached >= 0.95 * second.prompt
