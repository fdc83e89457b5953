"""The servers, conversations and the memory part (see __init__.py)."""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from ...client import Reply, Request, send
from ...corpus import passage
from ...models import Tokens, _built, dense_model
from ...names import OURS
from ...servers import Server, ServerSpec

OUT = Path(__file__).resolve().parents[2] / "out"  # benchmarks/out
MiB = 1 << 20
SMOLLM2_KV_PER_TOKEN = 30 * 3 * 64 * 2 * 4  # layers x KV heads x head dim x (K, V) x fp32

# A random llama with SmolLM2's tokenizer: 4 layers, 2 KV heads of 64 -> 4,096 B/token.
TINY_LONG_CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "max_position_embeddings": 131072,
    "vocab_size": 0,  # the tokenizer's
}
TINY_KV_PER_TOKEN = 4 * 2 * 64 * 2 * 4


def tiny_long_model() -> Path:
    return _built("llama-long", TINY_LONG_CONFIG, None)


def run_async(coro):
    return asyncio.run(coro)


def stream(server: Server | str, messages: list[dict[str, Any]], max_tokens: int) -> Reply:
    async def go() -> Reply:
        async with httpx.AsyncClient(timeout=None) as client:
            return await send(client, server, Request(messages=messages, max_tokens=max_tokens))

    return run_async(go())


def ours(model: Path, extra: tuple[str, ...], log_dir: Path) -> Server:
    return Server(ServerSpec(OURS, model, extra, "ours"), log_dir).start()


@dataclass(slots=True)
class Turn:
    conversation: str
    turn: int
    prompt_tokens: int | None
    cached_tokens: int | None
    ttft_s: float | None
    reply_tokens: int | None


@dataclass(slots=True)
class Conversation:
    name: str
    messages: list[dict[str, Any]] = field(default_factory=list)


def _text(start: int, n: int, tokens: Tokens) -> str:
    return passage(start, n, tokens.count)


# -- part 1: bytes per distinct token ---------------------------------------------------


def conversations(tokens: Tokens, system_tokens: int, user_tokens: int) -> list[Conversation]:
    shared = "You are a careful reader of old texts. " + _text(31000, system_tokens, tokens)
    own = "You answer questions about scripture briefly. " + _text(21000, system_tokens, tokens)
    convs = [Conversation("A"), Conversation("B"), Conversation("C")]
    for conv, system in zip(convs, (shared, shared, own), strict=True):
        conv.messages.append({"role": "system", "content": system})
    return convs


def user_message(conv: int, turn: int, tokens: Tokens, n: int) -> str:
    text = _text(1000 + 2500 * conv + 400 * turn, n, tokens)
    return f"{text}\n\nWho speaks in this passage, and to whom?"


def measure_memory(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    model = dense_model()
    tokens = Tokens(model.path)
    extra: tuple[str, ...] = ("--cache-budget", str(8 << 30), "--no-prefetch")
    disk_dir = None
    if args.disk:
        disk_dir = Path(tempfile.mkdtemp(prefix="bench-dedupe-disk-"))
        extra += ("--disk-cache", "full", "--cache-dir", str(disk_dir))
    server = ours(model.path, extra, log_dir)
    turns: list[Turn] = []
    try:
        convs = conversations(tokens, args.system_tokens, args.user_tokens)
        for turn in range(args.turns):
            for i, conv in enumerate(convs):
                conv.messages.append(
                    {"role": "user", "content": user_message(i, turn, tokens, args.user_tokens)}
                )
                reply = stream(server, conv.messages, args.max_tokens)
                conv.messages.append({"role": "assistant", "content": reply.text})
                turns.append(
                    Turn(
                        conv.name,
                        turn + 1,
                        reply.prompt_tokens,
                        reply.cached_tokens,
                        reply.ttft_s,
                        reply.completion_tokens,
                    )  # fmt: skip
                )
                print(f"  {conv.name}{turn + 1}: {turns[-1]}", flush=True)
        held = held_bytes(server, SMOLLM2_KV_PER_TOKEN)
        disk = disk_bytes(server, disk_dir) if disk_dir is not None else None
        again = follow_ups(server, convs[0], tokens, args)
    finally:
        server.stop()
    return {
        "part": "memory",
        "model": model.description,
        "kv_per_token": SMOLLM2_KV_PER_TOKEN,
        "turns": [asdict(t) for t in turns],
        "held": held,
        "disk": disk,
        "follow_ups": again,
    }


def held_bytes(server: Server, kv_per_token: int) -> dict[str, Any]:
    """What the memory tier holds, against the KV of the distinct tokens it covers."""
    data = httpx.get(server.url + "/v1/dashboard", timeout=60).json()
    nodes = [n for n in data["tree"] if n["entry_id"] is not None]
    distinct = sum(n["tokens"] - n["start"] for n in nodes)
    held = data["memory"]["bytes"]
    kv = distinct * kv_per_token
    return {
        "entries": len(nodes),
        "distinct_tokens": distinct,
        "kv_bytes": kv,
        "held_bytes": held,
        "ratio": held / kv if kv else None,
        "by_entry": [
            {k: n[k] for k in ("start", "tokens", "kind", "bytes", "parent", "id")} for n in nodes
        ],
    }


def disk_bytes(server: Server, directory: Path) -> dict[str, Any]:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        stats = httpx.get(server.url + "/v1/cache", timeout=60).json()
        pending = (stats.get("stats", stats).get("disk") or {}).get("pending_saves", 0)
        if not pending:
            break
        time.sleep(1.0)
    files = [p for p in directory.rglob("*") if p.is_file()]
    return {"files": len(files), "bytes": sum(p.stat().st_size for p in files)}


def follow_ups(
    server: Server, conv: Conversation, tokens: Tokens, args: argparse.Namespace
) -> dict[str, Any]:
    """What a regenerate and an edit of the last turn, and a regenerate of the turn
    before, restore (cached tokens of prompt tokens)."""
    last = conv.messages[:-1]  # the last turn's prompt: ... user
    edited = [*last[:-1], {"role": "user", "content": "Say that again, but shorter."}]
    before = conv.messages[:-3]  # the turn before: ... user (its reply and the last dropped)
    out = {}
    for name, messages in (("regenerate", last), ("edit", edited), ("turn_before", before)):
        reply = stream(server, messages, 4)
        out[name] = {"prompt_tokens": reply.prompt_tokens, "cached_tokens": reply.cached_tokens}
        print(f"  {name}: {out[name]}", flush=True)
    return out


# -- part 2: what it buys -------------------------------------------------------------------
