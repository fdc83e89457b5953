"""The JSON schema the structured-output tests hold replies to, and its check."""

from __future__ import annotations

import json
from typing import Any

from mlx_prefix.records import ResponseFormat

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "member"],
    "additionalProperties": False,
}
AS_PERSON = ResponseFormat("json_schema", json.dumps(PERSON), "person")


def check_person(text: str) -> dict[str, Any]:
    """The reply parses and follows PERSON (checked by hand: no jsonschema here)."""
    person = json.loads(text)
    assert isinstance(person, dict) and set(person) == set(PERSON["required"]), text
    assert isinstance(person["name"], str) and len(person["name"]) <= 12
    assert type(person["age"]) is int and 0 <= person["age"] <= 120
    assert isinstance(person["tags"], list) and len(person["tags"]) <= 3
    assert all(tag in ("red", "green", "blue") for tag in person["tags"])
    assert isinstance(person["member"], bool)
    return person
