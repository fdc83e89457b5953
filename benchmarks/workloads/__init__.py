"""One module per workload; see benchmarks/harness.py for the interface."""

from __future__ import annotations

from types import ModuleType

from . import (
    agent,
    burst,
    chat,
    concurrency,
    document,
    memory,
    restart,
    restore,
    shared_system,
)

WORKLOADS: dict[str, ModuleType] = {
    m.NAME: m
    for m in (chat, agent, shared_system, burst, concurrency, document, restart, memory, restore)
}
