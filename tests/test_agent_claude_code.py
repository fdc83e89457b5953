"""Claude Code itself (`claude -p`) against the server, twice, on a hybrid model with a
32K context: its second run reads at least 95% of its input from the cache. With its
billing header kept, each session's header differs (its version suffix follows the
first prompt), and GET /v1/cache/requests says so: `volatile`, at that header's text.

Claude Code's prompt is ~12.5K tokens of this tokenizer (12 tools, three system blocks:
a billing header that changes per run, two with cache_control) and a per-run session id
in `metadata`. The test model's replies are noise, so every reply hits the output cap
(CLAUDE_CODE_MAX_OUTPUT_TOKENS=8) and Claude Code asks to continue a few times before
it gives up with a max-output error: each run is several requests, all of them counted
in the usage its JSON reports. `make test-deps` installs Claude Code (npm, no
postinstall) into the git-ignored .test-clients/ folder; without it the test skips.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from server_fakes import serving

from mlx_prefix.config import CacheConfig
from mlx_prefix.engine.engine import Engine
from mlx_prefix.models.load import load_model
from mlx_prefix.models.testing import cached_test_model

VERSION = "2.1.328"
CLIENTS = Path(__file__).resolve().parent.parent / ".test-clients" / "node_modules"


def claude_binary() -> tuple[Path | None, str]:
    """Claude Code's native binary for this platform, or why there is none."""
    package = CLIENTS / "@anthropic-ai" / "claude-code" / "package.json"
    if not package.is_file():
        return None, "Claude Code is not installed: run `make test-deps` (needs npm)"
    if json.loads(package.read_text()).get("version") != VERSION:
        return None, f"Claude Code in .test-clients is not {VERSION}: run `make test-deps`"
    for candidate in sorted(CLIENTS.glob("@anthropic-ai/claude-code-*/claude")):
        try:
            out = subprocess.run(
                [str(candidate), "--version"], capture_output=True, text=True, timeout=60
            )
        except OSError:
            continue  # another platform's binary
        if out.returncode == 0 and VERSION in out.stdout:
            return candidate, ""
    return None, "no Claude Code binary for this platform runs here"


BINARY, WHY = claude_binary()
pytestmark = pytest.mark.skipif(BINARY is None, reason=WHY)


def run_claude(url: str, home: Path, work: Path, prompt: str = "Say hi") -> dict:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": url,
        "ANTHROPIC_API_KEY": "local",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "8",
    }
    out = subprocess.run(
        [str(BINARY), "-p", prompt, "--output-format", "json"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.stdout.strip(), f"claude printed nothing (exit {out.returncode}): {out.stderr}"
    return json.loads(out.stdout)


def test_second_claude_code_run_reads_its_prompt_from_the_cache(tmp_path, capsys):
    model = load_model(str(cached_test_model("qwen3_5", think_template=True, context=32768)))
    engine = Engine(model, CacheConfig(budget_bytes=2 << 30))
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    with serving(engine) as (url, _):
        started = time.perf_counter()
        first = run_claude(url, home, work)
        middle = time.perf_counter()
        second = run_claude(url, home, work)
        ended = time.perf_counter()
    for run in (first, second):
        # The model's noise fills every reply: Claude Code stops on its output cap, not on
        # an error of ours (an HTTP error would show in api_error_status).
        assert run["api_error_status"] is None, run["result"]
        assert run["num_turns"] >= 1
    usage = second["usage"]
    read = usage["cache_read_input_tokens"]
    total = usage["input_tokens"] + usage["cache_creation_input_tokens"] + read
    with capsys.disabled():
        print(
            f"\nclaude -p: first run {middle - started:.1f}s "
            f"(read {first['usage']['cache_read_input_tokens']}), second run "
            f"{ended - middle:.1f}s: read {read} of {total} input tokens ({read / total:.1%})"
        )
    assert total > 8000  # Claude Code's real prompt reached the model
    assert read >= 0.95 * total


def test_a_kept_billing_header_shows_as_volatile_on_its_text(tmp_path):
    """Three sessions, three first prompts: the header's `cc_version` suffix changes
    each time, right at the prompt's start, and everything after it is computed again."""
    model = load_model(str(cached_test_model("dense", think_template=True, context=32768)))
    engine = Engine(model, CacheConfig(budget_bytes=2 << 30))
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    with serving(engine, keep_billing_header=True) as (url, _):
        for prompt in ("Say hi", "Say hello", "Name a colour"):
            run = run_claude(url, home, work, prompt)
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
