"""mlx-prefix generate: one reply, streamed to stdout, one stats line on stderr."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from contextlib import closing
from pathlib import Path
from typing import Any

from mlx_prefix.errors import MlxPrefixError

from .args import (
    cache_args,
    cache_config,
    disk_args,
    disk_config,
    draft_args,
    draft_from_args,
    engine_config,
    kv_quant_args,
    model_args,
    model_from_args,
    number_type,
)

_max_tokens = number_type(int, lo=1, hi=float("inf"), what="at least 1")
_temperature = number_type(float, lo=0.0, hi=2.0, what="0 (greedy) to 2")
_top_p = number_type(float, lo=0.0, hi=1.0, what="0 to 1")
_seed = number_type(int, lo=0, hi=2**64 - 1, what="0 to 2**64-1")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="?", help="the user message (or - for stdin)")
    model_args(p)
    draft_args(p)
    cache_args(p)
    # One request per process: `auto` would have no earlier request to compare with, so
    # generate persists every checkpoint and a second run with the same --system hits.
    disk_args(p, "full")
    kv_quant_args(p)
    p.add_argument("-s", "--system", help="system prompt")
    p.add_argument(
        "--image",
        type=Path,
        action="append",
        default=[],
        metavar="FILE",
        help="an image (PNG, JPEG, WebP, still GIF) before PROMPT in the user message "
        "(repeatable; a vision model)",
    )
    p.add_argument("--messages", type=Path, help="OpenAI messages JSON file (array)")
    p.add_argument("-n", "--max-tokens", type=_max_tokens, default=256)
    p.add_argument(
        "-t", "--temp", type=_temperature, default=0.0, help="temperature, 0 to 2 (0 = greedy)"
    )
    p.add_argument("--top-p", type=_top_p, default=1.0, help="nucleus mass, 0 to 1 (0 = greedy)")
    p.add_argument("--seed", type=_seed, default=None, help="sampling seed, 0 to 2**64-1")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--raw", action="store_true", help="complete PROMPT as raw text, no template")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="no prefill progress bar (drawn on stderr only when it is a terminal)",
    )


def _read_messages(path: Path) -> list[dict[str, Any]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise MlxPrefixError(f"cannot read messages from {path}: {e}") from None
    if isinstance(data, dict) and "messages" in data:
        data = data["messages"]
    if not isinstance(data, list):
        raise MlxPrefixError(f"{path}: expected a JSON array of messages")
    return data


def _with_images(prompt: Any, files: list[Path], text: str | None) -> Any:
    """`prompt` with the images before the last user message's text (a new user message
    of them alone when PROMPT is not given)."""
    from dataclasses import replace

    from mlx_prefix.conversation import ImageAt, Message
    from mlx_prefix.vision.intake import ImageInput, ImageLimits, decode_image

    images = []
    for path in files:
        try:
            data = path.read_bytes()
        except OSError as e:
            raise MlxPrefixError(f"cannot read image {path}: {e}") from None
        image = decode_image(data, ImageLimits(), f"--image {path}")
        images.append(ImageAt(0, ImageInput(image), f"--image {path}"))
    messages = list(prompt.messages)
    if text is not None:
        last = messages[-1]
        messages[-1] = replace(last, images=tuple(images))
    else:
        messages.append(Message("user", "", images=tuple(images)))
    return replace(prompt, messages=tuple(messages))


def cmd_generate(args: argparse.Namespace) -> int:
    from mlx_prefix.records import (
        DoneEvent,
        ProgressEvent,
        PromptInput,
        SamplingParams,
        TokenEvent,
    )
    from mlx_prefix.session import PrefixCacheSession, chat_prompt

    from .progress import PrefillBar, wants_bar

    prompt_text = sys.stdin.read() if args.prompt == "-" else args.prompt
    if prompt_text is None and args.messages is None:
        raise MlxPrefixError("give a PROMPT, or --messages FILE")
    if args.raw:
        if prompt_text is None:
            raise MlxPrefixError("--raw needs a PROMPT")
        if args.system is not None or args.messages is not None:
            raise MlxPrefixError("--raw completes PROMPT alone: drop --system and --messages")
        prompt = PromptInput(text=prompt_text)
    else:
        messages = _read_messages(args.messages) if args.messages else None
        first = messages[0] if messages else None
        if args.system is not None and isinstance(first, dict) and first.get("role") == "system":
            raise MlxPrefixError(
                f"--system given, but {args.messages} already starts with a system message"
            )
        prompt = chat_prompt(prompt_text, system=args.system, messages=messages)
        if args.image:
            prompt = _with_images(prompt, args.image, prompt_text)
    sampling = SamplingParams(args.max_tokens, args.temp, args.top_p, args.seed, tuple(args.stop))
    model = model_from_args(args)
    session = PrefixCacheSession(
        model,
        cache_config=cache_config(args),
        engine_config=engine_config(args),
        disk_config=disk_config(args),
        draft=draft_from_args(args, model),
    )
    show_progress = wants_bar(sys.stderr, args.quiet)
    bar = PrefillBar(sys.stderr)
    with session, closing(bar):
        parts = []
        for event in session.stream(prompt, sampling, progress=show_progress):
            if isinstance(event, ProgressEvent):
                bar.update(event)
                continue
            bar.close()
            if isinstance(event, TokenEvent):
                parts.append(event.text)
                if not args.json:
                    sys.stdout.write(event.text)
                    sys.stdout.flush()
            elif isinstance(event, DoneEvent):
                u = event.usage
                if args.json:
                    print(
                        json.dumps(
                            {
                                "text": "".join(parts),
                                "finish_reason": event.finish_reason,
                                "usage": dataclasses.asdict(u),
                            }
                        )
                    )
                else:
                    sys.stdout.write("\n")
                print(
                    f"prompt_tokens={u.prompt_tokens} cached_tokens={u.cached_tokens} "
                    f"completion_tokens={u.completion_tokens} ttft={u.ttft_s * 1000:.0f}ms "
                    f"prefill={u.prefill_tokens_per_s:.1f}tok/s "
                    f"decode={u.decode_tokens_per_s:.1f}tok/s finish={event.finish_reason}",
                    file=sys.stderr,
                )
    return 0
