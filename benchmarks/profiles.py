"""Sizes per profile. `quick` fits in under 10 minutes on a 2-core Linux box (float32 on
the CPU: ~60-200 prefill tok/s); `full` is sized for Apple-silicon Macs."""

from __future__ import annotations

from dataclasses import dataclass, replace

MiB = 1 << 20


@dataclass(frozen=True)
class Profile:
    name: str
    models: tuple[str, ...]  # "dense", "hybrid" or model folders
    workloads: tuple[str, ...]  # run on the first model
    other_model_workloads: tuple[str, ...]  # run on the remaining models
    max_tokens: int  # greedy tokens per reply
    check_last: int | None  # cold-run twins for the last N warm requests (None: all)
    # chat
    chat_turns: int = 5
    chat_system_tokens: int = 200
    chat_user_tokens: int = 60
    # agent
    agent_steps: int = 4
    agent_result_tokens: int = 120
    # shared system prompt
    shared_system_tokens: int = 500
    shared_users: int = 4
    # burst
    burst_size: int = 6
    burst_instruction_tokens: int = 500
    burst_item_tokens: int = 40
    # concurrency (requests/s)
    concurrency_clients: tuple[int, ...] = (1, 4, 8)
    concurrency_requests_per_client: int = 2
    concurrency_system_tokens: int = 200
    # document
    document_tokens: int = 1200
    # restart (disk tier)
    restart_system_tokens: int = 1000
    # memory
    memory_requests: int = 12
    memory_prompt_tokens: int = 150
    memory_cap: int = 32 * MiB  # bytes; both servers take a plain integer
    # restore micro-benchmark
    restore_tokens: tuple[int, ...] = (1024, 8192, 32768)
    restore_repeat: int = 3


ALL_WORKLOADS = (
    "chat",
    "agent",
    "shared_system",
    "burst",
    "concurrency",
    "document",
    "restart",
    "memory",
    "restore",
)

PROFILES = {
    "quick": Profile(
        name="quick",
        models=("dense", "hybrid"),
        workloads=ALL_WORKLOADS,
        other_model_workloads=("chat", "agent", "concurrency", "document", "restart"),
        max_tokens=8,
        check_last=1,
    ),
    "full": Profile(
        name="full",
        models=("dense", "hybrid"),
        workloads=ALL_WORKLOADS,
        other_model_workloads=ALL_WORKLOADS[:-1],
        max_tokens=64,
        check_last=None,
        chat_turns=8,
        chat_system_tokens=600,
        chat_user_tokens=120,
        agent_steps=8,
        agent_result_tokens=400,
        shared_system_tokens=1500,
        shared_users=8,
        burst_instruction_tokens=500,
        burst_item_tokens=120,
        concurrency_requests_per_client=6,
        concurrency_system_tokens=600,
        document_tokens=6000,
        restart_system_tokens=4000,
        memory_requests=200,
        memory_prompt_tokens=400,
        memory_cap=256 * MiB,
        restore_repeat=20,
    ),
    # For the smoke test: a tiny model and the smallest sizes that still exercise reuse.
    "smoke": Profile(
        name="smoke",
        models=("dense",),
        workloads=("chat", "burst", "concurrency", "document", "memory", "restore"),
        other_model_workloads=(),
        max_tokens=3,
        check_last=1,
        chat_turns=3,
        chat_system_tokens=60,
        chat_user_tokens=20,
        agent_steps=2,
        agent_result_tokens=30,
        shared_system_tokens=60,
        shared_users=2,
        burst_size=3,
        burst_instruction_tokens=60,
        burst_item_tokens=10,
        concurrency_clients=(1, 2),
        concurrency_requests_per_client=1,
        concurrency_system_tokens=30,
        document_tokens=150,
        restart_system_tokens=80,
        memory_requests=3,
        memory_prompt_tokens=30,
        memory_cap=4 * MiB,
        restore_tokens=(256,),
        restore_repeat=1,
    ),
}


def get(name: str, **overrides: object) -> Profile:
    return replace(PROFILES[name], **{k: v for k, v in overrides.items() if v is not None})
