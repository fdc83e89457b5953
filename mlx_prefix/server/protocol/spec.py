"""One spec per API family, read by one set of readers, and the rules every family shares.

Each family has a SamplingSpec here, side by side (CHAT_SAMPLING for chat and
completions: request.py; MESSAGES_SAMPLING: anthropic/bodies.py; RESPONSES_SAMPLING:
responses/bodies.py; OPTIONS_SAMPLING: ollama/options.py): the name, default and bounds
of each sampling field its body carries, where they stand (the body, or Ollama's
`options`) and where its stop strings are. `read_sampling` reads any of
them the same way into SamplingParams' keyword arguments, the server's own defaults
(`serve --temp`, `--top-p`, `--top-k`, `--min-p`) over each API's. A field a family does
not carry takes the server's default, else SamplingParams' own.

The shared rules: stop strings (how many, how long, none with a structured format), a
structured format never with tools (a reply held to it could never call one), and an
unknown field refused with a 400 naming it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from mlx_prefix.errors import InvalidRequest
from mlx_prefix.records import ResponseFormat, SamplingParams

from .fields import integer, number

MAX_STOP_SEQUENCES = 16
# Characters in one stop string: the engine's matcher holds a node per character.
MAX_STOP_CHARS = 1024
SEED_LIMIT = 2**64  # mx.random.key takes an unsigned 64-bit seed
_UNSET = SamplingParams()  # what a field no family carries and no flag sets is


@dataclass(frozen=True)
class Number:
    """A float field: its name in the body, the API's default, its bounds."""

    name: str
    default: float
    lo: float
    hi: float


@dataclass(frozen=True)
class Integer:
    name: str
    default: int | None
    lo: int | None = None
    hi: int | None = None


@dataclass(frozen=True)
class Stops:
    """Where a family's stop strings are: `single`, a lone string is one stop (OpenAI,
    Ollama); `empties`, "" is allowed and dropped (else a 400)."""

    name: str
    single: bool = True
    empties: bool = True


@dataclass(frozen=True)
class SamplingSpec:
    """A family's sampling fields; None: the family has no such field."""

    temperature: Number
    top_p: Number
    top_k: Integer | None = None
    min_p: Number | None = None
    seed: Integer | None = None
    stop: Stops | None = None
    where: str = ""  # the object they stand in, as a param names it ("options.")
    integral_floats: bool = False  # 3.0 is the integer 3 (Ollama reads numbers as floats)


