"""POST /v1/embeddings bodies (OpenAI's shape). Pure: no model, no MLX.

`input` is a string, an array of strings, an array of token ids (one input), or an array
of arrays of token ids; none may be empty. `encoding_format` is "float" or "base64"
(little-endian float32, what the openai SDK asks for by default). `dimensions` is checked
against the model by the route. `user` is accepted as OpenAI accepts it: an end-user id
for the operator's own monitoring, which changes nothing in the vectors (it goes into the
log at debug level). Any other field is refused with a 400 naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from mlx_prefix.errors import InvalidRequest, json_type

from .fields import field, integer
from .spec import refuse_unknown

ENCODING_FORMATS = ("float", "base64")
FIELDS = frozenset({"input", "model", "encoding_format", "dimensions", "user"})


@dataclass(frozen=True)
class EmbeddingRequest:
    model: str | None  # as the client named it; None when absent
    texts: tuple[str, ...] | None  # text input (exactly one of texts, token_ids is set)
    token_ids: tuple[tuple[int, ...], ...] | None  # token-id input, as given
    encoding_format: Literal["float", "base64"]
    dimensions: int | None  # None: the model's own size
    user: str | None

    @property
    def count(self) -> int:
        return len(self.texts if self.texts is not None else self.token_ids or ())


def parse_embeddings(body: dict[str, Any], max_inputs: int) -> EmbeddingRequest:
    refuse_unknown(body, FIELDS, what="/v1/embeddings")
    texts, token_ids = _input(body.get("input"), max_inputs)
    encoding = field(body, "encoding_format", str, "float")
    if encoding not in ENCODING_FORMATS:
        raise InvalidRequest(
            f"'encoding_format' must be 'float' or 'base64', not {encoding!r}",
            param="encoding_format",
        )
    return EmbeddingRequest(
        model=field(body, "model", str, None),
        texts=texts,
        token_ids=token_ids,
        encoding_format=encoding,
        dimensions=integer(body, "dimensions", None, lo=1, hi=None),
        user=field(body, "user", str, None),
    )


def _input(
    value: Any, max_inputs: int
) -> tuple[tuple[str, ...] | None, tuple[tuple[int, ...], ...] | None]:
    if value is None:
        raise InvalidRequest("'input' is required", param="input")
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise InvalidRequest(
            f"'input' must be a string or an array, not {json_type(value)}", param="input"
        )
    if not value:
        raise InvalidRequest("'input' must not be an empty array", param="input")
    if all(_is_token(t) for t in value):
        return None, (tuple(value),)
    if len(value) > max_inputs:
        raise InvalidRequest(
            f"'input' holds {len(value)} inputs; at most {max_inputs} per request", param="input"
        )
    if all(isinstance(t, str) for t in value):
        empty = next((i for i, t in enumerate(value) if not t), None)
        if empty is not None:
            raise InvalidRequest(f"input[{empty}] is an empty string", param="input")
        return tuple(value), None
    if all(isinstance(t, list) for t in value):
        for i, ids in enumerate(value):
            if not ids or not all(_is_token(t) for t in ids):
                raise InvalidRequest(
                    f"input[{i}] must be a non-empty array of token ids (integers)", param="input"
                )
        return None, tuple(tuple(ids) for ids in value)
    raise InvalidRequest(
        "'input' must be a string, an array of strings, an array of token ids, or an array "
        "of arrays of token ids (not a mix)",
        param="input",
    )


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
