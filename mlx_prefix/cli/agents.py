"""What each coding agent needs to run against mlx-prefix (`mlx-prefix launch`): its
command, environment and config files, derived from the served model's context.

Every agent gets the base URL, a key (the server's --api-key, else a placeholder: a
keyless server takes any), the served model's name, the context window its
auto-compaction must respect and its output-token cap. The cap is derived from the
context (`output_cap`), never fixed: an agent's own default (OpenCode's and Qwen
Code's 32000) plus its prompt would overflow a small model's context and be refused,
and OpenCode then compacts in a loop (round 3). Settings go where each agent reads
them without touching the user's own config: environment variables, command-line
overrides, or files in `folder` passed by flag or variable (cli/launch.py's: private and
removed after the run, or $MLX_PREFIX_HOME/launch/<agent>/ for --print-env). The key goes
in a variable or a file, never in the command (`ps` shows every command line).
Telemetry and update checks a local session has no use for are turned off.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Target:
    """The server an agent is pointed at."""

    url: str  # base URL, no /v1
    key: str
    model: str  # the served model's name, as requests send it
    context: int  # tokens: prompt + reply
    output: int  # the reply cap the agent asks for (`output_cap`)


@dataclass(frozen=True)
class AgentRun:
    """An agent's command line, the environment it adds, and the files it reads."""

    command: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    files: dict[Path, str] = field(default_factory=dict)


def output_cap(context: int) -> int:
    """The reply cap for a model of `context` tokens: an eighth of it (4096 of 32K),
    within [256, 32768], and never more than half the context."""
    return max(min(context // 8, 32768), min(256, context // 2))


def _has(args: tuple[str, ...], *flags: str) -> bool:
    return any(a == f or a.startswith(f + "=") for a in args for f in flags)


def claude(t: Target, args: tuple[str, ...], folder: Path) -> AgentRun:
    env = {
        "ANTHROPIC_BASE_URL": t.url,
        "ANTHROPIC_API_KEY": t.key,
        "ANTHROPIC_MODEL": t.model,
        "ANTHROPIC_SMALL_FAST_MODEL": t.model,  # its background calls: the same model
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": t.model,
        # The window of a model it does not know, and where auto-compaction aims.
        "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(t.context),
        "CLAUDE_CODE_AUTO_COMPACT_WINDOW": str(t.context),
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(t.output),
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }
    return AgentRun(("claude", *args), env)


def codex(t: Target, args: tuple[str, ...], folder: Path) -> AgentRun:
    provider = (
        '{name = "mlx-prefix", base_url = "' + t.url + '/v1", wire_api = "responses", '
        'env_key = "MLX_PREFIX_API_KEY"}'
    )
    overrides = {
        "model": json.dumps(t.model),
        "model_provider": '"mlx_prefix"',
        "model_providers.mlx_prefix": provider,
        "model_context_window": str(t.context),
        "model_auto_compact_token_limit": str(t.context * 9 // 10),
        # Hosted and namespace tools the server refuses with a 400.
        "web_search": '"disabled"',
        "agents.enabled": "false",
        "check_for_update_on_startup": "false",
        "analytics.enabled": "false",
    }
    flags = [a for k, v in overrides.items() for a in ("-c", f"{k}={v}")]
    # Codex sends no reply cap of its own: the server's --max-tokens is its cap.
    return AgentRun(("codex", *flags, *args), {"MLX_PREFIX_API_KEY": t.key})


def opencode(t: Target, args: tuple[str, ...], folder: Path) -> AgentRun:
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            "mlx-prefix": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "mlx-prefix",
                "options": {"baseURL": f"{t.url}/v1", "apiKey": t.key},
                "models": {t.model: {"limit": {"context": t.context, "output": t.output}}},
            }
        },
        "model": f"mlx-prefix/{t.model}",
    }
    env = {"OPENCODE_CONFIG_CONTENT": json.dumps(config), "OPENCODE_DISABLE_MODELS_FETCH": "1"}
    return AgentRun(("opencode", *args), env)


def qwen(t: Target, args: tuple[str, ...], folder: Path) -> AgentRun:
    defaults = folder / "settings.json"  # below the user's own settings: theirs win
    settings = {
        "model": {"generationConfig": {"contextWindowSize": t.context}},
        "privacy": {"usageStatisticsEnabled": False},
    }
    env = {
        "OPENAI_BASE_URL": f"{t.url}/v1",
        "OPENAI_API_KEY": t.key,
        "OPENAI_MODEL": t.model,
        "QWEN_CODE_MAX_OUTPUT_TOKENS": str(t.output),
        "QWEN_CODE_SYSTEM_DEFAULTS_PATH": str(defaults),
    }
    return AgentRun(("qwen", *args), env, {defaults: json.dumps(settings, indent=1) + "\n"})


def continue_cli(t: Target, args: tuple[str, ...], folder: Path) -> AgentRun:
    config = folder / "config.yaml"
    text = (
        "name: mlx-prefix\nversion: 1.0.0\nschema: v1\nmodels:\n"
        f"  - name: mlx-prefix\n    provider: openai\n    model: {json.dumps(t.model)}\n"
        f"    apiBase: {json.dumps(t.url + '/v1')}\n    apiKey: {json.dumps(t.key)}\n"
        "    roles: [chat, edit, apply]\n    defaultCompletionOptions:\n"
        f"      contextLength: {t.context}\n      maxTokens: {t.output}\n"
    )
    command = ("cn", *args) if _has(args, "--config") else ("cn", "--config", str(config), *args)
    return AgentRun(command, {"CONTINUE_METRICS_ENABLED": "0"}, {config: text})


def aider(t: Target, args: tuple[str, ...], folder: Path) -> AgentRun:
    name = f"openai/{t.model}"
    metadata = folder / "model.metadata.json"
    settings = folder / "model.settings.yml"
    info = {
        "max_input_tokens": t.context,
        "max_output_tokens": t.output,
        "max_tokens": t.output,
        "input_cost_per_token": 0,
        "output_cost_per_token": 0,
        "litellm_provider": "openai",
        "mode": "chat",
    }
    yml = f"- name: {json.dumps(name)}\n  extra_params:\n    max_tokens: {t.output}\n"
    flags: tuple[str, ...] = ()
    if not _has(args, "--model"):
        flags += ("--model", name)
    flags += ("--model-metadata-file", str(metadata), "--model-settings-file", str(settings))
    env = {
        "OPENAI_API_BASE": f"{t.url}/v1",
        "OPENAI_API_KEY": t.key,
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no cost map fetched online
    }
    files = {metadata: json.dumps({name: info}, indent=1) + "\n", settings: yml}
    return AgentRun(("aider", *flags, *args), env, files)


AGENTS: dict[str, Callable[[Target, tuple[str, ...], Path], AgentRun]] = {
    "claude": claude,
    "codex": codex,
    "opencode": opencode,
    "qwen": qwen,
    "continue": continue_cli,
    "cn": continue_cli,
    "aider": aider,
}
