"""MLX_PREFIX_<SECTION>_<FIELD> environment variables onto a config dataclass's fields
(config.py), and byte sizes as the flags and variables write them ('4GiB', '512MB').

Precedence: CLI flag > environment variable > field default. The variable for field
`budget_bytes` of CacheConfig is MLX_PREFIX_CACHE_BUDGET_BYTES (prefix per section). A
leaf, like config.py: it imports nothing of the package.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")

_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 2**40,
}


def parse_bytes(text: str) -> int:
    """'4GiB', '512MB', '1e9', '1024' -> bytes; ValueError otherwise."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
    try:
        if m and m.group(2).lower() in _BYTE_UNITS:
            return int(float(m.group(1)) * _BYTE_UNITS[m.group(2).lower()])
    except ValueError:
        pass
    raise ValueError(f"not a byte size: {text!r} (e.g. 4GiB, 512MB)")


def _parse(value: str, annotation: Any) -> Any:
    if isinstance(annotation, str):
        annotation = eval(  # noqa: S307 - field annotations of our own dataclasses
            annotation, {"int": int, "str": str, "bool": bool, "float": float, "tuple": tuple}
        )
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if value.lower() in ("", "none"):
            return None
        return _parse(value, args[0])
    if origin is tuple:
        item = typing.get_args(annotation)[0] if typing.get_args(annotation) else str
        return tuple(_parse(v.strip(), item) for v in value.split(",") if v.strip())
    if annotation is bool:
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"not a boolean: {value!r}")
    return annotation(value)


def from_env(cls: type[T], prefix: str, overrides: dict[str, Any] | None = None) -> T:
    """Build `cls` from MLX_PREFIX_<PREFIX>_<FIELD> variables, then explicit overrides.

    Overrides whose value is None are ignored, so argparse defaults of None fall through.
    """
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        name = f"MLX_PREFIX_{prefix}_{field.name}".upper()
        if name in os.environ:
            try:
                raw = os.environ[name]
                if field.name.endswith("bytes") and raw.strip().lower() not in ("", "none"):
                    values[field.name] = parse_bytes(raw)  # sizes take units, like the flags
                    continue
                values[field.name] = _parse(raw, field.type)
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
    for key, value in (overrides or {}).items():
        if value is not None:
            values[key] = value
    return cls(**values)
