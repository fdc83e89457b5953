"""Replicas behind SGLang's router (issue 56): does each session stay where its cache is,
and do the sessions spread? The figures are reuse and spread, not speed.

Three mlx-prefix replicas of a tiny random-weight model (ports apart, this machine) and
twelve chat sessions of five turns, sent at once ("concurrent") and one session after
another ("sequential"), through the router with the documented recipe
(docs/several-macs.md), through `--policy round_robin`, and to one server alone (the
reference: what a single server reuses on the same trace). Per turn after the first:
prompt tokens restored from the cache, as a fraction of the single server's on the same
turn; per replica: the sessions it served (a session counts on each replica that served
one of its turns). `--failover`: a replica is killed after every session's second turn,
the trace goes on (errors counted), then it comes back and new sessions are sent.

The sessions share a long system prompt (as every user of one agent does) unless
`--distinct-heads`; the router's cache-aware tree matches request text, so it cannot
tell such sessions apart at their first turn (docs/several-macs.md says why).

    python -m mlx_prefix.blas_exec python -m benchmarks.studies.router [--failover]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from mlx_prefix.models.testing import make_test_model

from ..server_process import Server, ServerSpec
from ..servers import OURS
from .router_process import SGLANG_ROUTER, Router

SESSIONS, TURNS, REPLICAS = 12, 5, 3
MAX_TOKENS = 12
ROUTING_KEY = "X-SMG-Routing-Key"  # the header the router's `manual` policy routes on
# The recipe (docs/several-macs.md): sticky sessions on a routing key, new keys to the
# replica with the fewest in flight; a replica that failed is retried after 10 s (the
# circuit breaker's default, 60 s, keeps one that came back out of rotation a minute).
RECIPE = (
    "--policy", "manual", "--assignment-mode", "min_group", "--cb-timeout-duration-secs", "10"
)  # fmt: skip
# What a client that sends no header gets: the cache-aware tree, with load balancing
# left to the tree (the default thresholds, 64 requests apart, never trip on a Mac).
CACHE_AWARE = ("--policy", "cache_aware", "--cache-threshold", "0.5")
ROUND_ROBIN = ("--policy", "round_robin")
# name: (router arguments, whether the client sends the routing key). Not here:
# consistent_hashing, which the 0.3.2 launcher refuses (docs/several-macs.md).
CONFIGS = {
    "recipe": (RECIPE, True),
    "cache_aware": (CACHE_AWARE, False),
    "round_robin": (ROUND_ROBIN, False),
}
WORDS = (
    "river stone cloud maple copper lantern harbor meadow pixel quartz saddle timber "
    "violet walnut yonder zephyr anchor bramble cinder dune ember fjord glacier hollow"
).split()


@dataclass
class Turn:
    session: int
    turn: int
    id: str | None
    prompt_tokens: int
    cached_tokens: int
    error: str | None = None
    replica: int | None = None  # which replica served it (from its request records)


@dataclass
class Session:
    index: int
    system: str
    users: list[str]
    key: str  # its routing key
    history: list[dict[str, str]] = field(default_factory=list)  # the conversation so far


def make_sessions(count: int, start: int, shared_head: int, seed: int = 0) -> list[Session]:
    rng = random.Random(seed)
    head = " ".join(rng.choice(WORDS) for _ in range(shared_head))
    out = []
    for i in range(start, start + count):
        own = f"Session {i} works on project {rng.choice(WORDS)}-{i}."
        system = (
            f"{head}\n{own}"
            if shared_head
            else f"{own}\n" + " ".join(rng.choice(WORDS) for _ in range(300))
        )
        users = [
            f"Turn {t}: " + " ".join(rng.choice(WORDS) for _ in range(40)) for t in range(TURNS + 1)
        ]
        out.append(Session(i, system, users, key=f"session-{i}"))
    return out


async def run_session(
    client: httpx.AsyncClient, url: str, s: Session, keyed: bool, turns: range
) -> list[Turn]:
    if turns.start == 0:
        s.history = [{"role": "system", "content": s.system}]
    messages = s.history
    headers = {ROUTING_KEY: s.key} if keyed else {}
    out = []
    for t in turns:
        messages.append({"role": "user", "content": s.users[t]})
        body = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0.0}
        try:
            r = await client.post(url + "/v1/chat/completions", json=body, headers=headers)
            r.raise_for_status()
            data = r.json()
        except httpx.HTTPError as e:
            out.append(Turn(s.index, t, None, 0, 0, error=f"{type(e).__name__}: {e}"[:200]))
            messages.append({"role": "assistant", "content": "(no reply)"})
            continue
        usage = data["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        out.append(Turn(s.index, t, data["id"], usage["prompt_tokens"], cached))
        messages.append({"role": "assistant", "content": data["choices"][0]["message"]["content"]})
    return out


async def run_trace(
    url: str, sessions: list[Session], mode: str, keyed: bool, turns: range
) -> list[Turn]:
    async with httpx.AsyncClient(timeout=600) as client:
        if mode == "concurrent":
            runs = [run_session(client, url, s, keyed, turns) for s in sessions]
            return [t for turns_ in await asyncio.gather(*runs) for t in turns_]
        return [t for s in sessions for t in await run_session(client, url, s, keyed, turns)]


def attribute(replicas: list[Server], turns: list[Turn]) -> None:
    """Each turn's replica: the one whose request records hold its reply's id."""
    where = {}
    for i, server in enumerate(replicas):
        if server.proc is None:
            continue
        r = httpx.get(server.url + "/v1/cache/requests", params={"limit": 500}, timeout=30)
        where.update({rec["id"]: i for rec in r.json()["data"]})
    for t in turns:
        t.replica = where.get(t.id) if t.id else None


def flush(servers: list[Server]) -> None:
    for s in servers:
        if s.proc is not None:
            httpx.delete(s.url + "/v1/cache", timeout=60).raise_for_status()


@dataclass
class Result:
    config: str
    mode: str
    reuse_vs_single: float  # sum of cached tokens over later turns / the single server's
    worst_turn_vs_single: float  # the lowest per-turn ratio (turns where single reused > 0)
    turns_below_95: int  # later turns reusing < 0.95 of the single server's
    later_turns: int
    warm_turns: int  # later turns restoring >= 0.9 of the previous turn's prompt
    single_warm_turns: int  # ... on the single server
    sessions_per_replica: list[int]
    max_session_share: float  # the busiest replica's sessions / all sessions
    errors: int
    run: int = 1  # which of --runs (the router started afresh each time)
    turns: list[dict[str, Any]] = field(default_factory=list)


def score(config: str, mode: str, got: list[Turn], single: list[Turn], n_replicas: int) -> Result:
    ref = {(t.session, t.turn): t.cached_tokens for t in single}
    later = [t for t in got if t.turn > 0 and t.error is None]
    ratios = [t.cached_tokens / ref[(t.session, t.turn)] for t in later if ref[(t.session, t.turn)]]
    total_ref = sum(ref[(t.session, t.turn)] for t in later)
    per_replica = [len({t.session for t in got if t.replica == r}) for r in range(n_replicas)]
    n_sessions = len({t.session for t in got})
    return Result(
        config=config,
        mode=mode,
        reuse_vs_single=sum(t.cached_tokens for t in later) / total_ref if total_ref else 1.0,
        worst_turn_vs_single=min(ratios, default=1.0),
        turns_below_95=sum(r < 0.95 for r in ratios),
        later_turns=len(later),
        warm_turns=warm(got),
        single_warm_turns=warm(single),
        sessions_per_replica=per_replica,
        max_session_share=max(per_replica) / n_sessions if n_sessions else 0.0,
        errors=sum(t.error is not None for t in got),
        turns=[asdict(t) for t in got],
    )


def warm(turns: list[Turn]) -> int:
    """Later turns that restored >= 0.9 of the previous turn's prompt."""
    prompt = {(t.session, t.turn): t.prompt_tokens for t in turns}
    return sum(
        t.cached_tokens >= 0.9 * prompt[(t.session, t.turn - 1)]
        for t in turns
        if t.turn > 0 and t.error is None and (t.session, t.turn - 1) in prompt
    )