@dataclass(frozen=True)
class SamplingDefaults:
    """The server's values for sampling fields a request leaves out (`serve --temp`,
    `--top-p`, `--top-k`, `--min-p`, as in mlx_lm.server); None keeps the API's own
    default (temperature 0 for OpenAI's routes here, 1 for Anthropic's)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None

    def get(self, name: str, api_default: Any) -> Any:
        value = getattr(self, name)
        return api_default if value is None else value


# The four families' specs, side by side.
# Chat and completions' sampling fields (OpenAI's, with mlx_lm.server's top_k, min_p and
# this server's seed; the rest of mlx_lm.server's: protocol/sampling_fields.py).
CHAT_SAMPLING = SamplingSpec(
    temperature=Number("temperature", 0.0, lo=0.0, hi=2.0),
    top_p=Number("top_p", 1.0, lo=0.0, hi=1.0),
    top_k=Integer("top_k", 0, lo=0),
    min_p=Number("min_p", 0.0, lo=0.0, hi=1.0),
    seed=Integer("seed", None, lo=0, hi=SEED_LIMIT - 1),
    stop=Stops("stop"),
)

# Anthropic's sampling fields: its temperature is at most 1.0 (default 1.0); min_p is not
# one (the server's --min-p holds); seed is this server's extension.
MESSAGES_SAMPLING = SamplingSpec(
    temperature=Number("temperature", 1.0, lo=0.0, hi=1.0),
    top_p=Number("top_p", 1.0, lo=0.0, hi=1.0),
    top_k=Integer("top_k", 0, lo=0),
    seed=Integer("seed", None, lo=0, hi=SEED_LIMIT - 1),
    stop=Stops("stop_sequences", single=False, empties=False),
)

# The Responses API's sampling fields: no stop strings; top_k and min_p are SGLang's, which
# its router adds to every body it forwards (top_k -1, SGLang's "off", is mlx_lm's 0:
# responses/bodies.py).
RESPONSES_SAMPLING = SamplingSpec(
    temperature=Number("temperature", 0.0, lo=0.0, hi=2.0),
    top_p=Number("top_p", 1.0, lo=0.0, hi=1.0),
    top_k=Integer("top_k", 0, lo=-1),
    min_p=Number("min_p", 0.0, lo=0.0, hi=1.0),
    seed=Integer("seed", None, lo=0, hi=SEED_LIMIT - 1),
)

# Ollama's `options` as sampling fields, with its api.DefaultOptions() for what a request
# leaves out; a negative seed is a random one (ollama/options.py).
OPTIONS_SAMPLING = SamplingSpec(
    temperature=Number("temperature", 0.8, lo=0.0, hi=2.0),
    top_p=Number("top_p", 0.9, lo=0.0, hi=1.0),
    top_k=Integer("top_k", 40, lo=0),
    min_p=Number("min_p", 0.0, lo=0.0, hi=1.0),
    seed=Integer("seed", None, hi=SEED_LIMIT - 1),
    stop=Stops("stop"),
    where="options.",
    integral_floats=True,
)


def read_sampling(
    values: dict[str, Any], spec: SamplingSpec, defaults: SamplingDefaults
) -> dict[str, Any]:
    """SamplingParams keyword arguments for temperature, top_p, top_k, min_p, seed and
    stop, as `spec` says `values` (the body, or the object `spec.where` names) carries them."""
    out: dict[str, Any] = {}
    for key in ("temperature", "top_p", "min_p"):
        num: Number | None = getattr(spec, key)
        if num is None:
            out[key] = defaults.get(key, getattr(_UNSET, key))
            continue
        default = defaults.get(key, num.default)
        out[key] = number(values, num.name, default, lo=num.lo, hi=num.hi, where=spec.where)
    for key in ("top_k", "seed"):
        whole: Integer | None = getattr(spec, key)
        if whole is None:
            out[key] = defaults.get(key, getattr(_UNSET, key)) if key == "top_k" else None
            continue
        default = defaults.get(key, whole.default) if key == "top_k" else whole.default
        out[key] = integer(
            values,
            whole.name,
            default,
            lo=whole.lo,
            hi=whole.hi,
            where=spec.where,
            integral_floats=spec.integral_floats,
        )
    out["stop"] = read_stops(values, spec.stop, spec.where) if spec.stop else ()
    return out


def read_stops(values: dict[str, Any], spec: Stops, where: str = "") -> tuple[str, ...]:
    param = where + spec.name
    value = values.get(spec.name)
    if value is None:
        return ()
    stops = [value] if spec.single and isinstance(value, str) else value
    if (
        not isinstance(stops, list)
        or len(stops) > MAX_STOP_SEQUENCES
        or not all(isinstance(s, str) and (s or spec.empties) for s in stops)
    ):
        kinds = "a string or an array" if spec.single else "an array"
        strings = "strings" if spec.empties else "non-empty strings"
        raise InvalidRequest(
            f"{param} must be {kinds} of at most {MAX_STOP_SEQUENCES} {strings}", param=param
        )
    longest = max((len(s) for s in stops), default=0)
    if longest > MAX_STOP_CHARS:
        raise InvalidRequest(
            f"{param}: a stop string of {longest} characters; at most {MAX_STOP_CHARS}",
            param=param,
        )
    return tuple(s for s in stops if s)


def format_field(fmt: ResponseFormat) -> str:
    """The body field that asked for `fmt` (its param may name a part inside it)."""
    return fmt.param.removesuffix(".schema").removesuffix(".json_schema")


def refuse_stop_with_format(sampling: SamplingParams, param: str) -> None:
    """A stop string would cut a structured reply short of the closing brace: invalid
    JSON, while the format promises a reply that parses."""
    if sampling.stop and sampling.response_format is not None:
        raise InvalidRequest(
            f"{param} cannot be combined with {format_field(sampling.response_format)}: "
            "a stop string could cut the structured reply into invalid JSON",
            param=param,
        )


def refuse_format_with_tools(
    fmt: ResponseFormat | None, tools_offered: bool, *, tool_choice: bool = True
) -> None:
    """A reply held to a format could never call a tool. `tool_choice`: the family has
    one ('none' keeps the tools out of the prompt)."""
    if fmt is None or not tools_offered:
        return
    param = format_field(fmt)
    remedy = "send tool_choice: 'none', or no tools" if tool_choice else "send no tools"
    raise InvalidRequest(
        f"{param} cannot be combined with tools: a reply held to the format could never "
        f"call one ({remedy})",
        param=param,
    )


def is_empty(value: Any) -> bool:
    """A value clients send for "not set" (null, false, "", [], {})."""
    return value is None or value is False or value in ("", [], {})


def refuse_unknown(
    values: Mapping[str, Any],
    known: Collection[str],
    *,
    what: str,
    where: str = "",
    empty_ok: bool = False,
    reasons: Mapping[str, str] | None = None,
) -> None:
    """A 400 naming the first field of `values` not in `known` (`what`: the API or object
    it is not a field of; `empty_ok`: an unknown field with an empty value passes, as
    clients send defaults; `reasons`: why a field known elsewhere is refused here)."""
    for name, value in values.items():
        if name in known or (empty_ok and is_empty(value)):
            continue
        param = where + name
        reason = (reasons or {}).get(name)
        if reason is None:
            listed = f" (its fields: {', '.join(sorted(known))})" if known else ""
            reason = f"not a field of {what}{listed}"
        raise InvalidRequest(f"'{param}' is not supported: {reason}", param=param)
