"""Where the tests' files are, wherever the test that asks sits."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
REPO = TESTS.parent
DATA = TESTS / "data"  # vendored tokenizers, chat templates, recorded traces
WEB = TESTS / "web"  # the pages the browser tests open
