"""Image URLs: refused unless the operator allows them, and then fetched with care.

By default the server never fetches anything on a request's behalf: an http(s) image URL
is a 400 naming the field (the client sends the bytes as base64 instead). mlx_lm.server
fetches any URL a request names, with a 30 s timeout and no size cap: a page on the
user's machine could make the server read the LAN or a cloud metadata address.

With `serve --allow-image-urls` an http(s) URL is fetched, but:
- the host's addresses are resolved once and every one must be public: loopback,
  private (RFC 1918, fc00::/7), link-local (169.254/16: cloud metadata), CGNAT,
  multicast, reserved and unspecified addresses are refused;
- the connection goes to the address that was checked (not a second resolution, which a
  DNS-rebinding attacker could answer differently), with the URL's host as the HTTP
  Host and the TLS server name;
- no redirects (a redirect could point anywhere: the client can send the final URL);
- one time limit for the whole fetch, and the body is read only up to the byte limit
  (a larger Content-Length is refused before reading).
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from mlx_prefix.errors import InvalidRequest
from mlx_prefix.vision.intake import ImageLimits

Resolver = Callable[[str, int], list[str]]


@dataclass(frozen=True, slots=True)
class Target:
    scheme: str
    host: str
    port: int
    path: str
    address: str  # the checked address the connection goes to


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
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not (ip.is_multicast or ip.is_reserved or ip.is_unspecified)


def system_resolver(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def check_url(url: str, param: str, resolve: Resolver = system_resolver) -> Target:
    """Where a fetch of `url` would connect, if everything about it is allowed."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise InvalidRequest(f"{param} is not a valid URL", param=param) from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidRequest(f"{param} must be an http(s) or data: URL", param=param)
    if parts.username or parts.password:
        raise InvalidRequest(f"{param}: URLs with credentials are not fetched", param=param)
    port = port or (443 if parts.scheme == "https" else 80)
    try:
        addresses = resolve(parts.hostname, port)
    except (OSError, UnicodeError):
        raise InvalidRequest(
            f"{param}: the host {parts.hostname!r} does not resolve", param=param
        ) from None
    if not addresses or not all(public_address(a) for a in addresses):
        raise InvalidRequest(
            f"{param}: {parts.hostname!r} is a loopback, private or otherwise non-public "
            "address; the server fetches image URLs from public hosts only",
            param=param,
            code="image_url_not_allowed",
        )
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return Target(parts.scheme, parts.hostname, port, path, addresses[0])


def fetch_image(
    url: str, limits: ImageLimits, param: str, resolve: Resolver = system_resolver
) -> bytes:
    """The bytes behind `url` (module docstring's rules); InvalidRequest naming `param`."""
    if not limits.allow_urls:
        raise refuse_url(param)
    target = check_url(url, param, resolve)
    deadline = time.monotonic() + limits.fetch_timeout_s
    conn = _connection(target, limits.fetch_timeout_s)
    try:
        conn.request("GET", target.path, headers={"Host": target.host, "Accept": "image/*"})
        response = conn.getresponse()
        if response.status != 200:
            raise InvalidRequest(
                f"{param}: fetching the image answered HTTP {response.status} (redirects "
                "are not followed)",
                param=param,
            )
        length = response.getheader("Content-Length")
        if length is not None and length.isdigit() and int(length) > limits.max_bytes:
            raise InvalidRequest(
                f"{param}: the image is {int(length):,} bytes, more than the server's limit "
                f"of {limits.max_bytes:,}",
                param=param,
                code="image_too_large",
            )
        body = bytearray()
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError
            chunk = response.read1(64 * 1024)
            if not chunk:
                return bytes(body)
            body += chunk
            if len(body) > limits.max_bytes:
                raise InvalidRequest(
                    f"{param}: the image is more than the server's limit of "
                    f"{limits.max_bytes:,} bytes",
                    param=param,
                    code="image_too_large",
                )
    except InvalidRequest:
        raise
    except TimeoutError:
        raise InvalidRequest(
            f"{param}: fetching the image took longer than {limits.fetch_timeout_s:g}s",
            param=param,
        ) from None
    except (OSError, http.client.HTTPException) as e:
        raise InvalidRequest(f"{param}: fetching the image failed: {e}", param=param) from None
    finally:
        conn.close()


def _connection(target: Target, timeout: float) -> http.client.HTTPConnection:
    """A connection to the checked address, naming the host for HTTP and TLS."""
    if target.scheme == "http":
        conn = http.client.HTTPConnection(target.address, target.port, timeout=timeout)
        return conn
    context = ssl.create_default_context()

    class _Pinned(http.client.HTTPSConnection):
        def connect(self) -> None:
            sock = socket.create_connection((target.address, target.port), timeout)
            self.sock = context.wrap_socket(sock, server_hostname=target.host)

    return _Pinned(target.host, target.port, timeout=timeout, context=context)
