"""Cache namespaces over HTTP (issue 19, invariant 10): which part of the prompt cache a
request reads and writes, and which entries a caller may list and act on.

Every response reports `cached_tokens`, and a hit answers sooner than a miss, so a
client that could match another's entries could test whether some text was sent
(Gu et al., "Auditing Prompt Caching in Language Model APIs", 2025). So each entry
belongs to a namespace and a request matches only its own (engine/keys.py puts the
namespace in every key, in memory and on disk). With `cache_sharing="origin"` (the
default) the namespace is made of who sent the request:
- a page's or browser extension's `Origin`: two extensions never share;
- the API key, when the server has one (a slow digest of it: the key itself is never
  kept here, logged, or written): entries made under another key stay apart;
- clients without an Origin on this machine (curl, SDKs, the CLI, agents) share one
  namespace; a client on another machine (a server bound beyond loopback) without an
  Origin gets one per address.
The dashboard's own page (an Origin naming this server on a loopback host) counts as a
client without one. A request's `cache_salt` splits its namespace further.
`cache_sharing="global"` puts every client in one namespace (only `cache_salt` splits).

Listings, flushes, pins and evictions go through `visible`: a caller sees its own
namespace's entries (every salt in it), unless it holds the admin key (`api_key`) or is
a local client without an Origin, which see all. Aggregate counters (hits, bytes,
evictions) stay server-wide: they say how much others use the cache, not what for.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any, TypeVar
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.requests import Request

from mlx_prefix.cache.types import StoredTokens
from mlx_prefix.engine.keys import namespace_id, namespace_of
from mlx_prefix.records import CachePreference

SHARING = ("origin", "global")
_KEY_SALT = b"mlx-prefix cache namespace"
_KEY_ROUNDS = 100_000  # once per server start: a disk header must not make a weak key cheap
T = TypeVar("T")


@dataclass(frozen=True)
class Caller:
    """Who is asking, as far as the cache is concerned."""

    namespace: str  # the namespace its requests use, before any cache_salt ("": shared)
    admin: bool  # sees and acts on every namespace's entries

    @property
    def namespace_id(self) -> str:
        return namespace_id(self.namespace)

    def sees(self, namespace: str | None) -> bool:
        """Whether entries of namespace id `namespace` (None: an entry from before
        namespaces) are this caller's to list and act on."""
        return self.admin or namespace == self.namespace_id


class Namespaces:
    """One server's rule from a request to its Caller."""

    def __init__(self, sharing: str, api_key: str | None):
        if sharing not in SHARING:
            raise ValueError(f"cache_sharing must be one of {', '.join(SHARING)}, not {sharing!r}")
        self.sharing = sharing
        self._bearer = f"Bearer {api_key}".encode() if api_key else None
        self._key = api_key.encode() if api_key else None
        self._key_tag = (
            hashlib.pbkdf2_hmac("sha256", api_key.encode(), _KEY_SALT, _KEY_ROUNDS).hex()[:16]
            if api_key
            else None
        )

    def caller(self, request: Request) -> Caller:
        headers = request.headers
        origin = headers.get("origin")
        if origin is not None and _own_page(origin, headers.get("host", "")):
            origin = None
        peer = request.client.host if request.client is not None else None
        local = peer is None or _loopback(peer)
        holds_key = self.holds_key(headers)
        admin = holds_key or (local and origin is None)
        if self.sharing == "global":
            return Caller("", admin)
        parts = []
        if origin is not None:
            parts.append(f"origin={origin}")
        elif not local:
            parts.append(f"peer={peer}")
        if holds_key:
            parts.append(f"key={self._key_tag}")
        return Caller(";".join(parts), admin)

    def holds_key(self, headers: Headers) -> bool:
        """Whether the request carries the API key, sent either way the API key check
        accepts it (middleware.ApiKeyAuth): `Authorization: Bearer` (OpenAI clients) or
        `x-api-key` (Anthropic's SDK, Claude Code). One holder, one namespace."""
        if self._bearer is None or self._key is None:
            return False
        bearer = headers.get("authorization", "").encode()
        key = headers.get("x-api-key", "").encode()
        # Both compared, always, as ApiKeyAuth does.
        return hmac.compare_digest(bearer, self._bearer) | hmac.compare_digest(key, self._key)


def caller(request: Request) -> Caller:
    namespaces: Namespaces = request.app.state.namespaces
    return namespaces.caller(request)


def scoped(request: Request, pref: CachePreference) -> CachePreference:
    """`pref` (as the body asked, `cache_salt` included) in the sender's namespace."""
    return replace(pref, namespace=caller(request).namespace)


def visible(caller: Caller, items: Iterable[T]) -> list[T]:
    """What of `items` `caller` may see and act on: memory entries and disk files
    (StoredTokens, or an entry listing's dicts) by their key's namespace, jobs and
    request records by their `namespace`."""
    return [item for item in items if caller.sees(_namespace(item))]


def _namespace(item: Any) -> str | None:
    if isinstance(item, StoredTokens):
        return namespace_of(item.info.model_key)
    if isinstance(item, dict):
        return namespace_of(item["model_key"])
    return item.namespace


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _own_page(origin: str, host: str) -> bool:
    """Whether `origin` is this server's own page (the dashboard) reached on a loopback
    name. A page of another name resolving here (DNS rebinding) has its own origin."""
    parts = urlsplit(origin)
    if parts.netloc.lower() != host.lower() or parts.hostname is None:
        return False
    return _loopback(parts.hostname)
