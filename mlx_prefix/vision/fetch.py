"""Image URLs: refused unless the operator allows them, and then fetched with care.

By default the server never fetches anything on a request's behalf: an http(s) image URL
is a 400 naming the field (the client sends the bytes as base64 instead). mlx_lm.server
fetches any URL a request names, with a 30 s timeout and no size cap: a page on the
user's machine could make the server read the LAN or a cloud metadata address.

With `serve --allow-image-urls` an http(s) URL is fetched, but:
- the host's addresses are resolved once and every one must be public: loopback,
  private (RFC 1918, fc00::/7), link-local (169.254/16: cloud metadata), CGNAT,
  multicast, reserved and unspecified addresses are refused, and so is an IPv6 address
  that embeds a non-public IPv4 (IPv4-mapped, 6to4, NAT64; Teredo always);
- the connection goes to an address that was checked (not a second resolution, which a
  DNS-rebinding attacker could answer differently), tried in the resolver's order, with
  the URL's host as the HTTP Host and the TLS server name;
- no redirects (a redirect could point anywhere: the client can send the final URL);
- one deadline for the whole fetch, resolution included: every socket operation is given
  the time left (a server trickling a header byte at a time cannot hold a fetch past it),
  and the body is read only up to the byte limit (a larger Content-Length is refused
  before reading);
- at most FETCHES at once, each on a thread of its own: the request's thread (Starlette's
  pool, which also parses every other body) waits for the fetch no longer than the
  deadline, and a fetch beyond the bound is a 429 at once rather than a wait.
HTTP/1.1 is spoken by h11 (uvicorn's parser) over a socket this module owns, so every read
is under the deadline; h11 also bounds the response's header block (16 KiB).
"""

from __future__ import annotations

import functools
import ipaddress
import socket
import ssl
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from urllib.parse import urlsplit

import h11

from mlx_prefix.errors import EngineBusy, InvalidRequest
from mlx_prefix.vision.intake import ImageLimits

Resolver = Callable[[str, int], list[str]]
Allowed = Callable[[str], bool]

FETCHES = 8  # image URLs fetched at once, server-wide (Starlette's pool has 40 threads)
_READ = 64 * 1024
# The NAT64 well-known prefix (RFC 6052) embeds the IPv4 in its last 32 bits; the
# local-use prefix 64:ff9b:1::/48 (RFC 8215) places it as each network chooses, so what
# it reaches cannot be checked: refused.
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_NAT64_LOCAL = ipaddress.IPv6Network("64:ff9b:1::/48")


@dataclass(frozen=True, slots=True)
class Target:
    scheme: str
    host: str  # the URL's host name: TLS server name, certificate check
    authority: str  # the HTTP Host header: host[:port] as the URL gives it
    port: int
    path: str
    addresses: tuple[str, ...]  # the checked addresses, in the order they are tried


@dataclass(frozen=True, slots=True)
class Deadline:
    at: float  # time.monotonic()

    def left(self) -> float:
        """Seconds left; TimeoutError once there are none."""
        left = self.at - time.monotonic()
        if left <= 0:
            raise TimeoutError
        return left


def refuse_url(param: str) -> InvalidRequest:
    """The default answer to an http(s) image URL."""
    return InvalidRequest(
        f"{param}: this server does not fetch image URLs; send the image as base64 "
        "(a data:image/...;base64 URL), or start the server with --allow-image-urls",
        param=param,
        code="image_url_not_allowed",
    )


def public_address(address: str) -> bool:
    """Whether `address` is a public unicast address a fetch may connect to."""
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.teredo is not None or ip in _NAT64_LOCAL:
            return False
        # A translation prefix reaches the IPv4 it embeds: that address decides.
        embedded = ip.ipv4_mapped or ip.sixtofour
        if embedded is None and ip in _NAT64:
            embedded = ipaddress.IPv4Address(int(ip) & 0xFFFF_FFFF)
        if embedded is not None:
            ip = embedded
    return ip.is_global and not (ip.is_multicast or ip.is_reserved or ip.is_unspecified)


