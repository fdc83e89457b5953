"""mlx-prefix launch AGENT [-- AGENT ARGS]: run a coding agent against mlx-prefix.

The server at the address (default http://127.0.0.1:8080, or --url) is reused when one
answers there; otherwise `mlx-prefix serve` is started on it (with --model, the
--max-tokens the agent's cap gives, and --serve-arg flags) and stopped when the agent
exits; on port 0 (`--url http://127.0.0.1:0`) the server binds a free port and launch
reads it from the server's startup line. The served model's context length, from the
server's /v1/models, gives the agent's window and reply cap (cli/agents.py); the agent's
exit code is launch's. `--print-env` prints the settings (variables, files, command) and
runs nothing.

The API key never goes on a command line (`ps` shows every process's to every user):
the server launch starts reads it from MLX_PREFIX_SERVER_API_KEY, the agent from its
variables or from a file only the user can read (0600), in a private folder (0700)
removed once the agent exits (under $MLX_PREFIX_HOME/launch/ for `--print-env`, whose
command runs later).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote, urlsplit

from mlx_prefix.errors import InvalidRequest, MlxPrefixError

from .agents import AGENTS, AgentRun, Target, output_cap
from .client import api_key, get_json, server_url, url_args

READY_TIMEOUT_S = 1800.0  # a first run may download and convert the model
FALLBACK_CONTEXT = 8192  # a model whose config states no context length
# server/app.py's serving_line: the port a server started on port 0 bound
SERVING = re.compile(r"serving .* on http://\S+:(\d+) ")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("agent", choices=sorted(AGENTS), help="the agent to run")
    p.add_argument(
        "-m",
        "--model",
        default=None,
        help="the model to serve or select (default: the running server's, else the "
        "bundled default)",
    )
    url_args(p)
    p.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="an argument for the server launch starts, e.g. --serve-arg=--kv-bits=8 (repeatable)",
    )
    p.add_argument(
        "--print-env",
        action="store_true",
        help="print the agent's settings (variables, files, command) instead of running it",
    )
    p.set_defaults(agent_args=())  # what follows `--` (`split_agent_args`)


def split_agent_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """`launch ... -- AGENT ARGS`: the agent's arguments are cut off before parsing, so
    launch's own options may come before or after AGENT."""
    if "launch" in argv:
        start = argv.index("launch")
        if "--" in argv[start:]:
            cut = argv.index("--", start)
            return argv[:cut], argv[cut + 1 :]
    return argv, []


def cmd_launch(args: argparse.Namespace) -> int:
    agent_args = tuple(args.agent_args)
    url, key = server_url(args.url), api_key(args.api_key)
    # Nothing listens on port 0: it asks for a server on a free port.
    models = None if urlsplit(url).port == 0 else get_json(url, "/v1/models", key)
    server: subprocess.Popen | None = None
    if models is None and not args.print_env:
        context = _folder_context(args.model)
        server, url = start_server(url, key, args.model, output_cap(context), args.serve_arg)
        models = get_json(url, "/v1/models", key)
    try:
        target = target_for(url, key, args.model, models)
        with agent_folder(args.agent, keep=args.print_env) as folder:
            run = AGENTS[args.agent](target, agent_args, folder)
            write_private(run.files)
            if args.print_env:
                print_env(run, models is None, target, args.model)
                return 0
            return run_agent(run)
    finally:
        if server is not None:
            stop_server(server)


def launch_folder(agent: str) -> Path:
    from mlx_prefix.models.default import default_models_dir

    return default_models_dir().parent / "launch" / ("continue" if agent == "cn" else agent)


@contextlib.contextmanager
def agent_folder(agent: str, keep: bool) -> Iterator[Path]:
    """Where the agent's files go (some hold the API key: Continue's config): a private
    temporary folder (0700, tempfile's) removed when the agent is done, or with `keep`
    (--print-env: its command runs later) the agent's folder under launch_folder."""
    if keep:
        yield launch_folder(agent)
        return
    with tempfile.TemporaryDirectory(prefix=f"mlx-prefix-{agent}-") as folder:
        yield Path(folder)


def write_private(files: dict[Path, str]) -> None:
    """Each file readable by the user alone (0600), an older one included."""
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)  # a file launch wrote before keeps its mode through open
        with os.fdopen(fd, "w") as out:
            out.write(text)


def target_for(url: str, key: str | None, model: str | None, models: dict | None) -> Target:
    """The served model (the server's default, or `model`) and its context: from the
    server's /v1/models, else (no server: --print-env) the model folder's config."""
    if models is None:
        context = _folder_context(model)
        name = model or _default_name()
    else:
        cards = [c for c in models.get("data", []) if c.get("type") != "embedding"]
        if not cards:
            raise MlxPrefixError(f"the server at {url} lists no chat model")
        card = cards[0] if model is None else _card_for(model, cards, url, key)
        name = card["id"]  # as the server names it (a path given to --model is not)
        context = card.get("context_length") or _folder_context(model, quiet=True)
    return Target(url, key or "local", name, context, output_cap(context))


