"""mlx-prefix pull | ls | rm: the models on this machine (models/library/: pull.py,
catalog.py)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from mlx_prefix.errors import InvalidRequest

from .client import api_key, get_json, server_url, url_args


def human_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


# -- pull -------------------------------------------------------------------------


def add_pull_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="REPO[@REVISION]", help="a Hugging Face repo id, e.g. "
                   "mlx-community/Qwen3.5-4B-4bit (a branch, tag or commit after @)")  # fmt: skip
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def cmd_pull(args: argparse.Namespace) -> int:
    import logging

    from mlx_prefix.models.library.pull import check_loadable, plan_pull, pull, split_name

    for name in ("httpx", "httpx2"):  # one line per HTTP request: the bar says enough
        logging.getLogger(name).setLevel(logging.WARNING)

    repo_id, revision = split_name(args.model)
    plan = plan_pull(repo_id, revision)
    here = plan.total_bytes - plan.download_bytes
    print(
        f"{args.model}: {len(plan.files)} files, {human_bytes(plan.total_bytes)}"
        + (f" ({human_bytes(here)} already here)" if here else "")
        + f", commit {plan.commit[:12]}",
        file=sys.stderr,
    )
    check_loadable(plan)
    folder = pull(plan, progress=not args.quiet)
    print(folder)
    print(f"serve it: mlx-prefix serve --model {args.model}", file=sys.stderr)
    return 0


# -- ls ---------------------------------------------------------------------------


def add_ls_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="one JSON object per model")


def cmd_ls(args: argparse.Namespace) -> int:
    from mlx_prefix.models.library.catalog import local_models

    models = local_models()
    if args.json:
        for m in models:
            row = {**dataclasses.asdict(m), "path": str(m.path)}
            print(json.dumps(row))
        return 0
    if not models:
        print("no models yet: mlx-prefix pull ORG/NAME", file=sys.stderr)
        return 0
    width = max(len(m.name) for m in models)
    for m in models:
        context = f"{m.context_length:,}" if m.context_length else "?"
        can = ",".join(w for w, on in (("tools", m.tools), ("reasoning", m.reasoning)) if on)
        print(
            f"{m.name:<{width}}  {human_bytes(m.size_bytes):>10}  {m.quantization or '?':<9}"
            f"  {m.kinds:<16}  ctx {context:>9}  {can or '-'}"
        )
    return 0


# -- rm ---------------------------------------------------------------------------


def add_rm_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="NAME", help="a name `mlx-prefix ls` shows (or its path)")
    p.add_argument("-y", "--yes", action="store_true", help="do not ask")
    url_args(p)


def cmd_rm(args: argparse.Namespace) -> int:
    from mlx_prefix.models.library.catalog import find_model, local_models, remove_model

    model = find_model(args.model, local_models())
    url = server_url(args.url)
    status = get_json(url, "/v1/ps", api_key(args.api_key))
    if status is not None and str(model.path.resolve()) in _served_folders(status):
        raise InvalidRequest(
            f"{model.name} is served by the server at {url}: stop it (or let it serve "
            "another model) first"
        )
    if not args.yes:
        if not sys.stdin.isatty():
            raise InvalidRequest(f"rm {model.name}: pass -y to delete without a terminal")
        answer = input(
            f"delete {model.name} ({human_bytes(model.size_bytes)}, {model.path})? [y/N] "
        )
        if answer.strip().lower() not in ("y", "yes"):
            print("kept", file=sys.stderr)
            return 1
    remove_model(model)
    print(f"deleted {model.name} ({human_bytes(model.size_bytes)})", file=sys.stderr)
    return 0


def _served_folders(status: dict) -> set[str]:
    """The folders a server's /v1/ps says it serves: its --model and what is loaded."""
    from pathlib import Path

    rows = [*status.get("models", []), status.get("default") or {}]
    return {str(Path(r["folder"]).resolve()) for r in rows if r.get("folder")}
