"""Each cached token stored once (issue 48): bytes held per distinct token, restore time and
warm-turn TTFT, and the sessions a budget holds, before and after.

Three parts, each its own run (`--part`), writing benchmarks/out/shared_prefix_memory-
<part>-<label>.json. Run one label on main's code and one on the change's, the same day on
the same machine (`PYTHONPATH=<main checkout>:<this checkout>` picks main's mlx_prefix and
this benchmark; the servers inherit PYTHONPATH):

- `memory`: `mlx-prefix serve` with the bundled SmolLM2-135M-Instruct (float32, 46,080
  bytes of KV per token), `--disk-cache off`, a budget nothing is evicted under. Three
  interleaved five-turn conversations, A and B sharing a system prompt, C with its own
  (KJV text; greedy replies of up to 40 tokens). Then GET /v1/dashboard: the stored
  entries nest by their longest stored prefix, so the distinct tokens they cover are the
  sum of what each adds to its parent (a few template tokens per branch are counted twice
  where siblings share more than their stored parent); bytes held / (distinct x KV per
  token) is the figure (1.0: each token once; step padding included). Each turn's TTFT and
  cached tokens, then what a regenerate and an edit-last-message of A's last turn and a
  regenerate of its turn before restore. With `--disk`, the same workload with the disk
  tier on (`--disk-cache full`): bytes of the files written against the same KV.
- `sessions`: eight interleaved agent sessions (a shared 600-token system prompt, then
  tool results of ~330 tokens and 16-token replies, 11 steps: ~4.2K tokens each), round
  robin, under one byte budget (`--budget`, default 112 MiB: about three sessions' worth
  of today's entries), on mlx-prefix, mlx_lm.server (`--prompt-cache-bytes`, same bytes)
  and vllm-mlx where `make peers` installed it. Model: a random-weight llama with
  SmolLM2's tokenizer, 4 layers, 2 KV heads of 64 (4,096 bytes of KV per token): the
  cache's behaviour is what is measured, and SmolLM2 would take hours to prefill the
  misses here. Tokens reused per turn (usage.prompt_tokens_details.cached_tokens).
- `restore`: in process (mlx-prefix's Engine), the same tiny llama with a 128K context
  (SmolLM2's is 8K and it prefills 16K-64K far too slowly on this CPU): for each length a
  cold turn of that many tokens, then two warm turns of ~100 new tokens each (the second
  restores from an entry whose parent is the first's: a chain of pieces after the change).
  Per warm turn: the restore (`restore_longest`, incl. evaluating the restored state),
  the first prefill step after it (where today's restore pays its copy, on first append)
  and the TTFT.

    python -m mlx_prefix.blas_exec python -m benchmarks.studies.shared_prefix_memory \\
        --part memory --label after
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from ...bench_memory import machine
from ...client import Reply, Request, send
from ...corpus import passage
from ...models import Tokens, _built, dense_model
from ...names import OURS, PEER, VLLM
from ...servers import Server, ServerSpec, unavailable

OUT = Path(__file__).resolve().parent / "out"
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


def session_specs(model: Path, budget: int, log_dir: Path) -> list[ServerSpec]:
    specs = [
        ServerSpec(OURS, model, ("--cache-budget", str(budget), "--no-prefetch"), "ours"),
        ServerSpec(PEER, model, ("--prompt-cache-bytes", str(budget)), "peer"),
    ]
    problem = unavailable(VLLM)
    if problem is None:
        # vllm-mlx's prefix cache has its own memory limit flag; the closest to "the same
        # bytes" it takes.
        specs.append(ServerSpec(VLLM, model, ("--cache-memory-mb", str(budget // MiB)), "vllm-mlx"))
    else:
        print(f"  vllm-mlx left out: {problem}", flush=True)
    return specs


def measure_sessions(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    path = tiny_long_model()
    tokens = Tokens(path)
    system = "You are a coding agent. Tools: read, write, run. " + _text(
        52000, args.session_system_tokens, tokens
    )
    results: dict[str, Any] = {}
    for spec in session_specs(path, args.budget, log_dir):
        if args.servers and spec.label not in args.servers:
            continue
        server = Server(spec, log_dir)
        try:
            server.start()
        except Exception as e:  # a peer that cannot start is reported, not fatal
            results[spec.label] = {"error": str(e)}
            continue
        try:
            results[spec.label] = run_sessions(server, system, tokens, args)
        finally:
            server.stop()
    return {
        "part": "sessions",
        "model": f"random llama, SmolLM2 tokenizer, {TINY_LONG_CONFIG}",
        "kv_per_token": TINY_KV_PER_TOKEN,
        "budget_bytes": args.budget,
        "servers": results,
    }


def run_sessions(
    server: Server, system: str, tokens: Tokens, args: argparse.Namespace
) -> dict[str, Any]:
    sessions = [[{"role": "system", "content": system}] for _ in range(args.sessions)]
    rows = []
    for step in range(args.steps):
        for i, messages in enumerate(sessions):
            result = _text(60000 + 5000 * i + 450 * step, args.result_tokens, tokens)
            messages.append({"role": "user", "content": f"Tool result (step {step}):\n{result}"})
            reply = stream(server, messages, args.reply_tokens)
            messages.append({"role": "assistant", "content": reply.text})
            rows.append(
                {
                    "session": i,
                    "step": step,
                    "prompt_tokens": reply.prompt_tokens,
                    "cached_tokens": reply.cached_tokens,
                    "ttft_s": reply.ttft_s,
                }  # fmt: skip
            )
    if server.name == VLLM:  # it reports no cached tokens; its log says each fetch's
        for row, cached in zip(rows, vllm_cached(server), strict=False):
            row["cached_tokens"] = cached
    later = [r for r in rows if r["step"] > 0]
    out: dict[str, Any] = {
        "rows": rows,
        "reused_per_turn": statistics.fmean(r["cached_tokens"] or 0 for r in later),
        "prompt_per_turn": statistics.fmean(r["prompt_tokens"] or 0 for r in later),
        "reused_share": sum(r["cached_tokens"] or 0 for r in later)
        / max(1, sum(r["prompt_tokens"] or 0 for r in later)),
        "ttft_median_s": statistics.median(r["ttft_s"] or 0.0 for r in later),
    }
    if server.name == OURS:
        data = httpx.get(server.url + "/v1/dashboard", timeout=60).json()
        out["held_bytes"] = data["memory"]["bytes"]
        out["entries"] = len([n for n in data["tree"] if n["entry_id"] is not None])
        out["evictions"] = data["memory"]["evictions"]
    summary = {k: v for k, v in out.items() if k != "rows"}
    print(f"  {server.spec.label}: {summary}", flush=True)
    return out


def vllm_cached(server: Server) -> list[int]:
    """vllm-mlx's cached tokens per request, in order, from its log's `[cache_fetch]`
    lines (its usage carries none); the warm-up request's first line left out."""
    return vllm_cached_from(Path(server._log.name))  # type: ignore[union-attr]


