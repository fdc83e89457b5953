"""Qwen Code itself (`qwen -p`, npm @qwen-code/qwen-code) against the server over the
chat completions API, configured as the README says: a tool round trip, and a second
run that reads at least 95% of its input from the cache.

Qwen Code reads the endpoint from OPENAI_BASE_URL, OPENAI_API_KEY and OPENAI_MODEL, and
sends `max_tokens` 32000 unless QWEN_CODE_MAX_OUTPUT_TOKENS says otherwise (the test
model's noise never ends by itself). Its headless run sends the agent's turn (about 14K
tokens of this tokenizer, 10 tools: no shell without --yolo) and then a memory
extraction turn. `make test-deps` installs it (npm); it asks for Node 22 but runs on 20.
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

VERSION = "0.24.4"
FOLDER, WHY = npm_package("@qwen-code/qwen-code", VERSION)
if FOLDER is not None and shutil.which("node") is None:
    FOLDER, WHY = None, "Qwen Code needs node on PATH"
pytestmark = pytest.mark.skipif(FOLDER is None, reason=WHY)


def run_qwen(url: str, tmp: Path, prompt: str) -> list[dict]:
    """One `qwen -p` run; its JSON messages (the last is the result)."""
    home, work = tmp / "home", tmp / "work"
    (home / ".qwen").mkdir(parents=True, exist_ok=True)
    work.mkdir(exist_ok=True)
    settings = {"privacy": {"usageStatisticsEnabled": False}}
    (home / ".qwen" / "settings.json").write_text(json.dumps(settings))
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        **OFFLINE,
        "OPENAI_BASE_URL": f"{url}/v1",
        "OPENAI_API_KEY": "local",
        "OPENAI_MODEL": "default",
        "QWEN_CODE_MAX_OUTPUT_TOKENS": "8",
    }
    assert FOLDER is not None
    done = subprocess.run(
        ["node", str(FOLDER / "cli.js"), "-p", prompt, "--output-format", "json"],
        cwd=work,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert done.stdout.strip(), f"qwen printed nothing (exit {done.returncode}): {done.stderr}"
    messages = json.loads(done.stdout)
    result = messages[-1]
    assert result["type"] == "result" and not result["is_error"], result
    return messages


def test_a_tool_call_round_trip(tmp_path):
    notes = done_file(tmp_path / "work")
    prompt = "Read the notes. " + call("read_file", {"file_path": str(notes)})
    with scripted_server() as (url, engine):
        messages = run_qwen(url, tmp_path, prompt)
    assert messages[-1]["result"] == DONE
    assert messages[-1]["stats"]["tools"]["byName"]["read_file"]["success"] == 1
    # The turn's second request carried the call back with the file's content.
    turn = [s for s in engine.submissions if s.prompt.tools and "Read the notes" in str(s)]
    reply, result = turn[1].prompt.messages[-2:]
    assert reply.tool_calls[0].name == "read_file"
    assert result.role == "tool" and result.tool_call_id == reply.tool_calls[0].id
    assert "[[reply:All done.]]" in result.content


def test_a_second_run_reads_its_prompt_from_the_cache(tmp_path, capsys):
    with real_server() as url:
        run_qwen(url, tmp_path, "Say hi")
        with Counted(url) as second:
            result = run_qwen(url, tmp_path, "Say hi")[-1]
    usage = result["usage"]  # what Qwen Code read from the usage we sent
    assert usage["cache_read_input_tokens"] >= 0.95 * usage["input_tokens"]
    with capsys.disabled():
        print(f"\nqwen -p, second run: {second}")
    assert second.prompt > 10000  # Qwen Code's real prompt reached the model
    assert second.cached >= 0.95 * second.prompt
