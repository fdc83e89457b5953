"""`mlx-prefix launch AGENT`: every agent's settings derived from the served model's
context (cli/agents.py), `--print-env`, a server started (on a port it binds itself) and
stopped by launch, the API key kept off every command line, and each
agent `make test-deps` installs run twice through launch against a real engine, the
second run reading >= 95% of its prompt from the cache, with no agent setting written by
hand: only launch's.

The model answers one word and ends (tests/support/scripted_model.py): launch gives each agent
the reply cap a 32K context gives (4096 tokens), which random weights would fill."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from support.agent_e2e import CLIENTS, NODE_MODULES, OFFLINE, RUN_TIMEOUT_S, Counted
from support.pool_server import pool_server
from support.scripted_model import scripted_model
from support.server_fakes import FakeEngine, FakeModel, serving

from mlx_prefix.cli.agents import AGENTS, Target, output_cap
from mlx_prefix.config import CacheConfig
from mlx_prefix.engine.engine import Engine
from mlx_prefix.models.load import load_model
from mlx_prefix.models.testing import cached_test_model

TARGET = Target("http://127.0.0.1:9", "k", "tiny", 32768, output_cap(32768))


def test_output_cap_follows_the_context():
    assert [output_cap(c) for c in (1024, 4096, 32768, 131072, 1 << 20)] == [
        256, 512, 4096, 16384, 32768,
    ]  # fmt: skip


def test_each_agent_gets_url_key_model_window_and_cap(tmp_path):
    runs = {name: make(TARGET, ("-p", "hi"), tmp_path / name) for name, make in AGENTS.items()}
    claude = runs["claude"].env
    assert claude["ANTHROPIC_BASE_URL"] == TARGET.url and claude["ANTHROPIC_MODEL"] == "tiny"
    assert claude["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "32768"
    assert claude["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "4096"
    codex = " ".join(runs["codex"].command)
    assert "model_context_window=32768" in codex and f'base_url = "{TARGET.url}/v1"' in codex
    assert runs["codex"].command[-2:] == ("-p", "hi")
    opencode = json.loads(runs["opencode"].env["OPENCODE_CONFIG_CONTENT"])
    limit = opencode["provider"]["mlx-prefix"]["models"]["tiny"]["limit"]
    assert limit == {"context": 32768, "output": 4096} and opencode["model"] == "mlx-prefix/tiny"
    qwen = runs["qwen"]
    assert qwen.env["QWEN_CODE_MAX_OUTPUT_TOKENS"] == "4096"
    [(defaults, text)] = qwen.files.items()
    assert json.loads(text)["model"]["generationConfig"]["contextWindowSize"] == 32768
    assert qwen.env["QWEN_CODE_SYSTEM_DEFAULTS_PATH"] == str(defaults)
    [(config, yaml)] = runs["continue"].files.items()
    assert runs["continue"].command[:3] == ("cn", "--config", str(config))
    assert "contextLength: 32768" in yaml and "maxTokens: 4096" in yaml
    assert runs["cn"] == AGENTS["continue"](TARGET, ("-p", "hi"), tmp_path / "cn")
    aider = runs["aider"]
    metadata = json.loads(next(t for p, t in aider.files.items() if p.suffix == ".json"))
    assert metadata["openai/tiny"]["max_input_tokens"] == 32768
    assert aider.command[1:3] == ("--model", "openai/tiny")
    # An agent argument naming the same thing is the user's: launch leaves it.
    assert AGENTS["aider"](TARGET, ("--model", "x"), tmp_path).command.count("--model") == 1


def launch(*args: str, env: dict[str, str] | None = None, timeout: float = RUN_TIMEOUT_S):
    return subprocess.run(
        [sys.executable, "-m", "mlx_prefix", "launch", *args],
        env=env or os.environ.copy(),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def test_print_env_reads_the_running_servers_context(tmp_path):
    env = {**os.environ, "MLX_PREFIX_HOME": str(tmp_path)}
    with serving(FakeEngine(FakeModel(context_length=8192))) as (url, _):
        done = launch("qwen", "--url", url, "--print-env", env=env)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert f"export OPENAI_BASE_URL={url}/v1" in lines
    assert "export OPENAI_MODEL=fake-model" in lines
    assert "export QWEN_CODE_MAX_OUTPUT_TOKENS=1024" in lines
    assert lines[-1] == "qwen"
    defaults = tmp_path / "launch" / "qwen" / "settings.json"
    assert (
        json.loads(defaults.read_text())["model"]["generationConfig"]["contextWindowSize"] == 8192
    )


def test_print_env_for_a_model_the_server_loads_on_demand(tmp_path):
    other = scripted_model(tmp_path / "other", kind="dense", context=16384)
    env = {**os.environ, "MLX_PREFIX_HOME": str(tmp_path / "home")}
    default = cached_test_model("dense")
    with pool_server(default, allowed_models=(str(other),)) as (url, pool):
        named = launch("claude", "--url", url, "--model", str(other), "--print-env", env=env)
        unknown = launch("claude", "--url", url, "--model", "/no/such", "--print-env", env=env)
        assert len(pool.slots()) == 1  # nothing was loaded for launch
    assert named.returncode == 0, named.stderr
    assert f"export ANTHROPIC_MODEL={other}" in named.stdout.splitlines()
    assert "export CLAUDE_CODE_MAX_CONTEXT_TOKENS=16384" in named.stdout.splitlines()
    assert unknown.returncode == 1 and "does not serve '/no/such'" in unknown.stderr


KEY = "sk-launch-7f3a9c"  # the server's --api-key: it must never be on a command line
# A stand-in agent: asks the server with the key it was given, says what it got and which
# command lines `ps` shows holding the key, exits 3.
STAND_IN = """#!{python}
import json, os, subprocess, sys, urllib.request
env = dict(os.environ)
models = None
if env.get("OPENAI_BASE_URL"):
    ask = urllib.request.Request(env["OPENAI_BASE_URL"] + "/models",
                                 headers={{"Authorization": "Bearer " + env["OPENAI_API_KEY"]}})
    models = json.load(urllib.request.urlopen(ask))