def system_resolver(host: str, port: int) -> list[str]:
    """The host's addresses in getaddrinfo's order (RFC 6724's preference)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


@dataclass(frozen=True, slots=True)
class _Url:
    scheme: str
    host: str
    authority: str
    port: int
    path: str


def _parse(url: str, param: str) -> _Url:
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise InvalidRequest(f"{param} is not a valid URL", param=param) from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidRequest(f"{param} must be an http(s) or data: URL", param=param)
    if parts.username or parts.password or "@" in parts.netloc:
        raise InvalidRequest(f"{param}: URLs with credentials are not fetched", param=param)
    port = port or (443 if parts.scheme == "https" else 80)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return _Url(parts.scheme, parts.hostname, parts.netloc, port, path)


def _check(url: _Url, param: str, resolve: Resolver, allowed: Allowed) -> Target:
    try:
        addresses = tuple(resolve(url.host, url.port))
    except (OSError, UnicodeError):
        raise InvalidRequest(
            f"{param}: the host {url.host!r} does not resolve", param=param
        ) from None
    if not addresses or not all(allowed(a) for a in addresses):
        raise InvalidRequest(
            f"{param}: {url.host!r} is a loopback, private or otherwise non-public "
            "address; the server fetches image URLs from public hosts only",
            param=param,
            code="image_url_not_allowed",
        )
    return Target(url.scheme, url.host, url.authority, url.port, url.path, addresses)


def check_url(
    url: str, param: str, resolve: Resolver = system_resolver, allowed: Allowed = public_address
) -> Target:
    """Where a fetch of `url` would connect, if everything about it is allowed."""
    return _check(_parse(url, param), param, resolve, allowed)


class FetchPool:
    """At most `size` fetches at once, each on a daemon thread of its own (one stuck in
    the system resolver, which nothing can interrupt, holds its slot until it returns
    and never delays the process's exit)."""

    def __init__(self, size: int):
        self.size = size
        self._slots = threading.BoundedSemaphore(size)

    def run(self, work: Callable[[], bytes], deadline: Deadline, param: str) -> bytes:
        """`work`'s bytes; its exception; TimeoutError at the deadline; EngineBusy (429)
        at once when `size` fetches are under way."""
        if not self._slots.acquire(blocking=False):
            raise EngineBusy(
                f"{param}: the server is fetching {self.size} image URLs already; try "
                "again shortly or send the image as base64",
                param=param,
            )
        future: Future[bytes] = Future()

        def fetch() -> None:
            try:
                data = work()
            except BaseException as e:  # handed to the waiting request, raised there
                self._slots.release()
                future.set_exception(e)
            else:
                self._slots.release()
                future.set_result(data)

        try:
            threading.Thread(target=fetch, name="mlx-prefix-fetch", daemon=True).start()
        except BaseException:
            self._slots.release()
            raise
        return future.result(timeout=deadline.left())


_POOL = FetchPool(FETCHES)


def fetch_image(
    url: str,
    limits: ImageLimits,
    param: str,
    resolve: Resolver = system_resolver,
    *,
    allowed: Allowed = public_address,
    tls: ssl.SSLContext | None = None,
) -> bytes:
    """The bytes behind `url` (module docstring's rules); InvalidRequest naming `param`.
    `allowed` and `tls` (the trusted certificates) are the tests' ways to a loopback
    server with a certificate of their own; the server uses the defaults."""
    if not limits.allow_urls:
        raise refuse_url(param)
    parsed = _parse(url, param)
    deadline = Deadline(time.monotonic() + limits.fetch_timeout_s)

    def work() -> bytes:
        target = _check(parsed, param, resolve, allowed)
        return _get(target, limits.max_bytes, deadline, tls or _system_tls(), param)

    try:
        return _POOL.run(work, deadline, param)
    except TimeoutError:
        raise InvalidRequest(
            f"{param}: fetching the image took longer than {limits.fetch_timeout_s:g}s",
            param=param,
        ) from None
    except (OSError, h11.ProtocolError) as e:
        raise InvalidRequest(f"{param}: fetching the image failed: {e}", param=param) from None


@functools.cache
def _system_tls() -> ssl.SSLContext:
    return ssl.create_default_context()


def _open_socket(address: str, port: int, timeout: float) -> socket.socket:
    """A TCP connection to `address` itself (no name lookup)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect((address, port))
    except BaseException:
        sock.close()
        raise
    return sock


def _connect(target: Target, deadline: Deadline, tls: ssl.SSLContext) -> socket.socket:
    """A connection to the first checked address that answers, TLS shaken hands for
    https (the handshake as a whole is bounded by the socket's timeout). An address
    before the last gets half the time left, so one that drops packets (a broken IPv6
    route) leaves time for the next."""
    failed: OSError | None = None
    for i, address in enumerate(target.addresses):
        left = deadline.left()
        try:
            timeout = left if i == len(target.addresses) - 1 else left / 2
            sock = _open_socket(address, target.port, timeout)
            break
        except OSError as e:  # refused, unreachable, timed out: the next address
            failed = e
    else:
        assert failed is not None  # addresses is never empty (_check)
        raise failed
    if target.scheme == "https":
        try:
            sock = tls.wrap_socket(sock, server_hostname=target.host, do_handshake_on_connect=False)
            sock.settimeout(deadline.left())
            sock.do_handshake()
        except BaseException:
            sock.close()
            raise
    return sock


def _get(
    target: Target, max_bytes: int, deadline: Deadline, tls: ssl.SSLContext, param: str
) -> bytes:
    """GET the target's path from its checked address, every read under the deadline."""
    sock = _connect(target, deadline, tls)
    try:
        http = h11.Connection(h11.CLIENT)
        headers = [("Host", target.authority), ("Accept", "image/*"), ("Connection", "close")]
        request = http.send(h11.Request(method="GET", target=target.path, headers=headers))
        end = http.send(h11.EndOfMessage())
        sock.settimeout(deadline.left())
        sock.sendall((request or b"") + (end or b""))
        body = bytearray()
        while True:
            event = http.next_event()
            if event is h11.NEED_DATA:
                sock.settimeout(deadline.left())
                http.receive_data(sock.recv(_READ))
            elif isinstance(event, h11.Response):
                _check_response(event, max_bytes, param)
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > max_bytes:
                    raise InvalidRequest(
                        f"{param}: the image is more than the server's limit of "
                        f"{max_bytes:,} bytes",
                        param=param,
                        code="image_too_large",
                    )
            elif isinstance(event, h11.EndOfMessage):
                return bytes(body)
            elif isinstance(event, h11.ConnectionClosed):
                raise ConnectionError("the host closed the connection")
            # an InformationalResponse (1xx) is followed by the response itself
    finally:
        sock.close()


def _check_response(response: h11.Response, max_bytes: int, param: str) -> None:
    if response.status_code != 200:
        raise InvalidRequest(
            f"{param}: fetching the image answered HTTP {response.status_code} (redirects "
            "are not followed)",
            param=param,
        )
    length = dict(response.headers).get(b"content-length")
    if length is not None and int(length) > max_bytes:
        raise InvalidRequest(
            f"{param}: the image is {int(length):,} bytes, more than the server's limit "
            f"of {max_bytes:,}",
            param=param,
            code="image_too_large",
        )
