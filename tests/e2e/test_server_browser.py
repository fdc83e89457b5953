"""Browser use: the CORS policy over plain HTTP, then a real headless Chromium page that
streams a chat completion from another origin (allowed) and from a refused one."""

from __future__ import annotations

import html
import os
import re
import subprocess
from pathlib import Path

import httpx
import pytest
from support.live import live_server
from support.server_fakes import DEFAULT_REPLY, serving

from mlx_prefix.browsers import NO_CHROMIUM, find_chromium

CHROMIUM = find_chromium()
CHAT = "/v1/chat/completions"


live = live_server(allowed_origins=("https://app.example.com",))


@pytest.fixture
def api(live) -> str:
    return live[0]


def preflight(url: str, origin: str, method: str = "POST") -> httpx.Response:
    with httpx.Client() as c:
        return c.options(
            url + CHAT,
            headers={
                "Origin": origin,
                "Access-Control-Request-Method": method,
                "Access-Control-Request-Headers": "content-type, authorization",
                "Access-Control-Request-Private-Network": "true",
            },
        )


def assert_refused(r: httpx.Response) -> None:
    assert r.status_code == 403, r.text
    assert r.json()["error"].keys() == {"message", "type", "param", "code"}
    assert r.json()["error"]["code"] == "origin_not_allowed"
    assert "access-control-allow-origin" not in r.headers
    assert "access-control-allow-private-network" not in r.headers


@pytest.mark.parametrize(
    "origin",
    [
        "http://localhost:5173",
        "http://localhost",
        "https://127.0.0.1:8443",
        "http://[::1]:3000",
        "chrome-extension://abcdefghijklmnopabcdefghijklmnop",
        "chrome-extension://abc",
        "moz-extension://0b6c6f5e-9d2a-4c3e-8f1a-2b3c4d5e6f70",
        "safari-web-extension://ABC-123",
        "https://app.example.com",  # added through settings.allowed_origins
    ],
)
def test_preflight_allowed(api, origin):
    r = preflight(api, origin)
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == origin
    assert r.headers["access-control-allow-private-network"] == "true"
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()


@pytest.mark.parametrize(
    "origin",
    [
        "https://evil.example",
        "http://localhost.evil.example",
        "http://127.0.0.1.evil.example:8080",
        "https://app.example.com.evil.example",
        "http://app.example.com",  # the configured origin is https only
        "null",
        "file://",
    ],
)
def test_preflight_refused(api, origin):
    assert_refused(preflight(api, origin))


def test_preflight_for_a_method_not_served_is_refused(api):
    r = preflight(api, "http://localhost:5173", method="PUT")
    assert_refused(r)
    assert "method" in r.json()["error"]["message"]


@pytest.mark.parametrize("content_type", ["text/plain", "application/json"])
def test_request_from_a_refused_origin_does_not_run(live, content_type):
    # A text/plain POST is a "simple" request: browsers send it without a preflight.
    api, engine = live
    submitted = len(engine.submissions)
    body = b'{"messages": [{"role": "user", "content": "hi"}]}'
    with httpx.Client(base_url=api) as c:
        for origin in ("https://evil.example", "null"):
            headers = {"Origin": origin, "Content-Type": content_type}
            assert_refused(c.post(CHAT, content=body, headers=headers))
        assert_refused(c.get("/v1/models", headers={"Origin": "https://evil.example"}))
        ok = c.post(CHAT, content=body, headers={"Content-Type": content_type})  # no Origin
        assert ok.status_code == 200  # not a page: curl and scripts may omit the type
    assert len(engine.submissions) == submitted + 1


def test_simple_request_headers(api):
    with httpx.Client(base_url=api) as c:
        ok = c.get("/v1/models", headers={"Origin": "http://localhost:5173"})
        assert ok.headers["access-control-allow-origin"] == "http://localhost:5173"
        refused = c.get("/v1/models", headers={"Origin": "https://evil.example"})
        assert_refused(refused)
        # error responses carry the header too, so a page can read why it failed
        bad = c.post(CHAT, json={"messages": "no"}, headers={"Origin": "chrome-extension://abc"})
        assert bad.status_code == 400
        assert bad.headers["access-control-allow-origin"] == "chrome-extension://abc"
        form = c.post(CHAT, data={"a": "b"}, headers={"Origin": "chrome-extension://abc"})
        assert form.status_code == 415
        assert form.headers["access-control-allow-origin"] == "chrome-extension://abc"


def test_wildcard_setting_allows_any_origin():
    with serving(allowed_origins=("*",)) as (url, _):
        r = preflight(url, "https://anything.example")
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] in ("*", "https://anything.example")


# A real browser


def dump_dom(url: str, tmp_path: Path) -> str:
    if CHROMIUM is None:
        pytest.skip(NO_CHROMIUM)
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-features=HttpsUpgrades,HttpsFirstBalancedModeAutoEnable",
        "--host-resolver-rules=MAP evil.test 127.0.0.1",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--virtual-time-budget=10000",
        "--dump-dom",
        url,
    ]
    # Chromium must not inherit the BLAS preload that `make test` gives pytest: it aborts.
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    # A second try only for the browser itself failing (a crash, or the DOM dumped before
    # the page's script ran): what the page reads is asserted by the caller either way.
    for _ in range(2):
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False, env=env)
        match = re.search(r'<div id="out">(.*?)</div>', done.stdout, re.S)
        if done.returncode == 0 and match and match.group(1) != "PENDING":
            break
    assert done.returncode == 0, done.stderr[-2000:]
    assert match, f"no #out in the dumped DOM:\n{done.stdout[:2000]}\n{done.stderr[-2000:]}"
    return html.unescape(match.group(1))


def test_chromium_streams_from_an_allowed_origin(api, page_port, tmp_path):
    page = f"http://localhost:{page_port}/stream_chat.html?api={api}"
    out = dump_dom(page, tmp_path)
    assert out.startswith("STREAMED("), out
    n_chunks, text = re.fullmatch(r"STREAMED\((\d+)\):(.*)", out, re.S).groups()
    assert text == DEFAULT_REPLY
    assert int(n_chunks) > 2  # it arrived as a stream of chunks, not one body


def refused(api: str, endpoint: str = "preflight") -> float:
    with httpx.Client() as c:
        text = c.get(api + "/metrics").text
    line = f'mlx_prefix_requests_total{{endpoint="{endpoint}",status="403"}} '
    match = re.search(f"^{re.escape(line)}(\\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def test_chromium_page_from_a_refused_origin_cannot_read(live, page_port, tmp_path):
    api, engine = live
    before, submitted = refused(api), len(engine.submissions)
    page = f"http://evil.test:{page_port}/stream_chat.html?api={api}"
    out = dump_dom(page, tmp_path)
    assert out == "FETCH_FAILED:TypeError", out
    # it failed because our CORS policy refused the preflight, and nothing ran
    assert refused(api) == before + 1
    assert len(engine.submissions) == submitted


def test_chromium_simple_request_from_a_refused_origin_does_not_run(live, page_port, tmp_path):
    api, engine = live
    before, submitted = refused(api, CHAT), len(engine.submissions)
    page = f"http://evil.test:{page_port}/simple_post.html?api={api}"
    out = dump_dom(page, tmp_path)
    assert out == "SENT:opaque", out  # the browser sent it: no preflight stopped it
    assert refused(api, CHAT) == before + 1  # the server refused it by its Origin
    assert len(engine.submissions) == submitted
