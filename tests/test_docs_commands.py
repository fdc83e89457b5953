"""Every `mlx-prefix` command and `make` target the README and docs/ show still exists.

The docs moved out of the README into pages by task, and a page nobody runs goes stale:
a flag renamed in the CLI would leave a command that fails as written. Each command in a
shell block is parsed by the CLI's own parser (nothing runs, no model loads), and each
`make` target named in a block must be a target of the Makefile.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from mlx_prefix.cli import build_parser, launch

ROOT = Path(__file__).resolve().parent.parent
# The user's pages; ARCHITECTURE.md and INVARIANTS.md draw trees, not commands.
PAGES = [ROOT / "README.md"] + [
    page
    for page in sorted((ROOT / "docs").glob("*.md"))
    if page.name not in {"ARCHITECTURE.md", "INVARIANTS.md"}
]
SHELL_BLOCK = re.compile(r"^```(sh|bash|shell|)\n(.*?)^```", re.M | re.S)


def shell_lines(text: str) -> list[str]:
    """The command lines of a page's shell blocks, continuations joined."""
    lines = []
    for match in SHELL_BLOCK.finditer(text):
        for line in match.group(2).replace("\\\n", " ").splitlines():
            line = re.sub(r"<[^>]*>", "PLACEHOLDER", line)  # <repo id>, <session>
            line = re.sub(r"\[(--[\w-]+)\]", r"\1", line)  # an optional flag: [--pipeline]
            if line.strip():
                lines.append(line)
    return lines


def cli_arguments(line: str) -> list[str] | None:
    """The arguments after `mlx-prefix` (or `-m mlx_prefix`) on a line, or None."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        return None
    for i, word in enumerate(words):
        if word.endswith("/mlx-prefix") or word == "mlx-prefix":
            return words[i + 1 :]
        if word == "mlx_prefix" and i > 0 and words[i - 1] == "-m":
            return words[i + 1 :]
    return None


def commands() -> list[tuple[str, list[str]]]:
    found = []
    for page in PAGES:
        for line in shell_lines(page.read_text()):
            arguments = cli_arguments(line)
            if arguments:
                found.append((f"{page.relative_to(ROOT)}: {line.strip()}", arguments))
    return found


def make_targets_named() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        for line in shell_lines(page.read_text()):
            words = shlex.split(line, comments=True) if "make " in line else []
            if words[:1] == ["make"]:
                found += [(str(page.relative_to(ROOT)), target) for target in words[1:]]
    return found


def test_the_docs_show_commands_to_check():
    """The extraction finds what the README shows; an empty list would pass everything."""
    shown = [arguments[0] for _, arguments in commands()]
    assert {"serve", "generate", "pull", "launch"} <= set(shown)
    assert ("README.md", "serve") in make_targets_named()


@pytest.mark.parametrize(("where", "arguments"), commands(), ids=lambda value: str(value)[:80])
def test_every_cli_command_in_the_docs_parses(where, arguments):
    arguments, agent_arguments = launch.split_agent_args(arguments)
    try:
        build_parser().parse_args(arguments)
    except SystemExit as exit:
        pytest.fail(f"{where}\n  the CLI refuses it (exit {exit.code})")


def test_every_make_target_in_the_docs_exists():
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, re.M))
    missing = [(where, target) for where, target in make_targets_named() if target not in targets]
    assert not missing, f"make targets the docs name but the Makefile lacks: {missing}"
