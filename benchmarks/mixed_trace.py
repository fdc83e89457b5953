"""Record the mixed workload's request sequence for the cache simulation
(tests/support/trace_sim.py).

`python -m benchmarks.mixed_trace RUN.json --model dense|hybrid OUT.json` rebuilds the
prompts one run of `--workloads mixed` sent (its replies come from RUN.json: a chat's
next turn holds them), renders and plans them as mlx-prefix does (tokens, chunk grid,
checkpoints, the next-turn prefetch it would queue), and writes their shape: only
how the sequences share prefixes matters to the cache, so each is written as the
longest prefix it shares with an earlier one plus a count of new tokens. It records
the tokens each mlx-prefix server of that run reported cached, per request, for the
simulation to check itself against.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from .models import Tokens, common_prefix, dense_model, hybrid_model
from .profiles import PROFILES
from .workloads.mixed import OURS_KIND, _actors, schedule


def record(run: dict[str, Any], model: str) -> dict[str, Any]:
    from mlx_prefix.config import CacheConfig
    from mlx_prefix.engine.requests.chat_traffic import ChatTraffic
    from mlx_prefix.engine.requests.prefetch import next_turn_prompt, wants_prefetch
    from mlx_prefix.models.load import load_model
    from mlx_prefix.prompt.request.plan import PromptPlanner
    from mlx_prefix.records import PromptInput
    from mlx_prefix.server.protocol.messages import conversation_from_dicts

    path = (dense_model() if model == "dense" else hybrid_model()).path
    loaded = load_model(path)
    planner = PromptPlanner(loaded.tokenizer, CacheConfig(), loaded.template_args)
    sizes = PROFILES[run["profile"]].plan_for(model, 0).sizes
    (workload,) = [w for w in run["workloads"] if w["workload"] == "mixed" and w["model"] == model]
    servers = workload["servers"]
    ours, kind = servers["mlx-prefix"]["samples"], servers[OURS_KIND]["samples"]
    actors, shots = _actors(SimpleNamespace(sizes=sizes, tokens=Tokens(path)))
    traffic, seqs, requests = ChatTraffic(), [], []

    def add(prompt) -> int:
        seqs.append(prompt)
        return len(seqs) - 1

    for (actor, step), sample, other in zip(schedule(actors, shots), ours, kind, strict=True):
        request = actor.build(step)
        source = PromptInput(
            messages=conversation_from_dicts(request.messages), tools=request.tools
        )
        prompt = planner.plan(source)
        assert len(prompt.tokens) == sample["prompt_tokens"], sample["label"]
        reply = sample["text"]
        nxt = None
        if traffic.finished(source, reply) or wants_prefetch(source):
            nxt = next_turn_prompt(planner, source, reply, len(prompt.tokens))
        requests.append(
            {
                "label": sample["label"],
                "prompt": add(prompt),
                "prefetch": add(nxt) if nxt is not None else None,
                "cached": {"value": sample["cached_tokens"], "kind": other["cached_tokens"]},
            }
        )
        actor.reply(SimpleNamespace(text=reply))
    return {
        "model": model,
        "profile": run["profile"],
        "budget_bytes": sizes.mixed_budget,
        "sequences": _shapes(seqs, planner.grid),
        "requests": requests,
    }


def _shapes(prompts: list, grid) -> list[dict[str, Any]]:
    out = []
    for i, p in enumerate(prompts):
        best = (-1, 0)  # (earlier sequence, tokens shared)
        for j in range(i):
            shared = common_prefix(p.tokens, prompts[j].tokens)
            if shared > best[1]:
                best = (j, shared)
        # Sharing is by prefix only: an earlier sequence shares with this one exactly
        # min(what it shares with `best`, best's share), as the rebuilt ids will.
        out.append(
            {
                "prefix": list(best),
                "new": len(p.tokens) - best[1],
                "grid": grid.points(p.tokens),
                "checkpoints": [[c.position, int(c.kind)] for c in p.checkpoints],
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="a benchmark run's JSON (--workloads mixed)")
    ap.add_argument("--model", choices=("dense", "hybrid"), required=True)
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    trace = record(json.loads(args.run.read_text()), args.model)
    args.out.write_text(json.dumps(trace, separators=(",", ":")) + "\n")
    print(f"{args.out}: {len(trace['requests'])} requests, {len(trace['sequences'])} sequences")


if __name__ == "__main__":
    main()
