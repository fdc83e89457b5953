"""Configuration as frozen dataclasses. CLI flags and MLX_PREFIX_* env vars map onto
fields (env.py: the variables, byte sizes). Durations as Ollama writes them (5m, 1h, -1:
forever). A leaf: it imports nothing of the package.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TypedDict, cast

GiB = 1024**3

EVICTION_POLICIES = ("value", "kind")  # cache/eviction/policy.py builds each (POLICIES)
KV_BITS = (2, 3, 4, 5, 6, 8)  # --kv-bits: what mx.quantize supports
KV_GROUP_SIZES = (32, 64, 128)  # --kv-group-size


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model: str | None = None  # local folder or Hugging Face repo id; None = bundled default
    adapter: str | None = None
    dtype: str | None = None  # None = per device (float32 on CPU)
    # A Jinja chat template (its text, or a file holding it) replacing the tokenizer's.
    chat_template: str | None = None
    # A model without a chat template gets ChatML (what transformers used to default to).
    use_default_chat_template: bool = False
    # JSON object of apply_chat_template arguments for every request (e.g.
    # '{"enable_thinking": false}'); a request's chat_template_kwargs win over them.
    chat_template_args: str | None = None
    trust_remote_code: bool = False  # let the tokenizer run the model folder's own code
    draft_model: str | None = None  # speculative decoding's draft (engine/decode/speculative.py)
    # /v1/embeddings' model (mlx_prefix/embeddings/), and whether it is Matryoshka-trained
    # when its config.json does not say (then `dimensions` may shorten its vectors).
    embedding_model: str | None = None
    embedding_matryoshka: bool = False

    def load_options(self) -> LoadOptions:
        """What load_model and load_sharded take alike: the dtype, the template's options."""
        options = {name: getattr(self, name) for name in LoadOptions.__annotations__}
        return cast(LoadOptions, options)


class LoadOptions(TypedDict):
    """ModelConfig's fields that load_model (models/load.py) and load_sharded
    (engine/sharded/load.py) take as keywords of the same names."""

    dtype: str | None
    chat_template: str | None
    use_default_chat_template: bool
    chat_template_args: str | None
    trust_remote_code: bool


@dataclass(frozen=True, slots=True)
class CacheConfig:
    enabled: bool = True
    budget_bytes: int = 4 * GiB  # stored snapshots + running requests' caches
    # Size the budget from the memory free after the weights instead (cache/sizing.py):
    # what `serve` and `generate` do unless --cache-budget (or its variable) sets it.
    budget_from_machine: bool = False
    max_entries: int | None = None
    # Prefill chunk size C: chunk boundaries include every multiple of C.
    prefill_chunk: int = 256
    # Periodic checkpoints inside long prompts, every N tokens (a multiple of prefill_chunk):
    # a hybrid model resumes from an exact checkpoint only, so a divergence anywhere
    # recomputes at most N tokens before it. Trimmable (all-KV) caches keep none in memory.
    checkpoint_interval: int = 512
    # Which stored checkpoint goes first: "value" (recency mixed with the prefill work it
    # saves per byte; cache/eviction/policy.py) or "kind" (fixed kind order, then LRU).
    eviction: str = "value"
    # What one namespace (a page's origin, an API key) may pin, as a share of budget_bytes:
    # pins are never evicted, so without a bound one client could starve the others.
    pin_share: float = 0.25

    def __post_init__(self) -> None:
        if not 0.0 <= self.pin_share <= 1.0:
            raise ValueError("pin_share must be between 0 and 1")
        if (
            min(self.prefill_chunk, self.checkpoint_interval) <= 0
            or self.checkpoint_interval % self.prefill_chunk
        ):
            raise ValueError("checkpoint_interval must be a positive multiple of prefill_chunk")
        if self.eviction not in EVICTION_POLICIES:
            raise ValueError(f"eviction must be one of {', '.join(EVICTION_POLICIES)}")


DEFAULT_AUTO_WINDOW = 16
MAX_AUTO_WINDOW = 128  # requests remembered per model key (4 bytes per token each)


class ScopeMode(str, Enum):
    OFF = "off"
    FULL = "full"
    AUTO = "auto"
    FIXED = "fixed"  # written as a bare token count


