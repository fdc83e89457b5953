"""Pure ASGI middleware (no BaseHTTPMiddleware: it would hide client disconnects from
streaming responses): the Host check, CORS policy, API-key check.

Who may call what is decided here, once, for every route (the API under /v1 and its
unprefixed twins, /health, /metrics, the dashboard and the cache admin routes), in this
order: HostGuard (DNS rebinding), OriginPolicy (pages and extensions), ApiKeyAuth."""

from __future__ import annotations

import hmac
from collections.abc import Collection

from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from ..errors import HostRefused, OriginRefused, Unauthorized, error_response, error_response_for
from .hosts import HostPolicy

# Pages served from this machine on any port, and browser extensions. Other web origins
# are refused unless configured: a page on the open web must not drive a local model.
DEFAULT_ORIGIN_REGEX = (
    r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d{1,5})?"
    r"|(chrome-extension|moz-extension|safari-web-extension)://[A-Za-z0-9._-]+"
)


class HostGuard:
    """Refuses a request whose Host header the HostPolicy refuses (server/guards/hosts.py), on
    every path and method, before anything else runs: a 403 in the path's API family's
    error shape."""

    def __init__(self, app: ASGIApp, policy: HostPolicy):
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            host = Headers(scope=scope).get("host")
            if not self.policy.allows(host):
                err = HostRefused(
                    f"host {host!r} is not allowed: use localhost or 127.0.0.1, or start "
                    "the server with --allowed-hosts naming it"
                )
                await error_response_for(scope["path"], err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def cors(allowed_origins: Collection[str]) -> Middleware:
    return Middleware(
        OriginPolicy,
        allow_origins=tuple(allowed_origins),
        allow_origin_regex=DEFAULT_ORIGIN_REGEX,
        allow_methods=("GET", "POST", "DELETE", "OPTIONS"),
        allow_headers=("*",),
        # Chrome asks before a page reaches a loopback address (Private Network
        # Access); only origins that passed the check above get the grant.
        allow_private_network=True,
        max_age=600,
    )


class OriginPolicy(CORSMiddleware):
    """Starlette's CORS headers, plus: a request carrying a refused Origin is answered
    403 and never reaches a handler. CORS alone only hides the answer from the page,
    and a simple request (a POST with `Content-Type: text/plain`) needs no preflight,
    so it would still run. Requests without an Origin (curl, SDKs) pass."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            origin = Headers(scope=scope).get("origin")
            if origin is not None and not self.is_allowed_origin(origin):
                await _refused(scope["path"], origin)(scope, receive, send)
                return
        await super().__call__(scope, receive, send)

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code == 200:
            return response
        # An allowed origin asking for a method or header we do not serve; the refusal
        # must not carry the private-network grant the parent puts on every preflight.
        reason = bytes(response.body).decode()  # e.g. "Disallowed CORS method"
        return error_response(OriginRefused(f"CORS preflight refused: {reason}"))


def _refused(path: str, origin: str) -> Response:
    err = OriginRefused(
        f"origin {origin!r} is not allowed: pages on localhost and browser extensions are; "
        "start the server with --allowed-origins to add others"
    )
    return error_response_for(path, err, headers={"Vary": "Origin"})


OPEN_PATHS = frozenset({"/health", "/metrics", "/", "/dashboard"})
OPEN_PREFIXES = ("/dashboard/static/",)


def is_open(path: str) -> bool:
    """Paths served without the API key."""
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


class ApiKeyAuth:
    """Requires the API key on every path but the open ones (/health, /metrics, and the
    dashboard's page and files: no data, that is /v1/dashboard), the API under /v1 and
    its unprefixed twins alike (CORS preflights stay open), sent either way clients send
    it: `Authorization: Bearer <key>` (OpenAI clients) or `x-api-key: <key>` (Anthropic's)."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self._bearer = f"Bearer {api_key}".encode()
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not is_open(scope["path"]) and scope["method"] != "OPTIONS":
            headers = Headers(scope=scope)
            bearer = headers.get("authorization", "").encode()
            key = headers.get("x-api-key", "").encode()
            # Both compared, always: the time taken says nothing about which was close.
            ok = hmac.compare_digest(bearer, self._bearer) | hmac.compare_digest(key, self._key)
            if not ok:
                message = "missing API key" if not (bearer or key) else "invalid API key"
                err = Unauthorized(
                    f"{message}: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'"
                )
                response = error_response_for(
                    scope["path"], err, headers={"WWW-Authenticate": "Bearer"}
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
