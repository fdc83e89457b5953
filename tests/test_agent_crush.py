"""Crush itself (`crush run`, npm @charmland/crush) against the server over the chat
completions API, configured as the README says (a crushrc adding an `openai-compat`
provider): a tool round trip, and a second run that reads at least 95% of its input
from the cache.

Crush's npm package holds no binary: its postinstall downloads one from the project's
GitHub releases, which `make test-deps` runs for Crush alone. Where that download cannot
happen (a machine that reaches only the package registries), Crush is not installed and
these tests skip saying so.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from agent_e2e import (
    DONE,
    RUN_TIMEOUT_S,
    Counted,
    call,
    done_file,
    npm_package,
    real_server,
    scripted_server,
)

VERSION = "0.96.1"


def crush_binary() -> tuple[Path | None, str]:
    folder, why = npm_package("@charmland/crush", VERSION)
    download = "its npm postinstall downloads the binary from GitHub releases"
    if folder is None:
        return None, f"{why}; {download}, so npm cannot install it where GitHub is out of reach"
    binary = folder / "bin" / "crush"
    if not binary.exists():
        return None, f"Crush has no binary: {download} and it did not"
    return binary, ""


BINARY, WHY = crush_binary()
pytestmark = pytest.mark.skipif(BINARY is None, reason=WHY)

CRUSHRC = """\
provider add mlx-prefix --type openai-compat --base-url "{url}/v1" --api-key local
model add mlx-prefix/default --name "mlx-prefix" --context-window 32768 --default-max-tokens 8
option provider-auto-update false
"""


def run_crush(url: str, tmp: Path, prompt: str) -> str:
    """One `crush run`; what it printed."""
    home, work = tmp / "home", tmp / "work"
    (home / ".config" / "crush").mkdir(parents=True, exist_ok=True)
    work.mkdir(exist_ok=True)
    (home / ".config" / "crush" / "crushrc").write_text(CRUSHRC.format(url=url))
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_DATA_HOME": str(home / ".local" / "share"),
        "CRUSH_DISABLE_PROVIDER_AUTO_UPDATE": "1",
        "CRUSH_DISABLE_METRICS": "1",
    }
    done = subprocess.run(
        [str(BINARY), "run", "--quiet", "--model", "mlx-prefix/default", prompt],
        cwd=work,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert done.returncode == 0, f"crush failed (exit {done.returncode}): {done.stderr[-2000:]}"
    return done.stdout


def test_a_tool_call_round_trip(tmp_path):
    notes = done_file(tmp_path / "work")
    prompt = "Read the notes. " + call("view", {"file_path": str(notes)})
    with scripted_server() as (url, engine):
        out = run_crush(url, tmp_path, prompt)
    assert out.strip().endswith(DONE)
    turn = [s for s in engine.submissions if s.prompt.tools]
    reply, result = turn[-1].prompt.messages[-2:]
    assert reply.tool_calls[0].name == "view"
    assert result.role == "tool" and result.tool_call_id == reply.tool_calls[0].id
    assert "[[reply:All done.]]" in result.content


def test_a_second_run_reads_its_prompt_from_the_cache(tmp_path, capsys):
    with real_server() as url:
        run_crush(url, tmp_path, "Say hi")
        with Counted(url) as second:
            run_crush(url, tmp_path, "Say hi")
    with capsys.disabled():
        print(f"\ncrush run, second run: {second}")
    assert second.prompt > 2000  # Crush's real prompt reached the model
    assert second.cached >= 0.95 * second.prompt