def start_replicas(model: Path, n: int, log_dir: Path) -> list[Server]:
    spec = ServerSpec(OURS, model, extra_args=("--no-prefetch",), label="replica")
    servers = [Server(spec, log_dir).launch() for _ in range(n)]
    return [s.wait_ready() for s in servers]


def traced(
    replicas: list[Server], sessions: list[Session], mode: str, keyed: bool, router: Router
) -> list[Turn]:
    got = asyncio.run(run_trace(router.url, sessions, mode, keyed, range(TURNS)))
    attribute(replicas, got)
    return got


def through_router(
    replicas: list[Server], args: tuple[str, ...], log: Path, run: Any
) -> list[Turn]:
    flush(replicas)
    router = Router([s.url for s in replicas], args, log_path=log).start()
    try:
        return run(router)
    finally:
        router.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--modes", default="concurrent,sequential")
    p.add_argument("--shared-head", type=int, default=600, help="words every system prompt shares")
    p.add_argument("--distinct-heads", action="store_true", help="no shared system prompt")
    p.add_argument("--failover", action="store_true", help="kill a replica mid-trace")
    p.add_argument("--configs", default="recipe,cache_aware,round_robin", help=", ".join(CONFIGS))
    p.add_argument("--runs", type=int, default=1, help="traces per config and mode")
    out = Path(__file__).parents[1] / "out"  # benchmarks/out
    p.add_argument("--out", type=Path, default=out / "router.json")
    args = p.parse_args()
    heads = 0 if args.distinct_heads else args.shared_head
    work = Path(tempfile.mkdtemp(prefix="bench-router-"))
    model = make_test_model("dense", work / "tiny")
    replicas = start_replicas(model, REPLICAS, work / "logs")
    results: list[Result] = []
    failed_over = None
    try:
        if args.failover:
            from . import router as bench_router
            from . import router_failover

            log = work / "logs" / "router-failover.log"
            failed_over = router_failover.failover(bench_router, replicas, RECIPE, log)
            print(json.dumps({k: v for k, v in failed_over.items() if k != "turns"}), flush=True)
        for mode in filter(None, args.modes.split(",")):
            sessions = make_sessions(SESSIONS, 0, heads)
            single = replicas[:1]  # after --failover: the replica that came back
            flush(single)
            ref = asyncio.run(run_trace(single[0].url, sessions, mode, False, range(TURNS)))
            runs = [(name, run) for name in args.configs.split(",") for run in range(args.runs)]
            for name, run in runs:
                router_args, keyed = CONFIGS[name]
                log = work / "logs" / f"router-{name}-{mode}-{run + 1}.log"
                got = through_router(
                    replicas, router_args, log, partial(traced, replicas, sessions, mode, keyed)
                )
                results.append(replace(score(name, mode, got, ref, REPLICAS), run=run + 1))
                r = results[-1]
                print(
                    f"{mode:10s} {name:18s} run {r.run} reuse/single {r.reuse_vs_single:.3f} worst "
                    f"{r.worst_turn_vs_single:.2f} below-0.95 {r.turns_below_95}/{r.later_turns}"
                    f" sessions/replica {r.sessions_per_replica} errors {r.errors}",
                    flush=True,
                )
    finally:
        for s in replicas:
            s.stop()
    report = {
        "machine": platform.platform(),
        "sglang_router": SGLANG_ROUTER,
        "sessions": SESSIONS,
        "turns": TURNS,
        "replicas": REPLICAS,
        "shared_head_words": heads,
        "created": int(time.time()),
        "results": [asdict(r) for r in results],
        "failover": failed_over,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"## {report['replicas']} replicas behind sglang-router {report['sglang_router']} "
        "(issue 56)",
        "",
        f"{report['sessions']} sessions x {report['turns']} turns; system prompts share "
        f"{report['shared_head_words']} words. Reuse: cached tokens of turns 2+ / a single "
        "server's on the same trace.",
        "",
        "| mode | router | run | reuse / single | worst turn | turns < 0.95 of single | "
        "turns >= 0.9 of previous prompt (single) | sessions per replica | errors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        lines.append(
            f"| {r['mode']} | {r['config']} | {r.get('run', 1)} | {r['reuse_vs_single']:.3f} | "
            f"{r['worst_turn_vs_single']:.2f} | {r['turns_below_95']}/{r['later_turns']} | "
            f"{r['warm_turns']} ({r['single_warm_turns']}) | "
            f"{'/'.join(map(str, r['sessions_per_replica']))} | {r['errors']} |"
        )
    f = report.get("failover")
    if f:
        lines += [
            "",
            f"Failover (recipe, sessions at once): replica 0 killed during turns 3-5; its "
            f"sessions {f['killed_replica_sessions']} moved to replicas "
            f"{f['moved_sessions_replicas']} with cold turns {f['cold_turns_per_lost_session']}; "
            f"the other {f['other_sessions']} sessions' cold turns: "
            f"{f['cold_turns_other_sessions']}; "
            f"errors {len(f['errors'])}; back on its port, "
            f"it took {f['new_sessions_on_returned_replica']} of {f['new_sessions']} new sessions.",
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