shown = subprocess.run(["ps", "-A", "-ww", "-o", "args="], capture_output=True, text=True).stdout
config = sys.argv[sys.argv.index("--config") + 1] if "--config" in sys.argv else None
files = {{}}
if config:
    files = {{"text": open(config).read(), "mode": os.stat(config).st_mode & 0o777,
             "folder_mode": os.stat(os.path.dirname(config)).st_mode & 0o777}}
json.dump({{"argv": sys.argv[1:], "env": env, "models": models, "config": config,
           "files": files, "ps": [line for line in shown.splitlines() if {key!r} in line]}},
          open({seen!r}, "w"))
sys.exit(3)
"""


def stand_in(bin_dir: Path, name: str, seen: Path) -> None:
    bin_dir.mkdir(exist_ok=True)
    agent = bin_dir / name
    agent.write_text(STAND_IN.format(python=sys.executable, key=KEY, seen=str(seen)))
    agent.chmod(0o755)


def test_launch_starts_a_server_runs_the_agent_returns_its_code_and_stops_it(tmp_path):
    model = scripted_model(tmp_path / "model", kind="dense")
    bin_dir, seen = tmp_path / "bin", tmp_path / "seen.json"
    stand_in(bin_dir, "qwen", seen)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "MLX_PREFIX_HOME": str(tmp_path / "home"), "MLX_PREFIX_DISK_SCOPE": "off"}  # fmt: skip
    env["MLX_PREFIX_SERVER_API_KEY"] = KEY  # launch's own --api-key, off its command line
    # Port 0: the server binds a free port and launch reads it from its startup line (a
    # port probed free first could be taken before the server binds it).
    url = "http://127.0.0.1:0"
    done = launch("qwen", "--url", url, "--model", str(model), "--", "-p", "hi", env=env)
    assert done.returncode == 3, done.stderr
    got = json.loads(seen.read_text())
    assert got["argv"] == ["-p", "hi"]
    assert got["models"]["data"][0]["id"] == "model"  # asked with the key it was given
    assert got["env"]["OPENAI_MODEL"] == "model" and got["env"]["OPENAI_API_KEY"] == KEY
    assert got["env"]["QWEN_CODE_MAX_OUTPUT_TOKENS"] == str(output_cap(4096))
    # No command line held the key while the agent ran: not the agent's, not the server's.
    assert got["ps"] == []
    served = got["env"]["OPENAI_BASE_URL"].removesuffix("/v1")
    assert served.startswith("http://127.0.0.1:") and not served.endswith(":0")
    with pytest.raises(httpx.ConnectError):  # launch stopped the server it started
        httpx.get(served + "/health", timeout=5)
    log = (tmp_path / "home" / "launch" / "server" / "serve.log").read_text()
    assert "serving model on" in log and KEY not in log


def test_a_config_file_holding_the_key_is_the_users_alone_and_removed_after(tmp_path):
    bin_dir, seen = tmp_path / "bin", tmp_path / "seen.json"
    stand_in(bin_dir, "cn", seen)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "MLX_PREFIX_HOME": str(tmp_path / "home"), "MLX_PREFIX_SERVER_API_KEY": KEY}  # fmt: skip
    with serving(FakeEngine(FakeModel(context_length=8192)), api_key=KEY) as (url, _):
        done = launch("continue", "--url", url, "--", "-p", "hi", env=env)
    assert done.returncode == 3, done.stderr
    got = json.loads(seen.read_text())
    assert f"apiKey: {json.dumps(KEY)}" in got["files"]["text"]  # the agent got the key
    assert got["files"]["mode"] == 0o600 and got["files"]["folder_mode"] == 0o700
    assert KEY not in " ".join(got["argv"]) and got["ps"] == []
    assert not Path(got["config"]).exists()  # removed once the agent exited
    assert not Path(got["config"]).parent.exists()


# -- each installed agent, twice through launch -------------------------------------


def _agents() -> dict[str, tuple[list[str], str]]:
    """Installed agents: name -> (the command that runs it, why not when missing)."""
    claude = sorted(NODE_MODULES.glob("@anthropic-ai/claude-code-*/claude"))
    opencode = sorted(NODE_MODULES.glob("opencode-*/bin/opencode"))
    codex = NODE_MODULES / ".bin" / "codex"
    node = shutil.which("node")
    found = {
        "claude": [str(claude[0])] if claude else [],
        "codex": [str(codex)] if codex.exists() and node else [],
        "opencode": [str(opencode[0])] if opencode else [],
        "qwen": [node, str(NODE_MODULES / "@qwen-code/qwen-code/cli.js")] if node else [],
        "cn": [node, str(NODE_MODULES / "@continuedev/cli/dist/cn.js")] if node else [],
        "aider": [str(CLIENTS / "aider" / "bin" / "aider")],
    }
    return {k: (v, "") if v and Path(v[-1]).exists() else ([], f"{k} is not installed: "
            "run `make test-deps`") for k, v in found.items()}  # fmt: skip


INSTALLED = _agents()
# The agent's own headless switches: how it runs one prompt and exits (not a setting).
HEADLESS = {
    "claude": ["-p", "Say hi", "--output-format", "json"],
    "codex": ["exec", "--skip-git-repo-check", "--json", "Say hi"],
    "opencode": ["run", "--format", "json", "Say", "hi"],
    "qwen": ["-p", "Say hi", "--output-format", "json"],
    "cn": ["-p", "Say hi", "--format", "json"],
    "aider": ["--message", "Say hi", "--yes-always", "--no-git", "--no-check-update",
              "--no-analytics", "--no-show-release-notes", "--no-pretty", "--no-stream"],
}  # fmt: skip


@pytest.fixture(scope="module")
def served_model(tmp_path_factory):
    folder = scripted_model(
        tmp_path_factory.mktemp("scripted") / "tiny-agent",
        kind="qwen3_5",
        think_template=True,
        context=32768,
    )
    cache = CacheConfig(budget_bytes=1 << 30, prefill_chunk=256, checkpoint_interval=2048)
    engine = Engine(load_model(str(folder)), cache)
    try:
        with serving(engine) as (url, _):
            yield url
    finally:
        engine.shutdown()


@pytest.mark.parametrize("agent", sorted(HEADLESS))
def test_an_agent_runs_twice_through_launch_and_reads_its_prompt_from_the_cache(
    agent, served_model, tmp_path, capsys
):
    command, why = INSTALLED[agent]
    if not command:
        pytest.skip(why)
    bin_dir, home, work = tmp_path / "bin", tmp_path / "home", tmp_path / "work"
    for d in (bin_dir, home, work):
        d.mkdir()
    wrapper = bin_dir / agent
    wrapper.write_text(f'#!/bin/sh\nexec {" ".join(map(repr, command))} "$@"\n')
    wrapper.chmod(0o755)
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
        "HOME": str(home),
        "MLX_PREFIX_HOME": str(home / ".mlx-prefix"),
        **OFFLINE,
    }
    if "PYTHONPATH" in os.environ:  # launch itself is this checkout's
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]

    def run() -> subprocess.CompletedProcess:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "mlx_prefix",
                "launch",
                agent,
                "--url",
                served_model,
                "--",
                *HEADLESS[agent],
            ],  # fmt: skip
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
        assert done.returncode == 0, f"{agent} exit {done.returncode}: {done.stderr[-3000:]}"
        return done

    first = run()
    with Counted(served_model) as second:
        out = run()
    with capsys.disabled():
        print(f"\nlaunch {agent}, second run: {second}")
    assert "Hi" in first.stdout + out.stdout  # the model's answer reached the agent's output
    assert second.prompt > 300  # the agent's real prompt reached the model
    assert second.cached >= 0.95 * second.prompt
