"""Finding Chrome or Chromium for the browser tests, on Linux and macOS alike."""

from __future__ import annotations

from pathlib import Path

from mlx_prefix.browsers import CHROMIUM_ENV, find_chromium


def _binary(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def test_a_command_on_path_comes_first():
    which = {"google-chrome": "/opt/google/chrome/google-chrome"}.get
    assert find_chromium({}, which, ()) == "/opt/google/chrome/google-chrome"
    assert find_chromium({}, {"chromium": "/usr/bin/chromium"}.get, ()) == "/usr/bin/chromium"


def test_macos_app_bundles_are_found(tmp_path):
    apps, home_apps = tmp_path / "Applications", tmp_path / "home" / "Applications"
    none = {}.get
    assert find_chromium({}, none, (apps, home_apps)) is None
    chromium = _binary(home_apps / "Chromium.app/Contents/MacOS/Chromium")
    assert find_chromium({}, none, (apps, home_apps)) == str(chromium)
    chrome = _binary(apps / "Google Chrome.app/Contents/MacOS/Google Chrome")
    assert find_chromium({}, none, (apps, home_apps)) == str(chrome)


def test_the_environment_variable_wins(tmp_path):
    mine = _binary(tmp_path / "my-chrome")
    which = {"chromium": "/usr/bin/chromium"}.get
    assert find_chromium({CHROMIUM_ENV: str(mine)}, which, ()) == str(mine)
    assert find_chromium({CHROMIUM_ENV: str(tmp_path / "absent")}, which, ()) is None
