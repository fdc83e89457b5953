"""Structured output requests: chat's `response_format`, the Responses API's
`text.format` and the Messages API's `output_config.format` (beta: `output_format`) -> a
ResponseFormat (or None for free text).

Both families say the same thing in two shapes: chat nests the schema
(`{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`), Responses
flattens it (`{"type": "json_schema", "name", "schema", "strict"}`). The schema is
compiled by the engine (engine/decode/constraints.py), which blames `ResponseFormat.param`
when it cannot be used. The reply always follows the schema: `strict: false` asks for
less than that, so it is accepted too.
"""

from __future__ import annotations

import json
from typing import Any

from mlx_prefix.errors import InvalidRequest, json_type
from mlx_prefix.records import ResponseFormat

KINDS = ("text", "json_object", "json_schema")


def chat_response_format(body: dict[str, Any]) -> ResponseFormat | None:
    """`response_format` of a chat completions body."""
    value = body.get("response_format")
    if value is None:
        return None
    kind = _kind(value, "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object", param="response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequest(
            "response_format.json_schema must be an object with the schema",
            param="response_format.json_schema",
        )
    return _schema_format(spec, "response_format.json_schema")


def responses_text_format(value: Any) -> ResponseFormat | None:
    """`text.format` of a Responses body (already known not to be empty)."""
    kind = _kind(value, "text.format")
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object", param="text.format")
    return _schema_format(value, "text.format")


def anthropic_output_format(body: dict[str, Any]) -> ResponseFormat | None:
    """The Messages API's `output_config.format`, or the beta's `output_format`:
    `{"type": "json_schema", "schema": {...}}`."""
    config = body.get("output_config")
    nested = config.get("format") if isinstance(config, dict) else None
    beta = body.get("output_format")
    if nested is not None and beta is not None:
        raise InvalidRequest(
            "output_format and output_config.format both given; send one",
            param="output_format",
        )
    value, param = (beta, "output_format") if beta is not None else (nested, "output_config.format")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequest(f"{param} must be an object, not {json_type(value)}", param=param)
    if value.get("type") != "json_schema":
        raise InvalidRequest(
            f"{param}.type must be 'json_schema', got {value.get('type')!r}", param=f"{param}.type"
        )
    return _schema_format(value, param)


def _kind(value: Any, param: str) -> str:
    if not isinstance(value, dict):
        raise InvalidRequest(f"{param} must be an object, not {json_type(value)}", param=param)
    kind = value.get("type")
    if kind not in KINDS:
        raise InvalidRequest(
            f"{param}.type must be one of {', '.join(map(repr, KINDS))}, got {kind!r}",
            param=f"{param}.type",
        )
    return kind


def _schema_format(spec: dict[str, Any], param: str) -> ResponseFormat:
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        got = "missing" if schema is None else json_type(schema)
        raise InvalidRequest(
            f"{param}.schema must be a JSON schema object ({got})", param=f"{param}.schema"
        )
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise InvalidRequest(f"{param}.name must be a string", param=f"{param}.name")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequest(f"{param}.strict must be a boolean", param=f"{param}.strict")
    # Key order is kept: it is the order the reply writes the properties in.
    return ResponseFormat("json_schema", json.dumps(schema), name, param=f"{param}.schema")
