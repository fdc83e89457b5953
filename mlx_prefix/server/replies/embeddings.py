"""The embeddings family's reply: OpenAI's list of vectors, each as floats or base64
(little-endian float32, as the `openai` SDK decodes it), with the tokens counted."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np


def embeddings_body(
    vectors: np.ndarray, encoding: str, model: str, prompt_tokens: int
) -> dict[str, Any]:
    """`vectors`: float32 [n, dims], one row per input."""
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": _encoded(v, encoding)}
            for i, v in enumerate(vectors)
        ],
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


def _encoded(vector: np.ndarray, encoding: str) -> Any:
    if encoding == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()
