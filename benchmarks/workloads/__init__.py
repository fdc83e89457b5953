"""One module per workload; see benchmarks/harness.py for the interface."""

from __future__ import annotations

from types import ModuleType

from ..profiles import ALL_WORKLOADS
from . import (
    agent,
    blas,
    burst,
    chat,
    concurrency,
    document,
    edits,
    memory,
    messages_agent,
    messages_agent_cch,
    mixed,
    restart,
    restore,
    shared_system,
    throughput,
)

_MODULES = (
    chat,
    agent,
    shared_system,
    burst,
    concurrency,
    document,
    edits,
    restart,
    memory,
    mixed,
    messages_agent,
    messages_agent_cch,
    throughput,
)
WORKLOADS: dict[str, ModuleType] = {m.NAME: m for m in (*_MODULES, restore, blas)}
assert tuple(WORKLOADS) == ALL_WORKLOADS
