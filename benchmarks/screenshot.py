"""`--dashboard-png`: a picture of mlx-prefix's dashboard after the chat workload, taken
with Playwright (the test extra) driving the system's headless Chromium. Optional: when
either is missing the run goes on without it."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from mlx_prefix.browsers import NO_CHROMIUM, find_chromium

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]


def dashboard_png(url: str, path: Path, log: Callable[[str], None]) -> bool:
    """Open `url`/dashboard, wait until it shows live data and its charts, save a
    full-page PNG at `path`. Returns whether it did."""
    try:
        from playwright.sync_api import expect, sync_playwright
    except ImportError:
        log("dashboard screenshot skipped: playwright is not installed (pip install playwright)")
        return False
    chromium = find_chromium()
    if chromium is None:
        log(f"dashboard screenshot skipped: no Chrome or Chromium found ({NO_CHROMIUM})")
        return False
    # The benchmark runs with the fast BLAS preloaded; Chromium and node must not get it.
    preload = os.environ.pop("LD_PRELOAD", None)
    try:
        pw = sync_playwright().start()
    finally:
        if preload is not None:
            os.environ["LD_PRELOAD"] = preload
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    try:
        browser = pw.chromium.launch(executable_path=chromium, args=FLAGS, env=env)
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto(url + "/dashboard")
        expect(page.locator("#status")).to_contain_text("live", timeout=30_000)
        expect(page.locator("#tree tbody tr").first).to_be_visible(timeout=30_000)
        time.sleep(1.5)  # one more poll: charts and "last use" settle
        path.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(path), full_page=True)
        browser.close()
    except Exception as e:  # a picture is not worth failing a benchmark run for
        log(f"dashboard screenshot failed: {type(e).__name__}: {e}")
        return False
    finally:
        pw.stop()
    log(f"wrote {path}")
    return True