def vllm_cached_from(log: Path) -> list[int]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if "[cache_fetch]" not in line:
            continue
        found = re.search(r"cached=(\d+)", line)
        out.append(int(found.group(1)) if found and " HIT " in line else 0)
    return out[1:]


# -- part 3: restore time and warm-turn TTFT ---------------------------------------------


def measure_restore(args: argparse.Namespace) -> dict[str, Any]:
    import mlx.core as mx

    from mlx_prefix.config import CacheConfig, EngineConfig
    from mlx_prefix.conversation import Message
    from mlx_prefix.engine.engine import Engine
    from mlx_prefix.engine.prefill import phase as prefill_phase
    from mlx_prefix.models.load import load_model
    from mlx_prefix.records import CachePreference, PromptInput, SamplingParams, TokenEvent

    path = tiny_long_model()
    tokens = Tokens(path)
    loaded = load_model(str(path))
    restores: list[float] = []
    real = prefill_phase.restore_longest

    def timed(*a, **k):
        t = time.perf_counter()
        found = real(*a, **k)
        if found.cache is not None:
            mx.eval([c.state for c in found.cache])
        restores.append(time.perf_counter() - t)
        return found

    prefill_phase.restore_longest = timed
    steps: list[float] = []
    rows: list[dict[str, Any]] = []

    def one_turn(engine: Engine, messages: list, n: int, turn: int) -> dict[str, Any]:
        restores.clear()
        steps.clear()
        start = time.perf_counter()
        handle = engine.submit(
            PromptInput(messages=tuple(messages)),
            SamplingParams(max_tokens=8, temperature=0.0),
            CachePreference(),
        )
        ttft, text, usage = None, [], None
        for event in handle.events(timeout=7200):
            if isinstance(event, TokenEvent):
                ttft = ttft or time.perf_counter() - start
                text.append(event.text)
            elif hasattr(event, "usage"):
                usage = event.usage
        return {
            "tokens": n,
            "turn": turn,  # 4: the third turn again (a regenerate)
            "prompt_tokens": usage.prompt_tokens if usage else None,
            "cached_tokens": usage.cached_tokens if usage else None,
            "restore_ms": restores[0] * 1e3 if restores else None,
            "first_step_ms": steps[0] * 1e3 if steps else None,
            "ttft_ms": ttft * 1e3 if ttft else None,
            "text": "".join(text),
        }

    try:
        for n in args.lengths:
            config = EngineConfig(prefetch_next_turn=False)
            engine = Engine(loaded, CacheConfig(budget_bytes=8 << 30), config)
            real_step = engine._prefill.step

            def step(*a, _real=real_step, **k):
                t = time.perf_counter()
                out = _real(*a, **k)
                steps.append(time.perf_counter() - t)
                return out

            engine._prefill.step = step
            try:
                messages = [Message("user", _text(90000, n, tokens) + "\n\nSummarize.")]
                # Three turns (the first cold), then the third again `repeat` times: a
                # regenerate, restored from its own entry (after: a chain of 3 pieces).
                for turn in range(3 + args.repeat):
                    row = one_turn(engine, messages, n, min(turn, 3) + 1)
                    rows.append(row)
                    print(f"  {row}", flush=True)
                    if turn < 2:
                        messages += [
                            Message("assistant", row.pop("text")),
                            Message("user", _text(95000 + 300 * turn, 100, tokens)),
                        ]
                    else:
                        row.pop("text")
            finally:
                engine.shutdown()
    finally:
        prefill_phase.restore_longest = real
    return {
        "part": "restore",
        "model": f"random llama, SmolLM2 tokenizer, {TINY_LONG_CONFIG}",
        "kv_per_token": TINY_KV_PER_TOKEN,
        "rows": rows,
    }


