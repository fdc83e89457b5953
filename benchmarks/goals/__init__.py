"""The benchmarks' goals, computed from a run's JSON document and shown first in
RESULTS.md: one row per workload, model and measure, each against mlx_lm.server or the
faster peer in the same run (names.py), with its target and whether it was met.

- reuse.py: what the cache reuses (restore, chat, agent, restart, messages_agent, edits,
  mixed);
- speed.py: burst and concurrency against mlx_lm.server;
- throughput.py: the throughput workload against the faster of mlx_lm.server and
  vllm-mlx;
- sharded.py: chat and burst with both servers on 2 ranks (information only);
- common.py: the Goal record and how a goal reads a run.

The goals of the models served on one rank hold for each of them (dense and hybrid).
"""

from __future__ import annotations

from typing import Any

from ..profiles import ALL_WORKLOADS
from . import reuse, sharded, speed, throughput
from .common import Goal

__all__ = ["Goal", "evaluate"]


def evaluate(doc: dict[str, Any]) -> list[Goal]:
    """Every goal's rows, grouped by workload in the profiles' order."""
    rows = [
        *reuse.evaluate(doc),
        *speed.evaluate(doc),
        *throughput.evaluate(doc),
        *sharded.evaluate(doc),
    ]
    order = {name: i for i, name in enumerate(ALL_WORKLOADS)}
    return sorted(rows, key=lambda g: order.get(g.workload, len(order)))
