"""Codex CLI itself (`codex exec`, npm @openai/codex) against a live server over
/v1/responses, configured as the README says.

Tests never touch the network, so Codex must already be installed: set MLX_PREFIX_CODEX
to its binary, put `codex` on PATH, or run
`npm install --prefix .test-clients --ignore-scripts @openai/codex@0.169.0`.
Skipped (saying so) otherwise.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
from conftest import loaded_test_model
from server_fakes import FakeEngine, FakeModel, FakeTokenizer, serving

from mlx_prefix.config import CacheConfig, EngineConfig
from mlx_prefix.engine.engine import Engine
from mlx_prefix.models.load import load_model
from mlx_prefix.models.testing import cached_test_model
from mlx_prefix.records import ToolCallIds

ROOT = Path(__file__).resolve().parent.parent
INSTALL = "npm install --prefix .test-clients --ignore-scripts @openai/codex@0.169.0"
CONFIG = """\
model = "default"
model_provider = "mlx-prefix"
web_search = "disabled"
check_for_update_on_startup = false

[agents]
enabled = false

[analytics]
enabled = false

[model_providers.mlx-prefix]
name = "mlx-prefix"
base_url = "{url}/v1"
wire_api = "responses"
"""


def find_codex() -> str | None:
    named = os.environ.get("MLX_PREFIX_CODEX")
    if named:
        return named
    local = ROOT / ".test-clients" / "node_modules" / ".bin" / "codex"
    if local.exists() and shutil.which("node"):
        return str(local)
    return shutil.which("codex")


@pytest.fixture(scope="module")
def codex() -> str:
    found = find_codex()
    if found is None:
        pytest.skip(f"Codex CLI is not installed (tests stay offline); install it: {INSTALL}")
    return found


def run_codex(codex: str, url: str, tmp: Path, prompt: str) -> list[dict]:
    """One `codex exec` session; its JSON events."""
    home, work = tmp / "home", tmp / "work"
    home.mkdir(exist_ok=True)
    work.mkdir(exist_ok=True)
    (home / "config.toml").write_text(CONFIG.format(url=url))
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "CODEX_HOME": str(home)}
    command = [codex, "exec", "--skip-git-repo-check", "--json", "-s", "danger-full-access"]
    done = subprocess.run(
        [*command, prompt],
        cwd=work,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert events, f"codex printed no events (exit {done.returncode}): {done.stderr[-2000:]}"
    return events


def test_a_tool_call_round_trip(codex, tmp_path):
    # The fake engine replies with a call to Codex's shell tool; the command prints the
    # directive that makes the next reply "All done." once Codex sends its output back.
    command = "printf '\\x5b\\x5breply:All done.\\x5d\\x5d'"
    call = json.dumps({"name": "exec_command", "arguments": {"cmd": command}})
    model = FakeModel(context_length=1 << 20, tokenizer=FakeTokenizer.with_json_tools())
    with serving(FakeEngine(model)) as (url, engine):
        events = run_codex(codex, url, tmp_path, f"Run it. [[reply:<tool_call>{call}</tool_call>]]")
    items = [e["item"] for e in events if e["type"] == "item.completed"]
    ran = [i for i in items if i["type"] == "command_execution"]
    assert [i["aggregated_output"] for i in ran] == ["[[reply:All done.]]"]
    assert [i["text"] for i in items if i["type"] == "agent_message"] == ["All done."]
    assert events[-1]["type"] == "turn.completed"
    first, second = engine.submissions[:2]
    assert first.prompt.tools and len(engine.submissions) == 2
    # Codex sent the call back under the id the server gave it, with the tool's output.
    call_id = ToolCallIds(first.request_id).id(0)
    assert second.prompt.messages is not None
    reply, result = second.prompt.messages[-2:]
    assert [c.id for c in reply.tool_calls] == [call_id]
    assert result.role == "tool" and result.tool_call_id == call_id


def long_context_hybrid(tmp: Path) -> Engine:
    """The tiny qwen3_5 hybrid with a 32K context: Codex's prompt is about 6.5K tokens."""
    folder = tmp / "model"
    shutil.copytree(cached_test_model("qwen3_5", think_template=True), folder)
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["max_position_embeddings"] = 32768
    (folder / "config.json").write_text(json.dumps(config))
    assert loaded_test_model("qwen3_5", think_template=True).context_length == 4096
    cache = CacheConfig(budget_bytes=1 << 30, prefill_chunk=256, checkpoint_interval=2048)
    return Engine(load_model(str(folder)), cache, EngineConfig())


def token_counters(url: str) -> tuple[float, float]:
    text = httpx.get(f"{url}/metrics").text
    prompt = re.search(r"^mlx_prefix_prompt_tokens_total (\S+)$", text, re.M)
    cached = re.search(r"^mlx_prefix_cached_tokens_total (\S+)$", text, re.M)
    assert prompt and cached
    return float(prompt.group(1)), float(cached.group(1))


def test_a_second_session_reads_its_prompt_from_the_cache(codex, tmp_path):
    engine = long_context_hybrid(tmp_path)
    try:
        # Short replies: the random model never ends its reply, so each response stops
        # at max_output_tokens and Codex reports it (having parsed the whole stream).
        with serving(engine, default_max_tokens=8) as (url, _):
            first = run_codex(codex, url, tmp_path, "Say hi")
            before = token_counters(url)
            second = run_codex(codex, url, tmp_path, "Say hi")
            prompt, cached = (a - b for a, b in zip(token_counters(url), before, strict=True))
    finally:
        engine.shutdown()
    for events in (first, second):
        assert events[-1]["type"] == "turn.failed"
        assert "max_output_tokens" in events[-1]["error"]["message"]
    assert prompt > 4000
    assert cached >= 0.95 * prompt, f"{cached:.0f} of {prompt:.0f} prompt tokens from the cache"
