"""Image URLs (vision/fetch.py): refused by default with nothing fetched; with the flag,
fetched only from public addresses (an IPv6 address embedding a private IPv4 is not
public), pinned to the address checked, bounded in size and time, redirects not followed.
A loopback server stands in for the public host: the socket is handed to it only after
the checks, with the checked address recorded. The pinned connection itself, the
whole-fetch deadline and the bound on concurrent fetches are in test_vision_fetch_limits.py."""

from __future__ import annotations

import http.client
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from mlx_prefix.errors import InvalidRequest
from mlx_prefix.vision import fetch
from mlx_prefix.vision.intake import ImageLimits

ALLOW = ImageLimits(allow_urls=True, max_bytes=10_000, fetch_timeout_s=2.0)
PUBLIC = "93.184.215.14"


@pytest.fixture
def no_network(monkeypatch):
    """Any socket connection or name lookup fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"network touched: {args}")

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(http.client.HTTPConnection, "connect", refuse)
    monkeypatch.setattr(fetch, "_open_socket", refuse)


def test_urls_are_refused_without_the_flag(no_network):
    with pytest.raises(InvalidRequest, match="--allow-image-urls") as e:
        fetch.fetch_image("https://example.com/cat.png", ImageLimits(), "messages[0].content[0]")
    assert e.value.param == "messages[0].content[0]" and e.value.code == "image_url_not_allowed"


# IPv6 addresses that reach an IPv4 one: IPv4-mapped, 6to4 (2002::/16), NAT64 (64:ff9b::/96).
PRIVATE_EMBEDDED = [
    "::ffff:10.0.0.1", "2002:a00:1::1", "2002:7f00:1::1", "2002:a9fe:a9fe::1",
    "2002:c0a8:1::", "64:ff9b::a00:1", "64:ff9b::7f00:1", "64:ff9b::a9fe:a9fe",
    "64:ff9b:1::5db8:d70e",  # local-use NAT64: where it puts the IPv4 is the network's choice
    "2001:0:5db8:d70e:0:f227:f5ff:fefe",  # Teredo (here to client 10.0.1.1)
    "2001:0:5db8:d70e:0:f227:a2ff:fffe",  # Teredo is never global, whatever it embeds
]  # fmt: skip
PUBLIC_EMBEDDED = ["::ffff:93.184.215.14", "2002:5db8:d70e::1", "64:ff9b::5db8:d70e"]


@pytest.mark.parametrize(
    "address",
    ["127.0.0.1", "10.1.2.3", "192.168.0.9", "172.16.5.5", "169.254.169.254", "100.64.0.1",
     "0.0.0.0", "224.0.0.1", "::1", "fc00::1", "fe80::1", "::ffff:127.0.0.1", "::a00:1",
     *PRIVATE_EMBEDDED],
)  # fmt: skip
def test_non_public_addresses_are_refused_before_connecting(no_network, address):
    assert not fetch.public_address(address)
    with pytest.raises(InvalidRequest, match="non-public"):
        fetch.fetch_image("http://host.test/x.png", ALLOW, "p", resolve=lambda h, p: [address])


@pytest.mark.parametrize("address", [PUBLIC, "2606:4700::1111", *PUBLIC_EMBEDDED])
def test_public_addresses_and_public_ipv4_embedded_in_ipv6_are_allowed(address):
    assert fetch.public_address(address)


def test_one_private_address_among_public_ones_refuses_the_host(no_network):
    with pytest.raises(InvalidRequest, match="non-public"):
        fetch.fetch_image(
            "http://host.test/x.png", ALLOW, "p", resolve=lambda h, p: [PUBLIC, "10.0.0.1"]
        )


@pytest.mark.parametrize(
    "url", ["ftp://host.test/x.png", "file:///etc/passwd", "http://user:pw@host.test/x"]
)
def test_other_schemes_and_credentials_are_refused(no_network, url):
    with pytest.raises(InvalidRequest):
        fetch.fetch_image(url, ALLOW, "p", resolve=lambda h, p: [PUBLIC])


class _Handler(BaseHTTPRequestHandler):
    routes: dict = {}

    def do_GET(self):  # noqa: N802
        self.server.hosts.append(self.headers["Host"])
        status, headers, body, delay = self.routes[self.path]
        time.sleep(delay)
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the fetch stopped reading at its limit: what the test checks

    def log_message(self, *args):
        pass


@pytest.fixture
def stand_in(monkeypatch):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.hosts = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    connected = []

    def open_socket(address, port, timeout):
        connected.append(address)
        return socket.create_connection(("127.0.0.1", server.server_address[1]), timeout)

    monkeypatch.setattr(fetch, "_open_socket", open_socket)
    yield server, connected
    server.shutdown()
    server.server_close()


def _get(path, limits=ALLOW):
    return fetch.fetch_image(f"http://img.test{path}", limits, "p", resolve=lambda h, p: [PUBLIC])


def test_a_public_image_is_fetched_from_the_checked_address(stand_in):
    server, connected = stand_in
    _Handler.routes = {"/ok.png": (200, {"Content-Length": "5"}, b"hello", 0)}
    assert _get("/ok.png") == b"hello"
    assert connected == [PUBLIC] and server.hosts == ["img.test"]


def test_size_redirect_and_time_limits(stand_in):
    _Handler.routes = {
        "/big": (200, {"Content-Length": "20000"}, b"", 0),
        "/stream": (200, {}, b"x" * 20_000, 0),
        "/moved": (302, {"Location": "http://10.0.0.1/", "Content-Length": "0"}, b"", 0),
        "/slow": (200, {"Content-Length": "1"}, b"x", 1.5),
    }
    with pytest.raises(InvalidRequest, match="20,000 bytes"):
        _get("/big")
    with pytest.raises(InvalidRequest, match="limit of 10,000"):
        _get("/stream")
    with pytest.raises(InvalidRequest, match="HTTP 302"):
        _get("/moved")
    with pytest.raises(InvalidRequest, match="longer than 0.5s"):
        _get("/slow", ImageLimits(allow_urls=True, fetch_timeout_s=0.5))
