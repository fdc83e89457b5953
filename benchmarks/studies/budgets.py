"""One byte budget on every server, and what a conversation's KV is (issue 55's budget
sweep and subagent trace).

Each server's own budget flag: mlx-prefix `--cache-budget BYTES` (stored snapshots plus
running requests), mlx_lm.server `--prompt-cache-bytes BYTES` (stored caches only; its
`--prompt-cache-size` entry cap stays at its default), vllm-mlx `--cache-memory-mb MB`
(whole MiB: a budget is rounded to the nearest, at least 1). A conversation's KV is what
one prefill of its tokens leaves: attention keys and values per token times its tokens,
plus the fixed recurrent state of a hybrid model's linear layers (measured by one
token's forward through mlx-lm's own model, in a child process so its weights leave
with it). vllm-mlx reports no cached tokens: its log's `[cache_fetch]` lines say them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from ..client import Reply, Request, send
from ..names import OURS, PEER, VLLM
from ..server_process import Server, ServerSpec
from .shared_prefix_memory.sessions import vllm_cached_from

MiB = 1 << 20


@dataclass(frozen=True)
class KvSize:
    per_token: int  # bytes of attention KV one more token of context costs
    fixed: int  # bytes of recurrent state a snapshot holds whatever its length

    def of(self, tokens: int) -> int:
        return tokens * self.per_token + self.fixed


_MEASURE = """
import json, sys
from pathlib import Path
import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache
from mlx_lm.utils import load_model
from mlx.utils import tree_flatten
model, _ = load_model(Path(sys.argv[1]), lazy=True)
cache = make_prompt_cache(model)
mx.eval(model(mx.array([[1]]), cache=cache))
per_token = fixed = 0
for c in cache:
    if isinstance(c, KVCache):
        k = c.keys
        per_token += 2 * k.shape[1] * k.shape[3] * k.dtype.size
    else:
        fixed += sum(a.nbytes for _, a in tree_flatten(c.state) if a is not None)
print(json.dumps([per_token, fixed]))
"""


def kv_size(model: Path) -> KvSize:
    """The model's KV bytes per token and fixed state, measured by mlx-lm (see above)."""
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(model)],
        capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    per_token, fixed = json.loads(out.stdout.strip().splitlines()[-1])
    return KvSize(per_token=per_token, fixed=fixed)


def budget_args(name: str, budget: int) -> tuple[str, ...]:
    """`name`'s flags for a budget of `budget` bytes."""
    if name == OURS:
        return ("--cache-budget", str(budget))
    if name == PEER:
        return ("--prompt-cache-bytes", str(budget))
    if name == VLLM:
        return ("--cache-memory-mb", str(max(1, round(budget / MiB))))
    raise ValueError(name)


def budget_flag(name: str) -> str:
    """How `name` was given its budget, for the tables."""
    return {
        OURS: "--cache-budget (bytes)",
        PEER: "--prompt-cache-bytes (bytes)",
        VLLM: "--cache-memory-mb (whole MiB)",
    }[name]


READY_S = 900.0  # vllm-mlx imports torch: minutes on a loaded 2-core box


def start(
    name: str,
    model: Path,
    budget: int | None,
    log_dir: Path,
    label: str,
    extra: tuple[str, ...] = (),
) -> Server:
    """`name` started on `model` with `budget` bytes (None: its default) and `extra` flags;
    stopped again if it does not come up."""
    extra = (*(budget_args(name, budget) if budget is not None else ()), *extra)
    server = Server(ServerSpec(name, model, extra, label), log_dir).launch()
    try:
        return server.wait_ready(timeout_s=READY_S)
    except BaseException:
        server.stop()
        raise


class Turns:
    """Requests sent one after another to one server, each row's cached tokens filled in
    from vllm-mlx's log where the server is vllm-mlx."""

    def __init__(self, server: Server):
        self.server = server
        self.rows: list[dict[str, Any]] = []

    async def send(self, client: httpx.AsyncClient, request: Request, **tags: Any) -> Reply:
        reply = await send(client, self.server, request)
        self.rows.append(
            {**tags, "prompt_tokens": reply.prompt_tokens, "cached_tokens": reply.cached_tokens,
             "ttft_s": reply.ttft_s}
        )  # fmt: skip
        return reply

    def finish(self) -> list[dict[str, Any]]:
        """The rows, vllm-mlx's cached tokens read from its log (call before stop)."""
        if self.server.name == VLLM:
            log = Path(getattr(self.server._log, "name", ""))
            fetched = vllm_cached_from(log)
            for row, cached in zip(self.rows, fetched, strict=False):
                row["cached_tokens"] = cached
        return self.rows


def ours_memory(server: Server) -> dict[str, Any]:
    """mlx-prefix's dashboard memory line: bytes held, the most ever held (stored and
    running), evictions, next-turn prefetches."""
    if server.name != OURS:
        return {}
    data = httpx.get(server.url + "/v1/dashboard", timeout=60).json()
    mem = data["memory"]
    return {
        "held_bytes": mem.get("bytes"), "peak_bytes": mem.get("peak_bytes"),
        "evictions": mem.get("evictions"), "prefetch": data.get("prefetch"),
    }  # fmt: skip


def runs_when(runs: Iterable[tuple[str, str]]) -> str:
    """Each invocation's date, machine and load (machine_line), with the servers it ran,
    from (server, machine line) pairs."""
    by: dict[str, list[str]] = {}
    for server, machine in runs:
        servers = by.setdefault(machine, [])
        if server not in servers:
            servers.append(server)
    return "; ".join(f"{', '.join(s)}: {m}" for m, s in by.items())


def machine_line() -> str:
    """Date, machine and load, for a table's caption."""
    import os
    import platform
    import time

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    where = f"{platform.system()} {platform.machine()}, {cpu}, {os.cpu_count()} cores"
    return f"{when}, {where}, load {load}"
