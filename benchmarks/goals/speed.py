"""The goals of the workloads that measure speed against mlx_lm.server in the same run,
keyed by workload:

- burst: a cold burst of 6 requests sharing a ~500-token instruction in at most 0.4x
  mlx_lm.server's wall time; the cold burst whose requests each add ~150 unique tokens in
  at most 0.4x; the warm burst in at most 0.8x; the p99 inter-token latency during the
  bursts no worse;
- concurrency: requests/s at 4, 8 and 16 clients at least 1.3x.

The throughput workload's goals (against the faster of mlx_lm.server and vllm-mlx) are
in throughput.py.
"""

from __future__ import annotations

from typing import Any

from ..names import OURS, PEER
from .common import Goal, burst_wall, missing, ratio, runs, skipped

RPS_CLIENTS = (4, 8, 16)


def evaluate(doc: dict[str, Any]) -> list[Goal]:
    return [
        *burst_wall(doc, "cold", "cold burst wall time, mlx-prefix / mlx_lm.server", 0.4),
        *burst_wall(doc, "unique", "cold burst, ~150 unique tokens each, wall / mlx_lm", 0.4),
        *burst_wall(doc, "warm", "warm burst wall time, mlx-prefix / mlx_lm.server", 0.8),
        *_rps(doc),
        *_itl(doc),
    ]


def _rps(doc: dict[str, Any]) -> list[Goal]:
    target = ">= 1.30x"
    out = []
    for w in runs(doc, "concurrency"):
        ours = w["servers"].get(OURS, {}).get("extra", {})
        peer = w["servers"].get(PEER, {}).get("extra", {})
        for n in RPS_CLIENTS:
            what = f"requests/s at {n} clients, mlx-prefix / mlx_lm.server"
            if w["skipped"]:
                out.append(skipped(what, w, target))
                continue
            a, b = ours.get(f"rps_{n}"), peer.get(f"rps_{n}")
            r = ratio(a, b)
            if r is None:
                out.append(
                    Goal(w["workload"], what, w["model"], None, "not measured", target, None)
                )
                continue
            shown = f"{r:.2f}x ({a:.2f} / {b:.2f} req/s)"
            key = f"completion_tokens_{n}"
            if ours.get(key) != peer.get(key):
                shown += f"; not comparable: completion tokens {ours.get(key)} vs {peer.get(key)}"
                out.append(Goal(w["workload"], what, w["model"], r, shown, target, None))
                continue
            out.append(Goal(w["workload"], what, w["model"], r, shown, target, r >= 1.3))
    return out or [missing("concurrency", f"requests/s at {RPS_CLIENTS} clients", target)]


def _itl(doc: dict[str, Any]) -> list[Goal]:
    what = "p99 inter-token latency during the bursts, mlx-prefix / mlx_lm.server"
    target = "<= 1.00x"
    out = []
    for w in runs(doc, "burst"):
        if w["skipped"]:
            out.append(skipped(what, w, target))
            continue
        ours = w["servers"].get(OURS, {}).get("extra", {}).get("itl", {}).get("all", {})
        peer = w["servers"].get(PEER, {}).get("extra", {}).get("itl", {}).get("all", {})
        a, b = ours.get("p99_ms"), peer.get("p99_ms")
        r = ratio(a, b)
        if r is None:
            out.append(Goal(w["workload"], what, w["model"], None, "not measured", target, None))
            continue
        shown = (
            f"{r:.2f}x ({a:.0f} ms / {b:.0f} ms; p50 {ours['p50_ms']:.0f} / "
            f"{peer['p50_ms']:.0f} ms; {ours['gaps']} / {peer['gaps']} gaps)"
        )
        out.append(Goal(w["workload"], what, w["model"], r, shown, target, r <= 1.0))
    return out or [missing("burst", what, target)]
