"""Image URLs (vision/fetch.py), the connection itself: the real pinned connection, over
HTTP and over TLS, reaches the address that was checked with the URL's name as Host and
TLS server name, trying the next checked address when one times out; one deadline bounds
the whole fetch (a resolver that hangs, a host that trickles its header a byte at a
time); fetches beyond the bound are refused at once and never take more than the bound
of threads. Loopback servers stand in for public hosts: the tests admit loopback through
fetch_image's `allowed`, everything else is the server's path. The certificate is made
here with the openssl command line and trusted by the test's own context only."""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from mlx_prefix.errors import EngineBusy, InvalidRequest
from mlx_prefix.vision import fetch
from mlx_prefix.vision.intake import ImageLimits

HANG = 60  # a deadline for a hang, never a timing assertion
ALLOW = ImageLimits(allow_urls=True, max_bytes=10_000, fetch_timeout_s=HANG)
IMAGE = b"\x89PNG not really"


def _anything(address: str) -> bool:
    return True


class _Host(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        local = self.connection.getsockname()[0]
        self.server.asked.append((local, self.headers["Host"], self.path))
        self.send_response(200)
        self.send_header("Content-Length", str(len(IMAGE)))
        self.end_headers()
        self.wfile.write(IMAGE)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    """A CA and a certificate for img.test it signed (the shape trustme makes)."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command line to make a test certificate")
    d = tmp_path_factory.mktemp("tls")

    def openssl(*args):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    (d / "ca.ext").write_text(
        "basicConstraints=critical,CA:TRUE\nkeyUsage=critical,keyCertSign,cRLSign\n"
        "subjectKeyIdentifier=hash\n"
    )
    (d / "leaf.ext").write_text(
        "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n"
        "extendedKeyUsage=serverAuth\nsubjectAltName=DNS:img.test\n"
        "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n"
    )
    for name in ("ca", "leaf"):
        openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", f"{name}.key")
        openssl(
            "req", "-new", "-key", f"{name}.key", "-subj", f"/CN=test {name}", "-out", f"{name}.csr"
        )
    sign = ("x509", "-req", "-days", "2", "-in")
    openssl(*sign, "ca.csr", "-signkey", "ca.key", "-extfile", "ca.ext", "-out", "ca.pem")
    by_ca = ("-CA", "ca.pem", "-CAkey", "ca.key", "-set_serial", "2")
    openssl(*sign, "leaf.csr", *by_ca, "-extfile", "leaf.ext", "-out", "leaf.pem")
    return d


@pytest.fixture(params=["http", "https"])
def host(request, certificate):
    """A loopback host on 127.0.0.1, and nothing on [::1] at its port; for https, the
    client context that trusts its certificate and the TLS server names it was sent."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Host)
    server.asked, server.names, server.trust = [], [], None
    port = server.server_address[1]
    if request.param == "https":
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(certificate / "leaf.pem", certificate / "leaf.key")
        context.sni_callback = lambda sock, name, ctx: server.names.append(name)
        server.socket = context.wrap_socket(server.socket, server_side=True)
        server.trust = ssl.create_default_context(cafile=str(certificate / "ca.pem"))
    refused = socket.socket(socket.AF_INET6)  # bound, not listening: a connection is refused
    try:
        refused.bind(("::1", port))
    except OSError:
        pass  # no IPv6 loopback: connecting there fails as surely
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield request.param, server, port
    refused.close()
    server.shutdown()
    server.server_close()


def test_the_real_connection_reaches_the_checked_address_with_the_urls_name(host, monkeypatch):
    scheme, server, port = host
    resolved, checked = [], []

    def resolve(name, port):
        resolved.append(name)
        return ["::1", "127.0.0.1"]  # the first refuses: the fetch tries the second

    def allowed(address):
        checked.append(address)
        return True

    def no_second_lookup(*args, **kwargs):
        raise AssertionError(f"a name looked up again: {args}")

    monkeypatch.setattr(socket, "getaddrinfo", no_second_lookup)
    url = f"{scheme}://img.test:{port}/cat.png"
    data = fetch.fetch_image(url, ALLOW, "p", resolve, allowed=allowed, tls=server.trust)
    assert data == IMAGE
    assert resolved == ["img.test"] and checked == ["::1", "127.0.0.1"]
    assert server.asked == [("127.0.0.1", f"img.test:{port}", "/cat.png")]
    if scheme == "https":
        assert server.names == ["img.test"]


def test_the_certificate_is_checked_against_the_urls_name(host):
    scheme, server, port = host
    if scheme != "https":
        pytest.skip("TLS only")
    to_host = lambda name, port: ["127.0.0.1"]  # noqa: E731
    with pytest.raises(InvalidRequest, match="fetching the image failed"):
        url = f"https://other.test:{port}/cat.png"  # the same address, another name
        fetch.fetch_image(url, ALLOW, "p", to_host, allowed=_anything, tls=server.trust)
    with pytest.raises(InvalidRequest, match="fetching the image failed"):
        url = f"https://img.test:{port}/cat.png"  # the test's CA is trusted by the test only
        fetch.fetch_image(url, ALLOW, "p", to_host, allowed=_anything)
    assert server.asked == []


def test_an_address_that_drops_packets_leaves_time_for_the_next(host, monkeypatch):
    scheme, server, port = host
    real_open, given = fetch._open_socket, []

    def open_socket(address, port, timeout):
        given.append(timeout)
        if address == "2001:db8::1":  # a route that drops packets: the connect times out
            raise TimeoutError
        return real_open(address, port, timeout)

    monkeypatch.setattr(fetch, "_open_socket", open_socket)
    url = f"{scheme}://img.test:{port}/cat.png"
    to_both = lambda name, port: ["2001:db8::1", "127.0.0.1"]  # noqa: E731
    assert fetch.fetch_image(url, ALLOW, "p", to_both, allowed=_anything, tls=server.trust) == IMAGE
    assert server.asked == [("127.0.0.1", f"img.test:{port}", "/cat.png")]
    assert given[0] <= HANG / 2  # the first address could not take the whole deadline


class _RawHost:
    """A loopback TCP server handing each connection to `serve(conn, host)` on a thread
    of its own; `stop` ends them all."""

    def __init__(self, serve):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.port = self.listener.getsockname()[1]
        self.stop, self.accepted = threading.Event(), 0
        self.serve = serve
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self):
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            self.accepted += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        with conn:
            try:
                conn.settimeout(HANG)
                self.serve(conn, self)
            except OSError:
                pass

    def close(self):
        self.stop.set()
        self.thread.join(HANG)
        self.listener.close()


