"""A tight budget and the conversations it serves (issue 55 items 3 and 4), on every server.

- sweep: one conversation of `--turns` turns (a system prompt, then user messages; the
  client sends back each reply the server gave, 4 tokens, as agents do),
  once per budget of 1.1x, 1.25x, 1.5x and 2x its final KV (budgets.py: what one prefill
  of its last prompt leaves), each budget a fresh process of each server. Per turn: the
  tokens it reported cached, over what it could reuse (the tokens its prompt shares with
  the turn before's).
- subagents: a main agent's conversation (`--main-turns`, 4: an agent that has worked a
  while before it starts subagents), then five subagents, each with its
  own system prompt and two turns, one after another, then the main agent's next turn, at
  a budget of 1.25x (mlx-prefix's documented need per conversation) the KV of the main
  conversation and two subagents'. Reported: the main turn's cached tokens over what it
  shares with the main agent's previous prompt, and each subagent's second turn's.

Memory only (mlx-prefix `--disk-cache off`, as the harness starts it). Writes
benchmarks/out/budget-<part>-<model>.json and renders
benchmarks/results/standalone/budget55.md from those found.

`python -m mlx_prefix.blas_exec python -m benchmarks.studies.budget --model dense [--part sweep]`
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path
from typing import Any

import httpx

from ..client import Request
from ..corpus import passage
from ..models import Tokens, common_prefix, resolve
from ..names import OURS, PEER, VLLM
from ..servers import unavailable
from .budgets import MiB, Turns, budget_flag, kv_size, machine_line, ours_memory, runs_when, start

OUT = Path(__file__).resolve().parents[1] / "out"
STANDALONE = Path(__file__).resolve().parents[1] / "results" / "standalone" / "budget55.md"
FACTORS = (1.1, 1.25, 1.5, 2.0)
ORDER = (OURS, PEER, VLLM)
REPLY_TOKENS = 4  # generated per request, sent back as the next turn's assistant message
PLACEHOLDER = "Yes, it is."  # about REPLY_TOKENS tokens: sizes a conversation in advance
SIZES = {  # model: (system tokens, user tokens per turn) for the sweep
    "dense": (600, 120),
    "hybrid": (1500, 300),
}


def _servers(only: list[str] | None) -> tuple[list[str], dict[str, str]]:
    names, left_out = [], {}
    for name in (OURS, PEER, VLLM):
        if only and name not in only:
            continue
        if (why := unavailable(name)) is not None:
            left_out[name] = why
            print(f"  {name} left out: {why}", flush=True)
            continue
        names.append(name)
    return names, left_out


class Conversation:
    """A chat that sends back each reply the server gave (a probe: a placeholder reply of
    about the same length, to size the conversation before any server runs)."""

    def __init__(self, system: str, tokens: Tokens):
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
        self.tokens, self.turn = tokens, 0
        self.previous: list[int] = []

    def ask(self, user: str) -> tuple[Request, int]:
        """The next turn's request and the tokens it shares with the turn before's."""
        self.turn += 1
        self.messages.append({"role": "user", "content": user})
        ids = self.tokens.chat(self.messages, None)
        reachable = common_prefix(self.previous, ids)
        self.previous = ids
        return Request(messages=list(self.messages), max_tokens=REPLY_TOKENS), reachable

    def answer(self, text: str = PLACEHOLDER) -> None:
        self.messages.append({"role": "assistant", "content": text})

    def final_tokens(self) -> int:
        return len(self.previous) + REPLY_TOKENS


def _plan(tokens: Tokens, system_n: int, user_n: int, turns: int, seed: int) -> list[str]:
    count = tokens.count
    return [passage(seed + 4000 + 300 * t, user_n, count) for t in range(turns)] + [
        passage(seed, system_n, count)
    ]


async def _converse(
    turns: Turns, conv: Conversation, users: list[str], think: float = 0.0, **tags: Any
) -> None:
    """`think`: seconds the client waits after each reply (a user reading it, a tool
    running): mlx-prefix prefetches the next turn meanwhile (after 0.5 s idle)."""
    async with httpx.AsyncClient() as client:
        for user in users:
            request, reachable = conv.ask(user)
            reply = await turns.send(client, request, turn=conv.turn, reachable=reachable, **tags)
            conv.answer(reply.text)
            await asyncio.sleep(think)


def sweep(args: argparse.Namespace, tokens: Tokens, model_path: Path) -> dict[str, Any]:
    system_n, user_n = SIZES.get(args.model, SIZES["dense"])
    if args.quick:
        system_n, user_n = system_n // 3, user_n // 2
    *users, system = _plan(tokens, system_n, user_n, args.turns, seed=21000)
    probe = Conversation(system, tokens)
    for user in users:
        probe.ask(user)
        probe.answer()
    kv = kv_size(model_path)
    final = probe.final_tokens()
    names, left_out = _servers(args.servers)
    out: dict[str, Any] = {
        "part": "sweep", "model": args.model, "final_tokens": final,
        "kv_bytes": kv.of(final), "kv_per_token": kv.per_token, "kv_fixed": kv.fixed,
        "runs": [], "left_out": left_out, "machine": machine_line(), "think_s": args.think,
    }  # fmt: skip
    log_dir = Path(tempfile.mkdtemp(prefix="bench-budget-"))
    for factor in args.factors:
        budget = int(factor * kv.of(final))
        for name in names:
            server = start(name, model_path, budget, log_dir, f"{name}-{factor}")
            try:
                turns = Turns(server)
                conv = Conversation(system, tokens)
                asyncio.run(_converse(turns, conv, users, think=args.think))
                rows, memory = turns.finish(), ours_memory(server)
            finally:
                server.stop()
            out["runs"].append(
                {"server": name, "factor": factor, "budget": budget, "rows": rows, **memory,
                 "machine": out["machine"]}
            )  # fmt: skip
            _save(args, {**out, "machine_end": machine_line()})  # a run cut short keeps these
            later = " ".join(f"{r['cached_tokens']}/{r['reachable']}" for r in rows[1:])
            print(f"  {factor}x {name}: cached/reachable per later turn {later}", flush=True)
    out["machine_end"] = machine_line()
    return out


def subagents(args: argparse.Namespace, tokens: Tokens, model_path: Path) -> dict[str, Any]:
    scale = 2 if args.model == "hybrid" else 1
    main_n, sub_n, user_n = 800 * scale, 400 * scale, 120 * scale
    if args.quick:
        main_n, sub_n, user_n = main_n // 3, sub_n // 3, user_n // 2
    count = tokens.count
    main_system = "You are the main coding agent. " + passage(31000, main_n, count)
    main_users = [passage(33000 + 200 * t, user_n, count) for t in range(args.main_turns + 1)]
    sub_systems = [
        f"You are subagent {i + 1}: {passage(35000 + 1500 * i, sub_n, count)}" for i in range(5)
    ]
    sub_users = [[passage(43000 + 1500 * i + 200 * t, user_n, count) for t in range(2)]
                 for i in range(5)]  # fmt: skip
    main_probe = Conversation(main_system, tokens)
    for user in main_users[: args.main_turns]:
        main_probe.ask(user)
        main_probe.answer()
    sub_finals = []
    for i in range(5):
        p = Conversation(sub_systems[i], tokens)
        for user in sub_users[i]:
            p.ask(user)
            p.answer()
        sub_finals.append(p.final_tokens())
    kv = kv_size(model_path)
    held = kv.of(main_probe.final_tokens()) + 2 * kv.of(max(sub_finals))
    budget = int(args.subagent_factor * held)
    names, left_out = _servers(args.servers)
    out: dict[str, Any] = {
        "part": "subagents", "model": args.model, "main_tokens": main_probe.final_tokens(),
        "sub_tokens": sub_finals, "held_bytes": held, "budget": budget,
        "factor": args.subagent_factor, "main_turns": args.main_turns, "runs": [],
        "left_out": left_out,
        "machine": machine_line(),
    }  # fmt: skip
    log_dir = Path(tempfile.mkdtemp(prefix="bench-subagents-"))

    async def trace(turns: Turns) -> None:
        main = Conversation(main_system, tokens)
        await _converse(turns, main, main_users[: args.main_turns], agent="main")
        for i in range(5):
            sub = Conversation(sub_systems[i], tokens)
            await _converse(turns, sub, sub_users[i], agent=f"sub{i + 1}")
        await _converse(turns, main, main_users[args.main_turns :], agent="main")

    for name in names:
        server = start(name, model_path, budget, log_dir, f"{name}-subagents")
        try:
            turns = Turns(server)
            asyncio.run(trace(turns))
            rows, memory = turns.finish(), ours_memory(server)
        finally:
            server.stop()
        out["runs"].append({"server": name, "rows": rows, **memory, "machine": out["machine"]})
        _save(args, {**out, "machine_end": machine_line()})
        last = rows[-1]
        print(
            f"  {name}: main's next turn cached {last['cached_tokens']} of "
            f"{last['reachable']} reachable ({last['prompt_tokens']} prompt)",
            flush=True,
        )
    out["machine_end"] = machine_line()
    return out


# -- the tables (benchmarks/results/standalone/budget55.md) --------------------------------


def _frac(cached: int | None, reachable: int) -> str:
    if cached is None:
        return "-"
    return f"{cached / reachable:.2f}" if reachable else "-"


def _when(doc: dict[str, Any]) -> str:
    return runs_when((r["server"], r.get("machine", doc["machine"])) for r in doc["runs"])


def _sweep_lines(doc: dict[str, Any]) -> list[str]:
    doc["runs"].sort(key=lambda r: (r["factor"], ORDER.index(r["server"])))
    turns = max(len(r["rows"]) for r in doc["runs"])
    lines = [
        "",
        f"**{doc['model']}**: {doc['final_tokens']:,} tokens at the end, KV "
        f"{doc['kv_bytes'] / MiB:.1f} MiB ({doc['kv_per_token']:,} B/token"
        + (f" + {doc['kv_fixed'] / MiB:.2f} MiB recurrent state" if doc["kv_fixed"] else "")
        + f"); {_when(doc)}.",
        "",
        "| budget | server | " + " | ".join(f"turn {t}" for t in range(2, turns + 1))
        + " | held / peak / evictions |",
        "|---|---|" + "---:|" * (turns - 1) + "---|",
    ]  # fmt: skip
    for run in doc["runs"]:
        cells = [
            f"{r['cached_tokens'] if r['cached_tokens'] is not None else '-'} / "
            f"{r['reachable']} ({_frac(r['cached_tokens'], r['reachable'])})"
            for r in run["rows"][1:]
        ]
        mem = (
            f"{run['held_bytes'] / MiB:.1f} MiB / {_peak(run)} / {run['evictions']}"
            if run.get("held_bytes") is not None
            else "-"
        )
        lines.append(
            f"| {run['factor']}x ({run['budget'] / MiB:.1f} MiB) | {run['server']} | "
            + " | ".join(cells) + f" | {mem} |"
        )  # fmt: skip
    return lines


def _peak(run: dict[str, Any]) -> str:
    """The most mlx-prefix held at once (stored and running), against its budget."""
    peak = run.get("peak_bytes")
    if peak is None:
        return "-"
    return f"{peak / MiB:.2f} MiB" + (" **over**" if peak > run["budget"] else "")


def _subagent_lines(doc: dict[str, Any]) -> list[str]:
    lines = [
        "",
        f"**{doc['model']}**: main conversation {doc['main_tokens']:,} tokens in "
        f"{doc.get('main_turns', 2)} turns, subagents "
        f"{min(doc['sub_tokens']):,}-{max(doc['sub_tokens']):,}; budget "
        f"{doc['budget'] / MiB:.1f} MiB = {doc['factor']}x the KV of main + 2 subagents "
        f"({doc['held_bytes'] / MiB:.1f} MiB); {_when(doc)}.",
        "",
        "| server | main's next turn: cached / shared with its previous prompt | of its prompt "
        "| subagents' 2nd turn: cached / shared, each | held / evictions |",
        "|---|---:|---:|---|---|",
    ]
    for run in sorted(doc["runs"], key=lambda r: ORDER.index(r["server"])):
        rows = run["rows"]
        main = rows[-1]
        subs = [r for r in rows if r["agent"].startswith("sub") and r["turn"] == 2]
        mem = (
            f"{run['held_bytes'] / MiB:.1f} MiB / {run['evictions']}"
            if run.get("held_bytes") is not None
            else "-"
        )
        lines.append(
            f"| {run['server']} | {main['cached_tokens']} / {main['reachable']} "
            f"(**{_frac(main['cached_tokens'], main['reachable'])}**) | "
            f"{main['cached_tokens']} / {main['prompt_tokens']} | "
            + ", ".join(_frac(r["cached_tokens"], r["reachable"]) for r in subs)
            + f" | {mem} |"
        )
    return lines


def render() -> str:
    docs = {p.stem: json.loads(p.read_text()) for p in sorted(OUT.glob("budget-*.json"))}
    lines = [
        "## A tight budget and the conversations it serves (issue 55 items 3, 4)",
        "",
        "`benchmarks/studies/budget.py`: each server a fresh process per budget, memory only, "
        "greedy, requests one after another, 4-token replies sent back as the next turn's "
        "assistant message. Budget flags: "
        + "; ".join(f"{n} `{budget_flag(n)}`" for n in (OURS, PEER, VLLM))
        + ". mlx-prefix's budget covers stored snapshots and running requests; "
        "mlx_lm.server's only its stored caches; vllm-mlx's only its prefix cache, in whole "
        "MiB. vllm-mlx reports no cached tokens: read from its log's `[cache_fetch]` lines. "
        "*held / evictions*: mlx-prefix's dashboard after the run.",
        "",
        "### Per-turn reuse at 1.1x-2x the conversation's KV",
        "",
        "Each cell: cached tokens / tokens the turn's prompt shares with the turn before's.",
    ]
    for key in ("budget-sweep-dense", "budget-sweep-hybrid"):
        if key in docs:
            lines += _sweep_lines(docs[key])
    lines += [
        "",
        "### Subagents beside a main agent",
        "",
        "A main agent's turns (each table says how many), five subagents (own system "
        "prompts) of two turns each one after another, then the main agent's next turn. "
        "Goal (item 4): >= 0.95 cached.",
    ]
    for key in ("budget-subagents-dense", "budget-subagents-hybrid"):
        if key in docs:
            lines += _subagent_lines(docs[key])
    left = {n: w for d in docs.values() for n, w in d.get("left_out", {}).items()}
    lines += ["", *(f"- {n} left out: {w}." for n, w in left.items())] if left else []
    return "\n".join(lines) + "\n"


def _save(args: argparse.Namespace, doc: dict[str, Any]) -> None:
    """Write `doc`, keeping the other servers' runs the file holds (another invocation's)."""
    path = OUT / f"budget-{doc['part']}-{args.model}.json"
    doc = _merged(json.loads(path.read_text()), doc) if path.is_file() else doc
    path.write_text(json.dumps(doc, indent=1))


def _merged(old: dict[str, Any], doc: dict[str, Any]) -> dict[str, Any]:
    """`doc`, keeping the runs of servers it did not run from the same measure's earlier
    file (a peer run on its own later, e.g. once `make peers` installed it)."""
    ran = {r["server"] for r in doc["runs"]}
    kept = [r for r in old.get("runs", []) if r["server"] not in ran]
    if any(old.get(k) != doc.get(k) for k in ("final_tokens", "main_tokens", "budget")):
        return doc  # another shape: nothing to keep
    left_out = {n: w for n, w in old.get("left_out", {}).items() if n not in ran}
    left_out.update(doc["left_out"])
    for n in ran:
        left_out.pop(n, None)
    return {**doc, "runs": kept + doc["runs"], "left_out": left_out}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="dense", help="dense | hybrid")
    p.add_argument("--part", choices=("sweep", "subagents", "both"), default="both")
    p.add_argument("--turns", type=int, default=5, help="sweep: turns of the conversation")
    p.add_argument("--factors", type=float, nargs="+", default=list(FACTORS))
    p.add_argument("--subagent-factor", type=float, default=1.25)
    p.add_argument(
        "--main-turns", type=int, default=4, help="subagents: the main agent's turns before them"
    )
    p.add_argument("--servers", nargs="+", choices=(OURS, PEER, VLLM), help="default: all")
    p.add_argument("--quick", action="store_true", help="shorter prompts")
    p.add_argument("--think", type=float, default=0.0, help="sweep: seconds between turns")
    p.add_argument("--render", action="store_true", help="only rewrite the table")
    args = p.parse_args(argv)
    if not args.render:
        model = resolve(args.model)
        tokens = Tokens(model.path)
        OUT.mkdir(parents=True, exist_ok=True)
        for part in ("sweep", "subagents") if args.part == "both" else (args.part,):
            _save(args, (sweep if part == "sweep" else subagents)(args, tokens, model.path))
    STANDALONE.write_text(render())
    print(f"wrote {STANDALONE}")


if __name__ == "__main__":
    main()
