"""Every failure leaves the server as one OpenAI-shaped body: {"error": {...}}."""

from __future__ import annotations

import logging

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


class UnsupportedMediaType(MlxPrefixError):
    status = 415
    type = "invalid_request_error"
    code = "unsupported_media_type"


class WarmTimeout(MlxPrefixError):
    status = 504
    type = "server_error"
    code = "timeout"


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


def body_for(exc: MlxPrefixError) -> dict:
    return error_body(exc.message, exc.type, param=exc.param, code=exc.code)


def error_response(exc: MlxPrefixError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(body_for(exc), status_code=exc.status, headers=headers)


_HTTP_TYPES = {404: "not_found", 405: "method_not_allowed"}


async def handle_mlx_prefix_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, MlxPrefixError)
    return error_response(exc)


async def handle_http_exception(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    code = _HTTP_TYPES.get(exc.status_code)
    message = f"{request.method} {request.url.path}: {exc.detail}"
    body = error_body(message, "invalid_request_error", code=code)
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


async def handle_unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    body = error_body(
        f"internal error: {type(exc).__name__}", "server_error", code="internal_error"
    )
    return JSONResponse(body, status_code=500)


EXCEPTION_HANDLERS = {
    MlxPrefixError: handle_mlx_prefix_error,
    HTTPException: handle_http_exception,
    Exception: handle_unexpected,
}