def _trickle(conn, host):
    """A status line, then a header one byte at a time, each well within any read
    timeout, for as long as the test lets it."""
    conn.recv(65536)
    conn.sendall(b"HTTP/1.1 200 OK\r\nX-Slow: ")
    while not host.stop.wait(0.05):
        conn.sendall(b"a")


def _hold(conn, host):
    conn.recv(65536)
    host.stop.wait(HANG)


def _in_thread(call):
    """Run `call` on a thread; the outcome (value or exception) once it ends."""
    outcome = {}

    def run():
        try:
            outcome["value"] = call()
        except Exception as e:
            outcome["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def test_a_host_trickling_its_header_is_cut_off_at_the_fetchs_deadline():
    host = _RawHost(_trickle)
    limits = ImageLimits(allow_urls=True, fetch_timeout_s=1.0)
    url = f"http://img.test:{host.port}/cat.png"
    resolve = lambda name, port: ["127.0.0.1"]  # noqa: E731
    try:
        thread, outcome = _in_thread(
            lambda: fetch.fetch_image(url, limits, "p", resolve, allowed=_anything)
        )
        thread.join(HANG)
        assert not thread.is_alive(), "the fetch outlived its deadline"
    finally:
        host.close()
    assert isinstance(outcome.get("error"), InvalidRequest), outcome
    assert "longer than 1s" in str(outcome["error"]) and host.accepted == 1


def test_name_resolution_is_within_the_deadline():
    release = threading.Event()

    def hanging_resolver(name, port):
        release.wait(HANG)
        return ["127.0.0.1"]

    limits = ImageLimits(allow_urls=True, fetch_timeout_s=0.5)
    try:
        thread, outcome = _in_thread(
            lambda: fetch.fetch_image(
                "http://img.test/cat.png", limits, "p", hanging_resolver, allowed=_anything
            )
        )
        thread.join(HANG / 2)
        assert not thread.is_alive(), "the fetch waited for the resolver past its deadline"
    finally:
        release.set()
    assert isinstance(outcome.get("error"), InvalidRequest), outcome
    assert "longer than 0.5s" in str(outcome["error"])


def _fetch_threads():
    return {t for t in threading.enumerate() if t.name.startswith("mlx-prefix-fetch")}


def test_fetches_beyond_the_bound_are_refused_at_once_and_take_no_thread(monkeypatch):
    bound = fetch.FETCHES
    monkeypatch.setattr(fetch, "_POOL", fetch.FetchPool(bound))  # no slot left by another test
    before = _fetch_threads()
    host = _RawHost(_hold)
    url = f"http://img.test:{host.port}/cat.png"
    resolve = lambda name, port: ["127.0.0.1"]  # noqa: E731

    def get():
        return fetch.fetch_image(url, ALLOW, "p", resolve, allowed=_anything)

    try:
        held = [_in_thread(get) for _ in range(bound)]
        for _ in range(HANG * 10):  # every held fetch connected
            if host.accepted == bound:
                break
            host.stop.wait(0.1)
        assert host.accepted == bound
        extra = [_in_thread(get) for _ in range(3)]
        for thread, _ in extra:
            thread.join(HANG)
        assert all(isinstance(o.get("error"), EngineBusy) for _, o in extra), extra
        assert f"fetching {bound} image URLs already" in str(extra[0][1]["error"])
        assert host.accepted == bound
        assert len(_fetch_threads() - before) == bound
    finally:
        host.close()  # the held fetches end: the host closed on them
    for thread, outcome in held:
        thread.join(HANG)
        assert isinstance(outcome.get("error"), InvalidRequest), outcome