@dataclass(frozen=True, slots=True)
class DiskScope:
    """Which positions of a request go to disk (cache/disk/policy.py says how each is
    chosen): the server's `--disk-scope`, or a request's `prefix_cache.scope`, parsed
    once where it enters (the CLI, the request body) and passed on typed."""

    mode: ScopeMode
    n: int = 0  # AUTO: window in requests; FIXED: tokens; else 0

    def __post_init__(self) -> None:
        if self.mode is ScopeMode.AUTO and not 1 <= self.n <= MAX_AUTO_WINDOW:
            raise ValueError(f"auto window {self.n} outside 1..{MAX_AUTO_WINDOW}")
        if self.mode is ScopeMode.FIXED and self.n < 1:
            raise ValueError(f"token count {self.n} must be at least 1")

    @classmethod
    def parse(cls, text: str) -> DiskScope:
        """Parse `off | full | auto | auto:N | N`; ValueError with the accepted forms."""
        s = text.strip().lower()
        if s == "off":
            return cls(ScopeMode.OFF)
        if s == "full":
            return cls(ScopeMode.FULL)
        if s == "auto":
            return cls(ScopeMode.AUTO, DEFAULT_AUTO_WINDOW)
        head, colon, tail = s.partition(":")
        if head == "auto" and colon:
            window = _positive(tail)
            if window is not None and window <= MAX_AUTO_WINDOW:
                return cls(ScopeMode.AUTO, window)
        elif not colon:
            tokens = _positive(s)
            if tokens is not None:
                return cls(ScopeMode.FIXED, tokens)
        raise ValueError(
            f"invalid disk cache scope {text!r}: expected off, full, auto, auto:N "
            f"(1 <= N <= {MAX_AUTO_WINDOW} recent requests) or a token count N >= 1"
        )

    @property
    def off(self) -> bool:
        return self.mode is ScopeMode.OFF

    def __str__(self) -> str:
        if self.mode is ScopeMode.FIXED:
            return str(self.n)
        if self.mode is ScopeMode.AUTO:
            return f"auto:{self.n}"
        return self.mode.value


DEFAULT_SCOPE = DiskScope(ScopeMode.AUTO, DEFAULT_AUTO_WINDOW)
FULL_SCOPE = DiskScope(ScopeMode.FULL)


def _positive(s: str) -> int | None:
    if not s.isdigit():
        return None
    value = int(s)
    return value if value >= 1 else None


@dataclass(frozen=True, slots=True)
class DiskConfig:
    """The disk tier: checkpoints persisted so the cache survives restarts."""

    scope: str = "auto"  # off | full | auto[:N] | N (DiskScope; cache/disk/policy.py)
    directory: str | None = None  # None = <user cache dir>/mlx-prefix/prompt-cache
    budget_bytes: int = 16 * GiB
    min_tokens: int = 64  # shorter prefixes are cheaper to recompute than to read

    def __post_init__(self) -> None:
        self.default_scope  # noqa: B018 - ValueError names the accepted forms

    @property
    def default_scope(self) -> DiskScope:
        return DiskScope.parse(self.scope)

    def path(self) -> Path:
        if self.directory:
            return Path(self.directory).expanduser()
        return home_dir() / "prompt-cache"


def home_dir() -> Path:
    """Where mlx-prefix keeps its files (models, the disk cache): `$MLX_PREFIX_HOME`,
    else the platform's user cache dir + `mlx-prefix`."""
    if home := os.environ.get("MLX_PREFIX_HOME"):
        return Path(home).expanduser()
    if sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches"
    elif sys.platform == "win32":
        base = Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local")
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "mlx-prefix"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    max_running: int = 16  # requests decoding together in one batch
    max_queued: int = 64  # waiting requests beyond this get a busy error
    max_passovers: int = 4  # a waiting request is overtaken at most this many times
    # In-flight sharing: a waiting request sharing at least this many prompt tokens with
    # the one being prefilled gets a checkpoint there, so the shared prefix is computed once.
    share_min_tokens: int = 32
    # Prefill work between two decode steps: grid chunks (of one request, then the next)
    # until this many tokens, at least one chunk. Higher: more throughput when many short
    # prompts arrive together; lower: steadier token pace for requests already decoding.
    prefill_tokens_per_step: int = 256
    # Requests prefilling at once (their next grid chunks computed in one step; chunks of
    # equal shape in one stacked forward: engine/forward/runner.py).
    max_prefilling: int = 4
    # Stacked tails (engine/prefill/tails.py): requests ready together whose prompt has
    # at most this many tokens left compute their rests in one forward, storing nothing
    # of them. 0: never. --deterministic never stacks them (batch invariance).
    stack_tail_tokens: int = 256
    # Target time between two tokens of a running request while others prefill: the
    # prefill share of a step is sized from measured cost to fit (engine/requests/pace.py), but
    # at least one grid chunk runs.
    decode_latency_s: float = 0.25
    # A burst decodes together: a request whose prefill ends while nothing decodes waits
    # for the other requests still prefilling when they have at most this many prompt
    # tokens left, so no prefill step runs between its tokens (engine/requests/pace.py). 0: never.
    gather_tokens: int = 1024
    # Next-turn prefetch (engine/requests/prefetch.py): once idle this long after a reply, prefill
    # that reply again on the chunk grid so the next turn restores the whole history.
    prefetch_next_turn: bool = True
    prefetch_delay_s: float = 0.5
    # A cancelled prefill runs on to its prompt's end while nothing else waits, giving
    # way at its next grid point to a request that cannot restore from it; stopped, or
    # with this off, it stores the grid point it reached (engine/loop.py, issue 55).
    finish_cancelled: bool = True
    # Quantized KV cache, mlx_lm's --kv-bits / --kv-group-size / --quantized-kv-start
    # (engine/forward/kv_quant.py). None: float KV. The start is mlx_lm's
    # DEFAULT_QUANTIZED_KV_START.
    kv_bits: int | None = None
    kv_group_size: int = 64
    quantized_kv_start: int = 5000
    # Speculative decoding (--draft-model): draft tokens per verify step by default.
    num_draft_tokens: int = 3
    # Prompt lookup (engine/decode/lookup.py): each decoding request drafts up to this many
    # tokens from its own prompt and reply, adapting down to off when it keeps none; 0: off
    # (a request's prompt_lookup wins). None: on, lookup.py's DEFAULT_TOKENS (8), unless a
    # --draft-model drafts instead.
    prompt_lookup: int | None = None
    # Batch invariance (--deterministic): a request's answer never depends on what else
    # runs. Off: decode batches every running row in one forward, as mlx_lm.server does;
    # the cache stays exact either way (prefill always computes alone, on the grid).
    deterministic: bool = False
    # Going idle, the engine gives the C heap's freed pages back to the system once
    # (platform.trim_heap: glibc keeps ~100 MiB after a burst) when nothing new arrived
    # for this many seconds. None: never.
    idle_trim_s: float | None = 1.0

    def __post_init__(self) -> None:
        check_kv_quant(self.kv_bits, self.kv_group_size, self.quantized_kv_start)
        if self.prompt_lookup is not None and not 0 <= self.prompt_lookup <= 32:  # MAX_DRAFT_TOKENS
            raise ValueError(f"prompt_lookup must be between 0 and 32, not {self.prompt_lookup}")
        if min(self.max_running, self.prefill_tokens_per_step, self.max_prefilling) < 1:
            raise ValueError(
                "max_running, prefill_tokens_per_step and max_prefilling must be at least 1"
            )
        if min(self.max_queued, self.gather_tokens, self.stack_tail_tokens) < 0:
            raise ValueError("max_queued, gather_tokens and stack_tail_tokens must be >= 0")
        if self.decode_latency_s <= 0:
            raise ValueError("decode_latency_s must be > 0")


