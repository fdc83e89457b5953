"""What each profile runs: per model, its workloads and their sizes.

`quick` was sized for under 10 minutes on a 2-core Linux box (float32 on the CPU: ~150
prefill tok/s on the dense model, ~3x that on the hybrid one; about 8.3 minutes in all
when the box is otherwise idle, see HISTORY.md's run-time table) before issues 14 and
15's workloads; those (the edit sweep, the mixed traffic on three servers, the burst
with unique snippets, 16 clients, the restart after one request) add an estimated 10
minutes, not yet measured; the chat and burst on 2 ranks (issue 16, both servers under
mlx.launch) add a few more. It spends its time where the issues' sizes matter: the
4K-token documents on the faster hybrid model (2K on the dense one), the 2K-token
restart and the 200 memory requests on both (short requests, 1-token replies), one
cold-run twin per workload, one request per client for requests/s.
`full` uses the issue's sizes (or more) everywhere and is sized for Apple-silicon Macs.
RESULTS.md prints the sizes of the run and of the other profile, generated from these.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

MiB = 1 << 20

MODEL_WORKLOADS = (
    "chat",
    "agent",
    "shared_system",
    "burst",
    "concurrency",
    "document",
    "edits",
    "restart",
    "memory",
    "mixed",
    "messages_agent",
    "messages_agent_cch",
    "throughput",
)
# What the sharded models (issue 16: both servers on 2 ranks) run; others run on 1 rank.
SHARDED_WORKLOADS = ("chat", "burst")
ONCE_WORKLOADS = ("restore", "blas")  # in-process, once per run, with the first model's plan
ALL_WORKLOADS = MODEL_WORKLOADS + ONCE_WORKLOADS


@dataclass(frozen=True)
class Sizes:
    """Workload sizes for one model. Token counts are of the text a workload pastes in
    (the chat template adds a few)."""

    max_tokens: int = 8  # greedy tokens per reply
    check_last: int | None = 1  # cold-run twins for the last N warm requests (None: all)
    chat_turns: int = 5
    chat_system_tokens: int = 200
    chat_user_tokens: int = 60
    chat_pause_s: float = 1.5  # the user reads a reply before sending the next message
    agent_steps: int = 4
    agent_result_tokens: int = 120
    shared_system_tokens: int = 500
    shared_users: int = 4
    burst_size: int = 6
    burst_instruction_tokens: int = 500
    burst_item_tokens: int = 40
    burst_unique_tokens: int = 150  # the third burst: each request adds this many tokens
    concurrency_clients: tuple[int, ...] = (1, 4, 8, 16)
    concurrency_requests_per_client: int = 1
    concurrency_system_tokens: int = 200
    document_tokens: int = 1200
    edit_doc_tokens: tuple[int, ...] = (1024, 4096)
    edit_positions: tuple[float, ...] = (0.1, 0.5, 0.7, 0.95)  # of the document's text
    restart_system_tokens: int = 2000
    restart_once_system_tokens: int = 1000  # the system prompt seen once before the restart
    memory_requests: int = 200
    memory_prompt_tokens: int = 8
    memory_max_tokens: int = 1
    memory_cap: int = 32 * MiB  # bytes; both servers take a plain integer
    mixed_docs: int = 2
    mixed_doc_tokens: int = 800
    mixed_doc_questions: int = 3
    mixed_chats: int = 2
    mixed_chat_turns: int = 3
    mixed_agent_steps: int = 3
    mixed_oneshots: int = 6
    mixed_oneshot_tokens: int = 60
    # Bytes, every server, sized from the model's bytes per cached token: about half of
    # what the workload's prefills would store, plus its largest running prefill (the
    # budget counts it), so some prefixes must go and the eviction order decides which.
    # Dense (45 KiB of KV a token): ~11K prompt tokens, each request's end a whole KV
    # copy, ~485 MiB kept; half of it + an 830-token document's 37 MiB ~ 288 MiB. Too
    # little (128 MiB) and both orders keep nothing; too much and both keep everything.
    mixed_budget: int = 288 * MiB
    restore_tokens: tuple[int, ...] = (1024, 8192, 32768)
    restore_repeat: int = 3
    blas_tokens: int = 64  # prompt tokens for the prefill speed with and without fast BLAS
    messages_turns: int = 8  # tool turns after the task (issue 13 asks 8)
    messages_system_tokens: int = 1500  # issue 13 asks ~20K (full)
    messages_result_tokens: int = 120
    # Issue 33's throughput workload (workloads/throughput.py).
    throughput_clients: tuple[int, ...] = (4, 8, 16)
    throughput_requests_per_client: int = 1
    throughput_prompt_tokens: int = 200  # the shared system prompt, or each request's own text
    throughput_max_tokens: int = 16  # reply length for the requests/s and the burst
    throughput_burst_size: int = 6
    throughput_burst_instruction_tokens: int = 500
    throughput_burst_item_tokens: int = 40
    throughput_decode_tokens: int = 64  # single-stream decode, against mlx_lm.generate


@dataclass(frozen=True)
class ModelPlan:
    model: str  # "dense" | "hybrid" (see models.py)
    workloads: tuple[str, ...]
    sizes: Sizes


@dataclass(frozen=True)
class Profile:
    name: str
    plans: tuple[ModelPlan, ...]  # in run order

    @property
    def models(self) -> tuple[str, ...]:
        return tuple(p.model for p in self.plans)

    def plan_for(self, key: str, index: int) -> ModelPlan:
        """The plan for the `index`-th model of a run: the plan named `key`, else the one
        at that position (the last one past the end), for `--model FOLDER`."""
        for plan in self.plans:
            if plan.model == key:
                return plan
        return self.plans[min(index, len(self.plans) - 1)]


_QUICK_DENSE = Sizes(document_tokens=2048, edit_doc_tokens=(1024, 2048))
# The hybrid model's KV is 2 KiB a token, each checkpoint's recurrent state 840 KiB: its
# mixed traffic keeps ~96 MiB (shared KV, ~100 checkpoints); half + a running prefill.
_QUICK_HYBRID = replace(
    _QUICK_DENSE, document_tokens=4096, edit_doc_tokens=(1024, 4096), mixed_budget=56 * MiB
)
_FULL = Sizes(
    max_tokens=64,
    check_last=None,
    chat_turns=8,
    chat_system_tokens=600,
    chat_user_tokens=120,
    agent_steps=8,
    agent_result_tokens=400,
    shared_system_tokens=1500,
    shared_users=8,
    burst_item_tokens=120,
    concurrency_requests_per_client=6,
    concurrency_system_tokens=600,
    document_tokens=6000,
    edit_doc_tokens=(1024, 4096, 16384),
    restart_system_tokens=2000,
    memory_requests=200,
    memory_prompt_tokens=400,
    memory_max_tokens=16,
    memory_cap=256 * MiB,
    mixed_docs=3,
    mixed_doc_tokens=4000,
    mixed_doc_questions=4,
    mixed_chats=3,
    mixed_chat_turns=6,
    mixed_agent_steps=6,
    mixed_oneshots=16,
    mixed_oneshot_tokens=200,
    mixed_budget=512 * MiB,
    restore_repeat=20,
    blas_tokens=512,
    messages_system_tokens=20000,
    messages_result_tokens=400,
    throughput_requests_per_client=4,
    throughput_prompt_tokens=600,
    throughput_max_tokens=64,
    throughput_burst_item_tokens=120,
    throughput_decode_tokens=256,
)

PROFILES = {
    "quick": Profile(
        "quick",
        (
            ModelPlan("dense", ALL_WORKLOADS, _QUICK_DENSE),
            ModelPlan("hybrid", MODEL_WORKLOADS, _QUICK_HYBRID),
            ModelPlan("sharded-dense", SHARDED_WORKLOADS, _QUICK_DENSE),
            ModelPlan("sharded-hybrid", SHARDED_WORKLOADS, _QUICK_HYBRID),
        ),
    ),
    "full": Profile(
        "full",
        (
            ModelPlan("dense", ALL_WORKLOADS, _FULL),
            ModelPlan("hybrid", MODEL_WORKLOADS, replace(_FULL, mixed_budget=64 * MiB)),
            ModelPlan("sharded-dense", SHARDED_WORKLOADS, _FULL),
            ModelPlan("sharded-hybrid", SHARDED_WORKLOADS, _FULL),
        ),
    ),
    # For the smoke test: a tiny model and the smallest sizes that still exercise reuse.
    "smoke": Profile(
        "smoke",
        (
            ModelPlan(
                "dense",
                (
                    "chat",
                    "burst",
                    "concurrency",
                    "document",
                    "edits",
                    "memory",
                    "mixed",
                    "restore",
                    "throughput",
                ),  # fmt: skip
                Sizes(
                    max_tokens=3,
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
                    burst_unique_tokens=20,
                    concurrency_clients=(1, 2),
                    concurrency_requests_per_client=1,
                    concurrency_system_tokens=30,
                    document_tokens=150,
                    edit_doc_tokens=(400,),  # past the 256-token reuse grid
                    restart_system_tokens=80,
                    restart_once_system_tokens=60,
                    memory_requests=3,
                    memory_prompt_tokens=10,
                    memory_cap=4 * MiB,
                    mixed_docs=1,
                    mixed_doc_tokens=100,
                    mixed_doc_questions=2,
                    mixed_chats=1,
                    mixed_chat_turns=2,
                    mixed_agent_steps=2,
                    mixed_oneshots=2,
                    mixed_oneshot_tokens=10,
                    # The tiny model: 128 KiB per 256 tokens of KV. Below what the trace's
                    # entries take now that a running request is counted once (issue 55):
                    # the budget must bite (evict, or hand an entry over).
                    mixed_budget=MiB // 4,
                    restore_tokens=(256,),
                    restore_repeat=1,
                    blas_tokens=16,
                    throughput_clients=(4, 8, 16),
                    throughput_prompt_tokens=30,
                    throughput_max_tokens=4,
                    throughput_burst_size=3,
                    throughput_burst_instruction_tokens=60,
                    throughput_burst_item_tokens=10,
                    throughput_decode_tokens=16,
                ),
            ),
        ),
    ),
}


def get(name: str, max_tokens: int | None = None) -> Profile:
    """A profile, with every plan's reply length overridden when `max_tokens` is given
    (the throughput workload's too; its single-stream decode keeps its length)."""
    prof = PROFILES[name]
    if max_tokens is None:
        return prof
    plans = tuple(
        replace(p, sizes=replace(p.sizes, max_tokens=max_tokens, throughput_max_tokens=max_tokens))
        for p in prof.plans
    )
    return replace(prof, plans=plans)
