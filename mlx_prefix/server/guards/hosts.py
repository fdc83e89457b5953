"""Which `Host` header a request may carry: the defence against DNS rebinding.

A page on evil.example whose name the attacker re-points at 127.0.0.1 is "same origin"
with this server: its requests carry no Origin (a same-origin GET) or its own, and
`Host: evil.example:PORT`. Only the Host tells them apart, so every route refuses a
Host that is not one of:
- a loopback name: `localhost`, an address in 127.0.0.0/8, `[::1]`;
- the address the server is bound to (`--host`), as given;
- bound to every address (0.0.0.0, ::): any IP literal (the machine's own addresses are
  what it listens on; an IP literal cannot be a rebound name) and the machine's own
  name (`socket.gethostname()`, with and without `.local`);
- the host of an origin named in `--allowed-origins` (the operator trusts that site);
- a name in `--allowed-hosts` (`.example.com` also allows its subdomains; `*` turns the
  check off, for a reverse proxy that rewrites Host).
The port is not checked: rebinding changes the name, never the port. A request without
a Host (HTTP/1.0) passes: browsers always send one. Pure: no Starlette, no I/O but the
host name lookup at construction.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Collection
from urllib.parse import urlsplit

WILDCARD_BINDS = frozenset({"0.0.0.0", "::", ""})


def host_name(header: str) -> str:
    """The name in a Host header: port and IPv6 brackets removed, lower case, no final
    dot ("localhost." is localhost)."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].partition("]")[0]
    name, sep, port = header.rpartition(":")
    if sep and port.isdigit() and ":" not in name:
        header = name
    return header.rstrip(".")


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


def is_loopback_name(name: str) -> bool:
    ip = _ip(name)
    return ip.is_loopback if ip is not None else name == "localhost"


def check_allowed_host(entry: str) -> str:
    """One --allowed-hosts entry, normalized; ValueError for what could never match."""
    name = entry.strip().lower()
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    if not name or "/" in name or " " in name or (":" in name and _ip(name) is None):
        raise ValueError(
            f"allowed_hosts: {entry!r} is not a host name such as 'llm.example.com' "
            "(no scheme, no port), '.example.com' (and its subdomains) or '*'"
        )
    return name.rstrip(".") if name != "." else name


class HostPolicy:
    """The rule above for one server. Immutable after construction."""

    def __init__(
        self,
        bind_host: str,
        allowed_hosts: Collection[str] = (),
        allowed_origins: Collection[str] = (),
        machine_name: str | None = None,
    ):
        names = {check_allowed_host(h) for h in allowed_hosts}
        self.any = "*" in names
        self.wildcard_bind = bind_host.strip() in WILDCARD_BINDS
        self._domains = tuple(n for n in names if n.startswith("."))
        self._names = {n for n in names if not n.startswith(".")}
        if not self.wildcard_bind:
            self._names.add(bind_host.strip().lower().strip("[]").rstrip("."))
        for origin in allowed_origins:
            hostname = urlsplit(origin).hostname if origin != "*" else None
            if hostname:
                self._names.add(hostname.rstrip("."))
        if self.wildcard_bind:
            own = (machine_name if machine_name is not None else socket.gethostname()).lower()
            short = own.rstrip(".").removesuffix(".local")
            self._names |= {own.rstrip("."), short, f"{short}.local"} - {""}

    def allows(self, header: str | None) -> bool:
        """Whether a request with this Host header (None: none sent) may be served."""
        if header is None or self.any:
            return True
        name = host_name(header)
        if is_loopback_name(name) or name in self._names:
            return True
        if self.wildcard_bind and _ip(name) is not None:
            return True
        return any(name.endswith(d) or name == d[1:] for d in self._domains)
