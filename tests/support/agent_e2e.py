"""What the coding agents' end-to-end tests (test_agents.py, over the table in agents.py)
share: finding an agent that `make test-deps` installed into the git-ignored
.test-clients/ folder, the real engine on a tiny hybrid model with a long context, the
fake engine that scripts a tool call, and the server's token counters, from which a
run's cache reads are measured whatever the agent reports.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx

from mlx_prefix.config import CacheConfig
from mlx_prefix.engine.engine import Engine
from mlx_prefix.models.load import load_model
from mlx_prefix.models.testing import cached_test_model
from support.paths import REPO, TESTS
from support.server_fakes import FakeEngine, FakeModel, FakeTokenizer, serving

ROOT = REPO
CLIENTS = ROOT / ".test-clients"
NODE_MODULES = CLIENTS / "node_modules"
DONE = "All done."
DONE_DIRECTIVE = f"[[reply:{DONE}]]"
# Tests never touch the network: a Node agent's fetch reaches loopback only (Continue's
# CLI asks its hub for the latest version at start), and npm, which OpenCode runs to
# install its plugin package, stays offline.
OFFLINE = {
    "NODE_OPTIONS": f"--require {json.dumps(str(TESTS / 'support' / 'agent_offline.cjs'))}",
    "npm_config_offline": "true",
}
# The agents' runs take minutes on two shared cores: the first run prefills the
# agent's whole prompt (7K to 15K tokens) on the CPU.
RUN_TIMEOUT_S = 900


def npm_package(name: str, version: str) -> tuple[Path | None, str]:
    """The folder of npm package `name` at `version` in .test-clients, or why not."""
    folder = NODE_MODULES / name
    package = folder / "package.json"
    if not package.is_file():
        return None, f"{name} is not installed: run `make test-deps` (needs npm)"
    found = json.loads(package.read_text()).get("version")
    if found != version:
        return None, f"{name} in .test-clients is {found}, not {version}: run `make test-deps`"
    return folder, ""


def native_binary(pattern: str, version: str, agent: str) -> tuple[Path | None, str]:
    """The native binary of an npm package for this platform (NODE_MODULES/`pattern`,
    one per platform package), or why none runs here."""
    for candidate in sorted(NODE_MODULES.glob(pattern)):
        try:
            out = subprocess.run(
                [str(candidate), "--version"], capture_output=True, text=True, timeout=60
            )
        except OSError:
            continue  # another platform's binary
        if out.returncode == 0 and version in out.stdout:
            return candidate, ""
    return None, f"no {agent} binary for this platform runs here"


def call(name: str, arguments: dict) -> str:
    """A reply directive: the fake engine answers with this tool call (Qwen's JSON syntax,
    which the fake's tokenizer parses as the real engine's does), with no spaces, so an
    agent that quotes a command-line word holding one leaves it alone."""
    body = json.dumps({"name": name, "arguments": arguments}, separators=(",", ":"))
    return f"[[reply:<tool_call>{body}</tool_call>]]"


def done_file(folder: Path) -> Path:
    """A file whose content makes the fake's next reply "All done." once a tool reads it
    (in the agent's working folder, where agents read without asking)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "notes.txt"
    path.write_text(DONE_DIRECTIVE + "\n")
    return path


@contextlib.contextmanager
def scripted_server() -> Iterator[tuple[str, FakeEngine]]:
    """A live server over the fake engine, with the tool-call markers of Qwen's template."""
    model = FakeModel(context_length=1 << 20, tokenizer=FakeTokenizer.with_json_tools())
    with serving(FakeEngine(model)) as (url, engine):
        yield url, engine


# The agents' prompts are 1.6K to 15K tokens: a small chunk, checkpoints every 2048.
AGENT_CACHE = CacheConfig(budget_bytes=1 << 30, prefill_chunk=256, checkpoint_interval=2048)


@contextlib.contextmanager
def real_server(max_tokens: int | None = 8, cache: CacheConfig = AGENT_CACHE) -> Iterator[str]:
    """A live server over the real engine on the tiny qwen3_5 hybrid (linear and full
    attention layers, Qwen3's template with tools and thinking) with a 32K context, large
    enough for any agent's prompt here. `max_tokens` is the server's default reply cap,
    for the agents that send none (None: the server's own default)."""
    folder = cached_test_model("qwen3_5", think_template=True, context=32768)
    settings = {} if max_tokens is None else {"default_max_tokens": max_tokens}
    engine = Engine(load_model(str(folder)), cache)
    try:
        with serving(engine, **settings) as (url, _):
            yield url
    finally:
        engine.shutdown()


def token_counters(url: str) -> tuple[float, float]:
    """The server's prompt tokens and cached prompt tokens so far."""
    text = httpx.get(f"{url}/metrics").text
    prompt = re.search(r"^mlx_prefix_prompt_tokens_total (\S+)$", text, re.M)
    cached = re.search(r"^mlx_prefix_cached_tokens_total (\S+)$", text, re.M)
    assert prompt and cached
    return float(prompt.group(1)), float(cached.group(1))


class Counted:
    """The prompt and cached tokens that the requests inside a `with` block sent."""

    def __init__(self, url: str):
        self.url = url
        self.prompt = self.cached = 0.0

    def __enter__(self) -> Counted:
        self._before = token_counters(self.url)
        return self

    def __exit__(self, *exc: object) -> None:
        after = token_counters(self.url)
        self.prompt = after[0] - self._before[0]
        self.cached = after[1] - self._before[1]

    def __str__(self) -> str:
        share = self.cached / self.prompt if self.prompt else 0.0
        return f"read {self.cached:.0f} of {self.prompt:.0f} prompt tokens ({share:.1%})"