# -- the table (benchmarks/results/standalone/shared_prefix_memory.md) -------------------


def _load(part: str, label: str) -> dict[str, Any] | None:
    path = OUT / f"shared_prefix_memory-{part}-{label}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / MiB:,.0f} MiB"


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _ms(v: float | None) -> str:
    return "-" if v is None else (f"{v:,.0f}" if v >= 10 else f"{v:.1f}")


def table(labels: tuple[str, str] = ("before", "after")) -> str:
    """The markdown section of the runs found in benchmarks/out/."""
    lines = ["## Each cached token stored once (issue 48)", ""]
    first = _load("memory", labels[0]) or {}
    lines += [
        f"`benchmarks/studies/shared_prefix_memory`, {first.get('date', '?')}, on "
        f"{first.get('machine', '?')} (shared with other work: load average ~20 on 2 "
        "cores, so times are noisy; bytes and tokens are exact). *before* = main's code, "
        "*after* = the chained entries, same machine, same day.",
        "",
        "Bytes held per distinct token's KV: SmolLM2-135M-Instruct float32 (46,080 B/token), "
        "three interleaved five-turn conversations, two sharing a system prompt, "
        "`--disk-cache off` (the disk row: `--disk-cache full`, bytes of the files).",
        "",
        "| code | entries | distinct tokens | their KV | held | held / KV | disk files / KV "
        "| regenerate / edit / turn before: cached of prompt | warm-turn TTFT, median s |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for label in labels:
        mem, disk = _load("memory", label), _load("memory-disk", label)
        if mem is None:
            continue
        h = mem["held"]
        d = (disk or {}).get("disk")
        on_disk = f"{d['bytes'] / h['kv_bytes']:.2f}x" if d and h["kv_bytes"] else "-"
        f = mem["follow_ups"]
        again = " / ".join(
            f"{f[k]['cached_tokens']} of {f[k]['prompt_tokens']}"
            for k in ("regenerate", "edit", "turn_before")
        )
        warm = _median([t["ttft_s"] for t in mem["turns"] if t["turn"] > 1])
        lines.append(
            f"| {label} | {h['entries']} | {h['distinct_tokens']:,} | {_mib(h['kv_bytes'])} "
            f"| {_mib(h['held_bytes'])} | **{h['ratio']:.2f}x** | {on_disk} | {again} "
            f"| {warm:.1f} |"
        )
    lines += [
        "",
        "Restore and warm-turn TTFT by prefix length: in process, a random llama with "
        "SmolLM2's tokenizer and a 128K context, 4 layers, 2 KV heads of 64 (4,096 B of KV "
        "per token; SmolLM2's context is 8K and it prefills 16K-64K far too slowly here). "
        "Turn 2 and 3 add ~100 tokens each to a cold turn 1; *regenerate* is turn 3 again "
        "(restored from its own entry: after the change a chain of three pieces), median "
        "of 5. *restore* = `restore_longest` with the restored state evaluated (after: the "
        "pieces assembled into one buffer; before: views), *first step* = the prefill step "
        "after it (before: where the first append copies the prefix), milliseconds.",
        "",
        "| tokens | code | turn 2: restore / first step / TTFT | turn 3: restore / first "
        "step / TTFT | regenerate: restore / first step / TTFT |",
        "|---:|---|---|---|---|",
    ]
    for n in sorted(
        {r["tokens"] for lb in labels for r in (_load("restore", lb) or {}).get("rows", [])}
    ):
        for label in labels:
            rows = [r for r in (_load("restore", label) or {}).get("rows", []) if r["tokens"] == n]
            if not rows:
                continue
            cells = []
            for turn in (2, 3, 4):
                rs = [r for r in rows if r["turn"] == turn]
                cells.append(
                    " / ".join(
                        _ms(_median([r[k] for r in rs]))
                        for k in ("restore_ms", "first_step_ms", "ttft_ms")
                    )
                )
            lines.append(f"| {n:,} | {label} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "What it buys: eight interleaved agent sessions (a shared 600-token system prompt, "
        "11 steps of ~330-token tool results and 16-token replies: ~4.2K tokens each), "
        "round robin, under one byte budget for every server (mlx-prefix `--cache-budget`, "
        "mlx_lm.server `--prompt-cache-bytes`, vllm-mlx `--cache-memory-mb`), the tiny "
        "llama above. Tokens reused per turn: cached tokens reported, steps 2-11.",
        "",
        "| server | code | budget | reused per turn | of prompt | held at the end | entries "
        "| evictions |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label in labels:
        sess = _load("sessions", label)
        if sess is None:
            continue
        for name, r in sess["servers"].items():
            if "error" in r:
                lines.append(f"| {name} | {label} | - | failed: {r['error'][:80]} | | | | |")
                continue
            lines.append(
                f"| {name} | {label} | {_mib(sess['budget_bytes'])} "
                f"| {r['reused_per_turn']:,.0f} | {r['reused_share']:.0%} "
                f"| {_mib(r.get('held_bytes'))} | {r.get('entries', '-')} "
                f"| {r.get('evictions', '-')} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--part", choices=("memory", "sessions", "restore", "table"), required=True)
    p.add_argument("--label", default="", help="before | after (names the output file)")
    p.add_argument("--disk", action="store_true", help="memory: with the disk tier on")
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--system-tokens", type=int, default=460)
    p.add_argument("--user-tokens", type=int, default=250)
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--steps", type=int, default=11)
    p.add_argument("--session-system-tokens", type=int, default=600)
    p.add_argument("--result-tokens", type=int, default=330)
    p.add_argument("--reply-tokens", type=int, default=16)
    p.add_argument("--budget", type=int, default=112 * MiB)
    p.add_argument(
        "--servers", type=lambda x: x.split(","), default=None,
        help="sessions: labels to run (ours, peer, vllm-mlx; default: all)",
    )  # fmt: skip
    p.add_argument("--repeat", type=int, default=5, help="restore: regenerates of turn 3")
    p.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")],
                   default=[2048, 16384, 65536])  # fmt: skip
    args = p.parse_args()
    log_dir = OUT / "logs"
    if args.part == "table":  # from the runs in benchmarks/out/
        print(table(), end="")
        return
    if not args.label:
        p.error("--label is required to run a part")
    if args.part == "memory":
        result = measure_memory(args, log_dir)
    elif args.part == "sessions":
        result = measure_sessions(args, log_dir)
    else:
        result = measure_restore(args)
    import mlx_prefix

    result.update(
        label=args.label,
        machine=machine(),
        python=platform.python_version(),
        mlx_prefix=str(Path(mlx_prefix.__file__).resolve().parent),
        date=time.strftime("%Y-%m-%d %H:%M"),
        blas=os.environ.get("LD_PRELOAD", ""),
    )
    suffix = "-disk" if args.part == "memory" and args.disk else ""
    out = OUT / f"shared_prefix_memory-{args.part}{suffix}-{args.label}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
