"""What the commands share: argument types (byte sizes, bounded numbers), the model,
cache, disk and engine flag groups, and the configs built from them (flag, else
MLX_PREFIX_* variable, else default)."""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import TYPE_CHECKING

from mlx_prefix.config import (
    EVICTION_POLICIES,
    KV_BITS,
    KV_GROUP_SIZES,
    CacheConfig,
    DiskConfig,
    EngineConfig,
    ModelConfig,
)
from mlx_prefix.config import parse_duration as config_parse_duration
from mlx_prefix.env import from_env
from mlx_prefix.env import parse_bytes as config_parse_bytes

if TYPE_CHECKING:
    from mlx_prefix.models.load import LoadedModel


def parse_bytes(text: str) -> int:
    """'4GiB', '512MB', '1e9', '1024' -> bytes (argparse type)."""
    try:
        return config_parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def duration(text: str) -> float:
    """'5m', '30s', '1h', '0', '-1' (forever) -> seconds (argparse type)."""
    try:
        return config_parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def number_type(kind: type, *, lo: float, hi: float, what: str):
    """An argparse type: a `kind` number in [lo, hi]."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not lo <= value <= hi:  # also refuses nan
            raise argparse.ArgumentTypeError(f"{text} is out of range: {what}")
        return value

    return parse


def model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-m",
        "--model",
        help="local model folder or Hugging Face repo id "
        "(default: the bundled SmolLM2-135M-Instruct)",
    )
    p.add_argument("--adapter", help="LoRA adapter folder")
    p.add_argument(
        "--dtype",
        choices=["float32", "float16", "bfloat16"],
        help="weights dtype (default: float32 on CPU, the checkpoint's on GPU)",
    )
    p.add_argument(
        "--chat-template",
        help="a Jinja chat template (or a file holding one) replacing the tokenizer's",
    )
    p.add_argument(
        "--use-default-chat-template",
        action="store_true",
        default=None,
        help="give a model without a chat template ChatML",
    )
    p.add_argument(
        "--chat-template-args",
        help="JSON object of apply_chat_template arguments for every request, e.g. "
        "'{\"enable_thinking\": false}' (a request's chat_template_kwargs win)",
    )
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        default=None,
        help="let the tokenizer run code from the model folder",
    )


def draft_args(p: argparse.ArgumentParser) -> None:
    """Speculative decoding, as mlx_lm.server's flags (engine/decode/speculative.py)."""
    p.add_argument(
        "--draft-model",
        help="a smaller model with the same tokenizer that proposes tokens for the model "
        "to verify (speculative decoding; the reply is the model's own)",
    )
    p.add_argument(
        "--num-draft-tokens",
        type=number_type(int, lo=1, hi=32, what="between 1 and 32"),
        help="draft tokens per verify step (default 3; a request's num_draft_tokens wins)",
    )
    p.add_argument(
        "--prompt-lookup",
        type=number_type(int, lo=0, hi=32, what="between 0 and 32"),
        help="prompt lookup: each request drafts up to N tokens from its prompt and reply, "
        "verified in one forward, fewer (down to none) while it keeps none (default 8, "
        "without --draft-model; 0: off; a request's prompt_lookup wins; hybrids too)",
    )


def draft_from_args(args: argparse.Namespace, target: LoadedModel) -> LoadedModel | None:
    """The --draft-model, loaded in the target's dtype (None: no speculative decoding)."""
    from mlx_prefix.models.load import load_model

    cfg = from_env(ModelConfig, "MODEL", {"draft_model": getattr(args, "draft_model", None)})
    if cfg.draft_model is None:
        return None
    return load_model(cfg.draft_model, dtype=target.identity.dtype)


def cache_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cache-budget",
        type=parse_bytes,
        dest="budget_bytes",
        help="bytes for cached snapshots plus running requests (default: half the memory "
        "free after the weights; a conversation of N tokens needs N x its KV bytes per "
        "token x 1.25)",
    )
    p.add_argument("--cache-max-entries", type=int, dest="max_entries")
    p.add_argument(
        "--pin-share",
        type=number_type(float, lo=0.0, hi=1.0, what="between 0 and 1"),
        dest="pin_share",
        help="share of the cache budget one client (namespace) may pin (default 0.25)",
    )
    p.add_argument(
        "--prefill-chunk",
        type=int,
        dest="prefill_chunk",
        help="prefill chunk size; chunk boundaries fall on its multiples (256)",
    )
    p.add_argument(
        "--checkpoint-interval",
        type=int,
        dest="checkpoint_interval",
        help="periodic checkpoint every N tokens of long prompts (512)",
    )
    p.add_argument(
        "--cache-eviction",
        choices=EVICTION_POLICIES,
        dest="eviction",
        help="which checkpoint goes first: value (recency + prefill saved per byte; "
        "default) or kind (fixed kind order, then least recently used)",
    )
    p.add_argument(
        "--no-cache",
        action="store_false",
        dest="enabled",
        default=None,
        help="disable the prefix cache",
    )


def engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-running", type=int, help="requests decoding together in one batch (default 16)"
    )
    p.add_argument(
        "--max-queued",
        type=int,
        help="waiting requests beyond this get a 429 busy error (default 64)",
    )
    p.add_argument(
        "--prefill-tokens-per-step",
        type=int,
        help="prefill tokens computed between two decode steps (default 256)",
    )
    p.add_argument(
        "--max-prefilling",
        type=int,
        help="requests prefilling at once (default 4)",
    )
    p.add_argument(
        "--stack-tails",
        type=int,
        dest="stack_tail_tokens",
        metavar="TOKENS",
        help="requests ready together with at most this many prompt tokens left compute "
        "them in one forward, storing none of them (default 256; 0: never; never with "
        "--deterministic)",
    )
    p.add_argument(
        "--decode-latency",
        type=float,
        dest="decode_latency_s",
        help="target seconds between two tokens of a running request while others "
        "prefill (default 0.25; at least one prefill chunk runs)",
    )
    p.add_argument(
        "--gather-tokens",
        type=int,
        help="a request whose prefill ends while nothing decodes waits for the other "
        "requests prefilling when they have at most this many prompt tokens left, so a "
        "burst decodes together (default 1024; 0: never wait)",
    )
    p.add_argument(
        "--no-prefetch",
        action="store_false",
        dest="prefetch_next_turn",
        default=None,
        help="don't prefill a chat's reply again while idle (next-turn prefetch)",
    )
    p.add_argument(
        "--finish-cancelled",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a cancelled request's prefill runs on to its prompt's end while nothing "
        "else waits, so the same prompt sent again restores it whole (default on; off: "
        "it stores the last grid point it reached)",
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        default=None,
        help="batch invariance: a request's reply never depends on the requests decoding "
        "beside it (measured at startup; slower decode batches). Cache hits never change "
        "a reply in either mode",
    )
    kv_quant_args(p)


def kv_quant_args(p: argparse.ArgumentParser) -> None:
    """mlx_lm's quantized KV cache flags (engine/forward/kv_quant.py)."""
    p.add_argument(
        "--kv-bits",
        type=int,
        choices=KV_BITS,
        help="quantize the KV cache to this many bits (default: no quantization); "
        "one request at a time, as mlx_lm.server",
    )
    p.add_argument(
        "--kv-group-size",
        type=int,
        choices=KV_GROUP_SIZES,
        help="group size for KV cache quantization (default 64)",
    )
    p.add_argument(
        "--quantized-kv-start",
        type=number_type(int, lo=0, hi=float("inf"), what="at least 0"),
        help="with --kv-bits, quantize a request's KV once it holds this many tokens "
        "(default 5000, mlx_lm's)",
    )


def disk_args(p: argparse.ArgumentParser, default_scope: str) -> None:
    p.add_argument(
        "--disk-cache",
        dest="scope",
        default=None,
        help=f"what to persist: off (no disk tier) | full | auto[:N] | N (default {default_scope})",
    )
    p.add_argument(
        "--cache-dir",
        dest="directory",
        default=None,
        help="disk cache folder (default: <user cache dir>/mlx-prefix/prompt-cache)",
    )
    p.add_argument(
        "--disk-budget",
        type=parse_bytes,
        dest="disk_budget_bytes",
        default=None,
        help="bytes of disk for cached checkpoints (default 16GiB)",
    )
    p.set_defaults(default_scope=default_scope)


def disk_config(args: argparse.Namespace) -> DiskConfig:
    overrides = {
        "scope": args.scope,
        "directory": args.directory,
        "budget_bytes": args.disk_budget_bytes,
    }
    config = from_env(DiskConfig, "DISK", overrides)
    if args.scope is None and "MLX_PREFIX_DISK_SCOPE" not in os.environ:
        config = dataclasses.replace(config, scope=args.default_scope)
    return config


def cache_config(args: argparse.Namespace) -> CacheConfig:
    keys = (
        "enabled",
        "budget_bytes",
        "max_entries",
        "prefill_chunk",
        "checkpoint_interval",
        "eviction",
        "pin_share",
    )
    config = from_env(CacheConfig, "CACHE", {k: getattr(args, k, None) for k in keys})
    if getattr(args, "budget_bytes", None) is None and "MLX_PREFIX_CACHE_BUDGET_BYTES" not in (
        os.environ
    ):  # sized from the memory the weights leave, once they are loaded (cache/sizing.py)
        config = dataclasses.replace(config, budget_from_machine=True)
    return config


def engine_config(args: argparse.Namespace) -> EngineConfig:
    keys = (
        "max_running",
        "max_queued",
        "prefill_tokens_per_step",
        "max_prefilling",
        "stack_tail_tokens",
        "decode_latency_s",
        "gather_tokens",
        "prefetch_next_turn",
        "finish_cancelled",
        "kv_bits",
        "kv_group_size",
        "quantized_kv_start",
        "num_draft_tokens",
        "prompt_lookup",
        "deterministic",
    )
    return from_env(EngineConfig, "ENGINE", {k: getattr(args, k, None) for k in keys})


def model_from_args(args: argparse.Namespace) -> LoadedModel:
    from mlx_prefix.models.load import load_model

    keys = ("model", "adapter", "dtype", "chat_template", "use_default_chat_template",
            "chat_template_args", "trust_remote_code")  # fmt: skip
    cfg = from_env(ModelConfig, "MODEL", {k: getattr(args, k, None) for k in keys})
    return load_model(cfg.model, adapter=cfg.adapter, **cfg.load_options())
