"""Cache namespaces (issue 19): the timing channel they close, and the reuse they cost.

timing: can a client tell from the time to its first token that another client sent a
  prompt? Per trial a victim origin sends a prompt (cached in its namespace), then, in
  random order, a fresh prober origin sends the same prompt ("cross") and another fresh
  prober the same prompt with one word changed at its start ("miss": nobody cached it,
  and it has as many tokens); the victim sends its prompt
  again ("own hit") as the control that shows the channel is there to find. Under
  `--cache-sharing global` the cross request is a hit: the channel namespaces close.
reuse: the burst workload (parallel requests sharing one instruction, cold then warm)
  and a multi-turn workload (clients sharing a system prompt, several turns each), with
  the clients spread over 1, 2 and 6 origins, against `global`: prompt tokens restored
  from the cache / prompt tokens sent.

Both run against `mlx-prefix serve` as a subprocess (fast BLAS, no disk tier, no
next-turn prefetch) with the bundled SmolLM2-135M-Instruct (float32).

    python -m mlx_prefix.blas_exec python -m benchmarks.studies.namespaces [--trials 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from ..client import Reply, Request, send
from ..corpus import passage
from ..models import Tokens, dense_model
from ..servers import OURS, Server, ServerSpec

PROMPT_TOKENS = 250  # the timing trials' system prompts
QUESTION = "Summarize the passage above in one sentence."


def origin(name: str) -> dict[str, str]:
    return {"Origin": f"chrome-extension://{name}"}


async def ask(server: Server, who: dict[str, str], request: Request) -> Reply:
    async with httpx.AsyncClient(headers=who, timeout=None) as client:
        return await send(client, server, request)


def chat(system: str, *turns: dict[str, str], max_tokens: int = 1) -> Request:
    return Request(messages=[{"role": "system", "content": system}, *turns], max_tokens=max_tokens)


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


# -- timing ---------------------------------------------------------------------------


async def timing(server: Server, tokens: Tokens, trials: int, offset: int) -> dict[str, Any]:
    rows: dict[str, list[tuple[float, int, int]]] = {"cross": [], "miss": [], "own hit": []}
    order = random.Random(19)
    for i in range(trials):
        text = passage(offset + 211 * i, PROMPT_TOKENS, tokens.count)
        secret, other = f"Passage A: {text}", f"Passage B: {text}"
        victim = origin(f"victim{offset}")
        await ask(server, victim, chat(secret, user(QUESTION)))
        probes = [
            ("cross", origin(f"probe{offset}-{i}a"), secret),
            ("miss", origin(f"probe{offset}-{i}b"), other),
        ]
        order.shuffle(probes)
        for label, who, system in [*probes, ("own hit", victim, secret)]:
            reply = await ask(server, who, chat(system, user(QUESTION)))
            assert reply.ttft_s is not None and reply.prompt_tokens is not None
            rows[label].append((reply.ttft_s, reply.cached_tokens or 0, reply.prompt_tokens))
    out: dict[str, Any] = {}
    for label, values in rows.items():
        ttft = [v[0] * 1000 for v in values]
        out[label] = {
            "n": len(values),
            "ttft_ms_median": statistics.median(ttft),
            "ttft_ms_p10": _quantile(ttft, 0.1),
            "ttft_ms_p90": _quantile(ttft, 0.9),
            "cached_tokens_mean": statistics.fmean(v[1] for v in values),
            "prompt_tokens_median": statistics.median(v[2] for v in values),
        }
    # Paired by trial: the two probes ran back to back, so a slow drift of the machine's
    # load (other processes) cancels out of their difference.
    cross, miss = ([v[0] * 1000 for v in rows[k]] for k in ("cross", "miss"))
    out["cross_minus_miss_ms"] = _median_ci([c - m for c, m in zip(cross, miss, strict=True)])
    hit = [v[0] * 1000 for v in rows["own hit"]]
    out["hit_minus_miss_ms"] = _median_ci([h - m for h, m in zip(hit, miss, strict=True)])
    return out


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _median_ci(diffs: list[float], rounds: int = 4000) -> dict[str, float]:
    """The median of paired differences, with a 95% bootstrap interval (seeded)."""
    rng = random.Random(0)
    boot = sorted(statistics.median(rng.choices(diffs, k=len(diffs))) for _ in range(rounds))
    return {
        "median": statistics.median(diffs),
        "ci95_low": boot[int(0.025 * rounds)],
        "ci95_high": boot[int(0.975 * rounds)],
    }


# -- reuse ----------------------------------------------------------------------------


async def burst(server: Server, tokens: Tokens, origins: int, offset: int) -> dict[str, Any]:
    head = "You are a browser extension's summarizer. Reply with one plain sentence. Rules:\n"
    instruction = head + passage(offset, 500, tokens.count)
    out: dict[str, Any] = {}
    for phase, base in (("cold", 1000), ("warm", 2000)):
        snippets = [passage(offset + base + 60 * i, 60, tokens.count) for i in range(6)]
        start = time.perf_counter()
        requests = [
            (origin(f"burst{offset}-{i % origins}"), chat(instruction, user(s), max_tokens=8))
            for i, s in enumerate(snippets)
        ]
        replies = await asyncio.gather(*(ask(server, who, r) for who, r in requests))
        out[phase] = _reuse(replies, time.perf_counter() - start)
    return out


async def multi_turn(server: Server, tokens: Tokens, origins: int, offset: int) -> dict[str, Any]:
    system = "You are a patient reading tutor.\n" + passage(offset, 300, tokens.count)
    histories: list[list[dict[str, str]]] = [[] for _ in range(6)]
    replies: list[Reply] = []
    start = time.perf_counter()
    for turn in range(3):
        for c, history in enumerate(histories):
            question = passage(offset + 3000 + 100 * c + 17 * turn, 60, tokens.count)
            history.append(user(question))
            reply = await ask(
                server, origin(f"chat{offset}-{c % origins}"), chat(system, *history, max_tokens=16)
            )
            history.append({"role": "assistant", "content": reply.text})
            replies.append(reply)
    return _reuse(replies, time.perf_counter() - start)


def _reuse(replies: list[Reply], wall_s: float) -> dict[str, Any]:
    prompt = sum(r.prompt_tokens or 0 for r in replies)
    cached = sum(r.cached_tokens or 0 for r in replies)
    reuse = cached / prompt
    return {"prompt_tokens": prompt, "cached_tokens": cached, "reuse": reuse, "wall_s": wall_s}


# -- driver ---------------------------------------------------------------------------


def serve(model: Path, sharing: str, log_dir: Path) -> Server:
    args = ("--cache-sharing", sharing, "--no-prefetch")
    return Server(ServerSpec(OURS, model, args, label=f"ours-{sharing}"), log_dir).start()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    model = dense_model()
    tokens = Tokens(model.path)
    report: dict[str, Any] = {"model": model.description, "machine": platform.platform()}
    for sharing in ("origin", "global"):
        server = serve(model.path, sharing, args.out.parent / "logs")
        try:
            result: dict[str, Any] = {}
            if "timing" in args.parts:
                result["timing"] = await timing(server, tokens, args.trials, 20000)
                _print_timing(sharing, result["timing"])
            if "reuse" in args.parts:
                spreads = (1, 2, 6) if sharing == "origin" else (6,)
                for i, k in enumerate(spreads):
                    b = await burst(server, tokens, k, 40000 + 5000 * i)
                    m = await multi_turn(server, tokens, k, 60000 + 5000 * i)
                    result[f"reuse_{k}_origins"] = {"burst": b, "multi_turn": m}
                    print(
                        f"{sharing:>6} {k} origin(s): burst cold {b['cold']['reuse']:.2f} "
                        f"({b['cold']['wall_s']:.1f} s) warm {b['warm']['reuse']:.2f}; "
                        f"multi-turn {m['reuse']:.2f} ({m['wall_s']:.1f} s)",
                        flush=True,
                    )
            report[sharing] = result
        finally:
            server.stop()
    return report


def _print_timing(sharing: str, t: dict[str, Any]) -> None:
    for label in ("cross", "miss", "own hit"):
        r = t[label]
        print(
            f"{sharing:>6} {label:>8}: TTFT median {r['ttft_ms_median']:7.1f} ms "
            f"(p10 {r['ttft_ms_p10']:.1f}, p90 {r['ttft_ms_p90']:.1f}), cached "
            f"{r['cached_tokens_mean']:.0f} of {r['prompt_tokens_median']:.0f}",
            flush=True,
        )
    for name in ("cross_minus_miss_ms", "hit_minus_miss_ms"):
        d = t[name]
        print(
            f"{sharing:>6} {name.removesuffix('_ms').replace('_minus_', ' - ')}, paired: "
            f"{d['median']:+.1f} ms (95% CI {d['ci95_low']:+.1f} .. {d['ci95_high']:+.1f})",
            flush=True,
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--trials", type=int, default=16)
    p.add_argument("--parts", default="timing,reuse", help="timing, reuse or both")
    out = Path(__file__).parents[1] / "out"  # benchmarks/out
    p.add_argument("--out", type=Path, default=out / "namespaces.json")
    args = p.parse_args()
    args.parts = set(args.parts.split(","))
    report = asyncio.run(run(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