def check_kv_quant(bits: int | None, group_size: int, start: int) -> None:
    """ValueError naming the flag when a KV quantization setting is out of range."""
    if bits is not None and bits not in KV_BITS:
        raise ValueError(f"--kv-bits must be one of {', '.join(map(str, KV_BITS))}, not {bits}")
    if group_size not in KV_GROUP_SIZES:
        sizes = ", ".join(map(str, KV_GROUP_SIZES))
        raise ValueError(f"--kv-group-size must be one of {sizes}, not {group_size}")
    if start < 0:
        raise ValueError(f"--quantized-kv-start must be >= 0, not {start}")


FOREVER = float("inf")
# Go's time.Duration (int64 nanoseconds) ends here, about 292 years: Ollama's keep-alive
# for good is that maximum (its /api/ps shows it as an expiry in 2318), and a longer one
# cannot be a Go duration at all. At or past it a keep-alive is FOREVER here, which also
# keeps "now + keep-alive" a date /api/ps can write.
MAX_DURATION_S = (2**63 - 1) / 1e9
_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0,
                   "h": 3600.0, "d": 86400.0}  # fmt: skip


def parse_duration(value: str | int | float) -> float:
    """A keep-alive as Ollama writes it (a Go duration) -> seconds: '5m', '1h30m', '90s',
    '250ms', or a number of seconds; a negative one (or 'forever'), or one of Go's
    maximum duration or more (MAX_DURATION_S), is `FOREVER`; 0 is "at once". ValueError
    otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"not a duration: {value!r}")
    if isinstance(value, (int, float)):
        if value != value:  # nan
            raise ValueError("not a duration: nan")
        return FOREVER if value < 0 or value >= MAX_DURATION_S else float(value)
    text = value.strip().lower()
    if text in ("forever", "inf", "never"):
        return FOREVER
    try:
        return parse_duration(float(text))
    except ValueError:
        pass
    sign = -1.0 if text.startswith("-") else 1.0
    unsigned = text[1:] if text[:1] in ("-", "+") else text
    parts = re.findall(r"([0-9]*\.?[0-9]+)(ns|us|µs|ms|s|m|h|d)", unsigned)
    if not parts or "".join(n + u for n, u in parts) != unsigned:
        raise ValueError(f"not a duration: {value!r} (e.g. 5m, 30s, 1h, -1 for forever)")
    seconds = sum(float(n) * _DURATION_UNITS[u] for n, u in parts)
    return FOREVER if sign < 0 or seconds >= MAX_DURATION_S else seconds


def format_duration(seconds: float) -> str:
    """`parse_duration`'s inverse, for messages: 'forever', '90s', '5m', '1h'."""
    if seconds == FOREVER:
        return "forever"
    for unit, size in (("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"
