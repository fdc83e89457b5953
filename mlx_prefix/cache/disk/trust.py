"""Whose files the disk tier reads and writes: this user's alone.

A checkpoint's header holds the prompt's token ids, so the folder is 0700 and its files
0600. A file another user could have planted (owned by someone else, or writable by
group or others, or in such a folder) is never served: a planted checkpoint would
answer this user's prompts with someone else's KV.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

log = logging.getLogger("mlx_prefix.cache.disk")

FILE_MODE = 0o600
DIR_MODE = 0o700


class Untrusted(Exception):
    """A file or folder another user could have written: never served, left alone."""


def untrusted(st: os.stat_result) -> str | None:
    """Why a file or folder with this status could hold another user's bytes; None when
    it cannot."""
    if st.st_uid != os.getuid():
        return f"owned by uid {st.st_uid}, not by this user ({os.getuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"writable by other users (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def make_private(directory: Path) -> None:
    """Create the folder 0700, or tighten ours to 0700 (an older version made it 0755).
    Another user's folder is left as it is (the checks above then refuse it). Logs,
    never raises."""
    try:
        directory.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        st = os.stat(directory)
        if st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) & 0o077:
            os.chmod(directory, DIR_MODE)
            log.info("disk cache: %s made private (mode 700)", directory)
    except OSError as e:
        log.warning("disk cache: cannot create or secure %s: %s", directory, e)


def check_directory(directory: Path) -> None:
    """Raise Untrusted when the folder is not this user's alone (follows a symlink to
    judge its target)."""
    why = untrusted(os.stat(directory))
    if why is not None:
        raise Untrusted(f"the cache folder {directory} is {why}")
