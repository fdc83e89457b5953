"""mlx_lm.server's sampling fields, read from chat and completions bodies:
`xtc_probability` / `xtc_threshold`, `logit_bias`, and `repetition_penalty`,
`presence_penalty`, `frequency_penalty` with their `*_context_size` (`top_k` and `min_p`:
request.py's CHAT_SAMPLING).

Same names, defaults and meanings as mlx_lm.server (engine/decode/sampling.py and
engine/decode/logits.py apply them); the ranges are those mlx_lm.sample_utils accepts without
failing mid-decode, and OpenAI's for `presence_penalty`, `frequency_penalty` and
`logit_bias`. The penalties read the last `*_context_size` tokens of prompt and reply
together, as mlx_lm does (OpenAI's read the whole reply only).
"""

from __future__ import annotations

import math
from typing import Any

from mlx_prefix.errors import InvalidRequest

from .fields import field, integer, number

MAX_BIAS = 100.0  # OpenAI: -100 bans a token, 100 forces it
MAX_REPETITION_PENALTY = 100.0  # well past any useful value (1.0-1.5 in practice)
DEFAULT_CONTEXT_SIZE = 20  # mlx_lm.server's default for each penalty


def mlx_lm_sampling(body: dict[str, Any]) -> dict[str, Any]:
    """SamplingParams keyword arguments for the fields `body` sets (defaults otherwise)."""
    return {
        "xtc_probability": number(body, "xtc_probability", 0.0, lo=0.0, hi=1.0),
        "xtc_threshold": number(body, "xtc_threshold", 0.1, lo=0.0, hi=0.5),
        "logit_bias": logit_bias(body),
        "repetition_penalty": number(
            body, "repetition_penalty", 0.0, lo=0.0, hi=MAX_REPETITION_PENALTY
        ),
        "repetition_context_size": _context_size(body, "repetition_context_size"),
        "presence_penalty": number(body, "presence_penalty", 0.0, lo=-2.0, hi=2.0),
        "presence_context_size": _context_size(body, "presence_context_size"),
        "frequency_penalty": number(body, "frequency_penalty", 0.0, lo=-2.0, hi=2.0),
        "frequency_context_size": _context_size(body, "frequency_context_size"),
    }


def logit_bias(body: dict[str, Any]) -> tuple[tuple[int, float], ...]:
    """`{"token id": bias}` -> ((id, bias), ...) in the order sent. The engine checks the
    ids against the model's vocabulary."""
    biases = field(body, "logit_bias", dict, None) or {}
    out = []
    for key, value in biases.items():
        if not (key.isascii() and key.isdigit()):
            raise InvalidRequest(
                f"logit_bias keys must be token ids (non-negative integers), got {key!r}",
                param="logit_bias",
            )
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or not -MAX_BIAS <= value <= MAX_BIAS
        ):
            raise InvalidRequest(
                f"logit_bias[{key!r}] must be a number between {-MAX_BIAS:g} and "
                f"{MAX_BIAS:g}, got {value!r}",
                param="logit_bias",
            )
        out.append((int(key), float(value)))
    return tuple(out)


def _context_size(body: dict[str, Any], name: str) -> int:
    return integer(body, name, DEFAULT_CONTEXT_SIZE, lo=1, hi=None)
