"""The coding agents that test_agents.py drives, one row each in AGENTS: how to find the
agent `make test-deps` installed (or why it is absent: its tests skip saying so), how to
run it headless against a server, and what is its own in each test: how much prompt
it brings, what it reports of a second run, and which of its tools a round trip calls.
Every agent talks to the server as docs/clients.md configures it.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlx_prefix.config import CacheConfig
from mlx_prefix.records import ToolCallIds
from support.agent_e2e import (
    CLIENTS,
    DONE,
    NODE_MODULES,
    OFFLINE,
    ROOT,
    RUN_TIMEOUT_S,
    call,
    done_file,
    native_binary,
    npm_package,
    real_server,
)
from support.server_fakes import Submission

Found = tuple[Any, str]  # the agent's program (None: absent) and why it is absent


@dataclass(frozen=True)
class ToolTrip:
    """A tool round trip: the fake engine replies with a call to one of the agent's own
    tools, the agent runs it, and the tool's output makes the next reply "All done."."""

    tool: str  # the agent's tool the reply calls
    prompt: Callable[[Path], str]  # the run's prompt (the test's tmp folder)
    answered: Callable[[Any], None]  # the agent's output: it ran the tool, ended on DONE
    sent_back: Callable[[list[Submission]], Submission]  # the request carrying the result


@dataclass(frozen=True)
class Agent:
    name: str  # the test id
    find: Callable[[], Found]
    # One headless run: (program, server URL, tmp folder, prompt, extra flags) -> its
    # output, parsed.
    run: Callable[..., Any]
    prompt_tokens: int  # fewer prompt tokens per run: the agent's real prompt got lost
    # What the agent reported of its two runs of one prompt (how each ended, the usage
    # it read from ours); nothing to check by default.
    reported: Callable[[Any, Any], None] = lambda first, second: None
    server: Callable[[], Any] = real_server  # a live server over the real engine: URL
    trip: ToolTrip | None = None

    @functools.cached_property
    def found(self) -> Found:
        return self.find()


def environment(home: Path, **extra: str) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), **extra}


