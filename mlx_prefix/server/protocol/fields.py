"""The JSON body and typed readers for its fields, shared by every API family."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from mlx_prefix.errors import InvalidRequest, json_type

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
    body: dict[str, Any],
    name: str,
    default: Any,
    *,
    lo: int | None,
    hi: int | None,
    where: str = "",
    integral_floats: bool = False,
) -> Any:
    """`body[name]`, an integer in [lo, hi] (None: unbounded); `where` prefixes the name
    in the error's param (an object inside the body: "options."); `integral_floats`: 3.0
    counts as 3 (Ollama reads JSON numbers as floats)."""
    param = where + name
    value = body.get(name)
    if value is None:
        return default
    if integral_floats and isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"'{param}' must be an integer, not {json_type(value)}", param=param)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        if hi is None:
            bounds = f"at least {lo}"
        elif lo is None:
            bounds = f"at most {hi}"
        else:
            bounds = f"between {lo} and {hi}"
        raise InvalidRequest(f"'{param}' must be {bounds}, got {value}", param=param)
    return value


def number(
    body: dict[str, Any], name: str, default: float, *, lo: float, hi: float, where: str = ""
) -> float:
    """`body[name]`, a finite number in [lo, hi], as a float (`where`: as `integer`'s)."""
    param = where + name
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequest(f"'{param}' must be a number, not {json_type(value)}", param=param)
    if not math.isfinite(value):  # NaN and Infinity: Python's JSON parser accepts them
        raise InvalidRequest(f"'{param}' must be a finite number, got {value}", param=param)
    if not lo <= value <= hi:
        raise InvalidRequest(
            f"'{param}' must be between {lo:g} and {hi:g}, got {value}", param=param
        )
    return float(value)
