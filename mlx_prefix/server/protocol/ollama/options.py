"""Ollama's request fields around the prompt: `options` (its Modelfile parameters),
`format`, `think` and `keep_alive`, read into the server's own values. Pure.

`options`, with Ollama's meanings and defaults (temperature 0.8, top_k 40, top_p 0.9,
repeat_last_n 64; a server's --temp, --top-p, --top-k, --min-p still win over them):
- honoured: temperature, top_p, top_k, min_p, seed (negative: a random seed, as Ollama),
  num_predict (-1 and -2: up to the context's end), num_ctx (a prompt and reply bound:
  checked by the route once the prompt's length is known), stop, repeat_penalty,
  repeat_last_n (the window of all three penalties, as Ollama's sampler reads it; 0: the
  penalties off, -1: the whole context), presence_penalty, frequency_penalty;
- refused with a 400 naming it unless at its neutral value: typical_p (1.0);
- ignored, listed at debug level: what only tunes how Ollama's runner uses the machine
  (num_gpu, num_thread, num_batch, use_mmap, ...) or its context shifting (num_keep),
  which change no output here, and names Ollama itself no longer reads (mirostat,
  tfs_z, penalize_newline, ...) or does not know: Ollama ignores those with a warning.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from mlx_prefix.config import parse_duration
from mlx_prefix.errors import InvalidRequest, json_type
from mlx_prefix.records import ResponseFormat

from ..effort import EFFORT_BUDGETS, Thinking
from ..fields import integer, number
from ..request import Limits
from ..sampling_fields import MAX_REPETITION_PENALTY
from ..spec import OPTIONS_SAMPLING, read_sampling

log = logging.getLogger("mlx_prefix.server")

DEFAULT_REPEAT_LAST_N = 64

# What tunes Ollama's runner (memory, threads, offload, batching, context shifting):
# nothing here that a reply depends on.
RUNNER_OPTIONS = frozenset(
    {
        "num_batch", "num_gpu", "main_gpu", "use_mmap", "use_mlock", "num_thread", "numa",
        "low_vram", "f16_kv", "vocab_only", "logits_all", "embedding_only", "num_keep",
        "draft_num_predict", "num_gqa",
    }
)  # fmt: skip
THINK_LEVELS = ("low", "medium", "high", "max")


@dataclass(frozen=True)
class OptionValues:
    """`options` as SamplingParams keyword arguments, and the reply's bounds."""

    sampling: dict[str, Any]
    max_tokens: int | None  # None: num_predict not given (the server's --max-tokens)
    num_ctx: int | None  # the context the client asked for; None: the model's
    ignored: tuple[str, ...] = ()  # logged at debug level


def parse_options(value: Any, limits: Limits) -> OptionValues:
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise InvalidRequest(
            f"'options' must be an object, not {json_type(value)}", param="options"
        )
    opts = {k: v for k, v in value.items() if v is not None}  # null: Ollama's "not set"
    ignored = tuple(sorted(k for k in opts if k not in _HONOURED))
    typical = _number(opts, "typical_p", 1.0, 0.0, 1.0)
    if typical != 1.0:
        raise InvalidRequest(
            "options.typical_p is not supported (locally typical sampling); leave it at 1.0",
            param="options.typical_p",
        )
    window = _int(opts, "repeat_last_n", DEFAULT_REPEAT_LAST_N, lo=-1)
    num_ctx = _int(opts, "num_ctx", None, lo=1)
    if window == -1:  # Ollama: the whole context
        window = num_ctx or limits.max_tokens
    repeat = _number(opts, "repeat_penalty", 1.0, 0.0, MAX_REPETITION_PENALTY)
    presence = _number(opts, "presence_penalty", 0.0, -2.0, 2.0)
    frequency = _number(opts, "frequency_penalty", 0.0, -2.0, 2.0)
    if window == 0:  # Ollama: the penalties look at nothing
        repeat, presence, frequency, window = 1.0, 0.0, 0.0, 1
    predict = _int(opts, "num_predict", None, lo=None)
    if predict is not None and predict <= 0:  # -1 (no limit), -2 (fill the context), 0
        predict = limits.max_tokens
    sampling = read_sampling(opts, OPTIONS_SAMPLING, limits.sampling)
    if sampling["seed"] is not None and sampling["seed"] < 0:  # Ollama: a random seed
        sampling["seed"] = None
    # One window for the three penalties, as Ollama's sampler reads repeat_last_n.
    for name, penalty in (("repetition", repeat), ("presence", presence), ("frequency", frequency)):
        sampling[f"{name}_penalty"] = penalty
        sampling[f"{name}_context_size"] = window
    return OptionValues(sampling, predict, num_ctx, ignored)


def log_ignored(request_id: str, values: OptionValues) -> None:
    """Ollama ignores options it does not use (with a warning); so does this server, at
    debug level: runner knobs change no reply here."""
    if values.ignored:
        log.debug("%s options ignored: %s", request_id, ", ".join(values.ignored))


def parse_format(value: Any) -> ResponseFormat | None:
    """`format`: "json" (any JSON object) or a JSON schema; "" and null: free text."""
    if value is None or value == "":
        return None
    if value == "json":
        return ResponseFormat("json_object", param="format")
    if isinstance(value, dict):
        # Key order is kept: it is the order the reply writes the properties in.
        return ResponseFormat("json_schema", json.dumps(value), param="format")
    raise InvalidRequest(
        f"'format' must be \"json\" or a JSON schema object, not {json.dumps(value)[:40]}",
        param="format",
    )


def parse_think(value: Any) -> Thinking | None:
    """`think`: true / false, or an effort level: "low" and "medium" bound the reasoning
    at 1024 and 4096 tokens (as reasoning_effort does on the other APIs), "high" and "max"
    leave it unbounded; false turns the template's thinking off and closes at once a
    block the prompt opens anyway. None: not sent (the model's own default)."""
    if value is None:
        return None
    if value is False:
        return Thinking(enable=False, budget=0)
    if value is True:
        return Thinking(enable=True)
    if value in THINK_LEVELS:
        level = "high" if value == "max" else value
        return Thinking(enable=True, budget=EFFORT_BUDGETS[level])
    raise InvalidRequest(
        'think must be true, false, "low", "medium", "high" or "max"', param="think"
    )


def parse_keep_alive(value: Any) -> float | None:
    """`keep_alive`: seconds as a number, or a Go duration ("5m", "1h30m", "0"); a
    negative one keeps the model loaded for good (config.FOREVER). None: not sent.
    What it does is the pool's (served/pool.py's keep_alive)."""
    if value is None:
        return None
    if isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:
            return parse_duration(value)
        except ValueError:
            pass
    raise InvalidRequest(
        f'keep_alive must be a number of seconds or a duration such as "5m", not '
        f"{json.dumps(value)[:40]}",
        param="keep_alive",
    )


_HONOURED = frozenset(
    {
        "temperature", "top_p", "top_k", "min_p", "seed", "num_predict", "num_ctx", "stop",
        "repeat_penalty", "repeat_last_n", "presence_penalty", "frequency_penalty",
        "typical_p",
    }
)  # fmt: skip


def _number(opts: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    return number(opts, name, default, lo=lo, hi=hi, where="options.")


def _int(opts: dict[str, Any], name: str, default: Any, *, lo: int | None) -> Any:
    return integer(opts, name, default, lo=lo, hi=None, where="options.", integral_floats=True)
