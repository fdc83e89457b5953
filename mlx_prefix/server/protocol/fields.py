"""The JSON body and typed readers for its fields, shared by every API family."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from mlx_prefix.errors import InvalidRequest

# A lone surrogate can only enter through a \uD800-\uDFFF escape: raw UTF-8 cannot
# encode one. (An escaped backslash before "uD8.." matches too; the walk then finds none.)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
MISSING = object()  # a required field's default: absent, told apart from null


def parse_json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except RecursionError:
        raise InvalidRequest("request body is not valid JSON: nested too deeply") from None
    except ValueError as e:  # bad JSON or UTF-8, or an integer past Python's digit limit
        raise InvalidRequest(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise InvalidRequest(f"request body must be a JSON object, not {json_type(body)}")
    if _SURROGATE_ESCAPE.search(raw) and (where := _lone_surrogate(body)) is not None:
        raise InvalidRequest(
            f"{where or 'a key'} contains a lone UTF-16 surrogate escape (\\ud800-\\udfff "
            "without its pair), which is not valid Unicode text",
            param=where or None,
        )
    return body


def _lone_surrogate(body: dict[str, Any]) -> str | None:
    """The path of the first string (or key: "") not encodable as UTF-8; None if none.
    Iterative: the body may be nested as deep as the JSON parser allows."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return path
        elif isinstance(value, dict):
            for key, item in value.items():
                try:
                    key.encode("utf-8")
                except UnicodeEncodeError:
                    return ""
                stack.append((f"{path}.{key}" if path else key, item))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(value))
    return None


def field(body: dict[str, Any], name: str, types: type | tuple[type, ...], default: Any) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, types):
        names = " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
        names = names.replace("dict", "object").replace("list", "array").replace("str", "string")
        raise InvalidRequest(
            f"'{name}' must be {names}, not {json_type(value)} ({json.dumps(value)[:40]})",
            param=name,
        )
    return value


def integer(
    body: dict[str, Any], name: str, default: Any, *, lo: int | None, hi: int | None
) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"'{name}' must be an integer, not {json_type(value)}", param=name)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f"at least {lo}" if hi is None else f"between {lo} and {hi}"
        raise InvalidRequest(f"'{name}' must be {bounds}, got {value}", param=name)
    return value


def number(body: dict[str, Any], name: str, default: float, *, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequest(f"'{name}' must be a number, not {json_type(value)}", param=name)
    if not math.isfinite(value):  # NaN and Infinity: Python's JSON parser accepts them
        raise InvalidRequest(f"'{name}' must be a finite number, got {value}", param=name)
    if not lo <= value <= hi:
        raise InvalidRequest(f"'{name}' must be between {lo:g} and {hi:g}, got {value}", param=name)
    return float(value)


def json_type(value: Any) -> str:
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
