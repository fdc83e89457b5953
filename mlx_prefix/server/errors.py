"""Every failure leaves the server as one error body in the shape of the API family the
path belongs to: OpenAI's `{"error": {message, type, param, code}}`, on the Anthropic
Messages routes `{"type": "error", "error": {type, message}}`, on Ollama's /api/ routes
`{"error": "message"}`, with the same status."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from mlx_prefix.errors import MlxPrefixError

log = logging.getLogger("mlx_prefix.server")


class PayloadTooLarge(MlxPrefixError):
    status = 413
    type = "invalid_request_error"
    code = "payload_too_large"


class Unauthorized(MlxPrefixError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class OriginRefused(MlxPrefixError):
    """A browser page from an origin outside the CORS policy."""

    status = 403
    type = "invalid_request_error"
    code = "origin_not_allowed"


class HostRefused(MlxPrefixError):
    """A Host header naming neither this machine nor a host the operator allowed (a
    page under a name re-pointed at this server: DNS rebinding)."""

    status = 403
    type = "invalid_request_error"
    code = "host_not_allowed"


class UnsupportedMediaType(MlxPrefixError):
    status = 415
    type = "invalid_request_error"
    code = "unsupported_media_type"


class WarmTimeout(MlxPrefixError):
    status = 504
    type = "server_error"
    code = "timeout"


class ExplainOff(MlxPrefixError):
    """GET /v1/cache/requests on a server started with --no-explain."""

    status = 404
    type = "invalid_request_error"
    code = "explain_off"


class CancelledByServer(MlxPrefixError):
    """The engine cancelled a request the client still waits for (shutdown)."""

    status = 503
    type = "server_error"
    code = "request_cancelled"


class GenerationFailed(MlxPrefixError):
    status = 500
    type = "server_error"
    code = "generation_failed"


def error_body(
    message: str, type: str, *, param: str | None = None, code: str | None = None
) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# Anthropic's error types by HTTP status (docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def is_anthropic_path(path: str) -> bool:
    """The Anthropic Messages routes (/v1/messages, /messages/count_tokens, ...)."""
    return path.removeprefix("/v1").startswith("/messages")


def is_ollama_path(path: str) -> bool:
    """Ollama's API routes (/api/chat, /api/tags, ...)."""
    return path.startswith("/api/") or path == "/api"


def anthropic_error_body(exc: MlxPrefixError) -> dict:
    kind = _ANTHROPIC_TYPES.get(exc.status)
    if kind is None:
        kind = "api_error" if exc.status >= 500 else "invalid_request_error"
    return {"type": "error", "error": {"type": kind, "message": exc.message}}


def body_for(exc: MlxPrefixError, *, anthropic: bool = False, ollama: bool = False) -> dict:
    if anthropic:
        return anthropic_error_body(exc)
    if ollama:  # Ollama's clients read the message from a bare "error" string
        return {"error": exc.message}
    return error_body(exc.message, exc.type, param=exc.param, code=exc.code)


def error_response(
    exc: MlxPrefixError,
    headers: Mapping[str, str] | None = None,
    *,
    anthropic: bool = False,
    ollama: bool = False,
) -> JSONResponse:
    body = body_for(exc, anthropic=anthropic, ollama=ollama)
    return JSONResponse(body, status_code=exc.status, headers=headers)


def error_response_for(
    path: str, exc: MlxPrefixError, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    """The error in the shape of the API family `path` belongs to."""
    return error_response(
        exc, headers, anthropic=is_anthropic_path(path), ollama=is_ollama_path(path)
    )


_HTTP_TYPES = {404: "not_found", 405: "method_not_allowed"}


async def handle_mlx_prefix_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, MlxPrefixError)
    return error_response_for(request.url.path, exc)


async def handle_http_exception(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    code = _HTTP_TYPES.get(exc.status_code)
    message = f"{request.method} {request.url.path}: {exc.detail}"
    err = MlxPrefixError(message, code=code)
    err.status, err.type = exc.status_code, "invalid_request_error"
    return error_response_for(request.url.path, err, exc.headers)


async def handle_unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    err = MlxPrefixError(f"internal error: {type(exc).__name__}", code="internal_error")
    return error_response_for(request.url.path, err)


EXCEPTION_HANDLERS = {
    MlxPrefixError: handle_mlx_prefix_error,
    HTTPException: handle_http_exception,
    Exception: handle_unexpected,
}
