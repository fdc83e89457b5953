"""Where this machine's Chrome or Chromium is. The browser tests and the benchmark's
dashboard picture drive it headless; on macOS (the product's platform) it lives in an
app bundle, not on PATH, so a fixed /usr/bin/chromium would skip them there for good."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

CHROMIUM_ENV = "MLX_PREFIX_CHROMIUM"  # a browser binary chosen by hand
NO_CHROMIUM = (
    "no Chrome or Chromium: install one (Debian's `chromium`, or Google Chrome on macOS), "
    f"or name its binary in ${CHROMIUM_ENV}"
)
COMMANDS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
# Inside /Applications or ~/Applications.
MAC_BUNDLES = (
    "Google Chrome.app/Contents/MacOS/Google Chrome",
    "Chromium.app/Contents/MacOS/Chromium",
    "Google Chrome for Testing.app/Contents/MacOS/Google Chrome for Testing",
)


def find_chromium(
    env: Mapping[str, str] = os.environ,
    which: Callable[[str], str | None] = shutil.which,
    app_folders: Sequence[Path] = (Path("/Applications"), Path.home() / "Applications"),
) -> str | None:
    """The path of a Chrome or Chromium binary: $MLX_PREFIX_CHROMIUM, then the usual
    commands on PATH, then the macOS app bundles. None if there is none."""
    chosen = env.get(CHROMIUM_ENV)
    if chosen:
        return chosen if _runnable(Path(chosen)) else None
    for command in COMMANDS:
        found = which(command)
        if found:
            return found
    for folder in app_folders:
        for bundle in MAC_BUNDLES:
            if _runnable(folder / bundle):
                return str(folder / bundle)
    return None


def _runnable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)
