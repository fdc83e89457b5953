"""The dashboard in a real browser: Playwright (from PyPI) driving the system's headless
Chromium. The page loads without a console error, shows an entry after a chat request
and its hit count going up after a second one (real engine, tiny model), pins, evicts,
warms and flushes through its buttons, asks for the API key, and a page from a foreign
origin (or a hostile name re-pointed at 127.0.0.1) can neither read nor act."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator

import httpx
import pytest
from support.live import post_chat
from support.models import TEST_CACHE, loaded_test_model
from support.server_fakes import serving

from mlx_prefix.browsers import NO_CHROMIUM, find_chromium
from mlx_prefix.config import EngineConfig
from mlx_prefix.engine.engine import Engine

sync_api = pytest.importorskip("playwright.sync_api")

CHROMIUM = find_chromium()
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-features=HttpsUpgrades,HttpsFirstBalancedModeAutoEnable",
    "--host-resolver-rules=MAP evil.test 127.0.0.1",
]
SYSTEM = {"role": "system", "content": "You are the help desk of a public library. " * 4}
QUESTION = "Where are the atlases?"
KEY = "sesame"


def _env_without_preload() -> dict[str, str]:
    # `make test` preloads the BLAS into pytest; Chromium (and Playwright's node driver)
    # must not inherit it.
    return {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    if CHROMIUM is None:
        pytest.skip(NO_CHROMIUM)
    preload = os.environ.pop("LD_PRELOAD", None)
    try:
        pw = sync_api.sync_playwright().start()  # the driver process starts here
    finally:
        if preload is not None:
            os.environ["LD_PRELOAD"] = preload
    try:
        chromium = pw.chromium.launch(
            executable_path=CHROMIUM, args=FLAGS, env=_env_without_preload()
        )
        yield chromium
        chromium.close()
    finally:
        pw.stop()


class Watched:
    """A fresh page (its own context: no shared sessionStorage) recording every console
    error, uncaught exception and failed request."""

    def __init__(self, browser) -> None:
        self.context = browser.new_context(viewport={"width": 1400, "height": 1000})
        self.page = self.context.new_page()
        self.page.set_default_timeout(20_000)
        self.errors: list[str] = []
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))
        self.page.on("requestfailed", lambda r: self.errors.append(f"{r.url}: {r.failure}"))

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def watched(browser) -> Iterator[Watched]:
    w = Watched(browser)
    yield w
    w.close()


@pytest.fixture
def real() -> Iterator[tuple[str, Engine]]:
    # No next-turn prefetch: entries appear only where the test's requests put them.
    config = EngineConfig(prefetch_next_turn=False)
    engine = Engine(loaded_test_model("dense"), TEST_CACHE, config)
    with serving(engine) as (url, _):
        yield url, engine


def chat(url: str, question: str = QUESTION) -> dict:
    body = {"messages": [SYSTEM, {"role": "user", "content": question}], "max_tokens": 8}
    return post_chat(url, body)


def tree(url: str, key: str | None = None) -> list[dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(url + "/v1/dashboard", headers=headers).json()["tree"]


def row(page, text: str):
    return page.locator("#tree tbody tr", has_text=text).last


def cell(page, text: str, column: int) -> str:
    return row(page, text).locator("td").nth(column).inner_text()


HITS, ACTIONS = 4, 7  # columns of the tree table


def wait_live(page) -> None:
    sync_api.expect(page.locator("#status")).to_have_text(re.compile("^live"))


def test_the_page_shows_an_entry_then_its_hits_going_up(browser, watched, real):
    url, _ = real
    page = watched.page
    page.goto(url + "/")  # redirected to /dashboard
    assert page.url == url + "/dashboard"
    wait_live(page)
    sync_api.expect(page.locator("#tree-empty")).to_be_visible()
    sync_api.expect(page.locator("#model")).to_have_text("tiny-dense")

    cold = chat(url)
    sync_api.expect(row(page, QUESTION)).to_be_visible()
    assert cell(page, QUESTION, HITS) == "0"
    assert "help desk of a public library" in page.locator("#tree tbody").inner_text()

    warm = chat(url)
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the hit happened
    assert warm["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
    sync_api.expect(row(page, QUESTION).locator("td").nth(HITS)).to_have_text("1")
    sync_api.expect(page.locator("#requests tbody tr")).to_have_count(2)
    assert page.locator("#chart-tokens canvas").count() == 1
    assert re.fullmatch(r"\d+%", page.locator("#hit-rate").inner_text())
    assert watched.errors == []


def test_the_misses_panel_shows_an_edited_prompt_with_both_texts(browser, watched, real):
    url, _ = real
    page = watched.page
    page.goto(url + "/dashboard")
    wait_live(page)
    sync_api.expect(page.locator("#misses-empty")).to_be_visible()
    chat(url)
    chat(url)  # a hit: not a miss
    edited = {**SYSTEM, "content": SYSTEM["content"].replace("public", "private", 1)}
    body = {"messages": [edited, {"role": "user", "content": QUESTION}], "max_tokens": 8}
    assert httpx.post(url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
    misses = page.locator("#misses tbody tr")
    sync_api.expect(misses).to_have_count(2)  # the first request (new), the edited one
    latest = misses.first
    sync_api.expect(latest.locator(".badge")).to_have_text("edited")
    assert "message 0 (system)" in latest.inner_text()
    assert "public" in latest.locator(".was").inner_text()
    assert "private" in latest.locator(".now").inner_text()
    sync_api.expect(misses.last.locator(".badge")).to_have_text("new")
    sync_api.expect(page.locator("#misses-empty")).to_be_hidden()
    assert watched.errors == []


def test_pin_evict_warm_and_flush_through_the_page(browser, watched, real):
    url, engine = real
    chat(url)
    page = watched.page
    page.goto(url + "/dashboard")
    deepest = max(tree(url), key=lambda n: n["tokens"])
    target = row(page, QUESTION)
    pin = target.locator("button.pin")
    evict = target.locator("button.evict")

    pin.click()
    sync_api.expect(pin).to_have_text("unpin")
    sync_api.expect(evict).to_be_disabled()
    pinned = {e["entry_id"] for e in engine.views.cache_entries() if e["pinned"]}
    assert pinned == {deepest["entry_id"]}
    pin.click()
    sync_api.expect(pin).to_have_text("pin")
    assert not any(e["pinned"] for e in engine.views.cache_entries())

    evict.click()
    sync_api.expect(page.locator("#tree tbody tr", has_text=QUESTION)).to_have_count(0)
    assert deepest["entry_id"] not in {e["entry_id"] for e in engine.views.cache_entries()}

    warm_text = "A raw prompt that the dashboard warms up and pins. " * 3
    page.fill("#warm-text", warm_text)
    page.select_option("#warm-as", "prompt")
    page.check("#warm-pin")
    page.click("#warm button[type=submit]")
    sync_api.expect(page.locator("#message")).to_contain_text("Warmed")
    sync_api.expect(row(page, "dashboard warms up")).to_be_visible()
    assert any(n["pinned"] and "dashboard warms up" in n["head"] for n in tree(url))

    page.once("dialog", lambda dialog: dialog.accept())
    page.click("#flush")
    sync_api.expect(page.locator("#message")).to_contain_text("Flushed")
    sync_api.expect(page.locator("#tree-empty")).to_be_visible()
    assert tree(url) == [] and engine.views.cache_entries() == []
    assert watched.errors == []


def test_the_page_asks_for_the_api_key_and_sends_it(browser, watched):
    with serving(api_key=KEY) as (url, _engine):
        httpx.post(
            url + "/v1/chat/completions",
            json={"messages": [SYSTEM, {"role": "user", "content": "hi"}]},
            headers={"Authorization": f"Bearer {KEY}"},
        )
        page = watched.page
        page.goto(url + "/dashboard")
        sync_api.expect(page.locator("#key-form")).to_be_visible()
        sync_api.expect(page.locator("#status")).to_have_text("API key needed")
        page.fill("#key-input", KEY)
        page.click("#key-form button[type=submit]")
        wait_live(page)
        sync_api.expect(page.locator("#key-form")).to_be_hidden()
        assert page.evaluate("sessionStorage.getItem('mlx-prefix-api-key')") == KEY
        page.locator("#tree tbody button.pin").first.click()  # an action carries the key too
        sync_api.expect(page.locator("#tree tbody button.pin").first).to_have_text("unpin")
        assert tree(url, KEY)[0]["pinned"] is True
        # only the 401s before the key was entered
        assert all("401" in e for e in watched.errors), watched.errors


def refused(url: str) -> float:
    """403s counted on the pin endpoint."""
    text = httpx.get(url + "/metrics").text
    line = (
        'mlx_prefix_requests_total{endpoint="/v1/cache/entries/{entry_id:int}/pin",status="403"} '
    )
    match = re.search(f"^{re.escape(line)}(\\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def test_a_foreign_origin_can_neither_read_nor_act(browser, watched, real, page_port):
    url, engine = real
    chat(url)
    entry_id = tree(url)[0]["entry_id"]
    page = watched.page
    # Served from 127.0.0.1 under another name: Chrome then lets it send requests to a
    # loopback server (a page from a public address could not even send them).
    page.goto(f"http://evil.test:{page_port}/blank.html")
    refused_before = refused(url)
    read = page.evaluate(
        "api => fetch(api + '/v1/dashboard').then(r => 'READ ' + r.status, e => e.name)", url
    )
    assert read == "TypeError"  # refused: the page learns nothing
    sent = page.evaluate(  # a simple request needs no preflight: it is sent, then refused
        """([api, id]) => fetch(api + `/v1/cache/entries/${id}/pin`, {method: 'POST',
             mode: 'no-cors', headers: {'Content-Type': 'text/plain'},
             body: '{"pinned": true}'}).then(r => r.type, e => e.name)""",
        [url, entry_id],
    )
    assert sent == "opaque"
    assert refused(url) == refused_before + 1  # the server got it and refused it
    flush = page.evaluate(
        "api => fetch(api + '/v1/cache', {method: 'DELETE'}).then(r => r.status, e => e.name)", url
    )
    assert flush == "TypeError"
    entries = engine.views.cache_entries()
    assert entries and not any(e["pinned"] for e in entries)

    # DNS rebinding: a hostile name resolving to 127.0.0.1 would be "same origin" with
    # the server; its GETs carry no Origin, only its own Host. Every route refuses that
    # Host (issue 35), so not even the page loads, and the name's own requests fail.
    port = httpx.URL(url).port
    response = page.goto(f"http://evil.test:{port}/dashboard")
    assert response is not None and response.status == 403
    assert "host_not_allowed" in page.content() and page.locator("#tree").count() == 0
    flush = page.evaluate(
        "() => fetch('/v1/cache', {method: 'DELETE'}).then(r => r.status, e => e.name)"
    )
    assert flush == 403
    assert len(engine.views.cache_entries()) == len(entries)  # nothing was flushed