def headless(command: list[str], work: Path, env: dict[str, str], timeout: float = RUN_TIMEOUT_S):
    return subprocess.run(
        command,
        cwd=work,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def folders(tmp: Path) -> tuple[Path, Path]:
    home, work = tmp / "home", tmp / "work"
    home.mkdir(exist_ok=True)
    work.mkdir(exist_ok=True)
    return home, work


def read_notes(tool: str, path_field: str) -> Callable[[Path], str]:
    """A prompt whose reply calls `tool` on a notes file that holds the DONE directive
    (in the agent's working folder, where agents read without asking)."""

    def prompt(tmp: Path) -> str:
        return "Read the notes. " + call(tool, {path_field: str(done_file(tmp / "work"))})

    return prompt


def last_with_tools(submissions: list[Submission]) -> Submission:
    return [s for s in submissions if s.prompt.tools][-1]


# Claude Code (`claude -p`, Anthropic Messages). Its prompt is ~12.5K tokens of this
# tokenizer (12 tools, three system blocks: a billing header that changes per run, two
# with cache_control) and a per-run session id in `metadata`. The test model's replies
# are noise, so every reply hits the output cap and Claude Code asks to continue a few
# times before it gives up with a max-output error: each run is several requests, all
# counted in the usage its JSON reports. The server keeps its default reply cap.
CLAUDE_CODE = "2.1.328"


def find_claude() -> Found:
    package = NODE_MODULES / "@anthropic-ai" / "claude-code" / "package.json"
    if not package.is_file():
        return None, "Claude Code is not installed: run `make test-deps` (needs npm)"
    if json.loads(package.read_text()).get("version") != CLAUDE_CODE:
        return None, f"Claude Code in .test-clients is not {CLAUDE_CODE}: run `make test-deps`"
    return native_binary("@anthropic-ai/claude-code-*/claude", CLAUDE_CODE, "Claude Code")


def run_claude(binary: Path, url: str, tmp: Path, prompt: str, max_output_tokens: int = 8) -> dict:
    home, work = folders(tmp)
    env = environment(
        home,
        ANTHROPIC_BASE_URL=url,
        ANTHROPIC_API_KEY="local",
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
        DISABLE_TELEMETRY="1",
        DISABLE_AUTOUPDATER="1",
        CLAUDE_CODE_MAX_OUTPUT_TOKENS=str(max_output_tokens),
    )
    out = headless([str(binary), "-p", prompt, "--output-format", "json"], work, env)
    assert out.stdout.strip(), f"claude printed nothing (exit {out.returncode}): {out.stderr}"
    return json.loads(out.stdout)


def claude_reported(first: dict, second: dict) -> None:
    for run in (first, second):
        # The model's noise fills every reply: Claude Code stops on its output cap, not on
        # an error of ours (an HTTP error would show in api_error_status).
        assert run["api_error_status"] is None, run["result"]
        assert run["num_turns"] >= 1
    usage = second["usage"]
    read = usage["cache_read_input_tokens"]
    total = usage["input_tokens"] + usage["cache_creation_input_tokens"] + read
    assert total > 8000  # Claude Code's real prompt reached the model
    assert read >= 0.95 * total


# Codex CLI (`codex exec`, npm @openai/codex, the Responses API). Codex resends ~6.5K
# tokens of instructions and tools. Set MLX_PREFIX_CODEX to its binary, put `codex` on
# PATH, or install it into .test-clients.
CODEX_INSTALL = "npm install --prefix .test-clients --ignore-scripts @openai/codex@0.169.0"
CODEX_CONFIG = """\
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
# The shell command the reply calls: it prints the directive of the next reply.
CODEX_COMMAND = "printf '\\x5b\\x5breply:All done.\\x5d\\x5d'"


def find_codex() -> Found:
    named = os.environ.get("MLX_PREFIX_CODEX")
    if named:
        return named, ""
    local = ROOT / ".test-clients" / "node_modules" / ".bin" / "codex"
    if local.exists() and shutil.which("node"):
        return str(local), ""
    found = shutil.which("codex")
    why = f"Codex CLI is not installed (tests stay offline); install it: {CODEX_INSTALL}"
    return found, "" if found else why


def run_codex(codex: str, url: str, tmp: Path, prompt: str) -> list[dict]:
    """One `codex exec` session; its JSON events."""
    home, work = folders(tmp)
    (home / "config.toml").write_text(CODEX_CONFIG.format(url=url))
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "CODEX_HOME": str(home)}
    command = [codex, "exec", "--skip-git-repo-check", "--json", "-s", "danger-full-access"]
    done = headless([*command, prompt], work, env, timeout=300)
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert events, f"codex printed no events (exit {done.returncode}): {done.stderr[-2000:]}"
    return events


def codex_reported(first: list[dict], second: list[dict]) -> None:
    # The random model never ends its reply, so each response stops at
    # max_output_tokens and Codex reports it (having parsed the whole stream).
    for events in (first, second):
        assert events[-1]["type"] == "turn.failed"
        assert "max_output_tokens" in events[-1]["error"]["message"]


def codex_answered(events: list[dict]) -> None:
    items = [e["item"] for e in events if e["type"] == "item.completed"]
    ran = [i for i in items if i["type"] == "command_execution"]
    assert [i["aggregated_output"] for i in ran] == ["[[reply:All done.]]"]
    assert [i["text"] for i in items if i["type"] == "agent_message"] == [DONE]
    assert events[-1]["type"] == "turn.completed"


def codex_sent_back(submissions: list[Submission]) -> Submission:
    first, second = submissions[:2]
    assert first.prompt.tools and len(submissions) == 2
    # Codex sent the call back under the id the server gave it, with the tool's output.
    call_id = ToolCallIds(first.request_id).id(0)
    assert second.prompt.messages is not None
    assert [c.id for c in second.prompt.messages[-2].tool_calls] == [call_id]
    return second


def codex_prompt(tmp: Path) -> str:
    body = json.dumps({"name": "exec_command", "arguments": {"cmd": CODEX_COMMAND}})
    return f"Run it. [[reply:<tool_call>{body}</tool_call>]]"


# OpenCode (`opencode run`, npm opencode-ai, chat completions). It sends `max_tokens` of
# the model's `limit.output` (32000 unless the config says otherwise), so the config caps
# it. Each run sends two requests: a title for the session (no tools) and the agent's
# turn (10 tools, about 7.7K tokens of this tokenizer).
OPENCODE = "1.18.33"


def find_opencode() -> Found:
    folder, why = npm_package("opencode-ai", OPENCODE)
    if folder is None:
        return None, why
    return native_binary("opencode-*/bin/opencode", OPENCODE, "OpenCode")


def opencode_config(url: str) -> dict:
    """docs/clients.md's opencode.json for a server at `url`."""
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


def run_opencode(binary: Path, url: str, tmp: Path, prompt: str) -> list[dict]:
    """One `opencode run`; its JSON events."""
    home, work = folders(tmp)
    (work / "opencode.json").write_text(json.dumps(opencode_config(url), indent=2))
    env = environment(
        home, **OFFLINE, OPENCODE_DISABLE_MODELS_FETCH="1", OPENCODE_DISABLE_AUTOUPDATE="1"
    )
    # One word an argument: `opencode run` quotes an argument that holds a space.
    done = headless([str(binary), "run", "--format", "json", *prompt.split(" ")], work, env)
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert events, f"opencode printed no events (exit {done.returncode}): {done.stderr[-2000:]}"
    assert not [e for e in events if e["type"] == "error"], events
    return events


def opencode_reported(first: list[dict], second: list[dict]) -> None:
    # The model's noise fills the reply: the step stops on its length cap.
    steps = [e["part"] for e in second if e["type"] == "step_finish"]
    assert steps and steps[-1]["reason"] == "length"
    tokens = steps[-1]["tokens"]  # what OpenCode read from the usage we sent
    assert tokens["cache"]["read"] >= 0.95 * (tokens["input"] + tokens["cache"]["read"])


def opencode_answered(events: list[dict]) -> None:
    tools = [e["part"] for e in events if e["type"] == "tool_use"]
    assert [(t["tool"], t["state"]["status"]) for t in tools] == [("read", "completed")]
    texts = [e["part"]["text"] for e in events if e["type"] == "text"]
    assert texts[-1] == DONE


# Qwen Code (`qwen -p`, npm @qwen-code/qwen-code, chat completions). It reads the
# endpoint from OPENAI_BASE_URL, OPENAI_API_KEY and OPENAI_MODEL, and sends `max_tokens`
# 32000 unless QWEN_CODE_MAX_OUTPUT_TOKENS says otherwise. Its headless run sends the
# agent's turn (about 14K tokens, 10 tools: no shell without --yolo) and then a memory
# extraction turn. It asks for Node 22 but runs on 20.
QWEN_CODE = "0.24.4"


def find_node_package(name: str, version: str, agent: str) -> Callable[[], Found]:
    def find() -> Found:
        folder, why = npm_package(name, version)
        if folder is not None and shutil.which("node") is None:
            return None, f"{agent} needs node on PATH"
        return folder, why

    return find


def run_qwen(folder: Path, url: str, tmp: Path, prompt: str) -> list[dict]:
    """One `qwen -p` run; its JSON messages (the last is the result)."""
    home, work = folders(tmp)
    (home / ".qwen").mkdir(parents=True, exist_ok=True)
    settings = {"privacy": {"usageStatisticsEnabled": False}}
    (home / ".qwen" / "settings.json").write_text(json.dumps(settings))
    env = environment(
        home,
        **OFFLINE,
        OPENAI_BASE_URL=f"{url}/v1",
        OPENAI_API_KEY="local",
        OPENAI_MODEL="default",
        QWEN_CODE_MAX_OUTPUT_TOKENS="8",
    )
    command = ["node", str(folder / "cli.js"), "-p", prompt, "--output-format", "json"]
    done = headless(command, work, env)
    assert done.stdout.strip(), f"qwen printed nothing (exit {done.returncode}): {done.stderr}"
    messages = json.loads(done.stdout)
    result = messages[-1]
    assert result["type"] == "result" and not result["is_error"], result
    return messages


def qwen_reported(first: list[dict], second: list[dict]) -> None:
    usage = second[-1]["usage"]  # what Qwen Code read from the usage we sent
    assert usage["cache_read_input_tokens"] >= 0.95 * usage["input_tokens"]


def qwen_answered(messages: list[dict]) -> None:
    assert messages[-1]["result"] == DONE
    assert messages[-1]["stats"]["tools"]["byName"]["read_file"]["success"] == 1


def qwen_sent_back(submissions: list[Submission]) -> Submission:
    # The turn's second request (the memory extraction turn is another).
    return [s for s in submissions if s.prompt.tools and "Read the notes" in str(s)][1]


# Continue's CLI (`cn -p`, npm @continuedev/cli, chat completions). It reads a
# config.yaml (`--config`) naming the model under the `openai` provider with the server
# as its `apiBase`; `defaultCompletionOptions.maxTokens` caps the reply. Its headless
# turn is one request (9 tools, about 1.6K tokens of this tokenizer).
CONTINUE = "1.5.47"
CONTINUE_CONFIG = """\
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


def run_cn(folder: Path, url: str, tmp: Path, prompt: str) -> str:
    """One `cn -p` run; its answer."""
    home, work = folders(tmp)
    config = tmp / "config.yaml"
    config.write_text(CONTINUE_CONFIG.format(url=url))
    env = environment(home, **OFFLINE, CONTINUE_METRICS_ENABLED="0")
    command = ["node", str(folder / "dist" / "cn.js"), "-p", prompt, "--config", str(config)]
    done = headless([*command, "--format", "json"], work, env)
    assert done.returncode == 0, f"cn failed (exit {done.returncode}): {done.stderr[-2000:]}"
    answer = json.loads(done.stdout)
    assert answer["status"] == "success", answer
    return answer["response"]


def continue_sent_back(submissions: list[Submission]) -> Submission:
    assert len(submissions) == 2  # one turn: the call, then its result sent back
    return submissions[1]


def answered_done(answer: str) -> None:
    assert answer == DONE


# Crush (`crush run`, npm @charmland/crush, chat completions; a crushrc adds an
# `openai-compat` provider). Its npm package holds no binary: its postinstall downloads
# one from the project's GitHub releases, which `make test-deps` runs for Crush alone;
# where that cannot happen (a machine that reaches only the package registries), Crush
# is not installed and its tests skip saying so.
CRUSH = "0.96.1"
CRUSHRC = """\
provider add mlx-prefix --type openai-compat --base-url "{url}/v1" --api-key local
model add mlx-prefix/default --name "mlx-prefix" --context-window 32768 --default-max-tokens 8
option provider-auto-update false
"""


def find_crush() -> Found:
    folder, why = npm_package("@charmland/crush", CRUSH)
    download = "its npm postinstall downloads the binary from GitHub releases"
    if folder is None:
        return None, f"{why}; {download}, so npm cannot install it where GitHub is out of reach"
    binary = folder / "bin" / "crush"
    if not binary.exists():
        return None, f"Crush has no binary: {download} and it did not"
    return binary, ""


def run_crush(binary: Path, url: str, tmp: Path, prompt: str) -> str:
    """One `crush run`; what it printed."""
    home, work = folders(tmp)
    (home / ".config" / "crush").mkdir(parents=True, exist_ok=True)
    (home / ".config" / "crush" / "crushrc").write_text(CRUSHRC.format(url=url))
    env = environment(
        home,
        XDG_CONFIG_HOME=str(home / ".config"),
        XDG_DATA_HOME=str(home / ".local" / "share"),
        CRUSH_DISABLE_PROVIDER_AUTO_UPDATE="1",
        CRUSH_DISABLE_METRICS="1",
    )
    command = [str(binary), "run", "--quiet", "--model", "mlx-prefix/default", prompt]
    done = headless(command, work, env)
    assert done.returncode == 0, f"crush failed (exit {done.returncode}): {done.stderr[-2000:]}"
    return done.stdout


def crush_answered(out: str) -> None:
    assert out.strip().endswith(DONE)


# Aider (`aider --message`, PyPI aider-chat, chat completions through LiteLLM's `openai/`
# provider), in a venv of its own under .test-clients/aider. It has no function tools:
# the reply carries the edit (the `whole` file format) and Aider applies it
# (test_agents.test_an_edit_round_trip). Its model-settings file caps the reply and its
# metadata file gives the context length, so Aider looks nothing up on the network.
AIDER = "0.86.2"
AIDER_SETTINGS = """\
- name: openai/default
  edit_format: whole
  extra_params:
    max_tokens: 8
"""
AIDER_METADATA = {
    "openai/default": {
        "max_input_tokens": 32768,
        "max_output_tokens": 8,
        "input_cost_per_token": 0,
        "output_cost_per_token": 0,
        "litellm_provider": "openai",
        "mode": "chat",
    }
}


def find_aider() -> Found:
    aider = CLIENTS / "aider" / "bin" / "aider"
    if not aider.exists():
        return None, "Aider is not installed: run `make test-deps` (needs pip)"
    out = subprocess.run([str(aider), "--version"], capture_output=True, text=True, timeout=120)
    if AIDER not in out.stdout:
        return None, f"Aider in .test-clients is not {AIDER}: run `make test-deps`"
    return aider, ""


def run_aider(aider: Path, url: str, tmp: Path, message: str, *extra: str) -> str:
    """One `aider --message` run in tmp/work; what it printed."""
    home, work = folders(tmp)
    (home / ".aider.model.settings.yml").write_text(AIDER_SETTINGS)
    (home / ".aider.model.metadata.json").write_text(json.dumps(AIDER_METADATA))
    env = environment(
        home,
        OPENAI_API_BASE=f"{url}/v1",
        OPENAI_API_KEY="local",
        LITELLM_LOCAL_MODEL_COST_MAP="True",
    )
    flags = ["--no-git", "--no-check-update", "--no-analytics", "--no-show-release-notes"]
    command = [str(aider), "--model", "openai/default", "--message", message, "--yes-always"]
    done = headless([*command, *flags, "--no-pretty", "--no-stream", *extra], work, env)
    assert done.returncode == 0, f"aider failed (exit {done.returncode}): {done.stderr[-2000:]}"
    return done.stdout


def claude_server() -> Any:
    return real_server(max_tokens=None, cache=CacheConfig(budget_bytes=2 << 30))


AGENTS: Sequence[Agent] = (
    Agent("claude_code", find_claude, run_claude, 8000, claude_reported, claude_server),
    Agent(
        "codex",
        find_codex,
        run_codex,
        4000,
        codex_reported,
        trip=ToolTrip("exec_command", codex_prompt, codex_answered, codex_sent_back),
    ),
    Agent(
        "opencode",
        find_opencode,
        run_opencode,
        5000,
        opencode_reported,
        trip=ToolTrip("read", read_notes("read", "filePath"), opencode_answered, last_with_tools),
    ),
    Agent(
        "qwen_code",
        find_node_package("@qwen-code/qwen-code", QWEN_CODE, "Qwen Code"),
        run_qwen,
        10000,
        qwen_reported,
        trip=ToolTrip(
            "read_file", read_notes("read_file", "file_path"), qwen_answered, qwen_sent_back
        ),
    ),
    Agent(
        "continue",
        find_node_package("@continuedev/cli", CONTINUE, "Continue's CLI"),
        run_cn,
        1000,
        trip=ToolTrip("Read", read_notes("Read", "filepath"), answered_done, continue_sent_back),
    ),
    Agent(
        "crush",
        find_crush,
        run_crush,
        2000,
        trip=ToolTrip("view", read_notes("view", "file_path"), crush_answered, last_with_tools),
    ),
    Agent("aider", find_aider, run_aider, 300),
)
