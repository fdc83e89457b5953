"""Image URLs through the server started with --allow-image-urls: a public host's image is
fetched from the address that was checked and keys as the same image sent inline; a URL
naming loopback, a private or a link-local (cloud metadata) address is a 400 in the API's
own shape with nothing fetched; a slow fetch holds up no other request. No network: names
resolve through a stand-in resolver (socket.getaddrinfo), and the connection the fetch
opens to a checked address is handed to a loopback server standing in for the host."""

from __future__ import annotations

import base64
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from support.live import live_server
from support.vision_models import encoded, picture, vision_engine

from mlx_prefix.vision import fetch

PNG = encoded(picture(96, 64, seed=21))
DATA_URL = "data:image/png;base64," + base64.b64encode(PNG).decode()
PUBLIC = "93.184.215.14"
NAMES = {"img.test": PUBLIC, "intranet.test": "10.0.0.5", "metadata.test": "169.254.169.254"}
LOOPBACK = ("127.0.0.1", "localhost", "::1")
SYSTEM = {"role": "system", "content": "You read screenshots for a developer. " * 4}
PLAIN = {"chat_template_kwargs": {"enable_thinking": False}}


class _Host(BaseHTTPRequestHandler):
    """The public host: every GET answers the PNG, once `release` is set."""

    def do_GET(self):  # noqa: N802
        self.server.asked.append((self.headers["Host"], self.path))
        self.server.arrived.set()
        self.server.release.wait(120)
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(PNG)))
        self.end_headers()
        self.wfile.write(PNG)

    def log_message(self, *args):
        pass


@pytest.fixture
def host(monkeypatch):
    """The stand-in host and resolver; yields the host server and the addresses the
    fetch connected to. A name outside NAMES and loopback fails the test."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Host)
    server.asked, server.arrived, server.release = [], threading.Event(), threading.Event()
    server.release.set()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    original, original_connect = socket.getaddrinfo, socket.create_connection
    connected = []

    def resolve(name, port, *args, **kwargs):
        if name in NAMES:
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (NAMES[name], port))]
        if name in LOOPBACK:  # the clients' own connections to the test server
            return original(name, port, *args, **kwargs)
        raise AssertionError(f"network touched: {name}")

    def open_socket(address, port, timeout):
        connected.append(address)
        return original_connect(("127.0.0.1", server.server_address[1]), timeout)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    monkeypatch.setattr(fetch, "_open_socket", open_socket)
    yield server, connected
    server.release.set()
    server.shutdown()
    server.server_close()


live = live_server(vision_engine, allow_image_urls=True, image_fetch_timeout_s=60.0)


def chat(url: str) -> dict:
    look = [{"type": "text", "text": "What is on this screen?"},
            {"type": "image_url", "image_url": {"url": url}}]  # fmt: skip
    messages = [SYSTEM, {"role": "user", "content": look}]
    return {"model": "m", "messages": messages, "max_tokens": 4, "temperature": 0, **PLAIN}


def test_a_public_image_is_fetched_from_the_checked_address_and_is_the_same_image(http, host):
    server, connected = host
    fetched = http.post("/v1/chat/completions", json=chat("http://img.test/shot.png"))
    assert fetched.status_code == 200, fetched.text
    assert connected == [PUBLIC] and server.asked == [("img.test", "/shot.png")]
    inline = http.post("/v1/chat/completions", json=chat(DATA_URL))
    assert inline.status_code == 200, inline.text
    # The same pixels, fetched or inline, are one image for the cache: the inline request
    # reads the fetched one's prompt, image included, and answers as it did.
    usage = inline.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 8
    assert inline.json()["choices"][0]["message"] == fetched.json()["choices"][0]["message"]


@pytest.mark.parametrize(
    "where",
    ["http://127.0.0.1:{port}/shot.png", "http://localhost:{port}/shot.png",
     "http://[::1]:{port}/shot.png", "http://intranet.test/shot.png",
     "http://metadata.test/latest/meta-data/"],
)  # fmt: skip
def test_loopback_private_and_metadata_urls_are_refused_with_nothing_fetched(http, host, where):
    server, connected = host
    url = where.format(port=server.server_address[1])
    anthropic = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": url}}]}]}  # fmt: skip
    r = http.post("/v1/chat/completions", json=chat(url))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "messages[1].content[1].image_url.url"
    assert error["code"] == "image_url_not_allowed" and "non-public" in error["message"]
    r = http.post("/v1/messages", json=anthropic)
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert "messages[0].content[0].source.url" in r.json()["error"]["message"]
    assert http.post("/v1/chat/completions", json=chat(DATA_URL)).status_code == 200
    assert connected == [] and server.asked == []


def test_a_fetch_in_progress_holds_up_no_other_request(url, host):
    server, _ = host
    server.release.clear()  # the host answers only once the server has answered another
    result = {}

    def ask():
        with httpx.Client(base_url=url, timeout=300) as client:
            body = chat("http://img.test/slow.png")
            result["r"] = client.post("/v1/chat/completions", json=body)

    asking = threading.Thread(target=ask)
    asking.start()
    try:
        assert server.arrived.wait(60)  # the fetch is under way, inside the body's parse
        # A deadline for a hang: an event loop held by the fetch answers nothing until
        # the host is released.
        with httpx.Client(base_url=url, timeout=30) as client:
            assert client.get("/health").status_code == 200
        with httpx.Client(base_url=url, timeout=300) as client:
            inline = chat(DATA_URL)
            inline["messages"][1]["content"][0]["text"] = "And this one?"
            assert client.post("/v1/chat/completions", json=inline).status_code == 200
    finally:
        server.release.set()
        asking.join(300)
    assert result["r"].status_code == 200, result["r"].text


def test_a_fetch_beyond_the_servers_bound_is_a_429_at_once(url, host, monkeypatch):
    server, connected = host
    monkeypatch.setattr(fetch, "_POOL", fetch.FetchPool(1))  # one fetch at a time
    server.release.clear()
    result = {}

    def ask():
        with httpx.Client(base_url=url, timeout=300) as client:
            result["r"] = client.post("/v1/chat/completions", json=chat("http://img.test/a.png"))

    asking = threading.Thread(target=ask)
    asking.start()
    try:
        assert server.arrived.wait(60)  # the one fetch is under way
        with httpx.Client(base_url=url, timeout=30) as client:  # a deadline for a hang
            r = client.post("/v1/chat/completions", json=chat("http://img.test/b.png"))
        assert r.status_code == 429, r.text
        error = r.json()["error"]
        assert error["code"] == "server_busy" and "image URLs already" in error["message"]
        assert error["param"] == "messages[1].content[1].image_url.url"
    finally:
        server.release.set()
        asking.join(300)
    assert result["r"].status_code == 200, result["r"].text
    assert connected == [PUBLIC] and server.asked == [("img.test", "/a.png")]
