"""Typed errors. The HTTP edge turns them into OpenAI-shaped bodies, the CLI into one line."""

from __future__ import annotations

from typing import Any


def json_type(value: Any) -> str:
    """A JSON value's type as an error message names it ("object", "array", ...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


class MlxPrefixError(Exception):
    """Base class. `status` is the HTTP status, `type`/`code`/`param` the OpenAI error fields."""

    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code


class InvalidRequest(MlxPrefixError):
    status = 400
    type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class ModelNotFound(MlxPrefixError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class PinQuotaExceeded(MlxPrefixError):
    """Pinning would take one namespace past its share of the cache budget."""

    status = 409
    type = "invalid_request_error"
    code = "pin_quota_exceeded"


class EngineBusy(MlxPrefixError):
    status = 429
    type = "server_error"
    code = "server_busy"


class RequestCancelled(MlxPrefixError):
    status = 499
    type = "cancelled"


class Unavailable(MlxPrefixError):
    """The server cannot serve any more (a rank of a sharded group is gone)."""

    status = 503
    type = "server_error"
    code = "unavailable"
