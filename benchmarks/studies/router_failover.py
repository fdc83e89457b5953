"""A replica lost behind the router (issue 56 item 3), for benchmarks/studies/router.py.

Twelve sessions at once through the recipe: two turns; then the next three turns, with
one replica killed (SIGKILL: a Mac gone, not a clean stop) while they run; then the
replica back on its port and six new sessions. Counted: errors a client saw, the killed
replica's sessions' cold turns (a turn restoring < 0.9 of its previous prompt) beside the
other sessions', and the new sessions the returning replica takes.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading
from pathlib import Path
from typing import Any

from ..server_process import Server
from .router_process import Router

COLD = 0.9  # a turn restoring less than this share of its previous prompt is cold
KILL_AFTER_S = 1.0  # into the third turn's requests
CIRCUIT_S = 12.0  # the recipe's circuit-breaker timeout (10 s) and a margin


def relaunch(old: Server) -> Server:
    """`old`'s server again on its port (the router knows the worker by its URL)."""
    new = Server(old.spec, old.log_dir)
    new.port = old.port
    new._log = open(old.log_dir / f"replica-{old.port}-back.log", "wb")  # noqa: SIM115
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    new.proc = subprocess.Popen(
        old.spec.argv(old.port), stdout=new._log, stderr=subprocess.STDOUT, env=env
    )
    return new.wait_ready()


def failover(bench: Any, replicas: list[Server], router_args: tuple[str, ...], log: Path) -> dict:
    """`bench`: the bench_router module (its trace, attribution and constants)."""
    sessions = bench.make_sessions(bench.SESSIONS, 0, 600)
    newcomers = bench.make_sessions(6, 100, 600, seed=1)
    bench.flush(replicas)
    router = Router([s.url for s in replicas], router_args, log_path=log).start()
    try:
        first = asyncio.run(bench.run_trace(router.url, sessions, "concurrent", True, range(2)))
        bench.attribute(replicas, first)
        victim = 0
        lost = sorted({t.session for t in first if t.replica == victim})
        # The later turns resend the whole conversation: rebuild it from the first two.
        rest: list = []
        runner = threading.Thread(
            target=lambda: rest.extend(
                asyncio.run(
                    bench.run_trace(router.url, sessions, "concurrent", True, range(2, bench.TURNS))
                )
            )
        )
        runner.start()
        threading.Event().wait(KILL_AFTER_S)
        dead = replicas[victim]
        assert dead.proc is not None
        dead.proc.kill()
        dead.proc.wait()
        runner.join()
        dead.proc = None
        bench.attribute(replicas, rest)
        replicas[victim] = relaunch(dead)
        router.wait_workers(len(replicas))
        threading.Event().wait(CIRCUIT_S)
        late = asyncio.run(bench.run_trace(router.url, newcomers, "concurrent", True, range(2)))
        # One more turn of the first sessions: where do the moved ones go now?
        after = asyncio.run(
            bench.run_trace(
                router.url, sessions, "concurrent", True, range(bench.TURNS, bench.TURNS + 1)
            )
        )
        bench.attribute(replicas, late + after)
    finally:
        router.stop()
    turns = first + rest
    prompt = {(t.session, t.turn): t.prompt_tokens for t in turns}
    cold = [
        (t.session, t.turn)
        for t in rest
        if t.error is None and t.cached_tokens < COLD * prompt.get((t.session, t.turn - 1), 0)
    ]
    return {
        "killed_replica_sessions": lost,
        "errors": [(t.session, t.turn, t.error) for t in rest if t.error],
        "cold_turns": cold,
        "cold_turns_per_lost_session": {s: sum(1 for c in cold if c[0] == s) for s in lost},
        "cold_turns_other_sessions": sum(1 for c in cold if c[0] not in lost),
        "other_sessions": bench.SESSIONS - len(lost),
        "moved_sessions_replicas": {
            s: sorted({t.replica for t in rest if t.session == s and t.replica is not None})
            for s in lost
        },
        "new_sessions_on_returned_replica": len({t.session for t in late if t.replica == victim}),
        "new_sessions": len(newcomers),
        "moved_sessions_after_return": {
            s: [(t.replica, t.cached_tokens, t.prompt_tokens) for t in after if t.session == s]
            for s in lost
        },
        "turns": [bench.asdict(t) for t in turns + late + after],
    }