def _card_for(model: str, cards: list[dict], url: str, key: str | None) -> dict:
    """The listed card `model` names, else the one the server gives for it when it can
    load it on demand (not listed until loaded)."""
    base = model.rstrip("/").rsplit("/", 1)[-1]
    for card in cards:
        if model in (card["id"], card.get("alias_of")) or card["id"] == base:
            return card
    try:
        fetched: dict | None = get_json(url, "/v1/models/" + quote(model, safe="/@"), key)
    except MlxPrefixError:  # a 404: not a name this server serves
        fetched = None
    if fetched is not None and fetched.get("id") in (model, base):
        return fetched
    raise InvalidRequest(
        f"the server at {url} does not serve {model!r} (it lists "
        f"{', '.join(c['id'] for c in cards)}): stop it, or pass --url for another"
    )


def _default_name() -> str:
    from mlx_prefix.models.default import DEFAULT_MODEL_NAME

    return DEFAULT_MODEL_NAME


def _folder_context(model: str | None, quiet: bool = False) -> int:
    """The context length the model folder's config states (FALLBACK_CONTEXT if none).
    A hub id not downloaded yet is looked up in the local cache only."""
    import json

    from mlx_prefix.models.preflight import context_length
    from mlx_prefix.models.resolve import find_local_model, resolve_model

    try:
        found = find_local_model(model) if model is not None else resolve_model(None)
        config = json.loads((found.path / "config.json").read_text()) if found else {}
    except (MlxPrefixError, OSError, ValueError):
        config = {}
    context = context_length(config)
    if context is None and not quiet:
        print(
            f"mlx-prefix: the model's context length is unknown here; assuming {FALLBACK_CONTEXT}",
            file=sys.stderr,
        )
    return context or FALLBACK_CONTEXT


def start_server(
    url: str, key: str | None, model: str | None, max_tokens: int, extra: list[str]
) -> tuple[subprocess.Popen, str]:
    """`mlx-prefix serve` on the address of `url`, ready (its /health answers), and its
    URL (on port 0: with the port it bound); or an error naming its log."""
    parts = urlsplit(url)
    if parts.scheme != "http" or parts.hostname is None:
        raise InvalidRequest(f"launch starts a server on an http:// address, not {url}")
    port = 80 if parts.port is None else parts.port
    log_path = launch_folder("server") / "serve.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "mlx_prefix", "serve", "--host", parts.hostname,
               "--port", str(port), "--max-tokens", str(max_tokens)]  # fmt: skip
    if model is not None:
        command += ["--model", model]
    command += extra
    env = dict(os.environ)
    if key is not None:  # serve's --api-key, out of `ps`'s sight
        env["MLX_PREFIX_SERVER_API_KEY"] = key
    print(f"mlx-prefix: starting the server at {url} (log: {log_path})", file=sys.stderr)
    log = log_path.open("w")
    server = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
    )
    log.close()
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
            raise MlxPrefixError(f"the server did not start: {' / '.join(tail)} (log: {log_path})")
        if port == 0 and (bound := SERVING.search(log_path.read_text(errors="replace"))):
            port = int(bound.group(1))
            url = parts._replace(netloc=f"{parts.netloc.rsplit(':', 1)[0]}:{port}").geturl()
        try:
            if port != 0 and get_json(url, "/health", key, timeout=2.0) is not None:
                return server, url
        except MlxPrefixError:
            pass  # something answered but not yet our server's JSON
        time.sleep(0.25)
    stop_server(server)
    raise MlxPrefixError(f"the server was not ready after {READY_TIMEOUT_S:.0f}s (log: {log_path})")


def stop_server(server: subprocess.Popen) -> None:
    if server.poll() is None:
        server.terminate()  # SIGTERM: the server's graceful shutdown
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def run_agent(run: AgentRun) -> int:
    """Run the agent in this terminal; its exit code."""
    env = {**os.environ, **run.env}
    program = shutil.which(run.command[0], path=env.get("PATH"))
    if program is None:
        raise MlxPrefixError(f"{run.command[0]} is not on PATH: install it first")
    try:
        return subprocess.run([program, *run.command[1:]], env=env, check=False).returncode
    except KeyboardInterrupt:
        return 130


def print_env(run: AgentRun, no_server: bool, target: Target, model: str | None) -> None:
    """The settings as shell lines: the files written, the variables, the command."""
    for path in run.files:
        print(f"# wrote {path}")
    for name, value in run.env.items():
        print(f"export {name}={shlex.quote(value)}")
    print(shlex.join(run.command))
    if no_server:
        serve = ["mlx-prefix", "serve", *(["--model", model] if model else [])]
        serve += ["--max-tokens", str(target.output)]
        print(f"# no server at {target.url} yet: {shlex.join(serve)}", file=sys.stderr)
