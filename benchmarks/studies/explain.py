"""What explaining every request costs (issue 46): the same requests against two servers,
one with the request explainer (the default) and one started with --no-explain, on a
model whose arithmetic is nearly free (the tests' tiny dense model: 2 layers, 64 wide),
so that host time dominates and any bookkeeping would show.

Two workloads, 1-token replies, one request at a time:
  hit:  the same ~600-token conversation with a new last question each time (the
        explainer compares it with the namespace's history, finds the closest, decodes
        the texts around where it left it);
  miss: the same conversation with one word changed at a random place in its system
        prompt (an edit: the closest, the location, the texts, the log line).
The servers take turns in blocks, so a drift of the machine's load falls on both. The
engine's own part (a trace record filled at admission) runs in both servers; its cost
is measured apart, in-process.

    python -m mlx_prefix.blas_exec python -m benchmarks.studies.explain [--requests 300]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import tempfile
import time
import timeit
from pathlib import Path

import httpx

from ..servers import OURS, ServerSpec, new_server

WORDS = "the atlases maps globes charts folios reading room floor cabinet shelf".split()
BLOCK = 25  # requests to one server before the other's turn


def system_prompt(rng: random.Random, edit: bool) -> str:
    words = [WORDS[i % len(WORDS)] for i in range(400)]
    if edit:
        words[rng.randrange(50, 350)] = "zebra"
    return "You are the help desk of a public library. " + " ".join(words)


def body(rng: random.Random, kind: str, i: int) -> dict:
    return {
        "model": "default",
        "max_tokens": 1,
        "messages": [
            {"role": "system", "content": system_prompt(rng, kind == "miss")},
            {"role": "user", "content": f"Question number {i}: where are the atlases?"},
        ],
    }


def timed(client: httpx.Client, url: str, payload: dict) -> tuple[float, int]:
    started = time.perf_counter()
    r = client.post(f"{url}/v1/chat/completions", json=payload)
    r.raise_for_status()
    usage = r.json()["usage"]
    return time.perf_counter() - started, usage["prompt_tokens_details"]["cached_tokens"]


def explainer_cost(folder: Path, requests: int) -> dict[str, float]:
    """Microseconds the explainer's thread spends per request (comparing, deciding,
    decoding the texts), off the request's path but on the same interpreter: the traces
    of real requests (an in-process engine) replayed into a fresh Explainer, per workload."""
    from mlx_prefix.config import CacheConfig, EngineConfig
    from mlx_prefix.engine.engine import Engine
    from mlx_prefix.explain.explainer import Explainer, _Job
    from mlx_prefix.models.load import load_model
    from mlx_prefix.records import PromptInput, SamplingParams
    from mlx_prefix.server.protocol.messages import conversation_from_dicts

    engine = Engine(load_model(str(folder)), CacheConfig(), EngineConfig(prefetch_next_turn=False))
    out = {}
    try:
        for kind in ("hit", "miss"):
            rng, traces = random.Random(7), []
            for i in range(requests):
                messages = conversation_from_dicts(body(rng, kind, i)["messages"])
                handle = engine.submit(PromptInput(messages=messages), SamplingParams(max_tokens=1))
                for _ in handle.events():
                    pass
                traces.append(handle.trace)
            explainer = Explainer()
            jobs = [_Job(t, f"r{i}", "chat", "", 0) for i, t in enumerate(traces)]
            explainer._explain(jobs[0])  # the template's opening, found once
            started = time.perf_counter()
            for job in jobs[1:]:
                explainer._add(explainer._explain(job))
            out[kind] = (time.perf_counter() - started) / (len(jobs) - 1) * 1e6
    finally:
        engine.shutdown()
    return out


def trace_cost() -> float:
    """Seconds per request of the engine's part: the trace made at submit and filled at
    admission (CacheTrace.of in Engine.submit, prefill/start.py), with a real conversation."""
    from mlx_prefix.cache.eviction.log import EvictionLog
    from mlx_prefix.cache.token_ids import TokenIds
    from mlx_prefix.explain.trace import CacheTrace, ExplainContext
    from mlx_prefix.prompt.request.grid import ChunkGrid
    from mlx_prefix.records import CachePreference, PromptInput
    from mlx_prefix.server.protocol.messages import conversation_from_dicts

    ctx = ExplainContext("m", "id", "key", None, ChunkGrid(256), EvictionLog())
    prompt = PromptInput(messages=conversation_from_dicts([{"role": "user", "content": "hi"}]))
    tokens = TokenIds(range(600))

    def one() -> None:
        t = CacheTrace.of(ctx, tokens, prompt, CachePreference(), "k/ns", True)
        t.source, t.cached, t.stored_match = "memory", 512, 590
        t.admitted = True
        t.reply = []

    n = 20000
    return timeit.timeit(one, number=n) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=300, help="per server and workload")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/history/explain.json"))
    args = parser.parse_args()

    from mlx_prefix.models.testing import make_test_model

    folder = make_test_model("dense", Path(tempfile.mkdtemp(prefix="bench-explain-")) / "tiny")
    logs = Path(tempfile.mkdtemp(prefix="bench-explain-logs-"))
    specs = {
        "explain": ServerSpec(OURS, folder, ("--no-prefetch",), "explain"),
        "off": ServerSpec(OURS, folder, ("--no-prefetch", "--no-explain"), "off"),
    }
    servers = {name: new_server(spec, logs).launch() for name, spec in specs.items()}
    results: dict[str, dict[str, list[float]]] = {}
    try:
        for s in servers.values():
            s.wait_ready()
        with httpx.Client(timeout=120) as client:
            for kind in ("hit", "miss"):
                times: dict[str, list[float]] = {name: [] for name in servers}
                rngs = {name: random.Random(7) for name in servers}  # the same edits
                for name, s in servers.items():  # each its first (cold) request
                    timed(client, s.url, body(rngs[name], "hit", -1))
                for start in range(0, args.requests, BLOCK):
                    order = list(servers) if (start // BLOCK) % 2 == 0 else list(servers)[::-1]
                    for name in order:
                        for i in range(start, min(start + BLOCK, args.requests)):
                            seconds, cached = timed(
                                client, servers[name].url, body(rngs[name], kind, i)
                            )
                            assert cached > 0
                            times[name].append(seconds)
                results[kind] = times
        check = httpx.get(f"{servers['explain'].url}/v1/cache/requests", params={"limit": 500})
        reasons: dict[str, int] = {}
        for record in check.json()["data"]:
            reasons[record["reason"]] = reasons.get(record["reason"], 0) + 1
    finally:
        for s in servers.values():
            s.stop()
    summary = {
        "machine": f"{platform.machine()}, {platform.processor() or platform.system()}",
        "model": "tiny dense test model (2 layers, 64 wide, random weights), float32",
        "requests_per_server_and_workload": args.requests,
        "reasons_seen": reasons,
        "trace_us_per_request": trace_cost() * 1e6,
        "explainer_us_per_request": explainer_cost(folder, min(args.requests, 100)),
    }
    for kind, times in results.items():
        on, off = statistics.median(times["explain"]), statistics.median(times["off"])
        summary[kind] = {
            "median_ms_explain": on * 1000,
            "median_ms_off": off * 1000,
            "difference_ms": (on - off) * 1000,
            "difference_pct": 100 * (on - off) / off,
            "p90_ms_explain": statistics.quantiles(times["explain"], n=10)[-1] * 1000,
            "p90_ms_off": statistics.quantiles(times["off"], n=10)[-1] * 1000,
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
